"""`tracedeck export` and the DSA data tools against what goes wrong around them: a shard that
is no file, an output inside another block directory, a SIGTERM mid-export, two exports to one
file. Each ends with a clear message or a whole file, never a half-written one or a traceback."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from dsa_writer import write_trace
from runhelp import cli_env, spawn, tracedeck, wait_for


def _no_part_files(where: Path) -> None:
    assert not list(where.rglob("*.part")), list(where.rglob("*.part"))


@pytest.mark.parametrize("what", ["a directory", "a dangling link"])
@pytest.mark.parametrize(
    ("verb", "opts"), [(["export"], ["--format", "csv"]), (["export"], ["--format", "parquet"]),
                       (["dsa", "whatif"], []), (["dsa", "tiers"], ["--hbm-blocks", "4"])],
)  # fmt: skip
def test_a_shard_that_is_no_readable_file_is_named_as_the_input(
    what: str, verb: list[str], opts: list[str], tmp_path: Path
) -> None:
    folder = write_trace(tmp_path / "t")
    shard = folder / "trace_steps_9_10.jsonl"
    if what == "a directory":
        shard.mkdir()
    else:
        shard.symlink_to(tmp_path / "nowhere")
    out = tmp_path / "out.x"
    args = [*verb, str(folder), *opts]
    if verb == ["export"]:
        args += ["--output", str(out)]
    done = tracedeck(*args, env=cli_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{shard}: cannot read" in done.stderr and "must be a readable file" in done.stderr
    assert not out.exists()
    _no_part_files(tmp_path)


def test_an_output_inside_any_block_directory_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    root = tmp_path / "trace"
    write_trace(root, bs=16)
    write_trace(root, bs=64)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    done = tracedeck(
        "export", str(root), "--format", "csv", "--output", str(root / "block64"),
        env=cli_env(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2 and "inside the block directory" in done.stderr
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # block16.csv too


def _blocked_trace(tmp_path: Path) -> tuple[Path, bytes, Path, int]:
    """A trace whose last shard is a FIFO held open by a writer (this test: the descriptor
    returned): an export reads it only as the test writes it, and ends when it closes it."""
    folder = write_trace(tmp_path / "t")
    last = sorted(folder.glob("trace_steps_*.jsonl"))[-1]
    data = last.read_bytes()
    last.unlink()
    os.mkfifo(last)
    return folder, data, last, os.open(last, os.O_RDWR)  # (a FIFO's O_RDWR never waits)


def test_a_sigterm_mid_export_leaves_no_file_and_says_so(tmp_path: Path) -> None:
    folder, _, fifo, writer = _blocked_trace(tmp_path)
    out = tmp_path / "x.parquet"
    proc = spawn("export", str(folder), "--output", str(out), env=cli_env(tmp_path))
    try:
        wait_for(lambda: list(tmp_path.glob("x.parquet.*.part")), what="the export's part file")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert not out.exists()
    _no_part_files(tmp_path)
    assert fifo.exists()


def test_two_exports_to_one_file_each_write_their_own_part_and_the_file_is_one_whole(
    tmp_path: Path,
) -> None:
    """Export A waits on its last shard with its part file open; export B of another trace to
    the same file runs to the end; then A ends. The file is A's whole export (the last
    renamed), byte for byte what A alone writes: never a mix."""
    folder, data, fifo, writer = _blocked_trace(tmp_path / "a")
    other = write_trace(tmp_path / "b" / "t", requests=3)
    out = tmp_path / "same.csv"
    env = cli_env(tmp_path)
    first = spawn("export", str(folder), "--format", "csv", "--output", str(out), env=env)
    try:
        wait_for(lambda: list(tmp_path.glob("same.csv.*.part")), what="A's part file")
        second = tracedeck("export", str(other), "--format", "csv", "--output", str(out), env=env)
        assert second.returncode == 0, second.stderr
        with open(writer, "wb", closefd=False) as fh:  # the writer writes the shard
            fh.write(data)
        os.close(writer)  # and closes it: the export's read of it ends
        writer = -1
        _, err = first.communicate(timeout=60)
    finally:
        if writer >= 0:
            os.close(writer)
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    fifo.unlink()
    (fifo.parent / fifo.name).write_bytes(data)
    alone = tmp_path / "alone.csv"
    done = tracedeck("export", str(folder), "--format", "csv", "--output", str(alone), env=env)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == alone.read_bytes()
    _no_part_files(tmp_path)


def test_an_export_of_shards_with_no_line_writes_nothing_and_says_so(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    for shard in folder.glob("trace_steps_*.jsonl"):
        shard.write_bytes(b"")
    out = tmp_path / "x.csv"
    done = tracedeck("export", str(folder), "--format", "csv", "--output", str(out), env=cli_env(tmp_path))  # fmt: skip
    assert done.returncode == 2 and "no trace line in its shards" in done.stderr
    assert not out.exists()
    _no_part_files(tmp_path)
    shutil.rmtree(folder)


def test_a_trace_with_no_stated_top_k_says_which_one_it_was_checked_against(
    tmp_path: Path,
) -> None:
    """No summary.json: the data tools check each record against the seed's top-2048 and, when
    that marks them invalid, say so and how to give the engine's (--topk); given, they pass."""
    folder = write_trace(tmp_path / "t", topk=32)
    (folder / "summary.json").unlink()
    env = cli_env(tmp_path)
    done = tracedeck("export", str(folder), "--format", "csv", "--output", str(tmp_path / "x.csv"), env=env)  # fmt: skip
    assert done.returncode == 1 and "marked invalid" in done.stdout
    assert "top-k was not stated" in done.stdout and "give it with --topk" in done.stdout
    done = tracedeck("dsa", "whatif", str(folder), env=env)
    assert done.returncode == 2 and "give it with --topk" in done.stderr
    done = tracedeck("dsa", "whatif", str(folder), "--topk", "32", env=env)
    assert done.returncode == 0, done.stderr
    done = tracedeck("export", str(folder), "--topk", "32", "--output", str(tmp_path / "y.parquet"), env=env)  # fmt: skip
    assert done.returncode == 0 and "top-k" not in done.stdout, done.stdout
