"""Issue 20 (DSA, seed 004): a judge that recomputes every claim the engine makes.

Each numbered case of the issue fails on the code before it, and the liar matrix lies about
every claim a DSA engine makes (summary statistics, counts, flags, shard names, the block
mapping, prefix cache claims, kv_fetch tiers, the top-k): each lie is refused. The traces come
from tests/dsa_writer.py, a plain-Python seed-004 writer independent of the judge.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dsa_writer import write_trace
from patience import patience
from runhelp import cli_env, spawn, tracedeck, wait_for

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)


def analyze(path: Path, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    done = tracedeck("analyze", str(path), "--json", *extra, env=cli_env(_home(tmp_path)))
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return home


def fields_of(block: dict[str, Any]) -> set[str]:
    found = {p["field"] for p in block["problems"]}
    if block["first_fail"]:
        found.add(block["first_fail"]["field"])
    return found


def edit_summary(folder: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    path = folder / "summary.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_records(folder: Path, shard: str, lines: list[int] | None, change: Callable) -> None:  # type: ignore[type-arg]
    """Change records (1-based lines; None: all) of a shard in place."""
    path = folder / shard
    text = path.read_text().splitlines()
    for n in range(len(text)):
        if lines is None or n + 1 in lines:
            rec = json.loads(text[n])
            change(rec)
            text[n] = json.dumps(rec)
    path.write_text("\n".join(text) + "\n")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        d[last] = value(d[last]) if callable(value) else value

    return change


# -- 7: summary.json is part of the output contract ----------------------------------------------


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("unique_blocks.count", _set("unique_blocks.count", lambda v: v + 1)),
        ("offsets.p50", _set("offsets.p50", lambda v: v + 1)),
        (
            "tokens_per_touched_block.mean",
            _set("tokens_per_touched_block.mean", lambda v: v * 1.01),
        ),  # fmt: skip
        ("prefix_intersection_ratio.max", _set("prefix_intersection_ratio.max", 0.99)),
        ("offsets", lambda d: d.pop("offsets")),
        ("offsets.p95", lambda d: d["offsets"].pop("p95")),
        (
            "prefix_hot_blocks['0']",
            lambda d: d["prefix_hot_blocks"]["0"][0].update(touch_count=99),
        ),  # fmt: skip
    ],
)
def test_a_wrong_summary_is_trace_invalid_naming_field_expected_found(
    field: str, change: Callable, tmp_path: Path
) -> None:  # type: ignore[type-arg]
    folder = write_trace(tmp_path / "t")
    edit_summary(folder, change)
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and result["verdict"] == "TRACE_INVALID"
    [block] = result["dirs"]
    assert block["invalid"] == 0  # the records hold; summary.json lies
    [p] = [p for p in block["problems"] if p["field"] == field]
    assert p["file"].endswith("summary.json") and p["expected"] and p["found"]


def test_hot_blocks_must_be_the_hottest_in_order(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t", steps=4, topk=12, bs=4)
    summary = json.loads((folder / "summary.json").read_text())
    layer = next(
        k for k, v in summary["prefix_hot_blocks"].items()
        if v[0]["touch_count"] > v[-1]["touch_count"]
    )  # fmt: skip
    name = f"prefix_hot_blocks[{layer!r}]"
    edit_summary(folder, lambda d: d["prefix_hot_blocks"][layer].reverse())  # wrong order
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and name in fields_of(result["dirs"][0])
    edit_summary(folder, lambda d: d["prefix_hot_blocks"][layer].reverse())
    edit_summary(folder, lambda d: d["prefix_hot_blocks"][layer].pop(0))  # the hottest left out
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and name in fields_of(result["dirs"][0])


def test_watch_compares_summary_json_exactly(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    edit_summary(folder, _set("offsets.p50", lambda v: v + 0.5))  # inside a live bucket's width
    done = tracedeck(
        "watch", str(tmp_path / "t"), "--headless", "--idle", "0.2", env=cli_env(_home(tmp_path))
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "summary.json: offsets.p50: expected" in done.stdout
    assert "RESULT: TRACE_INVALID" in done.stdout


# -- 8: prefix_cached_blocks and shard names ------------------------------------------------------


def test_prefix_blocks_past_the_requests_kv_are_refused(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", pcb={2: 20})  # ~43 tokens: 3 blocks of 16, not 20
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1
    first = result["dirs"][0]["first_fail"]
    assert (first["field"], first["request"], first["found"]) == ("prefix.prefix_cached_blocks", 2, "20")  # fmt: skip


def test_a_hit_must_claim_its_key_owners_blocks(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", pcb={1: 1})  # request 1 hits request 0's key (2 blocks)
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1
    [p] = [p for p in result["dirs"][0]["problems"] if p["field"] == "prefix.prefix_cached_blocks"]
    assert p["request"] == 1 and p["found"] == "1" and p["expected"].startswith("2 (request 0")


def test_prefix_blocks_past_the_prefix_key_tokens_are_refused(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t", pcb={3: 3})
    edit_summary(folder, lambda d: d["config"].update(trace_prefix_key_tokens=24))
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1
    [p] = [p for p in result["dirs"][0]["problems"] if p["field"] == "prefix.prefix_cached_blocks"]
    assert p["request"] == 3 and "trace_prefix_key_tokens 24" in p["expected"]


def test_a_shard_name_that_over_claims_its_requests_is_refused(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", names={"trace_steps_4_5.jsonl": "trace_steps_4_6.jsonl"})
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1
    [p] = [p for p in result["dirs"][0]["problems"] if p["field"] == "shards"]
    assert p["file"].endswith("trace_steps_4_6.jsonl") and "trace_steps_4_5.jsonl" in p["expected"]


# -- 9: the top-k comes from the trace, and says where from --------------------------------------


def test_watch_learns_the_topk_from_the_summary(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", prompt=200, topk=128, requests=2, steps=2, layers=2)
    done = tracedeck(
        "watch", str(tmp_path / "t"), "--headless", "--idle", "0.2", env=cli_env(_home(tmp_path))
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "top-128 from summary.json config.index_topk" in done.stdout
    assert "RESULT: TRACE_OK" in done.stdout


def test_records_judged_before_the_summary_appeared_are_judged_by_it(tmp_path: Path) -> None:
    """Shards first, summary.json later: the records wait for the top-k, then the summary's
    top-k judges them (true top-128: OK; a summary that says 64: every record is refused)."""
    for said, want in ((128, 0), (64, 1)):
        root = tmp_path / f"t{said}"
        folder = write_trace(root, prompt=200, topk=128, requests=2, steps=2, layers=2)
        summary = json.loads((folder / "summary.json").read_text())
        summary["config"]["index_topk"] = said
        (folder / "summary.json").unlink()
        watch = spawn("watch", str(root), "--headless", "--idle", "0.2", env=cli_env(_home(tmp_path)))  # fmt: skip
        assert watch.stdout is not None
        seen: list[str] = []
        wait_for(
            lambda: seen.append(watch.stdout.readline()) or "8 records" in seen[-1],  # noqa: B023
            what="watch to read every record",
        )
        (folder / "summary.json.part").write_text(json.dumps(summary))
        (folder / "summary.json.part").rename(folder / "summary.json")
        out, err = watch.communicate(timeout=patience(60))
        text = "".join(seen) + out
        assert watch.returncode == want, text + err
        assert f"top-{said} from summary.json config.index_topk" in text
        if want:
            assert "selected_token_pos: expected min(top-k 64" in text and "8 invalid" in text


def test_analyze_without_any_topk_source_says_where_it_came_from(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t", prompt=200, topk=128, requests=2, steps=2, layers=2)
    edit_summary(folder, lambda d: d["config"].pop("index_topk"))
    done = tracedeck("analyze", str(tmp_path / "t"), env=cli_env(_home(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "top-None" not in done.stdout and "top-128 (the records: 8 of the records" in done.stdout


# -- 11: the odd record is blamed, not the group ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("prefix.prefix_key", _set("prefix.prefix_key", hashlib.sha1(b"odd").hexdigest())),
        ("kv_fetch.hbm.latency_us", _set("kv_fetch.hbm.latency_us", 1)),
        ("run_name", _set("run_name", "another_run")),
    ],
)
def test_an_odd_first_record_is_blamed_not_the_others(
    field: str, change: Callable, tmp_path: Path
) -> None:  # type: ignore[type-arg]
    folder = write_trace(tmp_path / "t")
    edit_records(folder, "trace_steps_0_2.jsonl", [1], change)  # request 0's first record
    code, result = analyze(tmp_path / "t", tmp_path)
    [block] = result["dirs"]
    assert code == 1 and block["invalid"] == 1, block["problems"]
    first = block["first_fail"]
    assert (first["field"], first["line"], first["request"]) == (field, 1, 0)


def test_a_short_first_step_is_blamed_not_every_step_after_it(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    edit_summary(folder, lambda d: d["config"].pop("n_layers"))  # the layer count is learned
    _drop(folder / "trace_steps_0_2.jsonl", 3)  # request 0's first step loses its last layer
    code, result = analyze(tmp_path / "t", tmp_path)
    [block] = result["dirs"]
    assert code == 1 and block["layers"] == 3 and block["invalid"] == 2, block["problems"]
    first = block["first_fail"]
    assert (first["field"], first["line"], first["request"]) == ("layer_id", 1, 0)
    assert first["found"] == "2 (1 steps so)"


def test_messages_print_plain_numbers(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    edit_records(folder, "trace_steps_0_2.jsonl", [2], _set("touched_block_ratio", 0.01))
    edit_records(folder, "trace_steps_0_2.jsonl", [3], _set("prefix.intersection_ratio", 0.01))
    edit_records(folder, "trace_steps_0_2.jsonl", [4], _set("tokens_per_touched_block.mean", 99))
    done = tracedeck("analyze", str(tmp_path / "t"), "--json", env=cli_env(_home(tmp_path)))
    assert done.returncode == 1 and "np." not in done.stdout, done.stdout
    messages = [p["message"] for p in json.loads(done.stdout)["dirs"][0]["problems"]]
    assert any("unique_blocks / total_blocks_in_use = " in m for m in [json.loads(done.stdout)["dirs"][0]["first_fail"]["message"], *messages])  # fmt: skip


# -- the liar matrix: every claim a DSA engine makes, lied about ------------------------------------

HASH = hashlib.sha1(b"x").hexdigest()
S02, S24 = "trace_steps_0_2.jsonl", "trace_steps_2_4.jsonl"


def _all(shard: str, change: Callable) -> Callable[[Path], None]:  # type: ignore[type-arg]
    return lambda folder: edit_records(folder, shard, None, change)


def _line(shard: str, n: int, change: Callable) -> Callable[[Path], None]:  # type: ignore[type-arg]
    return lambda folder: edit_records(folder, shard, [n], change)


def _summary(change: Callable) -> Callable[[Path], None]:  # type: ignore[type-arg]
    return lambda folder: edit_summary(folder, change)


def _shift_blocks(r: dict[str, Any]) -> None:
    """block_off_by_one, every derived field made to agree."""
    blocks = [b + 1 for b in r["selected_block_ids"]]
    r["selected_block_ids"] = r["kv_fetch"]["hbm"]["hit_blocks"] = blocks


def _rename(old: str, new: str) -> Callable[[Path], None]:
    return lambda folder: (folder / old).rename(folder / new)


def _tier(r: dict[str, Any]) -> None:
    r["kv_fetch"]["local_pool"].update(hit_blocks=[0], batch_size=1, bytes_read=1024, read_ops=1)


LIARS: dict[str, tuple[str, Callable[[Path], None]]] = {
    # summary statistics and counts
    **{
        f"summary {s}.{k}": (f"{s}.{k}", _summary(_set(f"{s}.{k}", lambda v: v + 1)))
        for s in (
            "unique_blocks",
            "tokens_per_touched_block",
            "offsets",
            "prefix_intersection_ratio",
        )  # fmt: skip
        for k in ("count", "min", "p50", "p95", "max", "mean")
    },
    "summary hot blocks": (
        "prefix_hot_blocks['2']",
        _summary(lambda d: d["prefix_hot_blocks"]["2"].append({"block_id": 77, "touch_count": 1})),
    ),  # fmt: skip
    # (summary.json's top-k and layer count are the references the records are judged by)
    "summary topk": ("selected_token_pos", _summary(_set("config.index_topk", 64))),
    "summary layers": ("layer_id", _summary(_set("config.n_layers", 4))),
    "summary block size": (
        "config.kv_block_size_tokens",
        _summary(_set("config.kv_block_size_tokens", 64)),
    ),  # fmt: skip
    "summary requests (more)": ("shards", _summary(_set("config.requests", 7))),
    "summary requests (fewer)": ("shards", _summary(_set("config.requests", 4))),
    "record count": (
        "unique_token_pos_count",
        _line(S24, 3, _set("unique_token_pos_count", lambda v: v - 1)),
    ),  # fmt: skip
    "unique blocks": ("unique_blocks", _line(S24, 3, _set("unique_blocks", lambda v: v + 1))),
    "total blocks": (
        "total_blocks_in_use",
        _line(S24, 3, _set("total_blocks_in_use", lambda v: v + 1)),
    ),  # fmt: skip
    "touched ratio": ("touched_block_ratio", _line(S24, 3, _set("touched_block_ratio", 0.01))),
    "tokens per block p95": (
        "tokens_per_touched_block.p95",
        _line(S24, 3, _set("tokens_per_touched_block.p95", 99)),
    ),  # fmt: skip
    "offset min": ("offset_min", _line(S24, 3, _set("offset_min", lambda v: v + 1))),
    "offset max": ("offset_max", _line(S24, 3, _set("offset_max", lambda v: v - 1))),
    "offset p50": ("offset_p50", _line(S24, 3, _set("offset_p50", lambda v: v + 9))),
    "scores stats": ("scores_stats", _line(S24, 3, _set("scores_stats.min", 9.0))),
    # flags and constants
    "prefix hit flag": (
        "prefix.prefix_cache_hit",
        _all(S24, _set("prefix.prefix_cache_hit", True)),
    ),  # fmt: skip
    "prefix miss flag": (
        "prefix.prefix_cache_hit",
        lambda f: edit_records(f, S02, list(range(10, 19)), _set("prefix.prefix_cache_hit", False)),
    ),  # fmt: skip
    "prefix key": ("prefix.prefix_key", _line(S24, 3, _set("prefix.prefix_key", HASH))),
    "rank": ("rank", _line(S24, 3, _set("rank", 1))),
    "world size": ("world_size", _line(S24, 3, _set("world_size", 4))),
    "dataset": ("dataset", _line(S24, 3, _set("dataset", "sharegpt"))),
    "step latency": (
        "kv_fetch.hbm.latency_us",
        _line(S24, 3, _set("kv_fetch.hbm.latency_us", 7)),
    ),  # fmt: skip
    # shard names and order
    "shard name over-claims": (
        "shards",
        _rename("trace_steps_4_5.jsonl", "trace_steps_4_9.jsonl"),
    ),  # fmt: skip
    "shard name under-claims": ("request_id", _rename(S24, "trace_steps_2_3.jsonl")),
    "layer dropped": (
        "layer_id",
        lambda f: _drop(f / S24, 5),
    ),  # fmt: skip
    # the block mapping and the tiers
    "block mapping": ("selected_block_ids", _all(S24, _shift_blocks)),
    "hbm hit blocks": (
        "kv_fetch.hbm.hit_blocks",
        _line(S24, 3, _set("kv_fetch.hbm.hit_blocks", lambda v: v[:-1])),
    ),  # fmt: skip
    "hbm batch size": (
        "kv_fetch.hbm.batch_size",
        _line(S24, 3, _set("kv_fetch.hbm.batch_size", lambda v: v + 1)),
    ),  # fmt: skip
    "hbm bytes": (
        "kv_fetch.hbm.bytes_read",
        _line(S24, 3, _set("kv_fetch.hbm.bytes_read", lambda v: v + 1152)),
    ),  # fmt: skip
    "local tier": ("kv_fetch.local_pool/remote_pool", _line(S24, 3, _tier)),
    # prefix cache claims
    "prefix blocks over the KV": (
        "prefix.prefix_cached_blocks",
        lambda f: write_trace(f.parent, pcb={4: 9}) and None,
    ),  # fmt: skip
    "prefix blocks vs owner": (
        "prefix.prefix_cached_blocks",
        lambda f: write_trace(f.parent, pcb={1: 1}) and None,
    ),  # fmt: skip
    "intersection blocks": (
        "prefix.intersection_blocks",
        _line(S24, 3, _set("prefix.intersection_blocks", [0])),
    ),  # fmt: skip
    "intersection ratio": (
        "prefix.intersection_ratio",
        _line(S24, 3, _set("prefix.intersection_ratio", 0.5)),
    ),  # fmt: skip
    # the top-k
    "topk (one record short)": ("selected_token_pos", _line(S24, 3, lambda r: _short(r))),
}


def _drop(path: Path, line: int) -> None:
    lines = path.read_text().splitlines()
    del lines[line - 1]
    path.write_text("\n".join(lines) + "\n")


def _short(r: dict[str, Any]) -> None:
    """One position fewer, every derived field made to agree (a top-31 record in a top-32 trace)."""
    from dsa_writer import nearest_rank

    pos = sorted(r["selected_token_pos"])[1:]
    seq, bs = r["seq_len_current"], r["block_size_tokens"]
    per: dict[int, int] = {}
    for p in pos:
        per[p // bs] = per.get(p // bs, 0) + 1
    blocks = sorted(per)
    offs = [seq - 1 - p for p in pos]
    inter = [b for b in blocks if b < r["prefix"]["prefix_cached_blocks"]]
    r.update(
        selected_token_pos=pos,
        unique_token_pos_count=len(pos),
        offset_min=min(offs),
        offset_max=max(offs),
        offset_p50=nearest_rank(offs, 0.5),
        selected_block_ids=blocks,
        unique_blocks=len(blocks),
        touched_block_ratio=len(blocks) / r["total_blocks_in_use"],
    )
    r["tokens_per_touched_block"] = {
        "mean": len(pos) / len(blocks),
        "p50": nearest_rank(list(per.values()), 0.5),
        "p95": nearest_rank(list(per.values()), 0.95),
    }
    r["kv_fetch"]["hbm"].update(hit_blocks=blocks, batch_size=len(blocks), bytes_read=len(blocks) * bs * 1152)  # fmt: skip
    r["prefix"].update(intersection_blocks=inter, intersection_ratio=len(inter) / len(blocks))


@pytest.mark.parametrize("liar", sorted(LIARS))
def test_liar_matrix_every_lie_is_refused(liar: str, tmp_path: Path) -> None:
    field, lie = LIARS[liar]
    folder = write_trace(tmp_path / "t")
    lie(folder)
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and result["verdict"] == "TRACE_INVALID", liar
    assert field in fields_of(result["dirs"][0]), (liar, result["dirs"][0]["problems"][:5])


def test_the_honest_writer_passes(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", steps=4)
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 0 and result["dirs"][0]["problems"] == [], result


# -- 15: a finished DSA run's directory is re-judged ------------------------------------------------


def test_analyze_rejudges_a_dsa_run_directory_and_leaves_its_record(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = cli_env(_home(tmp_path))
    done = tracedeck(
        "run", "dsa_smoke", "--out", str(out),
        "--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"',
        env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [run_dir] = sorted(p.parent for p in out.glob("**/run.json"))
    recorded = (run_dir / "events.jsonl").read_bytes()
    again = tracedeck("analyze", str(run_dir), env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "RESULT: TRACE_OK" in again.stdout and "recorded verdict: TRACE_OK" in again.stdout
    # the summary that came home, lied about: the re-judgement refuses it
    [summary] = run_dir.glob("**/block16/summary.json")
    data = json.loads(summary.read_text())
    data["offsets"]["p50"] += 1
    summary.write_text(json.dumps(data))
    lied = tracedeck("analyze", str(run_dir), "--json", env=env)
    assert lied.returncode == 1, lied.stdout + lied.stderr
    trace = json.loads(lied.stdout)["traces"][0]
    assert "offsets.p50" in fields_of(trace) and trace["from"] == "the run's recorded digests"
    # shards copied home are judged whole from their records
    [remote] = (tmp_path / "remote").glob("*/artifacts/dsa/block16")
    for shard in remote.glob("trace_steps_*.jsonl"):
        (summary.parent / shard.name).write_bytes(shard.read_bytes())
    summary.write_bytes((remote / "summary.json").read_bytes())
    whole = tracedeck("analyze", str(run_dir), "--json", env=env)
    assert whole.returncode == 0, whole.stdout
    assert json.loads(whole.stdout)["traces"][0]["from"] == "the shards in the run directory"
    assert (run_dir / "events.jsonl").read_bytes() == recorded
