"""Seed 004 section 6 workloads, all from local data or generated: nothing is downloaded.

- ruler: RULER-style synthetic long-context tasks (needle in a haystack with one key or several,
  variable tracking) at a chosen token length, generated from a seed; or a local RULER .jsonl
  (lines with an "input" field) with --ruler-jsonl.
- sharegpt: a local ShareGPT JSON ("conversations" of {"from", "value"}); --sharegpt-turn-mode
  full (one request per conversation) or per_user_turn (one per human turn, with the history:
  turns of one conversation share a prefix).
- longbench: a local LongBench v2 JSON (context, question, choice_A..D); prompts over
  --max-prompt-tokens are skipped and counted.
- burstgpt: a local BurstGPT CSV (Timestamp, Request tokens, Response tokens, Total tokens,
  Model): arrival times and lengths; prompts are synthetic token runs of the recorded length.

The tokenizer is a word-level hash into the vocabulary (no files): ids 0..2 are reserved
(2 = EOS), every word or punctuation mark is one token.
"""

from __future__ import annotations

import csv
import json
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EOS = 2
_WORDS = re.compile(r"\w+|[^\w\s]")
RULER_TASKS = ("niah_single", "niah_multikey", "vt")


class WorkloadError(Exception):
    """A data file that cannot be used: the message names the file, the entry and the field."""


@dataclass
class Request:
    prompt: list[int]
    label: str
    max_new_tokens: int | None = None  # None: the run's --max-new-tokens
    arrival_s: float = 0.0


@dataclass
class Workload:
    dataset: str
    requests: list[Request]
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def tokenize(text: str, vocab: int) -> list[int]:
    return [3 + zlib.crc32(w.encode()) % (vocab - 3) for w in _WORDS.findall(text)]


# -- RULER-style synthetic tasks ---------------------------------------------------------------

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    "There and back again. The river bends past the old mill before it reaches the sea. "
)


def _haystack(rng: random.Random, n_words: int) -> list[str]:
    words = _FILLER.split()
    out: list[str] = []
    while len(out) < n_words:
        start = rng.randrange(len(words))
        out.extend(words[start:] + words[:start])
    return out[:n_words]


def ruler_sample(task: str, length: int, seed: int) -> tuple[str, str]:
    """(prompt text, expected answer) of one synthetic task, about `length` tokens long."""
    rng = random.Random(f"{task}:{seed}:{length}")
    body = max(16, length - 40)
    hay = _haystack(rng, body)
    if task == "vt":
        value = str(rng.randrange(10000, 99999))
        names = [f"V{rng.randrange(1000, 9999)}" for _ in range(4)]
        chain = [f"VAR {names[0]} = {value} ."] + [
            f"VAR {names[i]} = {names[i - 1]} ." for i in range(1, len(names))
        ]
        for i, sentence in enumerate(chain):
            at = (i + 1) * len(hay) // (len(chain) + 1)
            hay[at:at] = sentence.split()
        question = f"Find all variables that are assigned the value {value} ."
        return " ".join(hay) + " " + question, " ".join(names)
    keys = ["alpha", "cobalt", "meridian", "quartz"]
    needles = keys[:1] if task == "niah_single" else keys
    answers = {k: str(rng.randrange(1000000, 9999999)) for k in needles}
    for k in needles:
        at = rng.randrange(len(hay))
        hay[at:at] = f"One of the special magic numbers for {k} is : {answers[k]} .".split()
    target = needles[rng.randrange(len(needles))]
    question = f"What is the special magic number for {target} mentioned in the text ?"
    return " ".join(hay) + " " + question, answers[target]


def load_ruler(args: Any, vocab: int) -> Workload:
    requests: list[Request] = []
    if args.ruler_jsonl:
        path = Path(args.ruler_jsonl)
        for n, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["input"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise WorkloadError(
                    f"{path}:{n}: a RULER line needs an 'input' string ({exc})"
                ) from None
            requests.append(Request(tokenize(str(text), vocab), f"ruler:{n}"))
    else:
        tasks = [t.strip() for t in args.ruler_tasks.split(",") if t.strip()]
        for t in tasks:
            if t not in RULER_TASKS:
                raise WorkloadError(
                    f"--ruler-tasks: unknown task {t!r}; use {', '.join(RULER_TASKS)}"
                )
        for i in range(args.limit):
            task = tasks[i % len(tasks)]
            text, _ = ruler_sample(task, args.ruler_length, args.seed * 1000 + i)
            requests.append(Request(tokenize(text, vocab)[: args.ruler_length], f"{task}:{i}"))
    return Workload("ruler", requests)


# -- ShareGPT -----------------------------------------------------------------------------------


def load_sharegpt(args: Any, vocab: int) -> Workload:
    path = Path(args.sharegpt_json)
    data = _read_json(path)
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: ShareGPT JSON must be a list of conversations")
    requests: list[Request] = []
    for i, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise WorkloadError(f"{path}: entry {i}: no 'conversations' list")
        history: list[str] = []
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise WorkloadError(
                    f"{path}: entry {i} turn {j}: needs 'from' and a 'value' string"
                )
            role = str(turn.get("from", ""))
            history.append(f"{role}: {turn['value']}")
            if args.sharegpt_turn_mode == "per_user_turn" and role == "human":
                requests.append(Request(tokenize("\n".join(history), vocab), f"conv{i}:turn{j}"))
        if args.sharegpt_turn_mode == "full" and history:
            requests.append(Request(tokenize("\n".join(history), vocab), f"conv{i}"))
    return Workload("sharegpt", requests[: args.limit])


# -- LongBench v2 -------------------------------------------------------------------------------

LONGBENCH_TEMPLATE = (
    "Please read the following text and answer the question below.\n\n<text>\n{context}\n</text>\n\n"
    "What is the correct answer to this question: {question}\nChoices:\n(A) {choice_A}\n"
    "(B) {choice_B}\n(C) {choice_C}\n(D) {choice_D}\n\nThe correct answer is"
)


def load_longbench(args: Any, vocab: int) -> Workload:
    path = Path(args.longbench_json)
    data = _read_json(path)
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: LongBench v2 JSON must be a list of samples")
    requests: list[Request] = []
    skipped = 0
    for i, sample in enumerate(data):
        if len(requests) >= args.limit:
            break
        try:
            text = LONGBENCH_TEMPLATE.format(**{k: sample[k] for k in _LB_KEYS})
        except (KeyError, TypeError) as exc:
            raise WorkloadError(f"{path}: sample {i}: missing field {exc}") from None
        prompt = tokenize(text, vocab)
        if len(prompt) > args.max_prompt_tokens:
            skipped += 1
            continue
        requests.append(Request(prompt, str(sample.get("_id", i))))
    notes = [f"skipped {skipped} samples over --max-prompt-tokens {args.max_prompt_tokens}"]
    return Workload("longbench_v2", requests, {"over_max_prompt_tokens": skipped}, notes)


_LB_KEYS = ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D")


# -- BurstGPT -----------------------------------------------------------------------------------

BURST_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def load_burstgpt(args: Any, vocab: int) -> Workload:
    path = Path(args.burstgpt_csv)
    rows = list(csv.DictReader(_read_text(path).splitlines()))
    if rows and not set(BURST_COLUMNS) <= set(rows[0]):
        raise WorkloadError(f"{path}: BurstGPT CSV needs the columns {', '.join(BURST_COLUMNS)}")
    requests: list[Request] = []
    skipped = 0
    t0: float | None = None
    filler = tokenize(_FILLER * 8, vocab)
    for n, row in enumerate(rows[: args.limit], start=2):
        try:
            t = float(row["Timestamp"])
            req_tokens = int(float(row["Request tokens"]))
            resp_tokens = int(float(row["Response tokens"]))
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"{path}:{n}: bad number ({exc})") from None
        if req_tokens < 1 or req_tokens > args.max_prompt_tokens:
            skipped += 1
            continue
        t0 = t if t0 is None else t0
        prompt = (filler * (req_tokens // len(filler) + 1))[:req_tokens]
        cap = args.max_new_tokens if args.max_new_tokens > 0 else resp_tokens
        requests.append(Request(prompt, f"row{n}", max(1, min(resp_tokens, cap)), t - t0))
    notes = [f"skipped {skipped} rows (request tokens < 1 or > --max-prompt-tokens)"]
    return Workload("burstgpt", requests, {"bad_request_tokens": skipped}, notes)


def load(args: Any, vocab: int) -> Workload:
    loader = {
        "ruler": load_ruler,
        "sharegpt": load_sharegpt,
        "longbench": load_longbench,
        "burstgpt": load_burstgpt,
    }[args.workload]
    need = {"sharegpt": "sharegpt_json", "longbench": "longbench_json", "burstgpt": "burstgpt_csv"}
    flag = need.get(args.workload)
    if flag and not getattr(args, flag):
        raise WorkloadError(f"--workload {args.workload} needs --{flag.replace('_', '-')} PATH")
    return loader(args, vocab)


def _read_text(path: Path) -> str:
    """A data file's text; "@sample" (any extension) is the engine's built-in sample."""
    if path.name.startswith("@sample"):
        from runners.reference.dsa_samples import burstgpt, longbench, sharegpt

        kind = path.name.removeprefix("@sample").lstrip(".:") or path.suffix
        made = {
            "sharegpt": lambda: json.dumps(sharegpt()),
            "longbench": lambda: json.dumps(longbench()),
            "burstgpt": burstgpt,
        }
        if kind not in made:
            raise WorkloadError(
                f"{path}: use @sample:sharegpt, @sample:longbench or @sample:burstgpt"
            )
        return made[kind]()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not valid JSON ({exc})") from None
