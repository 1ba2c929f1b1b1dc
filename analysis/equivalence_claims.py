"""A pair's metrics document judged on a host, checked here before anything of it is believed.

The host's judge says metrics, a verdict word and a first fail. This module believes none of the
words: every verdict is recomputed from the metrics and the console's thresholds, and every
field is checked against what the console holds itself (the pair's two metadata.json files, its
thresholds, the seed's rules) and against the other fields (p99 <= max, top-1 agreement a whole
number of tokens, the first fail inside the compared tokens and beyond its threshold, ...).
What cannot be recomputed without the logits (the metric values themselves) is taken from the
host's judge, whose code the console checked before it ran (runners/hosted/boot.py).
"""

from __future__ import annotations

import math
from typing import Any

from analysis.equivalence import (
    FAIL_EQUIV,
    METRIC_KEYS,
    SIGNIFICAND_BITS,
    PairResult,
    failing_metrics,
    pair_verdict,
)

DOC_KEYS = {
    "seed",
    "dtype",
    "prompt_len",
    "gen_len",
    "kv_aligned",
    "pair_count",
    "metrics",
    "verdict",
    "thresholds",
    "first_fail",
    "timestamp",
    "tokens",
    "precision",
    "diverged_at_token",
}
FIRST_FAIL_KEYS = {
    "seed",
    "kv_aligned",
    "token_idx",
    "token_id",
    "metric",
    "value",
    "threshold",
    "tripped",
    "token_ids",
    "top5",
    "where",
    "note",
}
TRIP_METRICS = ("token_id", "top1_agreement", "max_abs_diff", "p99_abs_diff")
MODES = ("prefill", "decode")


class ClaimError(ValueError):
    """A host's metrics document that contradicts itself or what the console holds."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def checked_pair(
    doc: Any,
    *,
    kv_aligned: int,
    seed: int,
    thresholds: dict[str, float],
    metadata: dict[str, dict[str, Any]],
    where: str,
) -> PairResult:
    """The pair's result from a host's metrics document, every verdict word recomputed.

    metadata: each side's metadata.json as the console fetched it. where: who said it (the
    host). Raises ClaimError naming the pair, the field, what was said and what it must be."""
    pair = f"kv_aligned_{kv_aligned}/seed_{seed}"

    def refuse(what: str) -> ClaimError:
        return ClaimError(f"{pair}: the metrics judged on {where} are refused: {what}")

    if not isinstance(doc, dict):
        raise refuse(f"not a metrics document ({type(doc).__name__})")
    extra = sorted(set(doc) - DOC_KEYS)
    if extra:
        raise refuse(f"unknown key(s) {', '.join(extra)}")
    missing = sorted(DOC_KEYS - {"diverged_at_token"} - set(doc))
    if missing:
        raise refuse(f"missing key(s) {', '.join(missing)}")

    # What the console holds itself: the pair, its metadata, its thresholds.
    prefill = metadata["prefill"]
    for key, want in (
        ("seed", seed),
        ("kv_aligned", kv_aligned),
        ("dtype", prefill.get("dtype")),
        ("prompt_len", prefill.get("prompt_len")),
        ("gen_len", prefill.get("gen_len")),
    ):
        if doc[key] != want or type(doc[key]) is not type(want):
            raise refuse(f"'{key}' is {doc[key]!r}, but the pair's metadata.json says {want!r}")
    if doc["thresholds"] != thresholds:
        raise refuse(f"'thresholds' are {doc['thresholds']!r}, but this run's are {thresholds!r}")

    # Counts: every line of both sides, gen_len of them (or both sides' recorded early stop).
    tokens = doc["tokens"]
    if not (
        isinstance(tokens, dict)
        and set(tokens) == set(MODES)
        and all(_int(tokens[m]) for m in MODES)
        and tokens["prefill"] == tokens["decode"] >= 1
    ):
        raise refuse(f"'tokens' is {tokens!r}: both sides must have the same count, at least 1")
    lines, gen_len = tokens["prefill"], doc["gen_len"]
    stops = {m: metadata[m].get("eos_at_token") for m in MODES}
    if lines != gen_len and not (
        lines < gen_len and stops["prefill"] == stops["decode"] == lines - 1
    ):
        raise refuse(
            f"'tokens' says {lines} lines a side, but gen_len is {gen_len} and the metadata "
            f"records no early stop at token {lines - 1} on both sides ({stops})"
        )
    diverged = doc.get("diverged_at_token")
    count = doc["pair_count"]
    want_count = lines if diverged is None else (diverged + 1 if _int(diverged) else None)
    if diverged is not None and not (_int(diverged) and 0 <= diverged < lines):
        raise refuse(f"'diverged_at_token' is {diverged!r}: not a token of the {lines} lines")
    if not _int(count) or count != want_count:
        raise refuse(
            f"'pair_count' is {count!r}, but {want_count} tokens were compared ({lines} lines, "
            f"diverged_at_token {diverged})"
        )

    metrics = _checked_metrics(doc["metrics"], count, refuse)

    # The verdict word: recomputed, never read.
    verdict = pair_verdict(metrics, kv_aligned, thresholds)
    if kv_aligned == 1 and diverged is not None:
        verdict = FAIL_EQUIV
    if doc["verdict"] != verdict:
        said = doc["verdict"]
        why = "; ".join(
            f"{name} {value:.6g} vs {limit:.6g}"
            for name, value, limit in failing_metrics(metrics, thresholds)
        )
        raise refuse(
            f"it says {said!r}, but its own metrics make it {verdict}"
            + (f" ({why})" if why else "")
            + (
                "; the modes wrote different tokens"
                if kv_aligned == 1 and diverged is not None
                else ""
            )
        )

    first_fail = doc["first_fail"]
    if verdict == FAIL_EQUIV:
        _check_first_fail(first_fail, doc, metrics, thresholds, refuse)
    elif first_fail is not None:
        raise refuse(f"a first fail is given for a {verdict} pair")
    precision = _checked_precision(doc["precision"], doc["dtype"], metrics, count, refuse)
    base = f"runs/kv_aligned_{kv_aligned}/seed_{seed}"
    return PairResult(
        seed=seed,
        kv_aligned=kv_aligned,
        dtype=doc["dtype"],
        prompt_len=doc["prompt_len"],
        gen_len=gen_len,
        pair_count=count,
        metrics=metrics,
        verdict=verdict,
        thresholds=dict(thresholds),
        first_fail=first_fail,
        prefill_path=f"{base}/prefill/logits.jsonl.gz",
        decode_path=f"{base}/decode/logits.jsonl.gz",
        diverged_at_token=diverged,
        tokens=dict(tokens),
        precision=precision,
    )


def _checked_metrics(metrics: Any, count: int, refuse: Any) -> dict[str, float]:
    if not isinstance(metrics, dict) or set(metrics) != set(METRIC_KEYS):
        raise refuse(f"'metrics' must hold exactly {', '.join(METRIC_KEYS)}; got {metrics!r}")
    for key in METRIC_KEYS:
        if not _num(metrics[key]):
            raise refuse(f"metrics.{key} is {metrics[key]!r}, not a finite number")
    m = {k: float(metrics[k]) for k in METRIC_KEYS}
    if not 0 <= m["p99_abs_diff"] <= m["max_abs_diff"]:
        raise refuse(
            f"metrics.p99_abs_diff {m['p99_abs_diff']!r} must lie between 0 and max_abs_diff "
            f"{m['max_abs_diff']!r}"
        )
    agree = round(m["top1_agreement"] * count)
    if not (0 <= agree <= count and agree / count == m["top1_agreement"]):
        raise refuse(
            f"metrics.top1_agreement {m['top1_agreement']!r} is not a whole number of the "
            f"{count} tokens compared"
        )
    # float32 cosines may stray past 1 by rounding, never by more than a few steps
    if not -1.0001 <= m["cos_sim_mean"] <= 1.0001:
        raise refuse(f"metrics.cos_sim_mean {m['cos_sim_mean']!r} is not a cosine")
    return m


def _check_first_fail(
    ff: Any,
    doc: dict[str, Any],
    metrics: dict[str, float],
    thresholds: dict[str, float],
    refuse: Any,
) -> None:
    """The first fail must be a failure: inside the compared tokens, beyond its threshold."""
    if not isinstance(ff, dict) or set(ff) != FIRST_FAIL_KEYS:
        raise refuse(f"a FAIL_EQUIV pair needs a first_fail with {sorted(FIRST_FAIL_KEYS)}")
    count, diverged = doc["pair_count"], doc.get("diverged_at_token")
    if ff["seed"] != doc["seed"] or ff["kv_aligned"] != doc["kv_aligned"]:
        raise refuse(f"first_fail names seed {ff['seed']!r} kv_aligned {ff['kv_aligned']!r}")
    idx = ff["token_idx"]
    if not (_int(idx) and 0 <= idx < count):
        raise refuse(f"first_fail.token_idx {idx!r} is not one of the {count} tokens compared")
    ids = ff["token_ids"]
    if not (isinstance(ids, dict) and set(ids) == set(MODES) and all(_int(ids[m]) for m in MODES)):
        raise refuse(f"first_fail.token_ids {ids!r}: each side's token id")
    if ff["token_id"] != ids["prefill"]:
        raise refuse(f"first_fail.token_id {ff['token_id']!r} is not prefill's {ids['prefill']}")
    if (ids["prefill"] != ids["decode"]) != (diverged == idx):
        raise refuse(
            f"first_fail.token_ids {ids} contradict diverged_at_token {diverged} at token {idx}"
        )
    tripped, metric, value, limit = ff["tripped"], ff["metric"], ff["value"], ff["threshold"]
    if not (
        isinstance(tripped, list)
        and tripped
        and tripped[0] == metric
        and len(set(tripped)) == len(tripped)
        and set(tripped) <= set(TRIP_METRICS)
    ):
        raise refuse(f"first_fail.tripped {tripped!r} must start with its metric {metric!r}")
    if metric == "token_id":
        if diverged != idx or limit is not None or value != ids["decode"]:
            raise refuse(
                f"first_fail says the modes wrote different tokens at {idx} (value {value!r}, "
                f"threshold {limit!r}), but diverged_at_token is {diverged}"
            )
    else:
        key = f"{metric}_min" if metric == "top1_agreement" else f"{metric}_max"
        if limit != thresholds[key] or not _num(value):
            raise refuse(
                f"first_fail.threshold {limit!r} for {metric} is not this run's {thresholds[key]}"
            )
        aggregate = value == metrics[metric]
        if metric == "top1_agreement":
            ok = value < limit and (aggregate or value == 0.0)
        else:
            ok = limit < value <= metrics["max_abs_diff"]
        if not ok:
            raise refuse(f"first_fail.value {value!r} of {metric} does not break {limit!r}")
    where = ff["where"]
    base = f"runs/kv_aligned_{doc['kv_aligned']}/seed_{doc['seed']}"
    want = {m: f"{base}/{m}/logits.jsonl.gz:{idx + 1}" for m in MODES}
    if where != want:
        raise refuse(f"first_fail.where {where!r}: token {idx} is {want}")
    top5 = ff["top5"]
    if not (isinstance(top5, dict) and set(top5) == set(MODES)):
        raise refuse("first_fail.top5 must give both sides' top five")
    for mode in MODES:
        rows = top5[mode]
        if not (
            isinstance(rows, list)
            and 1 <= len(rows) <= 5
            and all(isinstance(r, list) and len(r) == 2 and _int(r[0]) and _num(r[1]) for r in rows)
            and all(a[1] >= b[1] for a, b in zip(rows, rows[1:], strict=False))
        ):
            raise refuse(f"first_fail.top5.{mode} {rows!r}: up to five [id, logit], highest first")
    argmax_split = metric == "top1_agreement" and value == 0.0
    if argmax_split and top5["prefill"][0][0] == top5["decode"][0][0]:
        raise refuse("first_fail says the argmax differs, but both sides' top-1 is the same id")
    if ff["note"] is not None and not isinstance(ff["note"], str):
        raise refuse(f"first_fail.note {ff['note']!r}: text or null")


def _checked_precision(
    p: Any, dtype: str, metrics: dict[str, float], count: int, refuse: Any
) -> dict[str, Any] | None:
    """The ULP context of max |Δ|: its arithmetic recomputed from the magnitude it names."""
    if p is None:
        return None
    keys = {
        "dtype",
        "max_abs_diff_at",
        "logit_magnitude",
        "ulp",
        "max_abs_diff_ulps",
        "max_rel_diff",
        "max_rel_diff_at",
    }
    if not isinstance(p, dict) or set(p) != keys or p["dtype"] != dtype:
        raise refuse(f"'precision' is not the context of a {dtype} pair: {p!r}")
    for at in ("max_abs_diff_at", "max_rel_diff_at"):
        spot = p[at]
        if not (
            isinstance(spot, dict)
            and set(spot) == {"token_idx", "vocab_index"}
            and _int(spot["token_idx"])
            and 0 <= spot["token_idx"] < count
            and _int(spot["vocab_index"])
            and spot["vocab_index"] >= 0
        ):
            raise refuse(f"precision.{at} {spot!r} is not a logit of the compared tokens")
    magnitude = p["logit_magnitude"]
    if not (
        _num(magnitude) and magnitude >= 0 and _num(p["max_rel_diff"]) and p["max_rel_diff"] >= 0
    ):
        raise refuse(f"precision magnitudes {magnitude!r}, {p['max_rel_diff']!r}")
    bits = SIGNIFICAND_BITS.get(dtype.lower())
    ulp = (
        2.0 ** (math.floor(math.log2(magnitude)) - bits)
        if bits is not None and magnitude > 0
        else None
    )
    ulps = metrics["max_abs_diff"] / ulp if ulp else None
    if p["ulp"] != ulp or p["max_abs_diff_ulps"] != ulps:
        raise refuse(
            f"precision says ulp {p['ulp']!r} ({p['max_abs_diff_ulps']!r} of them), but |logit| "
            f"{magnitude!r} in {dtype} gives {ulp!r} ({ulps!r})"
        )
    return p
