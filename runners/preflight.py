"""`tracedeck plan --check` and `doctor`: connect to each host of a run and only read.

Is the host reachable and its key known, are the launcher's tools there (Slurm's on a login
node), are the workdir and runs directory usable and how much space is free, who holds the
lock, is the interpreter there with the packages the run needs, can it judge on the host;
then the plan is rendered again with the target's real paths. Each finding is ok, warn or
problem, and names its host in a fleet.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

import orjson

from runners.launchers.detached import lock_state
from runners.launchers.slurm import SlurmSettings
from runners.placement import Host
from runners.plan import PYTHON_RULE, interpreter
from runners.presets import Preset
from runners.preview import Preview, judging, preview, target_path, uses_python
from runners.remote_judge import imports_argv
from runners.targets.base import HostKeyMismatch, HostKeyUnknown, Target, TargetError

# The reference engine's imports (runners/reference): needed where it is shipped to run.
ENGINE_PACKAGES = ("torch", "numpy")
ENGINE_OPTIONAL = ("orjson",)
LAUNCHER_TOOLS = ("sh", "bash", "flock", "setsid")
SLURM_TOOLS = ("sbatch", "squeue", "scontrol", "scancel")  # on the login node
MIN_FREE = 100 << 20  # less than this in the runs directory: a run cannot even keep its logs
LOW_FREE = 1 << 30
OK, WARN, PROBLEM = "ok", "warn", "problem"


@dataclass(slots=True)
class Finding:
    level: str  # ok | warn | problem
    what: str
    text: str


@dataclass(slots=True)
class Checked:
    findings: list[Finding] = field(default_factory=list)
    preview: Preview | None = None  # rendered again with the target's real paths

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.level == PROBLEM]

    def add(self, level: str, what: str, text: str) -> None:
        self.findings.append(Finding(level, what, text))


def _q(text: str) -> str:
    return shlex.quote(text)


async def _sh(target: Target, script: str) -> tuple[int, str, str]:
    result = await target.run(script, timeout=60)
    return result.exit_status, result.stdout.strip(), result.stderr.strip()


async def check(p: Preview, target: Target | None = None) -> Checked:
    """Connect and read: reachability, host key, lock, space, interpreter, packages, paths.
    A fleet's hosts are each checked so (each finding names its host)."""
    out = Checked()
    for host in p.placement.hosts:
        one = Checked()
        await _check_host(p, host, target or p.placement.connect(host), one)
        prefix = f"{host.spec}: " if p.placement.fleet else ""
        out.findings += [Finding(f.level, prefix + f.what, f.text) for f in one.findings]
        out.preview = one.preview
    return out


async def _check_host(p: Preview, host: Host, target: Target, out: Checked) -> None:
    try:
        await target.connect()
    except (HostKeyUnknown, HostKeyMismatch) as exc:
        _add_host_key(out, target, exc)
        return
    except TargetError as exc:
        _add_host_key(out, target, exc)  # a key judged before the login failed is said too
        out.add(PROBLEM, "reachable", str(exc))
        return
    _add_host_key(out, target, None)
    try:
        await _check_connected(p, host, target, out)
    except TargetError as exc:
        out.add(PROBLEM, "reachable", f"{host.name}: {exc}")
    finally:
        await target.close()


def _add_host_key(out: Checked, target: Target, error: TargetError | None) -> None:
    """The host-key step of an SSH target (runners.hostkey_step), before reachable."""
    from runners.hostkey_step import host_key_step
    from runners.targets.ssh import SshTarget

    if isinstance(target, SshTarget):
        step = host_key_step(target, error is None, error)
        level = OK if step.ok else PROBLEM if step.ok is False else WARN
        out.add(level, "host key", step.text)
    elif error is not None and isinstance(error, (HostKeyUnknown, HostKeyMismatch)):
        out.add(PROBLEM, "host key", str(error))


async def _check_connected(p: Preview, host: Host, target: Target, out: Checked) -> None:
    name = host.name
    if name == "local":
        out.add(OK, "reachable", "this machine")
    else:
        out.add(OK, "reachable", f"connected to {name} (logged in, an SFTP session open)")
    code, home, err = await _sh(target, "cd && pwd")
    if code != 0 or not home.startswith("/"):
        out.add(PROBLEM, "home", f"{name}: no usable home directory ({err or home})")
        return
    tgt = p.preset.section("target")
    workdir = target_path(tgt["workdir"], home)
    runs = target_path(tgt["runs"], home)
    missing_tools = await _missing_tools(target)
    if missing_tools:
        out.add(
            PROBLEM,
            "launcher",
            f"{name} lacks {', '.join(missing_tools)}: the detached launcher needs sh, bash, "
            "flock and setsid (util-linux)",
        )
    else:
        out.add(OK, "launcher", "sh, bash, flock and setsid are there")
    if host.slurm is not None:
        await _check_slurm(target, out, host.slurm)
    await _check_dir(target, out, "target.workdir", workdir)
    anchor = await _check_dir(target, out, "target.runs", runs)
    if anchor is not None:
        await _check_space(target, out, runs, anchor)
    if host.slurm is None:
        await _check_lock(target, out, host.lock)
    else:  # the lock is the compute node's, taken by each task there: it waits, never refuses
        out.add(OK, "lock", f"{host.lock} is taken on each node by the task Slurm runs there")
    python = interpreter(name, tgt["python"])
    if uses_python(p.preset):
        await _check_python(target, out, p, python, name)
    await _check_judging(target, out, p, python)
    await _check_vars(target, out, p.preset)
    if not p.placement.fleet:
        again = preview(
            p.preset,
            p.target,
            p.local_dir.parent,
            home=home,
            run_id=p.run_id,
            placement=p.placement,
        )
        out.preview = replace(again, local_dir=p.local_dir, by_id=p.by_id)


async def _check_slurm(target: Target, out: Checked, settings: SlurmSettings) -> None:
    missing = await _missing_tools(target, SLURM_TOOLS)
    if missing:
        out.add(PROBLEM, "slurm", f"the login node lacks {', '.join(missing)}: is Slurm there?")
        return
    out.add(OK, "slurm", f"{', '.join(SLURM_TOOLS)} are there")
    # Asked first: with no controller every other question (the partition) fails too, and
    # blaming the partition would send the operator to the wrong fix.
    code, stdout, err = await _sh(target, "scontrol ping")
    if "is UP" not in stdout:
        lines = [line.strip() for line in f"{stdout}\n{err}".splitlines()]
        said = next((line for line in lines if line and "*" not in line), "")
        out.add(
            PROBLEM,
            "controller",
            f"no Slurm controller answers (`scontrol ping`: {said or f'exit {code}'}): start "
            "slurmctld, or point SLURM_CONF at the cluster's slurm.conf",
        )
        return
    out.add(OK, "controller", " ".join(stdout.split()))
    if not settings.partition:
        out.add(OK, "partition", "none named: Slurm's default partition")
        return
    code, stdout, err = await _sh(target, f"scontrol -o show partition {_q(settings.partition)}")
    if code != 0 or "PartitionName=" not in stdout:
        out.add(
            PROBLEM,
            "partition",
            f"Slurm knows no partition {settings.partition!r} ({err or stdout}); "
            "`sinfo -s` lists them",
        )
    else:
        state = next((w for w in stdout.split() if w.startswith("State=")), "State=?")
        out.add(OK, "partition", f"{settings.partition} ({state})")


async def _missing_tools(target: Target, tools: tuple[str, ...] = LAUNCHER_TOOLS) -> list[str]:
    script = " ".join(f"command -v {tool} >/dev/null 2>&1 || echo {tool};" for tool in tools)
    _, stdout, _ = await _sh(target, script)
    return stdout.split()


async def _check_dir(target: Target, out: Checked, key: str, path: str) -> str | None:
    """The directory, or the nearest existing one above it (where it would be made); its
    writability. Returns that existing directory."""
    script = f"""p={_q(path)}
a=$p
while [ ! -d "$a" ]; do a=$(dirname -- "$a"); done
if [ "$a" = "$p" ]; then echo exists; else echo missing; fi
echo "$a"
if [ -w "$a" ]; then echo writable; else echo readonly; fi
"""
    code, stdout, err = await _sh(target, script)
    words = stdout.splitlines()
    if code != 0 or len(words) != 3:
        out.add(PROBLEM, key, f"{path}: cannot look at it ({err or stdout})")
        return None
    state, anchor, access = words
    if access != "writable":
        where = path if state == "exists" else f"{anchor} (where {path} would be made)"
        out.add(PROBLEM, key, f"{where} is not writable for the login user")
    elif state == "exists":
        out.add(OK, key, f"{path} exists")
    else:
        out.add(OK, key, f"{path} does not exist yet: the launch makes it (under {anchor})")
    return anchor


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


async def _check_space(target: Target, out: Checked, runs: str, anchor: str) -> None:
    code, stdout, err = await _sh(target, f"df -Pk -- {_q(anchor)} | tail -n 1")
    fields = stdout.split()
    if code != 0 or len(fields) < 4 or not fields[3].isdigit():
        out.add(WARN, "free space", f"{anchor}: df gave no answer ({err or stdout})")
        return
    free = int(fields[3]) * 1024
    text = f"{_size(free)} free for {runs}"
    if free < MIN_FREE:
        out.add(PROBLEM, "free space", f"{text}: less than {_size(MIN_FREE)}; free some first")
    elif free < LOW_FREE:
        out.add(WARN, "free space", f"{text}: low (artifacts and traces can be large)")
    else:
        out.add(OK, "free space", text)


async def _check_lock(target: Target, out: Checked, lock: str) -> None:
    state, holder, said = await lock_state(target, lock)
    who = ", ".join(
        f"{k}={holder[k]}" for k in ("run_id", "user", "console_host", "pgid") if k in holder
    )
    if state == "held":
        out.add(
            PROBLEM,
            "lock",
            f"{lock} is held ({who or 'holder unknown'}): a run now would be refused "
            "(LOCK_BUSY); wait for that run, or ask its owner to `tracedeck cancel` it",
        )
    elif state == "unwritable":
        out.add(PROBLEM, "lock", f"{lock}: the login user cannot write it (or its directory)")
    elif state in ("free", "absent"):
        last = f"; last held by {who}" if who else ""
        out.add(OK, "lock", f"{lock} is free{last}")
    else:
        out.add(WARN, "lock", f"{lock}: could not tell ({said or 'no answer'})")


async def _check_python(target: Target, out: Checked, p: Preview, python: str, name: str) -> None:
    probe = (
        "import importlib.util as u, sys; "
        "print(sys.version.split()[0]); "
        f"print(' '.join(n for n in {ENGINE_PACKAGES + ENGINE_OPTIONAL!r} "
        "if u.find_spec(n) is None))"
    )
    # The interpreter runs from workdir, as the cells do; a missing workdir is checked above.
    code, stdout, err = await _sh(target, f"{_q(python)} -c {_q(probe)}")
    if code != 0:
        why = "not found" if code == 127 else (err.splitlines() or [f"exit {code}"])[-1]
        out.add(
            PROBLEM,
            "python",
            f"{python!r} ({PYTHON_RULE}): {why}; set target.python to an interpreter on {name}",
        )
        return
    lines = stdout.splitlines() + [""]
    version, missing = lines[0], lines[1].split()
    out.add(OK, "python", f"{python} is Python {version}")
    if not p.preset.section("engine")["ship_reference"]:
        return
    needed = [m for m in missing if m in ENGINE_PACKAGES]
    if needed:
        out.add(
            PROBLEM,
            "packages",
            f"{python} lacks {', '.join(needed)}: the shipped reference engine needs "
            f"{' and '.join(ENGINE_PACKAGES)}; install them there (a torch build for the "
            "host's GPU), or set target.python to an interpreter that has them",
        )
    else:
        extra = [m for m in missing if m in ENGINE_OPTIONAL]
        note = f" ({', '.join(extra)} missing: optional, only slower)" if extra else ""
        out.add(OK, "packages", f"{' and '.join(ENGINE_PACKAGES)} are there{note}")


async def _check_judging(target: Target, out: Checked, p: Preview, python: str) -> None:
    """Can the run be judged on the host, as [judge] on asks? (What its python must import.)"""
    judge = judging(p)
    if judge is None or judge["where"] == "console" or not judge["requires"]:
        return
    judge["python"] = p.placement.judging.python or python  # type: ignore[union-attr]
    imports = ", ".join(judge["requires"])
    # Started as the judge is (runners/hosted/boot.py): PYTHONPATH, ~/.local and whatever a
    # .pth line would add do not count.
    argv = imports_argv(judge["python"], list(judge["requires"]))
    code, said_out, err = await _sh(target, " ".join(_q(a) for a in argv))
    if code == 0:
        out.add(OK, "judging", f"on the host: {judge['python']} there has {imports}")
        writable = [orjson.loads(line) for line in said_out.splitlines() if line.startswith("{")]
        for found in (f for f in writable if f.get("writable")):
            out.add(
                WARN,
                "judging",
                f"{found['module']} in {found['dir']} can be changed by the login user, who runs "
                "the engine: the judge there imports it as it finds it. Point [judge] python at "
                "an interpreter that user cannot write, or set [judge] on = console",
            )
        return
    said = (err.splitlines() or [f"exit {code}"])[-1]
    if judge["on"] == "host":
        out.add(
            PROBLEM,
            "judging",
            f"[judge] on = host, but {judge['python']} cannot import {imports} ({said}); "
            "install it there, name another python with [judge] python, or set [judge] on = auto",
        )
    else:
        out.add(
            WARN,
            "judging",
            f"on this console: {judge['python']} on the host cannot import {imports} ({said}); "
            "every artifact will be fetched",
        )


async def _check_vars(target: Target, out: Checked, preset: Preset) -> None:
    """[vars] values that are absolute paths: does each exist on the target? (A warning: some
    name what a run will make.)"""
    paths = {k: v for k, v in preset.vars.items() if isinstance(v, str) and v.startswith("/")}
    if not paths:
        return
    script = "".join(f"[ -e {_q(v)} ] || echo {_q(k)}\n" for k, v in paths.items())
    _, stdout, _ = await _sh(target, script)
    missing = stdout.split()
    for key in missing:
        out.add(WARN, f"vars.{key}", f"{paths[key]} does not exist on the target")
    if not missing:
        out.add(OK, "vars", f"every absolute path in [vars] exists ({', '.join(paths)})")


def checked_document(checked: Checked) -> list[dict[str, str]]:
    return [{"level": f.level, "what": f.what, "text": f.text} for f in checked.findings]
