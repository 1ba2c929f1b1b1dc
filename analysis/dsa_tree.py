"""`tracedeck analyze` for a DSA trace directory (seed 004 5.1): every shard streamed and judged.

A trace directory is <trace-out> (with block<N>/ inside) or one block<N>/ itself. Each block
directory is judged on its own: every record against the contract, the shards against their
names and each other, and summary.json against the statistics recomputed from the shards
(docs/ENGINES.md says how each is computed; any difference is a problem). The verdict is
TRACE_OK, or TRACE_INVALID with the first invalid record.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from analysis.dsa_lines import READ_CHUNK, feed_file
from analysis.dsa_record import Fail
from analysis.dsa_stats import compare_summary, percentile
from analysis.dsa_stream import (
    BLOCK_DIR,
    SHARD,
    TraceStream,
    dir_block_size,
    problem,
    shard_range,
)
from analysis.regular_file import open_regular

SERVING = "serving.jsonl"
TRACE_OK = "TRACE_OK"
TRACE_INVALID = "TRACE_INVALID"


class NotATrace(Exception):
    """The path holds no DSA trace directory (usage error, not a verdict)."""


def block_dirs(root: Path) -> list[Path]:
    if BLOCK_DIR.fullmatch(root.name) and root.is_dir():
        return [root]
    found = sorted(p for p in root.glob("block*") if p.is_dir() and BLOCK_DIR.fullmatch(p.name))
    if not found:
        raise NotATrace(
            f"{root}: no block<N>/ directory with trace_steps_<start>_<end>.jsonl shards "
            f"(pass the --trace-out directory or one block<N>/ in it)"
        )
    return found


def shard_files(folder: Path) -> list[Path]:
    """The shards in request order (trace_steps.jsonl, unsharded, first when present)."""
    named = [p for p in folder.iterdir() if SHARD.fullmatch(p.name)]
    named.sort(key=lambda p: tuple(int(x) for x in SHARD.fullmatch(p.name).groups()))  # type: ignore[union-attr]
    plain = folder / "trace_steps.jsonl"
    return ([plain] if plain.is_file() else []) + named


def stray_shards(folder: Path, shards: list[Path]) -> list[Path]:
    """Files that look like trace shards but are not named as one: never silently skipped."""
    taken = set(shards)
    return sorted(
        p
        for p in folder.iterdir()
        if p.name.startswith("trace_steps") and p not in taken and not p.name.endswith(".part")
    )


def analyze_dir(
    root: Path, topk: int | None = None, layers: int | None = None, workers: int = 1
) -> dict[str, Any]:
    """Judge every block directory under root; the result is JSON-ready. workers >= 2: each
    directory's chunks are checked by that many processes (the same result)."""
    results = [analyze_block(folder, topk, layers, workers) for folder in block_dirs(Path(root))]
    ok = all(r["verdict"] == TRACE_OK for r in results)
    return {"verdict": TRACE_OK if ok else TRACE_INVALID, "dirs": results}


def analyze_block(
    folder: Path,
    topk: int | None,
    layers: int | None,
    workers: int = 1,
    chunk: int = READ_CHUNK,
) -> dict[str, Any]:
    engine, why = read_summary(folder / "summary.json")
    config = engine.get("config", {}) if isinstance(engine.get("config"), dict) else {}
    if topk is not None:
        source = "--dsa-topk"
    elif _int(config.get("index_topk")) is not None:
        topk, source = _int(config.get("index_topk")), "summary.json config.index_topk"
    else:
        source = ""
    stream = TraceStream(
        topk=topk,
        layers=layers or _int(config.get("n_layers")),
        block_size=dir_block_size(str(folder / "x")) or _int(config.get("kv_block_size_tokens")),
        bytes_per_token=_int0(config.get("kv_bytes_per_token")),
        topk_source=source,
        live_view=False,
    )
    files = shard_files(folder)
    problems: list[dict[str, Any]] = []
    for path in stray_shards(folder, files):
        problems.append(
            problem(
                str(path),
                None,
                None,
                Fail(
                    "shards",
                    "trace_steps_<start>_<end>.jsonl (or trace_steps.jsonl), seed 5.1",
                    f"{path.name}: a trace file under another name, not judged (rename it, or "
                    "move it out of the block directory)",
                ),
            )
        )
    if workers >= 2:
        from analysis.dsa_parallel import feed_files

        feed_files(stream, files, workers, chunk)  # a torn last line is in stream.torn
    else:
        for path in files:
            feed_file(stream, path, chunk)
    result = trace_verdict(
        str(folder), stream, engine, why, [str(p) for p in files], serving_stats(folder / SERVING)
    )
    result["problems"] = (problems + result["problems"])[:50]
    result["first_fail"] = stream.first or (result["problems"] or [None])[0]
    result["verdict"] = TRACE_OK if not result["invalid"] and not result["problems"] else TRACE_INVALID  # fmt: skip
    result["shards"] = [p.name for p in files]
    result["shard_records"] = {Path(f).name: n for f, n in stream.files.items()}
    result["recomputed"] = {"records": stream.summary.records, **stream.summary.summary()}
    return result


def trace_verdict(
    folder: str,
    stream: TraceStream,
    engine: dict[str, Any],
    why: str,
    shards: list[str] | None,
    serving: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One trace directory's verdict (analyze, a run's judge, watch alike): the records as
    judged, the end-of-trace checks, and summary.json (seed 5.3) recomputed from the records:
    any difference is a problem naming the field, what the records give and what it says."""
    where = f"{folder}/summary.json"
    problems: list[dict[str, Any]] = list(stream.torn)  # last lines with no newline

    def summary_fail(fail: Fail) -> None:
        problems.append(problem(where, None, None, fail))

    if why:
        summary_fail(
            Fail(
                "summary.json",
                "the engine's summary (seed 5.3), written at the end of a run",
                why,
            )
        )
    config = engine.get("config") if isinstance(engine.get("config"), dict) else {}
    claimed = _int(config.get("index_topk"))
    if claimed is not None:
        if stream.topk is None:
            problems += stream.set_topk(claimed, "summary.json config.index_topk")
        elif claimed != stream.topk:
            summary_fail(Fail("config.index_topk", f"{stream.topk} ({stream.topk_source})", str(claimed)))  # fmt: skip
    for key, mine in (("n_layers", stream.layers), ("kv_block_size_tokens", stream.block_size)):
        value = config.get(key)
        if value is not None and mine is not None and value != mine:
            summary_fail(Fail(f"config.{key}", f"{mine} (the records)", repr(value)))
    stream.prefix_tokens = _int(config.get("trace_prefix_key_tokens"))
    requests = _int0(config.get("requests"))
    problems += stream.finish(requests, shards)
    files = shards if shards is not None else list(stream.files)
    problems += shard_name_problems(files, requests, _int0(config.get("max_requests_per_file")))
    problems += _shard_counts(engine, stream, folder)
    if engine:
        for fail in compare_summary(engine, stream.summary):
            summary_fail(fail)
        for fail in serving_problems(engine, serving):
            summary_fail(fail)
    invalid = stream.invalid + stream.end_invalid
    ok = invalid == 0 and not problems
    return {
        "dir": folder,
        "verdict": TRACE_OK if ok else TRACE_INVALID,
        "records": stream.records,
        "invalid": invalid,
        "requests": len(stream.reqs),
        "layers": stream.layers,
        "topk": stream.topk,
        "topk_from": stream.topk_claim(),
        "first_fail": stream.first or (problems[0] if problems else None),
        "problems": problems[:50],
    }


def shard_name_problems(
    files: list[str], requests: int | None, per: int | None
) -> list[dict[str, Any]]:
    """Shard names hold what summary.json says: no shard names a request past config.requests,
    and with config.max_requests_per_file P > 0 shard k is [kP, min(N, (k+1)P)) (P 0: one)."""
    out = []
    for f in files:
        got = shard_range(f)
        if got is None or requests is None:
            continue
        start, end = got
        if per is not None and per > 0:
            want = (start - start % per, min(requests, start - start % per + per))
        elif per == 0:
            want = (0, requests)
        else:
            want = (start, min(end, requests))
        if (start, end) != want:
            name = f.rsplit("/", 1)[-1]
            why = f"trace_steps_{want[0]}_{want[1]}.jsonl (config.requests {requests}, max_requests_per_file {per})"  # fmt: skip
            out.append(problem(f, None, None, Fail("shards", why, f"{name} (its name claims requests it cannot hold)")))  # fmt: skip
    return out


SUMMARY_MAX = 1 << 24  # no engine's summary.json comes near (the live path reads as much)


def read_summary(path: Path) -> tuple[dict[str, Any], str]:
    try:
        with open_regular(path) as fh:
            raw = fh.read(SUMMARY_MAX + 1)
        if len(raw) > SUMMARY_MAX:
            return {}, f"unreadable (larger than {SUMMARY_MAX >> 20} MiB)"
        data = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        return {}, "missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"unreadable ({exc.strerror if isinstance(exc, OSError) else exc})"
    except RecursionError:
        return {}, "unreadable (nested deeper than a JSON parser reads)"
    if not isinstance(data, dict):
        return {}, "not a JSON object"
    return data, ""


def _shard_counts(engine: dict[str, Any], stream: TraceStream, folder: str) -> list[dict[str, Any]]:
    """The reference engine lists each shard's record count: a lost or extra line shows."""
    out = []
    for entry in engine.get("shards", []) if isinstance(engine.get("shards"), list) else []:
        if not isinstance(entry, dict) or "file" not in entry:
            continue
        path = f"{folder}/{entry['file']}"
        seen = stream.files.get(path)
        if seen is None and entry.get("records") == 0:
            continue  # an empty shard: nothing to follow
        if seen is None:
            out.append(
                problem(
                    path,
                    None,
                    None,
                    Fail("shards", "the shard summary.json lists", "no such file (missing shard)"),
                )
            )
        elif entry.get("records") is not None and seen != entry["records"]:
            out.append(
                problem(
                    path,
                    None,
                    None,
                    Fail("records", f"{entry['records']} lines (summary.json shards)", f"{seen}"),
                )
            )
    return out


def serving_latency(line: bytes | str) -> float | str:
    """One serving.jsonl line's latency_ms, or why the line is no serving entry (one rule for
    the live judge and analyze)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return "not valid JSON"
    value = entry.get("latency_ms") if isinstance(entry, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "no number latency_ms"
    return float(value)


def serving_summary(latencies: list[float], bad: int, first_bad: str) -> dict[str, Any]:
    """What summary.json serving must say of these latencies; bad: lines that were no entry."""
    lat: dict[float, int] = {}
    for value in latencies:
        lat[value] = lat.get(value, 0) + 1
    items = sorted(lat.items())
    out: dict[str, Any] = {"requests": len(latencies), "latency_ms": {}, "bad": bad}
    if first_bad:
        out["first_bad"] = first_bad
    if items:
        pcts = {k: percentile(items, q) for k, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}
        out["latency_ms"] = {**pcts, "max": items[-1][0]}
    return out


def serving_stats(path: Path) -> dict[str, Any] | None:
    """serving.jsonl (reference engine, BurstGPT): latency percentiles over finished requests."""
    if not path.is_file():
        return None
    latencies, bad, first_bad = [], 0, ""
    # lines end at a newline only, as a follower splits them (bytes.splitlines also splits at
    # \r and others: a line the live judge reads whole would be two here)
    for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        got = serving_latency(line)
        if isinstance(got, str):
            bad += 1
            first_bad = first_bad or f"{path}:{n}: {got}"
        else:
            latencies.append(got)
    return serving_summary(latencies, bad, first_bad)


def serving_problems(engine: dict[str, Any], ours: dict[str, Any] | None) -> list[Fail]:
    """summary.json serving (BurstGPT, seed 6.4) against serving.jsonl, when the engine wrote it."""
    serving = engine.get("serving")
    if engine.get("dataset") == "burstgpt" and not isinstance(serving, dict):
        return [Fail("serving", "serving.latency_ms (BurstGPT runs report it)", "missing")]
    if ours is not None and ours.get("bad"):
        bad = [Fail("serving.jsonl", "one JSON object with a number latency_ms a line", f"{ours['bad']} lines that are not (the first: {ours.get('first_bad', '?')})")]  # fmt: skip
    else:
        bad = []
    if not isinstance(serving, dict) or ours is None:
        return bad
    out = bad
    if serving.get("requests") != ours["requests"]:
        out.append(Fail("serving.requests", f"{ours['requests']} (serving.jsonl)", repr(serving.get("requests"))))  # fmt: skip
    for key, value in ours["latency_ms"].items():
        theirs = (serving.get("latency_ms") or {}).get(key)
        if not isinstance(theirs, int | float) or abs(theirs - value) > 1e-6 * max(1.0, abs(value)):
            out.append(Fail(f"serving.latency_ms.{key}", f"{value!r} (serving.jsonl)", repr(theirs)))  # fmt: skip
    return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _int0(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def format_result(result: dict[str, Any]) -> str:
    lines = []
    for r in result["dirs"]:
        lines.append(
            f"DSA trace {r['dir']}: {r['records']} records, {r['requests']} requests, "
            f"{r['layers']} layers, {r['topk_from']}, {len(r['shards'])} shards; "
            f"{r['invalid']} invalid records"
        )
        if r["first_fail"]:
            lines.append(f"  first fail: {r['first_fail']['message']}")
        for p in r["problems"][:10]:
            if p is not r["first_fail"] and p["message"] != (r["first_fail"] or {}).get("message"):
                lines.append(f"  problem: {p['message']}")
        if not any(p["file"].endswith("summary.json") for p in r["problems"]):
            lines.append("  summary.json: equal to the statistics recomputed from the shards")
        lines.append(f"  verdict: {r['verdict']}")
    lines.append(f"RESULT: {result['verdict']}")
    return "\n".join(lines)
