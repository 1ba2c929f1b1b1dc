"""`tracedeck doctor`: this machine and a target checked, reading only, with what to fix.

The target's checks are plan --check's (reachable, host key, launcher tools, directories, free
space, lock holder, interpreter and the reference engine's packages), made for a run of the
shipped reference-engine smoke preset, so that no preset has to be named.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from runners.kinds import load_preset
from runners.preflight import OK, PROBLEM, WARN, Checked, check
from runners.presets import SHIPPED_DIR, PresetError
from runners.preview import preview

PROBE_PRESET = "b3_67_smoke"
FREE_MIN = 1 << 30  # less than this free under the records is a warning


def check_here(out_dir: Path, packages: tuple[str, ...]) -> Checked:
    """This machine as the console's: Python, `packages` (the console's), the config, ~/.ssh, the
    records."""
    out = Checked()
    version = ".".join(str(v) for v in sys.version_info[:3])
    out.add(OK, "python", f"{sys.executable} is Python {version}")
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        out.add(
            PROBLEM,
            "packages",
            f"missing {', '.join(missing)}: reinstall (bash scripts/install.sh, or pip install -e .)",
        )
    else:
        out.add(OK, "packages", f"{', '.join(packages)} are there")
    try:
        from runners.config import config_path, load_config

        load_config()
        path = config_path()
        out.add(OK, "config", f"{path} {'reads' if path.exists() else 'is absent (no fleets)'}")
    except ValueError as exc:
        out.add(PROBLEM, "config", f"{exc}: fix that line of the config file")
    ssh_config = Path.home() / ".ssh" / "config"
    if ssh_config.exists() and not os.access(ssh_config, os.R_OK):
        out.add(PROBLEM, "ssh config", f"{ssh_config} cannot be read: chmod u+r it")
    elif not ssh_config.exists():
        out.add(
            OK, "ssh config", f"{ssh_config} is absent: no host aliases (ssh://USER@HOST works)"
        )
    else:
        from runners.targets.factory import ssh_config_aliases

        aliases = ssh_config_aliases()
        out.add(OK, "ssh config", f"{len(aliases)} host alias(es) in {ssh_config}")
    _check_records(out, out_dir)
    return out


def _check_records(out: Checked, out_dir: Path) -> None:
    anchor = out_dir
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    if not os.access(anchor, os.W_OK):
        out.add(PROBLEM, "records", f"{anchor} cannot be written: run records go to {out_dir}")
        return
    free = shutil.disk_usage(anchor).free
    gib = free / (1 << 30)
    level = OK if free >= FREE_MIN else WARN
    out.add(level, "records", f"{out_dir}: {gib:.1f} GiB free")


async def check_target(target: str, out_dir: Path) -> Checked:
    try:
        probe = load_preset(SHIPPED_DIR / f"{PROBE_PRESET}.toml")
        view = preview(probe, target, out_dir)
    except (PresetError, ValueError) as exc:
        checked = Checked()
        checked.add(PROBLEM, "target", str(exc))
        return checked
    return await check(view)
