"""Each run kind's judged items, rebuilt from a run's recorded events (as dicts) for a diff.

Verdict words are recomputed wherever the record holds what they follow from (B3.67 metrics
and thresholds, readout facts, DSA digests); a recorded word the recomputation contradicts is a
failure of the item, never believed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from analysis.dsa_stream import TraceStream
from analysis.equivalence import EXPECTED_DRIFT, THRESHOLDS, failing_metrics, pair_verdict
from analysis.kv_invariance import BITWISE_EQUAL, point_label
from analysis.readout import VERDICT_OK, ReadoutAggregator, rechecked_row
from analysis.run_compare import DRIFT, FAIL, PASS, Item

Events = Iterable[dict[str, Any]]
EQUIV_METRICS = ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean")


def cell_items(events: Events) -> list[Item]:
    """Command cells: each cell's exit status (the kind whose exit codes are its verdict)."""
    cells: dict[int, dict[str, Any]] = {}
    params: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "run_started":
            params = {c["index"]: c.get("params", {}) for c in e.get("cells", [])}
        elif e["type"] == "cell_finished" and e["cell"] >= 0:
            cells[e["cell"]] = e
        elif e["type"] == "cell_requeued":
            cells.pop(e["cell"], None)
    out = []
    keys = {index: _cell_key(index, params[index]) for index in params}
    twice = {k for k, n in Counter(keys.values()).items() if n > 1}
    for index in sorted(params):
        key = keys[index]
        if key in twice:  # cells with the same parameters: told apart by their place
            key = f"{key} (cell {index + 1})"
        e = cells.get(index)
        if e is None:
            out.append(Item("cell", key, "UNJUDGED", FAIL, first_fail="the cell never finished"))
            continue
        ok = e["state"] == "passed"
        text = "" if ok else f"{e['state']} (exit {e.get('exit_code')}) {e.get('stderr_tail', '')}"
        out.append(
            Item(
                "cell",
                key,
                e["state"].upper(),
                PASS if ok else FAIL,
                {"exit_code": e.get("exit_code")},
                first_fail=text.strip(),
            )
        )
    return out


def _cell_key(index: int, params: dict[str, Any]) -> str:
    text = " ".join(f"{k}={v}" for k, v in params.items())
    return text or f"cell {index + 1}"


def equivalence_items(events: Events) -> list[Item]:
    """B3.67 pairs: the verdict recomputed from each pair's recorded metrics and thresholds.
    A pair the run planned (its cells in run_started) with no recorded verdict is UNJUDGED:
    a record that lost a pair's verdict never passes by leaving the pair out."""
    out: dict[str, Item] = {}
    for e in events:
        if e["type"] == "run_started":
            for cell in e.get("cells", []):
                p = cell.get("params") or {}
                if "kv_aligned" in p and "seed" in p:
                    key = f"kv_aligned={p['kv_aligned']} seed={p['seed']}"
                    why = "the record holds no verdict for this planned pair"
                    out.setdefault(key, Item("pair", key, "UNJUDGED", FAIL, first_fail=why))
        elif e["type"] == "pair_verdict":
            item = pair_item(e)
            out[item.key] = item
        elif e["type"] == "pair_unjudged":
            key = f"kv_aligned={e['kv_aligned']} seed={e['seed']}"
            out[key] = Item("pair", key, "UNJUDGED", FAIL, first_fail=e.get("reason", ""))
    return list(out.values())


def pair_item(e: dict[str, Any]) -> Item:
    """One recorded pair_verdict's item, its word recomputed from its own metrics and
    thresholds (a word they contradict is the recomputed one, failing)."""
    return _pair_item(f"kv_aligned={e['kv_aligned']} seed={e['seed']}", e)


def _pair_item(key: str, e: dict[str, Any]) -> Item:
    metrics = {m: e["metrics"].get(m) for m in EQUIV_METRICS}
    thresholds = e["thresholds"]
    try:
        word = pair_verdict(e["metrics"], int(e["kv_aligned"]), thresholds)
        failing = [m for m, _, _ in failing_metrics(e["metrics"], thresholds)]
    except (KeyError, TypeError, ValueError) as exc:
        return Item("pair", key, "UNJUDGED", FAIL, metrics, first_fail=f"record unreadable: {exc}")
    ff = e.get("first_fail") or {}
    where = f"token {ff['token_idx']}" if ff.get("token_idx") is not None else ""
    text = ""
    ids = ff.get("token_ids") or {}
    if ff and ff.get("metric") == "token_id" and ids:
        text = (
            f"token_idx={ff.get('token_idx')}: the modes wrote different tokens "
            f"(prefill {ids.get('prefill')}, decode {ids.get('decode')})"
        )
    elif ff:
        text = f"token_idx={ff.get('token_idx')} token_id={ff.get('token_id')} {ff.get('metric')}"
        if ff.get("value") is not None:
            text += f"={_num(ff['value'])}"
        if ff.get("threshold") is not None:
            text += f" (threshold {_num(ff['threshold'])})"
    if word != e["verdict"]:
        return Item(
            "pair",
            key,
            word,
            FAIL,
            metrics,
            failing,
            f"the record says {e['verdict']}, its own metrics and thresholds say {word}",
            where,
        )
    tone = DRIFT if word == EXPECTED_DRIFT else (PASS if not failing else FAIL)
    if word == EXPECTED_DRIFT:
        failing = []  # kv_aligned=0: drift is allowed, no metric fails
    elif tone == PASS:
        # A pass under thresholds the operator loosened is not the seed's pass: shown like drift.
        past_seed = [m for m, _, _ in failing_metrics(e["metrics"], THRESHOLDS)]
        if past_seed:
            tone, word = DRIFT, f"{word} (loosened)"
            text = f"passes only under loosened thresholds: {', '.join(past_seed)} past the seed's"
    return Item("pair", key, word, tone, metrics, failing, text, where)


def _num(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def kv_items(events: Events) -> list[Item]:
    """03C grid cells: BITWISE_EQUAL passes; DIFFERS, PRECONDITION and UNJUDGED fail."""
    out: dict[str, Item] = {}
    planned: dict[int, dict[str, Any]] = {}  # cell -> its params, from run_started
    judged: set[int] = set()
    for e in events:
        if e["type"] == "run_started":
            planned = {c["index"]: c.get("params", {}) for c in e.get("cells", [])}
        if e["type"] != "kv_cell_verdict":
            continue
        judged.add(e.get("cell"))  # type: ignore[arg-type]
        item = kv_cell_item(e)
        out[item.key] = item
    for index in sorted(set(planned) - judged):  # a planned cell with no verdict: never a pass
        key = f"{_cell_key(index, planned[index])} (cell {index + 1})"
        why = "the record holds no verdict for this planned cell"
        out[key] = Item("cell", key, "UNJUDGED", FAIL, first_fail=why)
    return list(out.values())


def kv_cell_item(e: dict[str, Any]) -> Item:
    """One recorded kv_cell_verdict's item: BITWISE_EQUAL passes only with no differing
    element recorded beside it."""
    key = point_label(e.get("point") or {}, e.get("source", ""))
    detail = e.get("detail") or {}
    metrics = {
        "differing": detail.get("differing", 0),
        "max_abs_diff": detail.get("max_abs_diff", 0.0),
        "max_ulp": detail.get("max_ulp", 0),
    }
    word = e["verdict"]
    ok = word == BITWISE_EQUAL and not detail.get("first")
    text, where = "", ""
    first = detail.get("first")
    if first:
        flows = " vs ".join(first.get("flows", []))
        where = f"batch {first.get('batch')} head {first.get('head')} index {first.get('index')}"
        values = first.get("values") or [None, None]
        text = (
            f"{flows} differ first at {where}: {values[0]!r} vs {values[1]!r} "
            f"({first.get('ulp')} ULP); {metrics['differing']} element(s) differ"
        )
    elif not ok:
        text = e.get("reason") or word
    failing = [m for m in ("differing",) if not ok and metrics["differing"]]
    return Item("cell", key, word, PASS if ok else FAIL, metrics, failing, text, where)


def readout_items(events: Events) -> list[Item]:
    """Readout prompts: the rows rebuilt from the recorded trace digests, verdicts recomputed."""
    tables: dict[str, ReadoutAggregator] = {}
    legacy: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "trace" and e.get("digest"):
            table = tables.setdefault(e["file"], ReadoutAggregator())
            for fact in e["digest"].get("facts", []):
                table.apply(fact, e["file"])
        elif e["type"] == "readout_row":
            row = e["row"]
            # a whole row as runs once recorded it: its word is recomputed from its numbers
            legacy[f"{row.get('file')}:{row.get('line')}"] = rechecked_row(row)
    rows = list(legacy.values()) + [r for t in tables.values() for r in t.rows()]
    names = [str(r.get("prompt")) for r in rows]
    out = []
    for row, name in zip(rows, names, strict=True):
        key = name if names.count(name) == 1 else f"{name} ({row.get('file')}:{row.get('line')})"
        word = row.get("verdict") or "UNJUDGED"
        ok = word == VERDICT_OK
        metrics = {
            "prefill_last_top1": row.get("prefill_last_top1"),
            "decode0_top1": row.get("decode0_top1"),
            "prefill_last_gap": row.get("prefill_last_gap"),
            "decode0_gap": row.get("decode0_gap"),
            "readout_mismatch_count": row.get("readout_mismatch_count"),
        }
        failing = []
        if row.get("decode0_top1") != row.get("prefill_last_top1"):
            failing.append("decode0_top1")
        if row.get("readout_mismatch_count"):
            failing.append("readout_mismatch_count")
        # The file is under the run's own directory: its name and line say where, run to run.
        where = f"{str(row.get('file')).rsplit('/', 1)[-1]}:{row.get('line')}" if not ok else ""
        out.append(
            Item("prompt", key, word, PASS if ok else FAIL, metrics, failing, row["note"], where)
        )
    return out + _readout_cells(events)


def _readout_cells(events: Events) -> list[Item]:
    """What the readout judge requires besides its rows (ReadoutJudge.verdict): every planned
    cell passed and wrote a prefill_last line that was judged. A cell short of that is a
    failing item: a record whose failed cell, or whose cell's trace lines, were lost (or
    edited away) never passes on the prompts left."""
    planned: dict[int, dict[str, Any]] = {}
    finished: dict[int, dict[str, Any]] = {}
    opened: Counter[int] = Counter()
    for e in events:
        if e["type"] == "run_started":
            planned = {c["index"]: c.get("params", {}) for c in e.get("cells", [])}
        elif e["type"] == "cell_finished" and e["cell"] >= 0:
            finished[e["cell"]] = e
        elif e["type"] == "cell_requeued":
            finished.pop(e["cell"], None)
        elif e["type"] == "trace" and e.get("digest"):
            facts = e["digest"].get("facts", [])
            opened[e.get("cell")] += sum(1 for f in facts if f and f[0] == "p")
        elif e["type"] == "readout_row":
            opened[e.get("cell")] += 1
    out = []
    for index in sorted(planned):
        e = finished.get(index)
        if e is None:
            word, why = "UNJUDGED", "the cell never finished"
        elif e["state"] != "passed":
            word, why = e["state"].upper(), f"{e['state']} (exit {e.get('exit_code')})"
        elif not opened[index]:
            word = "UNJUDGED"
            why = "the cell passed, but the record holds no prefill_last line of it judged"
        else:
            continue
        key = f"{_cell_key(index, planned[index])} (cell {index + 1})"
        out.append(Item("cell", key, word, FAIL, first_fail=why))
    return out


DSA_STATS = ("unique_blocks", "tokens_per_touched_block", "offsets", "prefix_intersection_ratio")


def dsa_items(events: Events, summary: dict[str, Any] | None) -> list[Item]:
    """DSA trace directories and their shards, rebuilt from the recorded digests.

    A directory's verdict is the one the run's judge recorded at the end (it also compared the
    engine's summary.json, which only it read); records and invalid counts are recounted here,
    and a recorded TRACE_OK over invalid records is a failure.
    """
    streams: dict[str, TraceStream] = {}
    invalid_in: dict[str, int] = {}  # shard -> invalid records
    first_in: dict[str, dict[str, Any]] = {}  # shard -> its first invalid record
    for e in events:
        if e["type"] == "trace" and e.get("digest") and "serving" not in e["digest"]:
            digest, file = e["digest"], e["file"]
            streams.setdefault(file.rsplit("/", 1)[0], TraceStream()).apply(file, digest)
            invalid_in[file] = invalid_in.get(file, 0) + int(digest.get("invalid", 0))
            if digest.get("first") and file not in first_in:
                first_in[file] = digest["first"]
    judged = {t["dir"]: t for t in (summary or {}).get("traces", []) if isinstance(t, dict)}
    out = []
    for folder in sorted(set(streams) | set(judged), key=_rel):
        stream = streams.get(folder) or TraceStream()
        t = judged.get(folder, {})
        word = t.get("verdict") or "UNJUDGED"
        ok = word == "TRACE_OK" and stream.invalid == 0 and stream.records > 0
        ff = t.get("first_fail") or stream.first or {}
        text = ff.get("message", "") if ff else ""
        if word == "TRACE_OK" and not ok:
            text = f"recorded TRACE_OK, but the digests count {stream.invalid} invalid of {stream.records}"
        metrics: dict[str, Any] = {
            "records": stream.records,
            "invalid": stream.invalid,
            "requests": len(stream.reqs),
        }
        stats = stream.summary.summary() if stream.records else {}
        for name in DSA_STATS:
            s = stats.get(name) or {}
            for q in ("p50", "p95", "mean"):
                value = s.get(q)
                if isinstance(value, list):  # a bucket's range
                    value = f"{value[0]}..{value[1]}"
                metrics[f"{name}.{q}"] = value
        where = _rel(f"{ff.get('file')}:{ff.get('line')}") if ff.get("file") else ""
        failing = ["invalid"] if stream.invalid else []
        item = Item(
            "trace", _rel(folder), word, PASS if ok else FAIL, metrics, failing, text, where
        )
        item.hists = _hists(stream)
        out.append(item)
        problems = [p for p in t.get("problems", []) if isinstance(p, dict)]
        for file, records in sorted(stream.files.items()):
            fail = first_in.get(file) or next((p for p in problems if p.get("file") == file), None)
            bad = invalid_in.get(file, 0) > 0 or fail is not None
            line = (fail or {}).get("line")
            out.append(
                Item(
                    "shard",
                    _rel(file),
                    "INVALID" if bad else "OK",
                    FAIL if bad else PASS,
                    {"records": records, "invalid": invalid_in.get(file, 0)},
                    ["invalid"] if invalid_in.get(file, 0) else [],
                    first_fail=str((fail or {}).get("message", "")),
                    where=f"{_rel(file)}:{line}" if fail and line else "",
                )
            )
    return out


def _hists(stream: TraceStream) -> dict[str, list[list[float]]]:
    """The distributions of summary.json 5.3 as [[value, count], ...] (valid records only)."""
    agg = stream.summary
    ratios: dict[float, int] = {}
    for (hit, size), n in agg.ratios.items():
        if size:
            key = round(hit / size, 3)
            ratios[key] = ratios.get(key, 0) + n
    return {
        "unique_blocks": [[float(v), int(agg.ub[v])] for v in agg.ub.nonzero()[0].tolist()],
        "tokens_per_touched_block": [
            [float(v), int(agg.tpb[v])] for v in agg.tpb.nonzero()[0].tolist()
        ],
        "prefix_intersection_ratio": [[k, ratios[k]] for k in sorted(ratios)],
    }


def _rel(path: str) -> str:
    """A trace path as the run's artifacts name it (the run's own directory differs per run)."""
    return path.split("/artifacts/", 1)[-1]
