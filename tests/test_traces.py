"""Followed trace files: every line credited to the cell that wrote it; the record keeps offsets."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from runhelp import cli_env, events, run_dirs, tracedeck

WRITER = """
import json, sys, time
path, cell, count, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
shards = "{shard}" in path  # a new file every 3 lines, as DSA traces shard by request
fh = None
for i in range(count):
    if fh is None or (shards and i % 3 == 0):
        if fh is not None:
            fh.close()
        fh = open(path.replace("{shard}", f"{cell}_{i // 3:02d}"), "a")
    fh.write(json.dumps({"cell": cell, "i": i}) + "\\n")
    fh.flush()
    time.sleep(pause)
fh.close()
"""

SHARED = """
[preset]
name = "shared"
kind = "command"

[target]
runs = "{runs}"
lock = "{lock}"
python = "{python}"

[engine]
command = "mkdir -p {{out}} && {{python}} {writer} {{out}}/{written} {{cell}} {{count}} {{pause}}"

[matrix]
n = [1, 2, 3]
count = [{count}]
pause = [{pause}]

[traces]
follow = ["{trace}"]
"""


def write_preset(
    tmp_path: Path, trace: str, count: int, pause: float, written: str | None = None
) -> Path:
    import sys

    writer = tmp_path / "writer.py"
    writer.write_text(WRITER)
    path = tmp_path / "shared.toml"
    path.write_text(
        SHARED.format(
            runs=tmp_path / "remote",
            lock=tmp_path / "lock",
            python=sys.executable,
            writer=writer,
            trace=trace,
            written=written or trace,
            count=count,
            pause=pause,
        )
    )
    return path


def credited_lines(local_dir: Path) -> list[tuple[int, dict]]:
    """(credited cell, line) for every line the record's trace batches cover, read from the file."""
    out: list[tuple[int, dict]] = []
    starts: dict[str, int] = {}
    for e in events(local_dir):
        if e["type"] != "trace":
            continue
        assert "records" not in e  # the record keeps offsets and digests, never the lines
        with open(e["file"], "rb") as fh:  # the target is this machine
            fh.seek(starts.get(e["file"], 0))
            data = fh.read(e["end_offset"] - starts.get(e["file"], 0))
        starts[e["file"]] = e["end_offset"]
        lines = data.splitlines()
        assert len(lines) == e["last_line"] - e["first_line"] + 1
        out += [(e["cell"], orjson.loads(line)) for line in lines]
    return out


@pytest.mark.parametrize("where", ["local", "ssh"])
@pytest.mark.parametrize(
    ("trace", "written", "count", "pause"),
    [
        ("trace.jsonl", None, 40, 0.0),  # one file for all cells: credited by their end sizes
        ("trace.jsonl", None, 6, 0.05),
        ("trace_{n}.jsonl", None, 6, 0.02),  # one file per cell
        ("shard_*.jsonl", "shard_{{shard}}.jsonl", 10, 0.02),  # files appear as cells write
        ("shard_*.jsonl", "shard_{{shard}}.jsonl", 9, 0.0),
    ],
)
def test_every_trace_line_is_credited_to_the_cell_that_wrote_it(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    where: str,
    trace: str,
    written: str | None,
    count: int,
    pause: float,
) -> None:
    if where == "ssh":
        ssh_home = request.getfixturevalue("ssh_home")
        spec, home = ssh_home.server.spec, ssh_home.path
    else:
        spec, home = "local", tmp_path / "home"
        home.mkdir()
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        str(write_preset(tmp_path, trace, count, pause, written)),
        "--target",
        spec,
        "--out",
        str(out),
        env=cli_env(home),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = credited_lines(run_dirs(out)[0])
    assert len(got) == 3 * count
    for cell, line in got:
        assert cell == line["cell"], (cell, line)
    assert sorted((line["cell"], line["i"]) for _, line in got) == [
        (c, i) for c in range(3) for i in range(count)
    ]


def test_a_pattern_may_only_shape_the_file_name(tmp_path: Path) -> None:
    from runners.kinds import load_preset
    from runners.presets import PresetError

    path = write_preset(tmp_path, "x.jsonl", 1, 0)
    with pytest.raises(PresetError, match=r"traces.follow\[0\]: a pattern .* only be in the file"):
        load_preset(path, ['traces.follow=["block*/trace.jsonl"]'])
    with pytest.raises(PresetError, match=r"traces.follow\[0\]: a file-name pattern may use"):
        load_preset(path, ['traces.follow=["trace $(x)*.jsonl"]'])
    load_preset(path, ['traces.follow=["block64/trace_steps_*.jsonl"]'])
