"""The operator's configuration of hosts: ~/.config/tracedeck/config.toml.

    [hosts.mi300x]                 # a target as it is written: an ssh_config alias, an
    lock = "/tmp/gpu.lock"         # ssh://user@host:port URL, or "local"

The lock belongs to the host, not to a preset: every preset aimed at a host takes that host's
lock (DEFAULT_LOCK unless configured), so two kinds of run never share one GPU. A preset or a
`--set target.lock=...` that names another lock is a deliberate choice of the operator.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_LOCK = "/tmp/tracedeck.lock"
HOST_KEYS = {"lock": str}
# A relative lock would depend on each console's directory: two runs could share the GPU.
LOCK_RULE = "must be an absolute path (every console must take the same lock)"


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
        if section != "hosts":
            raise ConfigError(f"{path}: {section}: unknown section; known: hosts")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: hosts: must be a table of [hosts.NAME] tables")
        for name, host in body.items():
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
    return data


def host_lock(target: str, preset_lock: str = "") -> str:
    """The lock a run on `target` takes: the preset's own when it names one, else the host's."""
    if preset_lock:
        return preset_lock
    host = load_config().get("hosts", {}).get(target.strip(), {})
    return str(host.get("lock") or DEFAULT_LOCK)
