"""Finding a run's local directory from what the operator typed (a directory, or a run id)."""

from __future__ import annotations

from pathlib import Path


def find_run(run: str, out: Path | None) -> Path:
    """A run directory as given, or the run with that id under the out dir (OUT/by-id/ID)."""
    from runners.local_run import default_out_dir
    from runners.record import find_local_run

    path = Path(run)
    if (path / "run.json").exists():
        return path
    root = out or default_out_dir()
    found = find_local_run(run, root)
    if found is not None:
        return found
    raise FileNotFoundError(
        f"no run {run!r}: not a run directory, and no run with that id under {root} "
        f"({root}/by-id/ links each run by its id); pass the directory `tracedeck run` printed "
        f"(or --out where it was written)"
    )
