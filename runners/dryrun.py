"""`tracedeck plan`: what a run of a preset would do, without starting it.

preview() renders every cell's exact command, environment, script, remote paths and the files
it fetches and follows, without connecting (relative target paths show as `<home>/...`, under the
target's login home, unless the target is this machine). check() connects and only reads: is the host
reachable and its key known, who holds the lock, how much space the runs directory has, is the
interpreter there with the packages the run needs; then renders the plan again with the
target's real paths. Both are UI-free: the CLI prints plan_lines(), the console shows them.
"""

from __future__ import annotations

import datetime as dt
import os
import posixpath
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from runners import kinds
from runners.config import chosen_lock
from runners.determinism import PROFILES
from runners.launchers.detached import holder_path, parse_holder
from runners.launchers.slurm import SlurmSettings, job_script
from runners.placement import (
    CONSOLE,
    Host,
    Placement,
    by_id_link,
    decide,
    local_dir_for,
    new_run_id,
)
from runners.plan import PYTHON_RULE, RunPlan, cell_dir_name, home_relative, interpreter
from runners.presets import Preset
from runners.targets.base import HostKeyMismatch, HostKeyUnknown, Target, TargetError
from runners.templates import template_fields

# The reference engine's imports (runners/reference): needed where it is shipped to run.
ENGINE_PACKAGES = ("torch", "numpy")
ENGINE_OPTIONAL = ("orjson",)
LAUNCHER_TOOLS = ("sh", "bash", "flock", "setsid")
SLURM_TOOLS = ("sbatch", "squeue", "scontrol", "scancel")  # on the login node
MEMBER = "HOST-N"  # a fleet host's batch directory, named when the host takes its cells
MIN_FREE = 100 << 20  # less than this in the runs directory: a run cannot even keep its logs
LOW_FREE = 1 << 30
OK, WARN, PROBLEM = "ok", "warn", "problem"
HOME = "<home>"  # the target's login home, until `plan --check` reads it


@dataclass(slots=True)
class Preview:
    """A run's placement rendered on its paths: nothing started, nothing written."""

    placement: Placement
    target_name: str  # as tracedeck names it (local, ssh://user@host:port, fleet a, b)
    python: str
    workdir: str  # absolute, or <home>/x while the target's home is unknown
    runs: str
    run_id: str
    local_dir: Path
    by_id: Path
    plan: RunPlan
    resolved: bool  # the remote paths are the target's real ones

    preset = property(lambda self: self.placement.preset)
    target = property(lambda self: self.placement.target)  # as the operator wrote it
    lock = property(lambda self: self.placement.hosts[0].lock)
    run_dir = property(lambda self: self.plan.run_dir)

    @property
    def hosts(self) -> list[str]:
        """A fleet's hosts; [] for one target."""
        return [h.spec for h in self.placement.hosts] if self.placement.fleet else []

    @property
    def slurm(self) -> SlurmSettings | None:
        """Set when the cells go to Slurm as one job array."""
        return None if self.placement.fleet else self.placement.hosts[0].slurm

    @property
    def groups(self) -> list[list[int]]:
        """How a fleet hands out the cells: each group runs on one host (a B3.67 pair)."""
        return [list(g) for g in self.placement.groups]


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


def _absolute(path: str, home: str | None) -> str:
    """target.workdir / target.runs on the target: as written when absolute, else under the
    home (<home>/x while the home is not known)."""
    rel = home_relative(path)
    if rel.startswith("/"):
        return posixpath.normpath(rel)
    if home is None:  # a stand-in no shell would take for a real path
        rel = posixpath.normpath(rel)
        return HOME if rel == "." else f"{HOME}/{rel}"
    return posixpath.normpath(posixpath.join(home, rel))


def preview(
    preset: Preset,
    target_spec: str,
    out_dir: Path,
    *,
    home: str | None = None,
    run_id: str | None = None,
    placement: Placement | None = None,
) -> Preview:
    """The run's plan without connecting; ValueError for a target spec that is not one, or a
    placement that cannot run (the reason).

    A fleet's cells are shown as its hosts run them: each host's batch in its own directory
    (`RUN_DIR/HOST-N`) under that host's own lock; a Slurm target's with the job's directives.
    """
    placement = placement or decide(preset, target_spec)
    first = placement.hosts[0]
    tgt = preset.section("target")
    if home is None and placement.local:
        home = os.path.expanduser("~")  # what `cd` finds on this machine
    workdir, runs = _absolute(tgt["workdir"], home), _absolute(tgt["runs"], home)
    run_id = run_id or new_run_id(preset.name)
    run_dir = f"{runs}/{run_id}/{MEMBER}" if placement.fleet else f"{runs}/{run_id}"
    date = dt.date.today().isoformat()
    python = interpreter("local" if placement.local else first.name, tgt["python"])
    plan = placement.plan(
        run_id=run_id, run_dir=run_dir, workdir=workdir, python=python, date=date, lock=first.lock
    )
    names = [h.name for h in placement.hosts]
    return Preview(
        placement=placement,
        target_name=f"fleet {', '.join(names)}" if placement.fleet else names[0],
        python=python,
        workdir=workdir,
        runs=runs,
        run_id=run_id,
        local_dir=local_dir_for(preset, Path(out_dir), date),
        by_id=by_id_link(Path(out_dir), run_id),
        plan=plan,
        resolved=home is not None,
    )


def judging(p: Preview) -> dict[str, Any] | None:
    """Where the run is judged, as its placement says, and which artifacts then stay on the
    target; None for a kind that judges nothing there."""
    decided, spec = p.placement.judging, kinds.get(p.preset.kind).host_judging
    if decided is None or spec is None:
        return None
    cfg = p.preset.section("judge")
    held = sorted({rel for c in p.plan.cells for rel in c.artifacts if spec.held(rel)})
    return {
        "on": cfg["on"],
        "where": decided.where,
        "why": decided.why,
        "python": decided.python or p.python,
        "requires": list(spec.requires),
        "held": held if decided.where != CONSOLE else [],
        "fetch_held": cfg["fetch_held"],
    }


def uses_python(preset: Preset) -> bool:
    engine = preset.section("engine")
    texts = [engine["command"], *engine["setup"], *(str(v) for v in engine["env"].values())]
    texts += [str(v) for v in preset.section("determinism")["env"].values()]
    texts.append(engine["version_command"])
    return engine["ship_reference"] or any("python" in template_fields(t) for t in texts)


# -- what the plan says -------------------------------------------------------------------------


def _env_text(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) or "(none)"


def plan_document(p: Preview) -> dict[str, Any]:
    """The plan as one JSON document (`tracedeck plan --json`)."""
    preset, plan = p.preset, p.plan
    tgt = preset.section("target")
    shared = [t.path for t in plan.traces if t.cell is None]
    judge = judging(p)
    held = set(judge["held"]) if judge else set()
    cells = []
    for c in plan.cells:
        cells.append(
            {
                "index": c.index,
                "params": c.params,
                "command": c.command,
                "env": c.env,
                "script": plan.cell_path(c.index, "cmd.sh"),
                "stdout": plan.cell_path(c.index, "stdout.log"),
                "stderr": plan.cell_path(c.index, "stderr.log"),
                "exit_code": plan.cell_path(c.index, "exit_code"),
                "fetch": [
                    {
                        "remote": f"{plan.artifacts}/{rel}",
                        "local": str(p.local_dir / rel),
                        "held": rel in held,  # judged on the host, it stays there
                    }
                    for rel in c.artifacts
                ],
                "follow": [t.path for t in plan.traces if t.cell == c.index],
            }
        )
    return {
        "preset": preset.name,
        "kind": preset.kind,
        "source": preset.source,
        "judge": judge,
        "target": p.target_name,
        "resolved": p.resolved,
        "python": p.python,
        "python_rule": PYTHON_RULE,
        "workdir": p.workdir,
        "workdir_setting": tgt["workdir"],
        "runs": p.runs,
        "runs_setting": tgt["runs"],
        "run_id": p.run_id,
        "run_dir": p.run_dir,
        "out": plan.artifacts,
        "lock": p.lock,
        "local_dir": str(p.local_dir),
        "by_id": str(p.by_id),
        "profile": preset.section("determinism")["profile"],
        "ship_reference": preset.section("engine")["ship_reference"],
        "pythonpath": plan.pythonpath,
        "setup": plan.setup,
        "follow_shared": shared,
        "fleet": _fleet_document(p),
        "slurm": {"directives": sbatch_directives(p)} if p.slurm is not None else None,
        "cells": cells,
    }


def _lock_source(p: Preview) -> str:
    lock, who = chosen_lock(p.preset, p.target)
    if who == "--set":
        return "named with --set target.lock"
    if who == "the preset":
        return "the preset's lock"
    if p.preset.section("target")["lock"]:
        return (
            f"the host's lock; the preset's [target] lock is for its own host "
            f"{p.preset.section('target')['host']}, not this one"
        )
    return "the host's lock"


def _fleet_document(p: Preview) -> dict[str, Any] | None:
    if not p.hosts:
        return None
    fleet = p.preset.section("fleet")
    return {
        "hosts": [{"host": h.spec, "lock": h.lock} for h in p.placement.hosts],
        "busy": fleet["busy"],
        "requeue": fleet["requeue"],
        "groups": p.groups,
    }


def sbatch_directives(p: Preview) -> list[str]:
    """The #SBATCH lines of the run's job array, as the launch writes them."""
    assert p.slurm is not None
    script = job_script(p.plan, p.slurm, {"preset": p.preset.name})
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


def _where(key: str, setting: str) -> str:
    if home_relative(setting).startswith("/"):
        return f"target.{key} = {setting!r}, absolute"
    return f"target.{key} = {setting!r}, under the target's home"


def plan_lines(p: Preview) -> list[str]:
    """The plan as the CLI prints it and the console shows it."""
    preset, plan = p.preset, p.plan
    tgt = preset.section("target")
    engine = preset.section("engine")
    n = len(plan.cells)
    det = preset.section("determinism")["profile"]
    where = f"over {len(p.hosts)} hosts" if p.hosts else f"on {p.target_name}"
    run_dir = f"(run id {p.run_id}; a new id each run)"
    lock = f"{p.lock}  ({_lock_source(p)})"
    if p.hosts:
        run_dir = f"(run id {p.run_id}; {MEMBER}: the host and its batch, named as it starts)"
        lock = "each host's own, for the time it runs cells (below)"
    elif p.slurm is not None:
        lock = f"{p.lock}  (each array task takes it on the node Slurm runs it on)"
    lines = [
        f"plan: preset {preset.name} ({preset.kind}), {n} cell{'s' if n != 1 else ''} "
        f"{where}; nothing is started",
        f"  preset file: {preset.source}",
        f"  python:      {p.python}  ({{python}}: {PYTHON_RULE})",
        f"  workdir:     {p.workdir}  ({_where('workdir', tgt['workdir'])}; each cell runs here)",
        f"  runs:        {p.runs}  ({_where('runs', tgt['runs'])}; independent of workdir)",
        f"  run dir:     {p.run_dir}  {run_dir}",
        f"  {{out}}:       {plan.artifacts}",
        f"  lock:        {lock}",
        f"  local dir:   {p.local_dir}  (also {p.by_id})",
        f"  determinism: {det}: {_env_text(PROFILES[det]) if PROFILES[det] else '(none)'}",
    ]
    if p.hosts:
        lines += _fleet_lines(p)
    if p.slurm is not None:
        lines += _slurm_lines(p)
    if not p.resolved:
        lines.append(
            f"  ({HOME} is the target's login home: `tracedeck plan --check` connects, reads "
            "the real paths and checks the target)"
        )
    if engine["ship_reference"]:
        lines.append(
            f"  shipped:     the reference engine (runners/reference) to {plan.pythonpath}, "
            "put first on PYTHONPATH"
        )
    judge = judging(p)
    if judge is not None:
        lines.append(f"  judged:      {judge['where']} ({judge['why']})")
        if judge["held"]:
            stays = (
                "fetched after judging ([judge] fetch_held)"
                if judge["fetch_held"]
                else ("stay there; `tracedeck fetch DIR` brings them home")
            )
            lines.append(f"               judged there, the files marked (held) {stays}")
    held = set(judge["held"]) if judge else set()
    for i, step in enumerate(plan.setup):
        lines.append(f"  setup[{i}]:    {step}")
    if plan.setup:
        lines.append(
            f"               script {plan.cell_path(-1, 'cmd.sh')}; a failure stops the run"
        )
    if engine["version_command"]:
        lines.append(
            f"  version:     {engine['version_command']} (in the workdir, before the run; its "
            "first line names the engine in the record)"
        )
    shared = [t for t in plan.traces if t.cell is None]
    for t in shared:
        lines.append(f"  follow:      {t.path}  (live, written by several cells)")
    lines.append(
        f"  each cell:   bash -c 'set -euo pipefail; cd {shlex.quote(plan.workdir)}; export "
        "ENV...; COMMAND' in cells/NNN/cmd.sh; stdout.log, stderr.log and exit_code beside it"
    )
    for c in plan.cells:
        label = " ".join(f"{k}={v}" for k, v in c.params.items())
        lines.append("")
        lines.append(f"cell {c.index + 1}/{n} ({label})")
        lines.append(f"  command: {c.command}")
        lines.append(f"  env:     {_env_text(c.env)}")
        lines.append(f"  script:  {plan.run_dir}/cells/{cell_dir_name(c.index)}/cmd.sh")
        for rel in c.artifacts:
            mark = "  (held)" if rel in held else ""
            lines.append(f"  fetch:   {plan.artifacts}/{rel}{mark}")
            lines.append(f"        -> {p.local_dir / rel}")
        for t in plan.traces:
            if t.cell == c.index:
                how = "every file matching it, " if t.is_pattern else ""
                lines.append(f"  follow:  {t.path}  ({how}live)")
    return lines


def _fleet_lines(p: Preview) -> list[str]:
    fleet = p.preset.section("fleet")
    lines = [f"  host:        {h.spec}  (lock {h.lock})" for h in p.placement.hosts]
    busy = {
        "skip": "skipped for this run (fleet.busy = skip)",
        "wait": "waited for (fleet.busy = wait)",
    }[fleet["busy"]]
    lost = "re-queued on the others" if fleet["requeue"] else "reported lost (fleet.requeue)"
    lines.append(f"  busy host:   {busy}; a lost host's cells are {lost}")
    groups = [g for g in p.groups if len(g) > 1]
    if groups:
        kept = ", ".join("+".join(str(c + 1) for c in g) for g in groups)
        lines.append(f"  together:    cells {kept} each run on one host (fleet.together)")
    return lines


def _slurm_lines(p: Preview) -> list[str]:
    n = len(p.plan.cells)
    lines = [
        f"  scheduler:   Slurm, through {p.target_name}: `sbatch --parsable` of one job array "
        f"({n} task{'s' if n != 1 else ''}, one cell each); squeue/scontrol watch it, scancel "
        "cancels it"
    ]
    lines += [f"    {line}" for line in sbatch_directives(p)]
    return lines


# -- the read-only check ------------------------------------------------------------------------


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
    workdir = _absolute(tgt["workdir"], home)
    runs = _absolute(tgt["runs"], home)
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


async def lock_state(target: Target, lock: str) -> tuple[str, dict[str, Any], str]:
    """Who holds the lock, found without taking it: a shared flock on a read-only descriptor
    fails while a run holds it, and is let go at once. (state: held, free, absent, unwritable
    or '' when the answer could not be read; the last holder's record; what the shell said.)"""
    script = f"""l={_q(lock)}
if [ ! -e "$l" ]; then
  if [ -w "$(dirname -- "$l")" ]; then echo absent; else echo unwritable; fi
  exit 0
fi
[ -w "$l" ] || {{ echo unwritable; exit 0; }}
if flock -n -s "$l" true 2>/dev/null; then echo free; else echo held; fi
"""
    _, stdout, err = await _sh(target, script)
    state = stdout.splitlines()[-1] if stdout else ""
    raw = await target.read_from(holder_path(lock), 0, 1 << 16)
    holder = parse_holder(raw.decode("utf-8", "replace")) if raw else {}
    return state, holder, err or stdout


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
    # -I: the judge runs isolated (runners/hosted/boot.py), so PYTHONPATH and ~/.local do not count
    code, _, err = await _sh(target, f"{_q(judge['python'])} -I -c {_q(f'import {imports}')}")
    if code == 0:
        out.add(OK, "judging", f"on the host: {judge['python']} there has {imports}")
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


def check_lines(checked: Checked) -> list[str]:
    marks = {OK: "ok     ", WARN: "WARNING", PROBLEM: "PROBLEM"}
    lines = [f"  {marks[f.level]} {f.what}: {f.text}" for f in checked.findings]
    n = len(checked.problems)
    lines.append(
        "check: the target is ready for this run"
        if n == 0
        else f"check: {n} problem{'s' if n != 1 else ''}: a run now would fail"
    )
    return lines


def to_json(doc: Any) -> str:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
