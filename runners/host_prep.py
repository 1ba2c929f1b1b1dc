"""What a launch asks of a host and puts there before its first batch: the run's directories
(made when missing), the engine's version, and the reference engine when the preset ships it."""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path

from runners.events import EngineVersion
from runners.plan import dir_command
from runners.presets import Preset
from runners.reference import SHIPPED_WITH
from runners.targets.base import Target, TargetError
from runners.templates import render

VERSION_TIMEOUT_S = 30.0  # [engine] version_command: a version query, not work
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"


async def ship_reference(target: Target, pkg: str) -> None:
    """Copy the reference engine (stdlib + torch only) so any host with torch can run it."""
    for name in SHIPPED_WITH:
        source = REFERENCE_DIR.parent / name
        await target.write_file(f"{pkg}/runners/{name}", source.read_bytes())
    for path in sorted(REFERENCE_DIR.glob("*.py")):
        await target.write_file(f"{pkg}/runners/reference/{path.name}", path.read_bytes())


async def resolve_dir(target: Target, path: str, key: str) -> str:
    """An absolute path on the target, made when missing: absolute as written; `~`, `~/x` and
    relative paths under the target's home (the login user's, on the local target $HOME)."""
    result = await target.run(dir_command(path, create=True))
    if result.exit_status != 0:
        raise TargetError(
            f"{target.name}: {key} {path!r} is not usable: "
            f"{result.stderr.strip()}; set {key} to a writable directory"
        )
    resolved = result.stdout.removesuffix("\n")
    if not resolved.startswith("/") or any(ord(c) < 32 or ord(c) == 127 for c in resolved):
        raise TargetError(
            f"{target.name}: {key} {path!r} resolves to {resolved!r}, not a plain absolute "
            f"path; set {key} to a directory whose path has no control characters"
        )
    return resolved


async def engine_version(
    preset: Preset, target: Target, workdir: str, python: str
) -> EngineVersion | None:
    """The engine's identity from [engine] version_command, run in the workdir (None when
    the preset has none). A failure is recorded, never fatal: it says nothing of results."""
    template = preset.section("engine")["version_command"]
    if not template:
        return None
    command = render(template, {**preset.section("vars"), "python": python, "workdir": workdir})
    try:
        done = await target.run(
            f"cd {shlex.quote(workdir)} && {command}", timeout=VERSION_TIMEOUT_S
        )
    except TargetError as exc:
        return EngineVersion(command=command, version="", error=str(exc))
    except TimeoutError:
        return EngineVersion(
            command=command, version="", error=f"no answer within {VERSION_TIMEOUT_S:g}s"
        )
    first = next((ln.strip() for ln in done.stdout.splitlines() if ln.strip()), "")
    if done.exit_status != 0 or not first:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        why = f"exit {done.exit_status}: {tail[0][:200]}" if done.exit_status else "no output"
        return EngineVersion(command=command, version=first[:200], error=why)
    return EngineVersion(command=command, version=first[:200])


async def own_dirs(target: Target, run_dir: str, parents: int) -> None:
    """Make the run's directory and check that it (and `parents` above it: a fleet's RUNS/RUN_ID)
    is a directory of the login user's own, not a link: in a shared runs directory another user
    could have made it first and would control what the run's scripts become."""
    dirs = [run_dir]
    for _ in range(parents):
        dirs.append(posixpath.dirname(dirs[-1]))
    words = " ".join(shlex.quote(d) for d in dirs)
    result = await target.run(
        f"mkdir -p -- {shlex.quote(run_dir)} && for d in {words}; do "
        '[ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] || { printf %s "$d"; exit 3; }; done'
    )
    if result.exit_status == 3:
        raise TargetError(
            f"{target.name}: {result.stdout} is not a directory of this login user's own (another "
            "user made it, or it is a link): the run's scripts would be where someone else can "
            "change them; set target.runs to a directory of your own"
        )
    if result.exit_status != 0:
        raise TargetError(
            f"{target.name}: cannot make {run_dir}: {result.stderr.strip() or 'mkdir failed'}"
        )
