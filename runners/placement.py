"""Where a run goes, decided once: its hosts (one, or a fleet), each host's lock and launcher,
how the cells are grouped, and where the run is judged. Launch, attach, `plan`, `plan --check`
and the run's record all read this one Placement; none derives it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from runners import kinds
from runners.config import fleet_hosts, run_lock
from runners.launchers.base import Launcher
from runners.launchers.detached import DetachedLauncher
from runners.launchers.slurm import SlurmLauncher, SlurmSettings, slurm_settings
from runners.plan import RunPlan, build_plan
from runners.presets import Preset
from runners.record import FLEET
from runners.targets.base import Target
from runners.targets.factory import parse_target

CONSOLE, HOST, HOST_IF_IT_CAN = "console", "host", "host if it can"


@dataclass(frozen=True, slots=True)
class Host:
    """One host of a run: as written, its batch directories' prefix in a fleet, its lock, and
    its launcher (Slurm when `slurm` is set, else detached)."""

    spec: str
    slug: str  # RUNS/RUN_ID/SLUG-N in a fleet; "" for a run on one host (RUNS/RUN_ID)
    lock: str
    slurm: SlurmSettings | None = None
    name: str = ""  # as tracedeck names it (local, ssh://user@host:port)


@dataclass(frozen=True, slots=True)
class Judging:
    """Where a kind that can judge on the target is judged, and why."""

    where: str  # CONSOLE | HOST | HOST_IF_IT_CAN (decided on each host as it starts)
    why: str
    python: str  # [judge] python; "" for the run's {python}


@dataclass(frozen=True, slots=True)
class Placement:
    preset: Preset
    target: str  # as the operator wrote it
    hosts: tuple[Host, ...]
    fleet: bool  # the cells are spread over the hosts, each batch in RUNS/RUN_ID/SLUG-N
    groups: tuple[tuple[int, ...], ...]  # cells that run on one host (a B3.67 pair)
    judging: Judging | None  # None: the kind judges nothing on a host

    @property
    def local(self) -> bool:
        return all(h.name == "local" for h in self.hosts)

    def connect(self, host: Host) -> Target:
        tgt = self.preset.section("target")
        return parse_target(
            host.spec, connect_timeout=tgt["connect_timeout_s"], keepalive=tgt["keepalive_s"]
        )

    def launcher(self, host: Host, target: Target) -> Launcher:
        return SlurmLauncher(target, host.slurm) if host.slurm else DetachedLauncher(target)

    def plan(
        self,
        *,
        run_id: str,
        run_dir: str,
        workdir: str,
        python: str,
        date: str,
        lock: str,
        cells: list[int] | None = None,
        marker: str = "",
    ) -> RunPlan:
        """The run's plan on one host's paths; a fleet batch's holds only its cells and their
        traces, and its own marker as its run id."""
        ship = self.preset.section("engine")["ship_reference"]
        full = build_plan(
            self.preset,
            run_id=run_id,
            run_dir=run_dir,
            workdir=workdir,
            python=python,
            date=date,
            lock=lock,
            pythonpath=f"{run_dir}/pkg" if ship else "",
        )
        if cells is None:
            return full
        wanted = set(cells)
        return replace(
            full,
            run_id=marker or run_id,
            cells=[c for c in full.cells if c.index in wanted],
            traces=tuple(t for t in full.traces if t.cell is None or t.cell in wanted),
        )


def decide(
    preset: Preset, target: str, *, hosts: list[str] | None = None, lock: str | None = None
) -> Placement:
    """The run's placement; ValueError (with the reason) for one that cannot run. An attach
    passes what the record holds (its hosts, its lock), never what the config says now."""
    specs = fleet_hosts(target) if hosts is None else (hosts or None)  # []: one host
    tgt = preset.section("target")
    if specs is not None and tgt["scheduler"]:
        raise ValueError(
            f"{preset.source}: target.scheduler = {tgt['scheduler']!r} with --target "
            f"{target!r}: a cluster's scheduler places the cells itself; give its login node "
            "as the target (slurm://LOGIN/PARTITION), not a fleet"
        )
    if specs is None:
        one = Host(
            target,
            "",
            lock if lock is not None else run_lock(target, preset),
            slurm_settings(target, preset),
            parse_target(target).name,
        )
        places: tuple[Host, ...] = (one,)
    else:
        taken: set[str] = set()
        out = []
        for spec in specs:
            slug = host_slug(spec, taken)
            taken.add(slug)
            out.append(
                Host(spec, slug, run_lock(spec, preset, target), None, parse_target(spec).name)
            )
        places = tuple(out)
    kind = kinds.get(preset.kind)
    cells = list(
        build_plan(preset, run_id="", run_dir="", workdir="", python="", date="", lock="").cells
    )
    fleet = specs is not None
    together = kind.together(cells) if fleet and preset.section(FLEET)["together"] else None
    groups = tuple(tuple(g) for g in (together or [[c.index] for c in cells]))
    if not fleet:
        groups = (tuple(c.index for c in cells),)  # one host: the queue gives everything at once
    placement = Placement(preset, target, places, fleet, groups, None)
    return Placement(preset, target, places, fleet, groups, _judging(placement))


def _judging(p: Placement) -> Judging | None:
    spec = kinds.get(p.preset.kind).host_judging
    if spec is None:
        return None
    cfg = p.preset.section("judge")
    python = cfg["python"] or "{python}"
    needs = " and ".join(spec.requires) or "nothing more"
    if cfg["on"] == "console":
        return Judging(CONSOLE, "[judge] on = console: every artifact is fetched", cfg["python"])
    if cfg["on"] == "auto" and p.local:
        return Judging(CONSOLE, "the data is already on this machine", cfg["python"])
    if p.fleet and not p.preset.section(FLEET)["together"]:
        why = "fleet.together = false: a pair's sides may run on different hosts"
        return Judging(CONSOLE, why, cfg["python"])
    where = "each host that runs a batch" if p.fleet else "the host"
    if cfg["on"] == "host":
        why = f"[judge] on = host: on {where}, with {python} there (it needs {needs})"
        return Judging(HOST, why, cfg["python"])
    why = (
        f"[judge] on = auto: on {where} when {python} there has {needs} (`plan --check` "
        "says), else on this console, fetching everything"
    )
    return Judging(HOST_IF_IT_CAN, why, cfg["python"])


def host_slug(spec: str, taken: set[str]) -> str:
    """A directory name for a host: its spec in safe characters, unique within the fleet."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.strip().removeprefix("ssh://")).strip("_.")
    slug, n = base or "host", 1
    while slug in taken:
        n += 1
        slug = f"{base}_{n}"
    return slug
