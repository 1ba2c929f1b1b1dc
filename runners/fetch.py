"""Bringing a cell's artifacts home: each file downloaded atomically, then its sha256 recorded."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

from runners.cells import PlannedCell, cell_name
from runners.events import ArtifactFailed, ArtifactFetched, ArtifactHeld, Error, Event
from runners.plan import RunPlan
from runners.progress import Meter, Sink
from runners.record import RecordError, record_name_problem
from runners.targets.base import (
    ConnectionLost,
    LocalWriteError,
    NotRegular,
    Target,
    TargetError,
)


class OutsideRun(TargetError):
    """A local path that resolves outside the run's directory (a planted link): not written."""


async def download_into(
    target: Target,
    remote: str,
    local_dir: Path,
    rel: str,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Download remote to local_dir/rel atomically; the one way a run brings a file home.

    A path that resolves outside local_dir is refused (OutsideRun); this machine failing to
    write (a full disk) is a RecordError: the run goes on, `tracedeck attach` fetches it later.
    progress(bytes done, bytes in all) as the bytes come.
    """
    local = local_dir / rel
    named = record_name_problem(rel)
    if named is not None:  # the preset refuses it; a path rendered otherwise is caught here
        raise OutsideRun(f"{local} {named}: not written")
    if not local.resolve().is_relative_to(local_dir.resolve()):
        # The preset refuses such paths; a link planted in the run's directory is caught here.
        raise OutsideRun(f"{local} resolves outside the run's directory {local_dir}: not written")
    try:
        await target.download(remote, local, progress=progress)
    except LocalWriteError as exc:
        # This machine's failure, not the engine's: stop recording, never judge a cell on it.
        raise RecordError(
            exc.errno,
            f"cannot write {exc.path}: {exc.strerror}; the run goes on on its target: free "
            f"the space, then `tracedeck attach {local_dir}` fetches it",
        ) from exc
    return local


async def fetch_cell(
    target: Target,
    plan: RunPlan,
    cell: PlannedCell,
    local_dir: Path,
    done: set[str],
    held: Callable[[str], bool] | None = None,
    progress: Sink | None = None,
) -> list[Event]:
    """Download every artifact of the cell not in `done`; one event per file, fetched or not
    (an ArtifactHeld for those `held` says stay on the target, judged there). A large file's
    bytes, rate and ETA go to `progress` as Progress events (never recorded).

    ConnectionLost propagates (the caller reconnects and tries again); any other failure of a
    file is an Error naming the cell, the file and where it was looked for.
    """
    events: list[Event] = []
    for rel in cell.artifacts:
        if rel in done:
            continue
        local = local_dir / rel
        remote = f"{plan.artifacts}/{rel}"
        if held is not None and held(rel):
            events.append(ArtifactHeld(cell=cell.index, path=rel))
            continue
        meter = Meter("fetch", rel, "bytes", progress, cell=cell.index)
        try:
            await download_into(target, remote, local_dir, rel, progress=meter.update)
        except (ConnectionLost, RecordError):
            raise  # the link (reconnect, resume) or this machine's disk: never the engine's
        except (OutsideRun, NotRegular) as exc:  # never looked at again (a FIFO's open blocks)
            why = str(exc)
            events.append(Error(message=f"{cell_name(cell.index, cell.params)}: {why}", where=rel))
            events.append(ArtifactFailed(cell=cell.index, path=rel, reason=why, missing=False))
            continue
        except (TargetError, OSError) as exc:
            missing = await target.read_from(remote, 0, 0) is None
            why = "the engine did not write it" if missing else str(exc)
            message = (
                f"{cell_name(cell.index, cell.params)}: artifact {rel} could not be fetched "
                f"from {target.name}:{remote}: {why}"
            )
            events.append(Error(message=message, where=remote))
            events.append(ArtifactFailed(cell=cell.index, path=rel, reason=why, missing=missing))
            continue
        meter.finish()
        digest = await asyncio.to_thread(sha256_file, local)
        events.append(
            ArtifactFetched(cell=cell.index, path=rel, size=local.stat().st_size, sha256=digest)
        )
    return events


def changed_since_fetched(root: Path, events: Iterable[Event]) -> list[str]:
    """'PATH: why' for each file the events say a run fetched into root (its size and
    sha256, the last fetch's) that is no longer what was fetched: judging it now would not
    judge the run. A file that is gone is the judge's to name as missing."""
    fetched = {e.path: e for e in events if isinstance(e, ArtifactFetched)}
    out = []
    for rel, e in sorted(fetched.items()):
        local = root / rel
        if not local.is_file():
            continue
        digest = sha256_file(local)
        if digest != e.sha256:
            out.append(
                f"{local}: sha256 {digest[:16]}, the run fetched {e.sha256[:16]} "
                f"({local.stat().st_size} bytes now, {e.size} then)"
            )
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
