"""Readout consistency judgement (B3.11 / B3.12): prefill_last top-1 vs the first decode top-1.

A readout trace (``GRETA_TRACE_READOUT=1``) is JSONL: a ``prefill_last`` line opens a prompt and
the ``decode`` lines after it are that prompt's decode steps. A prompt is "OK" when
``prefill_last_top1 == decode0_top1`` and no line of it has ``readout_mismatch=true``; otherwise
"NO OK". The aggregator is streaming: feed it lines as the engine writes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from analysis.json_once import GivenTwice, once

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
        elif old in out and out[old] != out[new]:
            raise TraceError(
                file,
                line_no,
                f"{old!r} (seed 001's name) is {out[old]!r} but {new!r} (seed 003's) is "
                f"{out[new]!r}: a line that says two things is believed in neither reading",
                key=old,
            )
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


# Indices a line carries, by what they must equal: the logical last index is tokens_total - 1
# (seeds 001 and 003); the physical index is the row read from the hidden buffer.
LOGICAL_INDEX_FIELDS = ("logical_last_index", "expected_last_index", "token_index", "pos_id")
PHYSICAL_INDEX_FIELDS = ("used_index", "hidden_token_index_used")
# Logits are float32: seed 003's lines put row r of the logits buffer at r * vocab * 4 bytes
# (104656896 = 204 * 128256 * 4), and B3.11's fix writes decode's row at the logical index.
LOGITS_BYTES = 4
DECODE_HIDDEN_TAG = "decode_hidden_single_token"  # seed 003: a single-token decode's hidden
# What a line may note about its indices (a row keeps the first few).
INDEX_NOTES = 3


def logical_index(record: dict[str, Any]) -> int:
    """The logical last index, from tokens_total alone (never from the line's own claim)."""
    return int(record["tokens_total"]) - 1


def physical_index(record: dict[str, Any]) -> int:
    """B3.12: a single-token buffer's only valid physical row is 0; a sequence buffer (or a
    B3.11 line, with no buffer kind) must read the logical last index."""
    return 0 if record.get("readout_buffer_kind") == "single_token" else logical_index(record)


def recomputed_mismatch(record: dict[str, Any]) -> bool | None:
    """B3.12's rule recomputed from tokens_total and the buffer kind, or None when the line
    names no physical index it read."""
    used = next((record[k] for k in PHYSICAL_INDEX_FIELDS if k in record), None)
    total = record.get("tokens_total")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (used, total)):
        return None
    return used != physical_index(record)


def index_problems(record: dict[str, Any]) -> list[str]:
    """Every index the line carries against what tokens_total and the buffer kind make it:
    logical fields (tokens_total - 1) and the logits row; the physical rule is
    recomputed_mismatch's. Whatever the engine's readout_mismatch flag says."""
    logical = logical_index(record)
    out = [
        f"{key} {record[key]} != tokens_total - 1 = {logical}"
        for key in LOGICAL_INDEX_FIELDS
        if key in record and record[key] != logical
    ]
    offset, vocab = record.get("logits_offset_bytes"), record.get("vocab")
    if offset is not None and vocab:
        want = logical * vocab * LOGITS_BYTES
        if offset != want:
            out.append(
                f"logits_offset_bytes {offset} is not the logical row {logical} "
                f"({logical} x vocab {vocab} x {LOGITS_BYTES} bytes = {want})"
            )
    return out


def _printed_error(x: float) -> float:
    """Half a unit in the sixth significant digit of x: how far %g (the engine's printf) may
    have moved it."""
    if x == 0:
        return 0.0
    return 0.5 * 10 ** (math.floor(math.log10(abs(x))) - 5)


def gap_tolerance(top1: float, top2: float, gap: float) -> float:
    """How far a printed gap may be from printed top1 - top2 for an honest engine.

    Each of the three numbers is printed with six significant digits (seed 003's lines, the
    engine's %g), so each is off by at most half a unit in its sixth digit; the engine may
    subtract in float32 (one rounding, 2^-24 of the larger operand). The sum of those bounds
    is the tolerance: seed 003's three lines are off by 1.6e-5, 3e-5 and 4.9e-5 against
    1.0e-4, 1.0e-4 and 1.0e-4; a gap off by more is not the difference of those logits.
    """
    scale = max(abs(top1), abs(top2))
    return (
        _printed_error(top1)
        + _printed_error(top2)
        + _printed_error(gap)
        + scale * 2.0**-24
        + 1e-12 * (scale + 1.0)
    )


def _refuse(file: str, line_no: int, message: str, key: str) -> TraceError:
    return TraceError(
        file,
        line_no,
        message,
        hint="the line contradicts itself: the engine's trace cannot be believed; fix the "
        "engine's readout trace",
        key=key,
    )


def check_consistency(record: dict[str, Any], line_no: int, file: str) -> None:
    """Refuse a line whose numbers contradict each other (top-1/top-2, gap, the row's stats,
    its two physical indices, its hidden offset)."""
    t1, t2 = record.get("top1_logit"), record.get("top2_logit")
    if "top2_id" in record and record["top2_id"] == record["top1_id"]:
        raise _refuse(file, line_no, f"top2_id {record['top2_id']} is top1_id", "top2_id")
    if record["gap"] < 0:
        raise _refuse(file, line_no, f"gap {record['gap']} is negative", "gap")
    if t1 is not None and t2 is not None:
        if t1 < t2:
            raise _refuse(file, line_no, f"top1_logit {t1} is below top2_logit {t2}", "top1_logit")
        tol = gap_tolerance(t1, t2, record["gap"])
        if abs(record["gap"] - (t1 - t2)) > tol:
            raise _refuse(
                file,
                line_no,
                f"gap {record['gap']} is not top1_logit - top2_logit = {t1 - t2:.6g} "
                f"(off by {abs(record['gap'] - (t1 - t2)):.3g}; six printed digits allow "
                f"{tol:.3g})",
                "gap",
            )
    top_max = record.get("logits_max")
    if t1 is not None and top_max is not None:
        tol = _printed_error(t1) + _printed_error(top_max)
        if abs(t1 - top_max) > tol:
            raise _refuse(
                file,
                line_no,
                f"top1_logit {t1} is not the row's max, logits_max {top_max}",
                "top1_logit",
            )
    low = record.get("logits_min")
    if t2 is not None and low is not None and t2 < low:
        raise _refuse(file, line_no, f"top2_logit {t2} is below logits_min {low}", "top2_logit")
    for prefix in ("hidden", "rms", "logits"):
        lo, mean, hi = (record.get(f"{prefix}_{k}") for k in ("min", "mean", "max"))
        if lo is not None and hi is not None and lo > hi:
            raise _refuse(file, line_no, f"{prefix}_min {lo} > {prefix}_max {hi}", f"{prefix}_min")
        if mean is not None and ((lo is not None and mean < lo) or (hi is not None and mean > hi)):
            raise _refuse(
                file,
                line_no,
                f"{prefix}_mean {mean} is outside [{prefix}_min, {prefix}_max] = [{lo}, {hi}]",
                f"{prefix}_mean",
            )
    used = [(k, record[k]) for k in PHYSICAL_INDEX_FIELDS if k in record]
    if len(used) == 2 and used[0][1] != used[1][1]:
        raise _refuse(
            file,
            line_no,
            f"used_index {used[0][1]} contradicts hidden_token_index_used {used[1][1]} "
            "(both are the physical row read)",
            "hidden_token_index_used",
        )
    stride, offset = record.get("hidden_stride_bytes"), record.get("hidden_offset_bytes")
    if used and stride is not None and offset is not None and offset != used[0][1] * stride:
        raise _refuse(
            file,
            line_no,
            f"hidden_offset_bytes {offset} is not {used[0][0]} {used[0][1]} x "
            f"hidden_stride_bytes {stride} = {used[0][1] * stride}",
            "hidden_offset_bytes",
        )
    tag = record.get("hidden_source_tag")
    if (
        tag is not None
        and record["phase"] == PHASE_DECODE
        and record.get("readout_buffer_kind") == "single_token"
        and tag != DECODE_HIDDEN_TAG
    ):
        raise _refuse(
            file,
            line_no,
            f"hidden_source_tag {tag!r} on a single-token decode line: seed 003's fix reads "
            f"decode's hidden from {DECODE_HIDDEN_TAG!r}",
            "hidden_source_tag",
        )
    alloc = record.get("hidden_alloc_bytes")
    if stride and offset is not None and alloc is not None and offset + stride > alloc:
        raise _refuse(
            file,
            line_no,
            f"hidden_offset_bytes {offset} + stride {stride} lies past hidden_alloc_bytes {alloc}",
            "hidden_offset_bytes",
        )
    seq_len = record.get("seq_len")
    if record.get("readout_buffer_kind") == "single_token" and (
        seq_len != 1
        if seq_len is not None
        else record["phase"] == PHASE_PREFILL_LAST and record["tokens_total"] > 1
    ):
        raise _refuse(
            file,
            line_no,
            f"readout_buffer_kind single_token on a {record['phase']} line of seq_len "
            f"{seq_len}: a single-token buffer holds one token's row (seed 003: decode, "
            "seq_len 1), so its row 0 is not this pass's last token",
            "readout_buffer_kind",
        )
    if seq_len is not None and seq_len > record["tokens_total"]:
        raise _refuse(
            file,
            line_no,
            f"seq_len {seq_len} exceeds tokens_total {record['tokens_total']}",
            "seq_len",
        )


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
    if record["tokens_total"] < 1:
        raise TraceError(
            file, line_no, "tokens_total 0: a readout needs at least one token", key="tokens_total"
        )
    check_consistency(record, line_no, file)
    return record


def load_record(raw: bytes | str, line_no: int, file: str = "") -> Any:
    """One line's JSON (orjson.JSONDecodeError when it is none); a key given twice is refused.

    orjson keeps the last of a repeated key, another reader the first: a line that says two
    things (tokens_total 205, then 101) is believed in neither reading."""
    record = orjson.loads(raw)
    if isinstance(record, dict):
        try:
            json.loads(raw, object_pairs_hook=once)
        except GivenTwice as exc:
            key, first, second = exc.args
            raise _refuse(
                file, line_no, f"key {key!r} is given twice ({first!r}, then {second!r})", key
            ) from None
        except RecursionError:  # orjson reads 1,023 levels, json fewer: no record nests so
            raise _refuse(
                file, line_no, "a value nested deeper than the checks read (no record does)", ""
            ) from None
    return record


def parse_line(raw: bytes | str, line_no: int, file: str = "") -> dict[str, Any]:
    """Parse and validate one JSONL line (trailing newline allowed)."""
    text = raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw.rstrip("\r\n")
    if not text.strip():
        raise TraceError(file, line_no, "blank line where a trace record was expected")
    try:
        record = load_record(text, line_no, file)
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
    index_lines: int = 0  # lines whose indices contradict tokens_total (index_problems)
    index_notes: list[str] = field(default_factory=list)  # the first few, with their line
    top1_seq: list[int] = field(default_factory=list)
    gap_seq: list[float] = field(default_factory=list)
    decode_steps: int = 0  # decode lines folded in (a scratch copy keeps it, not the sequence)

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
        if self.index_lines:
            notes.append(
                f"indices contradict tokens_total on {self.index_lines} line(s): "
                + "; ".join(self.index_notes)
            )
        if collapsed:
            notes.append(f"collapsed: decode top-1 stuck on {decode0_top1} for {steps} steps")
        if self.mismatches or self.index_lines:
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
            "index_problem_lines": self.index_lines,
            "collapsed": collapsed,
            "verdict": verdict,
            "note": "; ".join(notes),
        }


# A fact is the compact account of one trace line, all a row needs:
# ["p", line, top1_id, gap, mismatch, step, prompt name or None, tokens_total, disagrees,
# index problems] for a prefill_last line, ["d", line, top1_id, gap, mismatch, step, prompt
# index, tokens_total, disagrees, index problems] for a decode line (the prompt it continues).
# Runs recorded before index problems were checked have 9 elements.
Fact = list[Any]


class ReadoutAggregator:
    """Streaming per-prompt readout table; feed lines in file order.

    `fact` checks a record against the table so far and returns its compact account; `apply`
    folds an account in. A followed trace records the facts, so a replay rebuilds the same rows.
    """

    def __init__(self) -> None:
        self._prompts: list[_Prompt] = []
        self.facts: list[Fact] = []  # every fact applied, in order

    def scratch(self) -> ReadoutAggregator:
        """A copy to check further lines against that leaves this table as it is (fact() reads
        the prompts' names, lines and counters (decode_steps among them), never their token
        sequences or the facts)."""
        copy = ReadoutAggregator()
        copy._prompts = [
            dataclasses.replace(p, index_notes=list(p.index_notes), top1_seq=[], gap_seq=[])
            for p in self._prompts
        ]
        return copy

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
        problems = index_problems(record)[:INDEX_NOTES]
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
                problems,
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
        if prompt.decode_steps and step <= prompt.last_step:
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
            problems,
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
        found = [i for i, p in enumerate(self._prompts) if p.tokens_total + 1 == total]
        # What tells prompts at the same tokens_total apart: the line's prompt name, then its
        # step (the prompt's next step). Never a guess: still ambiguous is refused.
        named, step = record.get("prompt"), record.get("step")
        if len(found) > 1 and named is not None:
            found = [i for i in found if self._prompts[i].name == named] or found[-1:]
        if len(found) > 1 and step is not None:
            found = [i for i in found if self._prompts[i].last_step + 1 == step] or found
        if len(found) > 1:
            which = ", ".join(
                f"{self._prompts[i].name!r} (line {self._prompts[i].line})" for i in found
            )
            raise TraceError(
                file,
                line_no,
                f"decode line with tokens_total {total} continues {len(found)} prompts: "
                f"{which}; it cannot be told which",
                hint="the lines carry nothing that tells these prompts apart: the engine must "
                "write each line's prompt name (or distinct steps) when prompts interleave",
                key="tokens_total",
            )
        if found:
            return found[0]
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
        self.facts.append(fact)
        phase, line_no, top1, gap, mismatch, step, who, total, disagrees = fact[:9]
        problems = [f"line {line_no}: {p}" for p in (fact[9] if len(fact) > 9 else [])]
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
                    index_lines=int(bool(problems)),
                    index_notes=problems[:INDEX_NOTES],
                )
            )
            return len(self._prompts) - 1
        prompt = self._prompts[who]
        prompt.last_step = step
        prompt.tokens_total = total
        prompt.decode_steps += 1
        prompt.top1_seq.append(top1)
        prompt.gap_seq.append(gap)
        prompt.mismatches += mismatch
        prompt.disagreements += disagrees
        if problems:
            prompt.index_lines += 1
            room = INDEX_NOTES - len(prompt.index_notes)
            prompt.index_notes.extend(problems[: max(room, 0)])
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


def row_verdict(row: dict[str, Any]) -> str | None:
    """A recorded row's verdict recomputed from its own numbers, as _Prompt.row makes it: the
    word a row carries is a claim, never the judgement (runs recorded whole rows once)."""
    seq = row.get("top1_seq") or []
    decode0 = row.get("decode0_top1")
    if seq and seq[0] != decode0:  # its decode0 is not its first decode step's top-1
        return VERDICT_NO_OK
    if row.get("readout_mismatch_count") or row.get("index_problem_lines"):
        return VERDICT_NO_OK
    if decode0 is None:
        return None
    return VERDICT_OK if decode0 == row.get("prefill_last_top1") else VERDICT_NO_OK


def rechecked_row(row: dict[str, Any]) -> dict[str, Any]:
    """A recorded row with its verdict recomputed (row_verdict); a word it recomputes to
    something else is replaced, and its note says what the record claimed."""
    word = row_verdict(row)
    if row.get("verdict") == word:
        return row
    claim = f"the record says {row.get('verdict') or 'no verdict'}, its own numbers say {word}"
    return {**row, "verdict": word, "note": f"{claim}; {row.get('note', '')}".rstrip("; ")}


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


def format_table(rows: list[dict[str, Any]], verdict: str, reason: str | None = None) -> str:
    """The seeds' readout table as markdown, with the mismatch count and the overall verdict.

    verdict and reason: the run's (a run with refused lines is NO OK whatever its rows say);
    reason defaults to the rows' own.
    """
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
    why = overall(rows)[1] if reason is None else reason
    lines.append(f"Verdict: **{verdict}** — {_cell(why)}")
    return "\n".join(lines) + "\n"


def to_json(rows: list[dict[str, Any]], verdict: str, reason: str | None = None) -> dict[str, Any]:
    """The table as a JSON-ready dict (for ``--json``)."""
    return {
        "verdict": verdict,
        "reason": overall(rows)[1] if reason is None else reason,
        "readout_mismatch_count": sum(row["readout_mismatch_count"] for row in rows),
        "prompts": rows,
    }


def fact_key(fact: Fact) -> tuple[Any, ...]:
    """What a fact says about its line, without the name a judge gave its prompt."""
    named = fact[6] if fact[0] == "d" else None
    return (*fact[:6], named, *fact[7:9], tuple(fact[9]) if len(fact) > 9 else ())


def kept_facts(lines: Iterable[bytes], file: str) -> list[Fact]:
    """The facts of every line that can be judged, as a live judge folds them (a line that
    cannot be judged is left out, as the live judge leaves it out and reports it)."""
    agg = ReadoutAggregator()
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            agg.apply(agg.fact(load_record(raw, line_no, file), line_no, file), file)
        except (orjson.JSONDecodeError, TraceError):
            continue
    return agg.facts


def compare_kept(followed: list[Fact], kept: list[Fact]) -> str:
    """'' when a kept copy of a trace says what was followed live; else what differs."""
    a, b = [fact_key(f) for f in followed], [fact_key(f) for f in kept]
    if a == b:
        return ""
    first = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    line = (a[first] if first < len(a) else b[first])[1]
    return (
        f"{len(a)} line(s) judged live, {len(b)} judged from the kept copy; they differ from "
        f"line {line} on"
    )


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
