"""The B3_67_EQUIVALENCE_GUARDRAIL.md report, rendered from a summary and its pair results."""

from __future__ import annotations

from typing import Any

from analysis.equivalence import PairResult

_VERDICTS = """\
## How to read the verdicts

Per pair (seed section 3.2):

- **PASS_EQUIV** — a `kv_aligned=1` pair whose p99 |Δ|, max |Δ| and top-1 agreement are all
  within the thresholds: prefill and decode computed the same logits.
- **FAIL_EQUIV** — a `kv_aligned=1` pair outside at least one threshold: decode does not
  reproduce prefill. This fails the benchmark; the first failing token is shown above.
- **EXPECTED_DRIFT** — a `kv_aligned=0` pair: KV alignment is off, so drift is allowed.
  Its metrics are recorded for reference and never fail the run.

Global (seed section 3.3, and what tracedeck adds so that no failure reads as a pass):

- **PASS_GUARDRAIL** — every pair of the matrix was judged and every `kv_aligned=1` pair is
  PASS_EQUIV under the seed's thresholds (exit code 0).
- **PASS_GUARDRAIL_LOOSENED** — the same, under thresholds the operator loosened on purpose
  (`--loose-thresholds`); the headline says which and by how much (exit code 0).
- **FAIL_GUARDRAIL** — a `kv_aligned=1` pair is FAIL_EQUIV, or an engine wrote output that
  breaks the contract, or no `kv_aligned=1` pair exists to guard anything (exit code 1).
- **ENGINE_ERROR** — a side crashed, never started, or wrote nothing: an infrastructure
  failure, not a verdict on equivalence (exit code 3). **INFRA_ERROR** — an artifact could not
  be brought home (exit code 3).
- **INPUT_ERROR** — `tracedeck analyze` was handed a tree it could not wholly judge (exit
  code 2). Pairs without a verdict are listed under "Not judged".
"""


def _num(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _matrix(summary: dict[str, Any]) -> list[str]:
    lines = ["| parameter | values |", "| --- | --- |"]
    for key, values in summary.get("config_matrix", {}).items():
        shown = ", ".join(str(v) for v in values) if isinstance(values, list) else values
        lines.append(f"| {_cell(key)} | {_cell(shown)} |")
    return lines


def _judged(result: PairResult, metric: str, limit: str) -> str:
    # Thresholds do not apply to kv_aligned=0 pairs: show the value alone.
    value = _num(result.metrics[metric])
    if result.kv_aligned != 1:
        return value
    return f"{value} ({_num(result.thresholds[limit])})"


def _compared(result: PairResult) -> str:
    total = max(result.tokens.values()) if result.tokens else result.pair_count
    if result.pair_count == total:
        return str(total)
    return f"{result.pair_count} of {total}"


def _precision(result: PairResult) -> str:
    p = result.precision or {}
    ulps = p.get("max_abs_diff_ulps")
    steps = f"{_num(ulps)} ULP" if ulps is not None else "—"
    return f"{steps} / {_num(p.get('max_rel_diff'))}"


def _results_table(results: list[PairResult]) -> list[str]:
    lines = [
        "| kv_aligned | seed | dtype | tokens compared | max \\|Δ\\| (≤) | p99 \\|Δ\\| (≤) "
        "| top-1 agreement (≥) | cos sim mean | max \\|Δ\\| in ULP / max rel. Δ | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.kv_aligned} | {r.seed} | {_cell(r.dtype)} | {_compared(r)} "
            f"| {_judged(r, 'max_abs_diff', 'max_abs_diff_max')} "
            f"| {_judged(r, 'p99_abs_diff', 'p99_abs_diff_max')} "
            f"| {_judged(r, 'top1_agreement', 'top1_agreement_min')} "
            f"| {_num(r.metrics['cos_sim_mean'])} | {_precision(r)} | **{r.verdict}** |"
        )
    lines += [
        "",
        "Thresholds (in parentheses) apply to kv_aligned=1 pairs only. The ULP column is max "
        "|Δ| in rounding steps of the dtype at that logit's magnitude (for bf16, 1 ULP at "
        "|logit| 2–4 is 0.0156), with the largest relative difference: context for reading the "
        "metrics, not part of the verdict.",
    ]
    diverged = [r for r in results if r.diverged_at_token is not None]
    for r in diverged:
        lines.append(
            f"- kv_aligned={r.kv_aligned} seed={r.seed}: the two modes wrote different tokens "
            f"at token {r.diverged_at_token}; tokens after it follow different prefixes, so "
            f"{r.pair_count} of {_compared(r).split(' of ')[-1]} tokens were compared."
        )
    return lines


def _unjudged(summary: dict[str, Any]) -> list[str]:
    missing = summary.get("unjudged") or []
    if not missing:
        return ["Every pair of the matrix was judged."]
    lines = ["| pair | class | why |", "| --- | --- | --- |"]
    for u in missing:
        lines.append(f"| {_cell(u['pair'])} | {_cell(u['class'])} | {_cell(u['why'])} |")
    return lines


def _first_fail(first_fail: dict[str, Any] | None) -> list[str]:
    if first_fail is None:
        return ["No kv_aligned=1 pair failed: there is no first failure."]
    ff = first_fail
    lines = [
        f"- pair: kv_aligned={ff['kv_aligned']}, seed={ff['seed']}",
        f"- token: token_idx {ff['token_idx']}, token_id {ff['token_id']}",
    ]
    if ff["metric"] == "token_id":
        ids = ff.get("token_ids") or {}
        lines.append(
            f"- metric: `token_id`: prefill wrote {ids.get('prefill')}, decode wrote "
            f"{ids.get('decode')}"
        )
    else:
        lines.append(
            f"- metric: `{ff['metric']}` = {_num(ff['value'])} against threshold "
            f"{_num(ff['threshold'])}"
        )
    if ff.get("tripped") and len(ff["tripped"]) > 1:
        lines.append(f"- also tripped at this token: {', '.join(ff['tripped'][1:])}")
    if ff.get("note"):
        lines.append(f"- note: {ff['note']}")
    lines += [
        f"- where: prefill `{ff['where']['prefill']}`, decode `{ff['where']['decode']}`",
        "",
        "| rank | prefill token_id | prefill logit | decode token_id | decode logit |",
        "| --- | --- | --- | --- | --- |",
    ]
    pre, dec = ff["top5"]["prefill"], ff["top5"]["decode"]
    for rank in range(max(len(pre), len(dec))):
        p = pre[rank] if rank < len(pre) else ["", None]
        d = dec[rank] if rank < len(dec) else ["", None]
        lines.append(f"| {rank + 1} | {p[0]} | {_num(p[1])} | {d[0]} | {_num(d[1])} |")
    return lines


def _loosened(summary: dict[str, Any]) -> list[str]:
    loose = summary.get("thresholds_loosened") or {}
    if not loose:
        return []
    parts = ", ".join(
        f"`{k}` {_num(v['seed'])} → {_num(v['used'])} ({v['factor']:.3g}x)"
        for k, v in loose.items()
    )
    return ["", f"**Thresholds loosened by the operator (not the seed's guardrail): {parts}.**"]


def report_markdown(summary: dict[str, Any], results: list[PairResult]) -> str:
    """B3_67_EQUIVALENCE_GUARDRAIL.md: objective, method, matrix, results, first failure."""
    t = summary["threshold_config"]
    k1 = summary["results"]["kv_aligned_1"]
    k0 = summary["results"]["kv_aligned_0"]
    parts = [
        f"# B3.67 Equivalence Guardrail — {summary['date']}",
        "",
        f"**Global verdict: {summary['global_verdict']}** — {summary['total_runs']} pair(s) "
        f"judged: {summary['pass_equiv']} PASS_EQUIV, {summary['fail_equiv']} FAIL_EQUIV, "
        f"{summary['expected_drift']} EXPECTED_DRIFT; "
        f"{len(summary.get('unjudged') or [])} not judged.",
        "",
        f"Why: {_cell(summary.get('reason', ''))}",
        *_loosened(summary),
        "",
        "## Objective",
        "",
        "Check that decode (token by token, through the KV cache) reproduces the logits of "
        "prefill (the whole sequence at once) for the same prompt and seed. With the KV cache "
        "aligned (`kv_aligned=1`) the two must agree within the thresholds below; without it "
        "(`kv_aligned=0`) drift is expected and only recorded.",
        "",
        "## Method",
        "",
        "For every seed and kv_aligned setting the engine ran once in prefill mode and once "
        "in decode mode, writing one `logits.jsonl.gz` line per generated token. The analyzer "
        "verified each file (gzip integrity, one JSON object per line, token_idx 0..T-1 with "
        "no gap, equal vocab sizes, finite values) and paired the two sides token by token "
        "(same token_idx and token_id; each side must have gen_len lines, unless both record "
        "the same early stop). Where the two sides wrote different tokens, the comparison stops "
        "after that token: later tokens follow different prefixes (with kv_aligned=1 that is a "
        "FAIL_EQUIV at that token, metric `token_id`). On float32 logits it computed, per pair, "
        "over the tokens compared:",
        "",
        "- `max_abs_diff`: the largest |prefill − decode| over every logit of every token "
        "compared;",
        "- `p99_abs_diff`: the 99th percentile (linear interpolation) of those |Δ| values;",
        "- `top1_agreement`: the fraction of tokens whose argmax agrees;",
        "- `cos_sim_mean`: the mean over tokens of the cosine similarity of the two rows.",
        "",
        f"Thresholds: p99 |Δ| ≤ {_num(t['p99_abs_diff_max'])}, "
        f"max |Δ| ≤ {_num(t['max_abs_diff_max'])}, "
        f"top-1 agreement ≥ {_num(t['top1_agreement_min'])}.",
        "",
        "Precision: both sides are normalised to float32 before they are compared (seed "
        "section 4), so each |Δ| is a float32 difference of float32 values. A float64 reading "
        "of section 8 can differ from it by one float32 rounding step: a pair within one "
        "float32 step of a threshold may get the other verdict under a float64 judge. This "
        "is the seed's normalisation, kept on purpose.",
        "",
        "## Matrix",
        "",
        *_matrix(summary),
        "",
        "## Results",
        "",
        *_results_table(results),
        "",
        f"kv_aligned=1: {k1['total_runs']} run(s), {k1['pass_equiv']} PASS_EQUIV, "
        f"{k1['fail_equiv']} FAIL_EQUIV; mean max |Δ| "
        f"{_num(k1['metrics_summary']['max_abs_diff_mean'])}, mean p99 |Δ| "
        f"{_num(k1['metrics_summary']['p99_abs_diff_mean'])}, mean top-1 agreement "
        f"{_num(k1['metrics_summary']['top1_agreement_mean'])}.",
        "",
        f"kv_aligned=0: {k0['total_runs']} run(s), {k0['expected_drift']} EXPECTED_DRIFT; "
        f"mean max |Δ| {_num(k0['metrics_summary']['max_abs_diff_mean'])}, mean p99 |Δ| "
        f"{_num(k0['metrics_summary']['p99_abs_diff_mean'])}, mean top-1 agreement "
        f"{_num(k0['metrics_summary']['top1_agreement_mean'])}.",
        "",
        "## Not judged",
        "",
        *_unjudged(summary),
        "",
        "## First failure",
        "",
        *_first_fail(summary.get("first_fail")),
        "",
        _VERDICTS,
    ]
    return "\n".join(parts)
