"""Readout consistency judgement (B3.11 / B3.12): prefill_last top-1 vs the first decode top-1.

A readout trace (``GRETA_TRACE_READOUT=1``) is JSONL: a ``prefill_last`` line opens a prompt and
the ``decode`` lines after it are that prompt's decode steps. A prompt is "OK" when
``prefill_last_top1 == decode0_top1`` and no line of it has ``readout_mismatch=true``; otherwise
"NO OK". The aggregator is streaming: feed it lines as the engine writes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

PHASE_PREFILL_LAST = "prefill_last"
PHASE_DECODE = "decode"
PHASES = (PHASE_PREFILL_LAST, PHASE_DECODE)

VERDICT_OK = "OK"
VERDICT_NO_OK = "NO OK"

NO_DECODE_NOTE = "no decode step"
COLLAPSE_MIN_STEPS = 3

BUFFER_KINDS = ("seq", "single_token")

_INT = "non-negative integer"
_NUM = "finite number"
_STR = "string"
_BOOL = "boolean"

# What every line must carry once named the seed-003 way (see normalize_record): seed 001's
# lines name the ids top1/top2 and carry no phase or step, which follow from seq_len and
# tokens_total.
REQUIRED_FIELDS: dict[str, str] = {
    "tokens_total": _INT,
    "top1_id": _INT,
    "gap": _NUM,
    "readout_mismatch": _BOOL,
}

# Fields named in seeds 001 / 003: not required, but checked when a line carries them.
OPTIONAL_FIELDS: dict[str, str] = {
    "phase": _STR,
    "step": _INT,
    "top1_logit": _NUM,
    "top2_id": _INT,
    "top2_logit": _NUM,
    "prompt": _STR,
    "readout_buffer_kind": _STR,
    "hidden_source_tag": _STR,
    "seq_len": _INT,
    "pos_id": _INT,
    "token_index": _INT,
    "used_index": _INT,
    "logical_last_index": _INT,
    "expected_last_index": _INT,
    "hidden_token_index_used": _INT,
    "hidden_src_ptr": _INT,
    "hidden_alloc_bytes": _INT,
    "hidden_stride_bytes": _INT,
    "hidden_offset_bytes": _INT,
    "hidden_hash": _INT,
    "hidden_min": _NUM,
    "hidden_max": _NUM,
    "hidden_mean": _NUM,
    "rms_in_ptr": _INT,
    "rms_out_ptr": _INT,
    "lm_in_ptr": _INT,
    "rms_offset_bytes": _INT,
    "rms_hash": _INT,
    "rms_min": _NUM,
    "rms_max": _NUM,
    "rms_mean": _NUM,
    "logits_ptr": _INT,
    "logits_offset_bytes": _INT,
    "logits_hash": _INT,
    "logits_min": _NUM,
    "logits_max": _NUM,
    "logits_mean": _NUM,
    "vocab": _INT,
}

_FIX_LINE = "fix or regenerate the trace line (GRETA_TRACE_READOUT=1 writes one JSON object a line)"


class TraceError(ValueError):
    """A readout trace line that cannot be judged; str() is ``FILE:LINE: message — what to do``."""

    def __init__(
        self, file: str, line: int, message: str, hint: str = _FIX_LINE, key: str | None = None
    ) -> None:
        self.file = file or "<input>"
        self.line = line
        self.message = message
        self.hint = hint
        self.key = key
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line > 0 else self.file
        return f"{where}: {self.message} — {self.hint}"


def _check_value(key: str, value: Any, kind: str, file: str, line_no: int) -> None:
    if kind == _STR:
        ok = isinstance(value, str)
    elif kind == _BOOL:
        ok = isinstance(value, bool)
    elif kind == _INT:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise TraceError(
            file,
            line_no,
            f"field {key!r} must be a {kind}, got {value!r} ({type(value).__name__})",
            key=key,
        )


ALIASES = {"top1": "top1_id", "top2": "top2_id"}  # seed 001's names for the ids


def normalize_record(record: dict[str, Any], line_no: int, file: str) -> dict[str, Any]:
    """Seed 001's field list in seed 003's names: ids from top1/top2, phase from seq_len."""
    out = dict(record)
    for old, new in ALIASES.items():
        if old in out and new not in out:
            out[new] = out[old]
    if "phase" not in out:
        seq_len, total = out.get("seq_len"), out.get("tokens_total")
        if isinstance(seq_len, int) and isinstance(total, int) and not isinstance(seq_len, bool):
            out["phase"] = PHASE_DECODE if seq_len == 1 and total > 1 else PHASE_PREFILL_LAST
        else:
            raise TraceError(
                file,
                line_no,
                "no phase, and no seq_len and tokens_total to tell prefill_last from decode",
                key="phase",
            )
    return out


def recomputed_mismatch(record: dict[str, Any]) -> bool | None:
    """B3.12's rule from the line's own indices, or None when it carries none.

    A single-token buffer's only valid physical index is 0; a sequence buffer (or a B3.11
    line, with no buffer kind) must read the logical last index.
    """
    used = record.get("used_index", record.get("hidden_token_index_used"))
    if not isinstance(used, int) or isinstance(used, bool):
        return None
    if record.get("readout_buffer_kind") == "single_token":
        return used != 0
    expected = record.get("logical_last_index", record.get("expected_last_index"))
    if not isinstance(expected, int) or isinstance(expected, bool):
        return None
    return used != expected


def validate_record(record: Any, line_no: int, file: str = "") -> dict[str, Any]:
    """Check one parsed trace record against the seed contract; return it in seed 003's names."""
    if not isinstance(record, dict):
        raise TraceError(file, line_no, f"expected a JSON object, got {type(record).__name__}")
    record = normalize_record(record, line_no, file)
    missing = [key for key in REQUIRED_FIELDS if key not in record]
    if missing:
        raise TraceError(
            file,
            line_no,
            f"missing required field(s): {', '.join(missing)}",
            key=missing[0],
        )
    for key, kind in REQUIRED_FIELDS.items():
        _check_value(key, record[key], kind, file, line_no)
    for key, kind in OPTIONAL_FIELDS.items():
        if key in record:
            _check_value(key, record[key], kind, file, line_no)
    if record["phase"] not in PHASES:
        raise TraceError(
            file,
            line_no,
            f"unknown phase {record['phase']!r} (expected one of: {', '.join(PHASES)})",
            hint="this reader knows the seed phases only; check the engine's trace version",
            key="phase",
        )
    kind = record.get("readout_buffer_kind")
    if kind is not None and kind not in BUFFER_KINDS:
        raise TraceError(
            file,
            line_no,
            f"unknown readout_buffer_kind {kind!r} (expected one of: {', '.join(BUFFER_KINDS)})",
            hint="this reader knows the B3.12 buffer kinds only; check the engine's trace version",
            key="readout_buffer_kind",
        )
    vocab = record.get("vocab")
    if vocab is not None:
        for key in ("top1_id", "top2_id"):
            if record[key] >= vocab:
                raise TraceError(
                    file,
                    line_no,
                    f"{key} {record[key]} is outside the vocab ({vocab})",
                    hint="the token id and vocab size disagree; check the model and the trace",
                    key=key,
                )
    return record


def parse_line(raw: bytes | str, line_no: int, file: str = "") -> dict[str, Any]:
    """Parse and validate one JSONL line (trailing newline allowed)."""
    text = raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw.rstrip("\r\n")
    if not text.strip():
        raise TraceError(file, line_no, "blank line where a trace record was expected")
    try:
        record = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise TraceError(file, line_no, f"not valid JSON ({exc})") from None
    return validate_record(record, line_no, file)


@dataclass(slots=True)
class _Prompt:
    name: str
    file: str
    line: int
    prefill_top1: int
    prefill_gap: float
    mismatches: int
    last_step: int
    tokens_total: int = 0  # of the prompt's last line: its next decode line has one more
    prefill_tokens_total: int = 0
    disagreements: int = 0  # lines whose readout_mismatch flag contradicts their indices
    top1_seq: list[int] = field(default_factory=list)
    gap_seq: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        steps = len(self.top1_seq)
        decode0_top1 = self.top1_seq[0] if steps else None
        collapsed = (
            steps >= COLLAPSE_MIN_STEPS
            and len(set(self.top1_seq)) == 1
            and self.top1_seq[0] != self.prefill_top1
        )
        notes: list[str] = []
        if not steps:
            notes.append(NO_DECODE_NOTE)
        elif decode0_top1 != self.prefill_top1:
            notes.append(f"prefill_last_top1 {self.prefill_top1} != decode0_top1 {decode0_top1}")
        if self.mismatches:
            notes.append(f"readout_mismatch=true on {self.mismatches} line(s)")
        if self.disagreements:
            notes.append(
                f"the engine's readout_mismatch flag contradicts its own indices on "
                f"{self.disagreements} line(s) (B3.12 rule recomputed)"
            )
        if collapsed:
            notes.append(f"collapsed: decode top-1 stuck on {decode0_top1} for {steps} steps")
        if self.mismatches:
            verdict: str | None = VERDICT_NO_OK
        elif not steps:
            verdict = None
        elif decode0_top1 == self.prefill_top1:
            verdict = VERDICT_OK
        else:
            verdict = VERDICT_NO_OK
        if verdict == VERDICT_OK:
            notes.append("prefill_last_top1 == decode0_top1, readout_mismatch=false")
        return {
            "prompt": self.name,
            "file": self.file,
            "line": self.line,
            "prefill_last_top1": self.prefill_top1,
            "prefill_last_gap": self.prefill_gap,
            "decode0_top1": decode0_top1,
            "decode0_gap": self.gap_seq[0] if steps else None,
            "decode_steps": steps,
            "top1_seq": list(self.top1_seq),
            "gap_seq": list(self.gap_seq),
            "readout_mismatch_count": self.mismatches,
            "collapsed": collapsed,
            "verdict": verdict,
            "note": "; ".join(notes),
        }


# A fact is the compact account of one trace line, all a row needs:
# ["p", line, top1_id, gap, mismatch, step, prompt name or None, tokens_total, disagrees]
# for a prefill_last line, ["d", line, top1_id, gap, mismatch, step, prompt index,
# tokens_total, disagrees] for a decode line (the prompt its tokens_total continues).
Fact = list[Any]


class ReadoutAggregator:
    """Streaming per-prompt readout table; feed lines in file order.

    `fact` checks a record against the table so far and returns its compact account; `apply`
    folds an account in. A followed trace records the facts, so a replay rebuilds the same rows.
    """

    def __init__(self) -> None:
        self._prompts: list[_Prompt] = []

    def feed_line(self, raw: bytes | str, line_no: int, file: str = "") -> list[dict[str, Any]]:
        """Parse one line, fold it in, and return the rows it changed."""
        return self.feed(parse_line(raw, line_no, file), line_no, file)

    def feed(
        self, record: dict[str, Any], line_no: int, file: str = "", name: str | None = None
    ) -> list[dict[str, Any]]:
        """Validate one record, fold it in, and return the rows it changed."""
        index = self.apply(self.fact(record, line_no, file, name), file)
        return [self._prompts[index].row()]

    def fact(
        self, record: dict[str, Any], line_no: int, file: str = "", name: str | None = None
    ) -> Fact:
        """The compact account of a record; TraceError when it cannot follow the lines so far.

        name: what to call a prompt whose prefill_last line names none (the preset's name for
        the cell that wrote it); else "prompt N".
        """
        record = validate_record(record, line_no, file)
        engine_flag = bool(record["readout_mismatch"])
        recomputed = recomputed_mismatch(record)
        disagrees = int(recomputed is not None and recomputed != engine_flag)
        mismatch = int(engine_flag or bool(recomputed))
        total = record["tokens_total"]
        if record["phase"] == PHASE_PREFILL_LAST:
            step = record.get("step", 0)
            named = record.get("prompt") or name
            return [
                "p",
                line_no,
                record["top1_id"],
                record["gap"],
                mismatch,
                step,
                named,
                total,
                disagrees,
            ]
        index = self._continued(record, line_no, file)
        prompt = self._prompts[index]
        step = record.get("step", total - prompt.prefill_tokens_total)
        named = record.get("prompt")
        if named is not None and named != prompt.name:
            raise TraceError(
                file,
                line_no,
                f"decode line for prompt {named!r} continues prompt {prompt.name!r} "
                f"(line {prompt.line}) by tokens_total",
                hint="each prompt's decode lines must continue its own tokens_total",
                key="prompt",
            )
        if prompt.top1_seq and step <= prompt.last_step:
            raise TraceError(
                file,
                line_no,
                f"decode step {step} does not follow step {prompt.last_step} "
                f"of prompt {prompt.name!r}",
                hint="decode steps must increase within a prompt; "
                "were two traces written into one file?",
                key="step",
            )
        return [
            "d",
            line_no,
            record["top1_id"],
            record["gap"],
            mismatch,
            step,
            index,
            total,
            disagrees,
        ]

    def _continued(self, record: dict[str, Any], line_no: int, file: str) -> int:
        """The prompt a decode line belongs to: the one whose tokens_total it continues."""
        if not self._prompts:
            raise TraceError(
                file,
                line_no,
                "decode line before any prefill_last line",
                hint="the trace must start with the prompt's prefill_last record; "
                "check that the file is complete from its first line",
                key="phase",
            )
        total = record["tokens_total"]
        for index in range(len(self._prompts) - 1, -1, -1):
            if self._prompts[index].tokens_total + 1 == total:
                return index
        last = self._prompts[-1]
        raise TraceError(
            file,
            line_no,
            f"decode line with tokens_total {total} continues no prompt (prompt {last.name!r} "
            f"of line {last.line} is at tokens_total {last.tokens_total}, so its next decode "
            f"step has {last.tokens_total + 1})",
            hint="a decode line follows its prompt's previous line with tokens_total + 1; a "
            "gap means lost lines or two traces written into one file",
            key="tokens_total",
        )

    def apply(self, fact: Fact, file: str = "") -> int:
        """Fold one fact in; returns the index of the prompt row it changed."""
        phase, line_no, top1, gap, mismatch, step, who, total, disagrees = fact
        if phase == "p":
            self._prompts.append(
                _Prompt(
                    name=who or f"prompt {len(self._prompts) + 1}",
                    file=file,
                    line=line_no,
                    prefill_top1=top1,
                    prefill_gap=gap,
                    mismatches=mismatch,
                    last_step=step,
                    tokens_total=total,
                    prefill_tokens_total=total,
                    disagreements=disagrees,
                )
            )
            return len(self._prompts) - 1
        prompt = self._prompts[who]
        prompt.last_step = step
        prompt.tokens_total = total
        prompt.top1_seq.append(top1)
        prompt.gap_seq.append(gap)
        prompt.mismatches += mismatch
        prompt.disagreements += disagrees
        return who

    def row(self, index: int) -> dict[str, Any]:
        return self._prompts[index].row()

    def rows(self) -> list[dict[str, Any]]:
        return [prompt.row() for prompt in self._prompts]

    def verdict(self) -> str:
        """ "OK" only when there is at least one prompt and every prompt is OK."""
        return overall(self.rows())[0]

    def reason(self) -> str:
        return overall(self.rows())[1]


def overall(rows: Iterable[dict[str, Any]], limit: int = 5) -> tuple[str, str]:
    """The trace's verdict and a one-line reason naming the prompts that are not OK."""
    rows = list(rows)
    if not rows:
        return VERDICT_NO_OK, "no prompts in the trace (no prefill_last line)"
    bad = [row for row in rows if row["verdict"] != VERDICT_OK]
    if not bad:
        return VERDICT_OK, (
            f"all {len(rows)} prompt(s): prefill_last_top1 == decode0_top1, readout_mismatch=false"
        )
    parts = [f"{row['prompt']} (line {row['line']}): {row['note']}" for row in bad[:limit]]
    if len(bad) > limit:
        parts.append(f"and {len(bad) - limit} more prompt(s) not OK")
    return VERDICT_NO_OK, "; ".join(parts)


def _cell(value: Any) -> str:
    # Prompt names come from the trace: keep them from breaking the markdown table.
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def format_table(rows: list[dict[str, Any]], verdict: str) -> str:
    """The seeds' readout table as markdown, with the mismatch count and the overall verdict."""
    lines = [
        "| Prompt | prefill_last_top1 | decode0_top1 | readout_mismatch | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        decode0 = NO_DECODE_NOTE if row["decode_steps"] == 0 else row["decode0_top1"]
        cells = [
            row["prompt"],
            row["prefill_last_top1"],
            decode0,
            row["readout_mismatch_count"],
            row["verdict"] or "—",
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    total = sum(row["readout_mismatch_count"] for row in rows)
    lines.append("")
    lines.append(f"`readout_mismatch=true` count: **{total}**")
    lines.append(f"Verdict: **{verdict}** — {_cell(overall(rows)[1])}")
    return "\n".join(lines) + "\n"


def to_json(rows: list[dict[str, Any]], verdict: str) -> dict[str, Any]:
    """The table as a JSON-ready dict (for ``--json``)."""
    return {
        "verdict": verdict,
        "reason": overall(rows)[1],
        "readout_mismatch_count": sum(row["readout_mismatch_count"] for row in rows),
        "prompts": rows,
    }


def analyze_trace(path: str | Path) -> ReadoutAggregator:
    """Read a readout JSONL file line by line and fold every line into a new aggregator."""
    file = str(path)
    agg = ReadoutAggregator()
    try:
        with open(path, "rb") as handle:
            _feed_lines(agg, handle, file)
    except OSError as exc:
        raise TraceError(
            file, 0, f"cannot read trace: {exc.strerror or exc}", hint="check the path"
        ) from None
    return agg


def _feed_lines(agg: ReadoutAggregator, lines: Iterable[bytes], file: str) -> None:
    blank_since = 0  # first of a run of blank lines: allowed only at the end of the file
    judged = 0
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            blank_since = blank_since or line_no
            continue
        if blank_since:
            raise TraceError(
                file,
                blank_since,
                "blank line inside the trace",
                hint="remove the blank line, or check how the file was written",
            )
        if not raw.endswith(b"\n"):
            try:
                orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise TraceError(
                    file,
                    line_no,
                    "truncated last line (no newline at end and not valid JSON)",
                    hint="the writer was cut off or is still writing; "
                    "wait for the run to finish or re-run it",
                ) from None
        agg.feed_line(raw, line_no, file)
        judged += 1
    if not judged:
        raise TraceError(
            file,
            0,
            "no readout lines (the file is empty or blank)",
            hint="the engine wrote no trace: was GRETA_TRACE_READOUT=1 set, and is this the file "
            "it writes?",
        )
