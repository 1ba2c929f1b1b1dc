"""The operator's configuration of hosts and fleets: ~/.config/tracedeck/config.toml.

    [hosts.mi300x]                 # a target as it is written: an ssh_config alias, an
    lock = "/tmp/gpu.lock"         # ssh://user@host:port URL, or "local"

    [fleets.rack]                  # `--target rack`: one run's cells spread over these hosts
    hosts = ["gpu1", "gpu2", "ssh://root@10.0.0.7"]

    [notify]                       # run when a headless run ends, with five quoted arguments:
    command = "notify-team"        # run id, preset, verdict, exit code, report path

The lock belongs to the host the run goes to, not to a preset: every run on a host takes that
host's lock (DEFAULT_LOCK unless configured), so two kinds of run never share one GPU. Two
deliberate choices name another: `--set target.lock=...` (this run, wherever it goes), and a
preset's own `[target] lock`, which speaks for the preset's own `[target] host` only: a run the
preset sends elsewhere (--target, the console's target, a fleet) takes that host's lock.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from runners.presets import LOCK_RULE, Preset

DEFAULT_LOCK = "/tmp/tracedeck.lock"
HOST_KEYS = {"lock": str}
FLEET_KEYS = ("hosts",)
SECTIONS = ("hosts", "fleets", "notify")
NOTIFY_KEYS: dict[str, tuple[Any, str]] = {
    "command": (str, "a string (a shell command line)"),
    "timeout_s": ((int, float), "a number of seconds"),
}
# A relative lock would depend on each console's directory: two runs could share the GPU.


class ConfigError(ValueError):
    """A configuration file that cannot be used; names the file and the key."""


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tracedeck" / "config.toml"


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The checked configuration ({} when there is no file)."""
    path = path or config_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: {section}: unknown section; known: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {section}: must be a table of [{section}.NAME] tables")
    for name, host in data.get("hosts", {}).items():
        if not isinstance(host, dict):
            raise ConfigError(f"{path}: hosts.{name}: must be a table")
        for key, value in host.items():
            if key not in HOST_KEYS:
                raise ConfigError(
                    f"{path}: hosts.{name}.{key}: unknown key; known: {', '.join(HOST_KEYS)}"
                )
            if not isinstance(value, HOST_KEYS[key]) or not value:
                raise ConfigError(f"{path}: hosts.{name}.{key}: must be a non-empty string")
            if key == "lock" and not value.startswith("/"):
                raise ConfigError(f"{path}: hosts.{name}.lock: {LOCK_RULE}, got {value!r}")
    for name, fleet in data.get("fleets", {}).items():
        _check_fleet(path, name, fleet, data.get("hosts", {}))
    _check_notify(path, data.get("notify", {}))
    return data


def _check_notify(path: Path, notify: dict[str, Any]) -> None:
    for key, value in notify.items():
        if key not in NOTIFY_KEYS:
            raise ConfigError(f"{path}: notify.{key}: unknown key; known: {', '.join(NOTIFY_KEYS)}")
        expected, words = NOTIFY_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(f"{path}: notify.{key}: must be {words}")
    command = notify.get("command")
    if notify and command is None:
        raise ConfigError(f"{path}: notify.command: missing; name the command to run")
    if command is not None and not command.strip():
        raise ConfigError(f"{path}: notify.command: must not be empty (or leave [notify] out)")
    if "timeout_s" in notify and not 0 < notify["timeout_s"] <= 3600:
        raise ConfigError(f"{path}: notify.timeout_s: must be between 0 and 3600 seconds")


def _check_fleet(path: Path, name: str, fleet: Any, hosts: dict[str, Any]) -> None:
    where = f"{path}: fleets.{name}"
    if not isinstance(fleet, dict):
        raise ConfigError(f"{where}: must be a table with hosts = [...]")
    if name in hosts:
        raise ConfigError(
            f"{where}: {name!r} also names a host ([hosts.{name}]): `--target {name}` would be "
            "ambiguous; rename one"
        )
    if "," in name or "://" in name or name == "local":
        raise ConfigError(f"{where}: {name!r} cannot name a fleet (it reads as a target)")
    for key in fleet:
        if key not in FLEET_KEYS:
            raise ConfigError(f"{where}.{key}: unknown key; known: {', '.join(FLEET_KEYS)}")
    members = fleet.get("hosts")
    if members is None:
        raise ConfigError(f"{where}.hosts: missing; list the fleet's hosts, e.g. ['gpu1', 'gpu2']")
    if not isinstance(members, list) or not members:
        raise ConfigError(f"{where}.hosts: must be a non-empty list of host names or URLs")
    seen: set[str] = set()
    for i, member in enumerate(members):
        if not isinstance(member, str) or not member.strip():
            raise ConfigError(f"{where}.hosts[{i}]: must be a non-empty string, got {member!r}")
        problem = fleet_member_problem(member)
        if problem:
            raise ConfigError(f"{where}.hosts[{i}]: {problem}")
        if member.strip() in seen:
            raise ConfigError(f"{where}.hosts[{i}]: {member!r} is listed twice")
        seen.add(member.strip())


def fleet_member_problem(spec: str) -> str | None:
    """Why a host cannot be in a fleet, or None (the spec is parsed as a target)."""
    from runners.targets.factory import parse_target

    text = spec.strip()
    if text.startswith("slurm://"):
        return f"{text!r}: a Slurm cluster places its own work; it cannot be one host of a fleet"
    try:
        parse_target(text)
    except ValueError as exc:
        return str(exc)
    return None


def host_lock(target: str, preset_lock: str = "") -> str:
    """The lock a run on `target` takes given the lock chosen for the run (see run_lock), else
    the host's own: config.toml's hosts.TARGET.lock, else DEFAULT_LOCK."""
    if preset_lock:
        return preset_lock
    host = load_config().get("hosts", {}).get(target.strip(), {})
    return str(host.get("lock") or DEFAULT_LOCK)


def chosen_lock(preset: Preset, run_target: str) -> tuple[str, str]:
    """The lock the preset names for a run going to run_target, and who named it:
    ("/x", "--set") for `--set target.lock=...`, which holds wherever the run goes;
    ("/x", "the preset") for the preset's own `[target] lock` when the run goes to the preset's
    own `[target] host`; ("", "the host") otherwise: the lock belongs to the host the run goes
    to, so a preset written for one host never takes its lock on another."""
    tgt = preset.section("target")
    if not tgt["lock"]:
        return "", "the host"
    if any(o.split("=", 1)[0].strip() == "target.lock" for o in preset.overrides):
        return str(tgt["lock"]), "--set"
    if run_target.strip() == str(tgt["host"]).strip():
        return str(tgt["lock"]), "the preset"
    return "", "the host"


def run_lock(host: str, preset: Preset, run_target: str | None = None) -> str:
    """The lock a run of preset takes on host (one host of run_target when that is a fleet)."""
    return host_lock(host, chosen_lock(preset, run_target or host)[0])


def fleet_hosts(spec: str) -> list[str] | None:
    """The hosts a target spec names when it is a fleet (`a,b` or a [fleets.NAME]), else None.

    ValueError (a ConfigError when the config file is at fault) for a fleet that cannot run.
    """
    text = spec.strip()
    if "," in text:
        hosts = [part.strip() for part in text.split(",")]
        for i, host in enumerate(hosts):
            if not host:
                raise ValueError(f"--target {spec!r}: host {i + 1} of the list is empty")
            problem = fleet_member_problem(host)
            if problem:
                raise ValueError(f"--target {spec!r}: host {i + 1}: {problem}")
        dupes = sorted({h for h in hosts if hosts.count(h) > 1})
        if dupes:
            raise ValueError(f"--target {spec!r}: {', '.join(dupes)} listed twice")
        return hosts
    fleets = load_config().get("fleets", {})
    if text in fleets:
        return [str(h).strip() for h in fleets[text]["hosts"]]
    return None


def check_target(spec: str) -> None:
    """ValueError (naming the spec, or the config file and key) when a target spec cannot be
    run on: one host, a Slurm login node, a list of hosts, or a fleet of the config."""
    from runners.targets.factory import parse_target

    if fleet_hosts(spec) is None:
        parse_target(spec)


def fleet_names() -> dict[str, list[str]]:
    """The config's fleets (name -> hosts); {} when the config cannot be read."""
    try:
        fleets = load_config().get("fleets", {})
    except ConfigError:
        return {}
    return {name: [str(h) for h in body["hosts"]] for name, body in fleets.items()}
