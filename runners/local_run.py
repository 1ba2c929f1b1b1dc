"""A run's identity and its place on this machine: its id, its local directory (named by the
preset's artifacts.dir), the by-id link to it, and the record it starts with."""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import os
import secrets
import socket
from pathlib import Path

from runners.placement import Placement
from runners.presets import Preset
from runners.record import BY_ID, FLEET, RunRecord
from runners.templates import render_plain


def default_out_dir() -> Path:
    base = os.environ.get("TRACEDECK_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share"),
        "tracedeck",
    )
    return Path(base) / "runs"


def new_run_id(preset_name: str) -> str:
    now = dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{preset_name}-{secrets.token_hex(2)}"


def fresh_dir(path: Path) -> Path:
    """The run's local directory: the preset's layout path, suffixed if a run already used it."""
    candidate, n = path, 1
    while (candidate / "run.json").exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def local_dir_for(preset: Preset, out_dir: Path, date: str) -> Path:
    rel = render_plain(preset.section("artifacts")["dir"], {"date": date, "name": preset.name})
    return fresh_dir(Path(out_dir) / rel)


def by_id_link(out_dir: Path, run_id: str) -> Path:
    """Where a run's local directory is linked by its id: OUT/by-id/RUN_ID."""
    return Path(out_dir) / BY_ID / run_id


def link_by_id(link: Path, local_dir: Path) -> None:
    """OUT/by-id/RUN_ID -> the run's directory (relative, so the out dir can move whole)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(os.path.relpath(local_dir, link.parent), target_is_directory=True)


def new_record(p: Placement, out_dir: Path) -> RunRecord:
    """The record of a run about to launch: a new id, a fresh local directory named by the
    preset's artifacts.dir (-2, -3 when taken), who and where from."""
    preset, date = p.preset, dt.date.today().isoformat()
    hosts = [h.spec for h in p.hosts]
    return RunRecord(
        run_id=new_run_id(preset.name),
        preset=preset.name,
        kind=preset.kind,
        source=preset.source,
        overrides=preset.overrides,
        preset_data=preset.data,
        target=p.target,
        remote_dir="",
        lock="" if p.fleet else p.hosts[0].lock,
        local_dir=str(local_dir_for(preset, out_dir, date)),
        started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        user=getpass.getuser(),
        console_host=socket.gethostname(),
        date=date,
        extra={FLEET: {"hosts": hosts, "members": []}} if p.fleet else {},
        options=sorted(preset.options),
    )


def recorded_preset(record: RunRecord) -> Preset:
    return Preset(
        source=record.source,
        data=record.preset_data,
        overrides=record.overrides,
        options=frozenset(record.options),
    )
