"""What a run of a preset would do, without starting it: its placement rendered on its paths.

preview() renders every cell's exact command, environment, script, remote paths and the files
it fetches and follows, without connecting (relative target paths show as `<home>/...` unless
the target is this machine). `tracedeck plan` shows it as text or JSON (console.plan_text);
`plan --check` (runners.preflight) renders it again with the target's real paths.
"""

from __future__ import annotations

import datetime as dt
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runners import kinds
from runners.launchers.slurm import SlurmSettings
from runners.local_run import by_id_link, local_dir_for, new_run_id
from runners.placement import CONSOLE, Placement, decide
from runners.plan import RunPlan, home_relative, interpreter
from runners.presets import Preset
from runners.templates import template_fields

MEMBER = "HOST-N"  # a fleet host's batch directory, named when the host takes its cells
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


def target_path(path: str, home: str | None) -> str:
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
    workdir, runs = target_path(tgt["workdir"], home), target_path(tgt["runs"], home)
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
