"""`tracedeck analyze` for a DSA trace directory (seed 004 5.1): every shard streamed and judged.

A trace directory is <trace-out> (with block<N>/ inside) or one block<N>/ itself. Each block
directory is judged on its own: every record against the contract, the shards against their
names and each other, and summary.json against the statistics recomputed from the shards
(differences are warnings: the demo's percentile method is not published). The verdict is
TRACE_OK, or TRACE_INVALID with the first invalid record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from analysis.dsa_record import Fail
from analysis.dsa_stats import compare_summary, percentile
from analysis.dsa_stream import BLOCK_DIR, SHARD, TraceStream, problem

TRACE_OK = "TRACE_OK"
TRACE_INVALID = "TRACE_INVALID"
READ_CHUNK = 4 << 20


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


def analyze_dir(root: Path, topk: int | None = None, layers: int | None = None) -> dict[str, Any]:
    """Judge every block directory under root; the result is JSON-ready."""
    results = [analyze_block(folder, topk, layers) for folder in block_dirs(Path(root))]
    ok = all(r["verdict"] == TRACE_OK for r in results)
    return {"verdict": TRACE_OK if ok else TRACE_INVALID, "dirs": results}


def analyze_block(folder: Path, topk: int | None, layers: int | None) -> dict[str, Any]:
    problems: list[dict[str, Any]] = []
    engine, why = read_summary(folder / "summary.json")
    if why:
        problems.append(
            problem(
                str(folder / "summary.json"),
                None,
                None,
                Fail(
                    "summary.json",
                    "the engine's summary (seed 5.3), written at the end of a run",
                    why,
                ),
            )
        )
    config = engine.get("config", {}) if isinstance(engine.get("config"), dict) else {}
    stream = TraceStream(
        topk=topk or _int(config.get("index_topk")),
        layers=layers or _int(config.get("n_layers")),
        block_size=_int(config.get("kv_block_size_tokens")),
        exact=True,
    )
    files = shard_files(folder)
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
    for path in files:
        torn = feed_file(stream, path)
        if torn is not None:
            problems.append(torn)
    requests = _int(config.get("requests"))
    problems += stream.finish(requests, [str(p) for p in files])
    problems += _shard_counts(engine, stream, folder)
    first = stream.first or (problems[0] if problems else None)
    recomputed = stream.summary.summary()
    warnings = compare_summary(engine, recomputed) if engine else []
    warnings += _serving_warnings(folder, engine)
    ok = stream.invalid == 0 and not problems
    return {
        "dir": str(folder),
        "verdict": TRACE_OK if ok else TRACE_INVALID,
        "records": stream.records,
        "invalid": stream.invalid,
        "shards": [p.name for p in files],
        "requests": len(stream.reqs),
        "layers": stream.layers,
        "first_fail": first,
        "problems": problems[:50],
        "warnings": warnings,
        "recomputed": {"records": stream.summary.records, **recomputed},
        "topk": stream.topk,
    }


def feed_file(stream: TraceStream, path: Path, chunk: int = READ_CHUNK) -> dict[str, Any] | None:
    """Stream one shard through the judge in bounded chunks; a torn last line is a problem."""
    line_no = 1
    rest = b""
    with open(path, "rb") as fh:
        while True:
            data = fh.read(chunk)
            if not data:
                break
            data = rest + data
            cut = data.rfind(b"\n")
            if cut < 0:
                rest = data
                continue
            lines = data[:cut].split(b"\n")
            rest = data[cut + 1 :]
            stream.feed(str(path), lines, line_no)
            line_no += len(lines)
    if rest:
        fail = Fail(
            "record",
            "a complete line ending in a newline",
            f"{len(rest)} bytes with no newline (the writer stopped mid-line)",
        )
        stream.records += 1
        stream.invalid += 1
        found = problem(str(path), line_no, None, fail)
        if stream.first is None:
            stream.first = found
        return found
    return None


def read_summary(path: Path) -> tuple[dict[str, Any], str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, "missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"unreadable ({exc})"
    if not isinstance(data, dict):
        return {}, "not a JSON object"
    return data, ""


def _shard_counts(
    engine: dict[str, Any], stream: TraceStream, folder: Path
) -> list[dict[str, Any]]:
    """The reference engine lists each shard's record count: a lost or extra line shows."""
    out = []
    for entry in engine.get("shards", []) if isinstance(engine.get("shards"), list) else []:
        if not isinstance(entry, dict) or "file" not in entry:
            continue
        path = str(folder / str(entry["file"]))
        seen = stream.files.get(path)
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


def serving_stats(path: Path) -> dict[str, Any] | None:
    """serving.jsonl (reference engine, BurstGPT): latency percentiles over finished requests."""
    if not path.is_file():
        return None
    lat: dict[float, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            value = float(json.loads(line)["latency_ms"])
            lat[value] = lat.get(value, 0) + 1
    items = sorted(lat.items())
    if not items:
        return {"requests": 0, "latency_ms": {}}
    pcts = {k: percentile(items, q) for k, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}
    return {"requests": sum(lat.values()), "latency_ms": {**pcts, "max": items[-1][0]}}


def _serving_warnings(folder: Path, engine: dict[str, Any]) -> list[str]:
    serving = engine.get("serving")
    ours = serving_stats(folder / "serving.jsonl")
    if engine.get("dataset") == "burstgpt" and not isinstance(serving, dict):
        return ["serving: missing from summary.json (BurstGPT runs report serving.latency_ms)"]
    if not isinstance(serving, dict) or ours is None:
        return []
    out = []
    if serving.get("requests") != ours["requests"]:
        out.append(
            f"serving.requests: summary.json says {serving.get('requests')}, serving.jsonl has {ours['requests']}"
        )
    for key, value in ours["latency_ms"].items():
        theirs = (serving.get("latency_ms") or {}).get(key)
        if not isinstance(theirs, int | float) or abs(theirs - value) > 1e-6 * max(1.0, abs(value)):
            out.append(
                f"serving.latency_ms.{key}: summary.json says {theirs!r}, serving.jsonl gives {value!r}"
            )
    return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def format_result(result: dict[str, Any]) -> str:
    lines = []
    for r in result["dirs"]:
        lines.append(
            f"DSA trace {r['dir']}: {r['records']} records, {r['requests']} requests, "
            f"{r['layers']} layers, top-{r['topk']}, {len(r['shards'])} shards; "
            f"{r['invalid']} invalid records"
        )
        if r["first_fail"]:
            lines.append(f"  first fail: {r['first_fail']['message']}")
        for p in r["problems"][:10]:
            if p is not r["first_fail"] and p["message"] != (r["first_fail"] or {}).get("message"):
                lines.append(f"  problem: {p['message']}")
        if r["warnings"]:
            lines.append(
                f"  summary.json differs from the shards' recomputation ({len(r['warnings'])} warnings):"
            )
            lines += [f"    - {w}" for w in r["warnings"]]
        elif not any(p["field"] == "summary.json" for p in r["problems"]):
            lines.append("  summary.json: equal to the statistics recomputed from the shards")
        lines.append(f"  verdict: {r['verdict']}")
    lines.append(f"RESULT: {result['verdict']}")
    return "\n".join(lines)
