"""Reads and judges a B3.67 artifact tree (seed section 1 layout); writes nothing.

ROOT/runs/kv_aligned_{k}/seed_{n}/{prefill,decode}/{logits.jsonl.gz,metadata.json} is read, with
ROOT/config.json when present. The documents to write (metrics/, summary.json, the report) are
returned for the caller to write.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from analysis.equivalence import (
    THRESHOLDS,
    PairResult,
    Unjudged,
    compare_files,
    loosened,
    resolve_thresholds,
)
from analysis.logits import InputError, iter_logits, read_metadata

MODES = ("prefill", "decode")
LOGITS_NAME = "logits.jsonl.gz"
METADATA_NAME = "metadata.json"
REPORT_NAME = "B3_67_EQUIVALENCE_GUARDRAIL.md"
LAYOUT = "ROOT/runs/kv_aligned_{0,1}/seed_{n}/{prefill,decode}/{logits.jsonl.gz,metadata.json}"

_KV_DIR = re.compile(r"kv_aligned_([01])")
_SEED_DIR = re.compile(r"seed_(0|[1-9][0-9]*)")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def pair_dir(root: str | Path, kv_aligned: int, seed: int) -> Path:
    return Path(root) / "runs" / f"kv_aligned_{kv_aligned}" / f"seed_{seed}"


def metrics_path(root: str | Path, kv_aligned: int, seed: int) -> Path:
    return Path(root) / "metrics" / f"kv_aligned_{kv_aligned}" / f"seed_{seed}_metrics.json"


# ---------------------------------------------------------------- one pair


def _side_files(side: Path, mode: str) -> tuple[Path, Path]:
    if not side.is_dir():
        raise InputError(
            side, None, f"the {mode} side of this pair is missing", "run or fetch it, then retry"
        )
    for entry in sorted(side.iterdir()):
        if entry.name.endswith((".part", ".tmp")):
            raise InputError(
                entry, None, "an unfinished download", "wait for the fetch to finish, or re-fetch"
            )
    files = side / LOGITS_NAME, side / METADATA_NAME
    for path in files:
        if not path.is_file():
            raise InputError(
                path,
                None,
                f"missing ({mode} side needs {LOGITS_NAME} and {METADATA_NAME})",
                "run or fetch this side again",
            )
    return files


def judge_pair(
    root: str | Path,
    kv_aligned: int,
    seed: int,
    thresholds: dict[str, float] | None = None,
    workers: int = 1,
    on_token: Callable[[int, int], None] | None = None,
) -> PairResult:
    """Judges one pair from the tree; returns the result (the caller writes its metrics file).

    workers >= 2 reads the two sides in two processes at once.
    on_token(tokens read, gen_len): progress through the pair's files."""
    base = pair_dir(root, kv_aligned, seed)
    logits: dict[str, Path] = {}
    meta_path: dict[str, Path] = {}
    for mode in MODES:
        logits[mode], meta_path[mode] = _side_files(base / mode, mode)
    if os.path.samefile(logits["prefill"], logits["decode"]):
        raise InputError(
            logits["decode"],
            None,
            f"is the prefill side's file itself ({logits['prefill']}: a link, or the same "
            "inode): a file compared with itself says nothing of what decode computed",
            "write each side's logits to its own file; re-run the decode side",
        )
    meta = _checked_metadata(meta_path, kv_aligned, seed)
    result = compare_files(
        logits["prefill"],
        logits["decode"],
        seed=seed,
        kv_aligned=kv_aligned,
        dtype=meta["prefill"]["dtype"],
        prompt_len=meta["prefill"]["prompt_len"],
        gen_len=meta["prefill"]["gen_len"],
        thresholds=thresholds,
        workers=workers,
        on_token=on_token,
    )
    _check_token_count(result.tokens["prefill"], meta, meta_path)
    if result.first_fail is not None:
        # Named from the tree's root: the same words wherever the tree is judged (console or
        # host) and after it is moved.
        root_text = str(Path(root))
        result.first_fail["where"] = {
            side: where.removeprefix(root_text + "/")
            for side, where in (result.first_fail.get("where") or {}).items()
        }
    return result


def _checked_metadata(
    paths: dict[str, Path], kv_aligned: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Both sides' metadata.json: each in its right place, both of one configuration."""
    meta: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        meta[mode] = read_metadata(paths[mode])
        expected = {"seed": seed, "kv_aligned": kv_aligned, "mode": mode}
        for key, want in expected.items():
            if meta[mode][key] != want:
                raise InputError(
                    paths[mode],
                    None,
                    f"'{key}' is {meta[mode][key]!r} but the directory says {want!r}",
                    "the file is in the wrong place, or the runner wrote the wrong metadata",
                )
    for key in ("dtype", "prompt_len", "gen_len"):
        if meta["prefill"][key] != meta["decode"][key]:
            raise InputError(
                paths["decode"],
                None,
                f"'{key}' is {meta['decode'][key]!r} here but {meta['prefill'][key]!r} in "
                f"{paths['prefill']}: the two sides did not run the same configuration",
                "re-run the pair with one configuration",
            )
    return meta


def read_pair_metadata(root: str | Path, kv_aligned: int, seed: int) -> dict[str, dict[str, Any]]:
    """A pair's two metadata.json files (checked as judge_pair checks them), without its logits:
    what the console holds of a pair judged on the host."""
    base = pair_dir(root, kv_aligned, seed)
    paths = {mode: base / mode / METADATA_NAME for mode in MODES}
    for mode, path in paths.items():
        if not path.is_file():
            raise InputError(
                path,
                None,
                f"missing: the {mode} side's metadata must come home to check what the host says",
                f"keep {METADATA_NAME} in [artifacts] fetch",
            )
    return _checked_metadata(paths, kv_aligned, seed)


def _check_token_count(lines: int, meta: dict[str, dict[str, Any]], paths: dict[str, Path]) -> None:
    """Seed section 4: abort if any token is missing (an early stop on both sides excepted)."""
    gen_len = meta["prefill"]["gen_len"]
    if lines == gen_len:
        return
    stops = {mode: meta[mode].get("eos_at_token") for mode in MODES}
    if lines < gen_len and stops["prefill"] == stops["decode"] == lines - 1:
        _check_early_stop(lines - 1, meta, paths)  # both sides stopped at the same EOS token
        return
    if lines > gen_len:
        why = f"{lines} token lines but gen_len is {gen_len}"
    else:
        recorded = ", ".join(f"{mode} eos_at_token={stops[mode]!r}" for mode in MODES)
        why = (
            f"{lines} token lines but gen_len is {gen_len}: tokens {lines}..{gen_len - 1} are "
            f"missing, and no early stop at token {lines - 1} is recorded on both sides "
            f"({recorded})"
        )
    raise InputError(
        paths["prefill"].parent,
        None,
        why,
        "re-run the pair; an engine that stops at EOS records eos_at_token in metadata.json",
    )


def _check_early_stop(stop: int, meta: dict[str, dict[str, Any]], paths: dict[str, Path]) -> None:
    """An early stop is recomputed, never believed: both sides name the same eos_token_id,
    chose it (greedy: its logit is the row's largest) at token `stop`, and at no token before.
    Otherwise a broken engine could cut both files short before they part and claim EOS."""
    eos = {mode: meta[mode].get("eos_token_id") for mode in MODES}
    hint = (
        "an engine that stops early records eos_at_token and eos_token_id (the end-of-sequence "
        "id it stopped on) in both metadata.json files"
    )
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos.values()) or (
        eos["prefill"] != eos["decode"]
    ):
        raise InputError(
            paths["prefill"].parent.parent,
            None,
            f"both sides record eos_at_token {stop}, but eos_token_id is {eos['prefill']!r} "
            f"(prefill) and {eos['decode']!r} (decode): an early stop must name the one "
            "end-of-sequence id both chose",
            hint,
        )
    want = eos["prefill"]
    for mode in MODES:
        logits = paths[mode].parent / LOGITS_NAME
        for row in iter_logits(logits):
            last = row.token_idx == stop
            if (row.token_id == want) != last:
                said = f"chose {row.token_id}" if last else f"already chose eos_token_id {want}"
                raise InputError(
                    logits,
                    row.line,
                    f"token {row.token_idx} {said}, but metadata.json says the side stopped on "
                    f"eos_token_id {want} at token {stop}",
                    hint,
                )
            if last and not 0 <= want < row.logits.shape[0]:
                raise InputError(
                    logits, row.line, f"eos_token_id {want} is outside the vocab", hint
                )
            if last and row.logits[want] < row.logits.max():
                raise InputError(
                    logits,
                    row.line,
                    f"token {stop} chose eos_token_id {want} (logit {row.logits[want]:.6g}), but "
                    f"the row's largest logit is {row.logits.max():.6g}: greedy decoding did not "
                    "pick it",
                    hint,
                )


# ---------------------------------------------------------------- the whole run


def read_config(root: Path) -> dict[str, Any] | None:
    path = root / "config.json"
    if not path.exists():
        return None
    hint = "fix or remove config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(path, exc.lineno, f"not valid JSON ({exc.msg})", hint) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, None, f"cannot read it ({exc})", hint) from None
    if type(config) is not dict:
        raise InputError(path, None, "does not hold a JSON object", hint)
    matrix = config.get("config_matrix")
    if matrix is not None and type(matrix) is not dict:
        raise InputError(path, None, "key 'config_matrix' must be an object", hint)
    return config


def _int_list(config: dict[str, Any], key: str, allowed: set[int] | None, path: Path) -> list[int]:
    value = config["config_matrix"][key]
    ok = (
        type(value) is list
        and value
        and all(type(v) is int and v >= 0 for v in value)
        and len(set(value)) == len(value)
        and (allowed is None or set(value) <= allowed)
    )
    if not ok:
        what = "0 and/or 1" if allowed else "non-negative integers"
        raise InputError(
            path,
            None,
            f"key 'config_matrix.{key}' must be a list of distinct {what}",
            "fix or remove config.json",
        )
    return value


def _stray(path: Path, expected: str) -> InputError:
    return InputError(
        path,
        None,
        f"unexpected name here (expected {expected})",
        f"move it out of the tree; the layout is {LAYOUT}",
    )


SEED_KV_ALIGNED = [1, 0]
SEED_SEEDS = [0, 1, 2]


def expected_pairs(
    root: str | Path, seeds: list[int] | None = None
) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """The pairs a tree must hold, in matrix order, and the matrix they come from.

    config.json's config_matrix says which; without it, the seed's matrix (kv_aligned 1 and 0,
    seeds 0 1 2). `seeds` (analyze --seeds) replaces the seed list either way.
    """
    root = Path(root)
    config = read_config(root) or {}
    cfg_path = root / "config.json"
    matrix = dict(config.get("config_matrix") or {})
    if "kv_aligned" in matrix:
        kv = _int_list(config, "kv_aligned", {0, 1}, cfg_path)
    else:
        kv = list(SEED_KV_ALIGNED)
    seed_key = next((key for key in ("seeds", "seed") if key in matrix), None)
    if seeds is not None:
        wanted = list(seeds)
    elif seed_key:
        wanted = _int_list(config, seed_key, None, cfg_path)
    else:
        wanted = list(SEED_SEEDS)
    matrix.pop("seed", None)
    matrix.update(kv_aligned=kv, seeds=wanted)
    return [(k, n) for k in kv for n in wanted], matrix


def check_layout(root: str | Path, expected: list[tuple[int, int]]) -> None:
    """Every name under runs/ is part of the layout, and every pair present is expected."""
    root = Path(root)
    runs = root / "runs"
    if not runs.is_dir():
        raise InputError(runs, None, "no runs/ directory", f"point at a B3.67 tree: {LAYOUT}")
    wanted = set(expected)
    for kv_dir in sorted(runs.iterdir()):
        match = _KV_DIR.fullmatch(kv_dir.name)
        if not match or not kv_dir.is_dir():
            raise _stray(kv_dir, "kv_aligned_0 or kv_aligned_1 directories")
        k = int(match.group(1))
        for seed_dir in sorted(kv_dir.iterdir()):
            seed = _SEED_DIR.fullmatch(seed_dir.name)
            if not seed or not seed_dir.is_dir():
                raise _stray(seed_dir, "seed_<n> directories")
            if (k, int(seed.group(1))) not in wanted:
                raise InputError(
                    seed_dir,
                    None,
                    "a pair outside the matrix being judged "
                    f"(kv_aligned {sorted({p[0] for p in wanted})}, "
                    f"seeds {sorted({p[1] for p in wanted})})",
                    "move it out, list it in config.json's config_matrix, or pass --seeds",
                )
            for entry in sorted(seed_dir.iterdir()):
                if entry.name not in MODES or not entry.is_dir():
                    raise _stray(entry, "the prefill and decode directories")


def _run_date(root: Path, config: dict[str, Any] | None) -> str:
    if config and isinstance(config.get("date"), str):
        return config["date"]
    for name in (root.name, root.parent.name):
        if _DATE.fullmatch(name):
            return name
    return datetime.now(UTC).strftime("%Y-%m-%d")


def _derived_matrix(results: list[PairResult]) -> dict[str, Any]:
    return {
        "dtype": sorted({r.dtype for r in results}),
        "prompt_len": sorted({r.prompt_len for r in results}),
        "gen_len": sorted({r.gen_len for r in results}),
    }


def _check_claimed_matrix(
    path: Path, claimed: dict[str, Any], results: list[PairResult], unjudged: list[Unjudged]
) -> None:
    """config.json's config_matrix against what the pairs' metadata.json say: the summary and
    report show the matrix, so one that contradicts the runs is refused (InputError), never
    shown as what was judged."""
    for key, have in _derived_matrix(results).items():
        if key not in claimed:
            continue
        said = claimed[key]
        kind = str if key == "dtype" else int
        if type(said) is not list or not all(type(v) is kind for v in said):
            what = "strings" if kind is str else "integers"
            raise InputError(
                path, None, f"key 'config_matrix.{key}' must be a list of {what}", "fix or remove config.json"
            )  # fmt: skip
        missing = sorted(set(have) - set(said))
        extra = sorted(set(said) - set(have)) if not unjudged else []
        if missing or extra:
            raise InputError(
                path,
                None,
                f"key 'config_matrix.{key}' says {said} but the pairs' metadata.json say "
                f"{have}: a matrix the runs contradict is not shown as what was judged",
                "fix config.json (or remove its config_matrix: it is then read from the runs)",
            )


@dataclass
class TreeJudgement:
    """Every pair of a tree's matrix judged, or named with why it could not be."""

    results: list[PairResult]
    unjudged: list[Unjudged]
    config: dict[str, Any]
    config_matrix: dict[str, Any]
    thresholds: dict[str, float]
    date: str
    notes: list[str]


def tree_thresholds(
    root: Path, given: dict[str, float] | None, config: dict[str, Any]
) -> tuple[dict[str, float], list[str]]:
    """The thresholds to judge with, and notes: config.json may tighten, never loosen.
    Thresholds given (analyze --threshold) replace only the keys they name: the others stay the
    tree's own, so one stricter threshold never drops another that config.json tightened."""
    if "thresholds" not in config:
        return resolve_thresholds(given), []
    try:
        wanted = resolve_thresholds(config["thresholds"])
    except (ValueError, AttributeError) as exc:
        raise InputError(
            root / "config.json", None, f"key 'thresholds': {exc}", "fix or remove config.json"
        ) from None
    loose = loosened(wanted)
    used = {k: (THRESHOLDS[k] if k in loose else v) for k, v in wanted.items()}
    named = resolve_thresholds(given)
    used.update({k: named[k] for k in given or {}})
    notes = [
        f"config.json's thresholds.{k} ({v['used']:g}) is looser than the seed's "
        f"({v['seed']:g}); the seed's is used (a tree never loosens its own guardrail)"
        for k, v in loose.items()
        if k not in (given or {})
    ]
    return used, notes


def judge_tree(
    root: str | Path,
    thresholds: dict[str, float] | None = None,
    date: str | None = None,
    seeds: list[int] | None = None,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> TreeJudgement:
    """Judges every pair of a B3.67 tree's matrix; a pair that cannot be judged is named.

    Thresholds come from the argument, else config.json's where they are stricter than the
    seed's, else the seed's. A malformed layout (stray names, no runs/) raises InputError.
    With workers >= 2, pairs are judged that many at a time in processes of their own (one
    pair alone: its two sides at once); the results are the same, in the same order.
    progress(pairs judged, pairs in all) is called as each pair ends.
    """
    root = Path(root)
    expected, matrix = expected_pairs(root, seeds)
    check_layout(root, expected)
    config = read_config(root) or {}
    resolved, notes = tree_thresholds(root, thresholds, config)
    results: list[PairResult] = []
    unjudged: list[Unjudged] = []
    for (k, n), outcome in zip(
        expected, _judge_pairs(root, expected, resolved, workers, progress), strict=True
    ):
        if isinstance(outcome, InputError):
            unjudged.append(Unjudged(k, n, "input", str(outcome)))
        else:
            results.append(outcome)
    if "config_matrix" not in config:
        matrix = {**_derived_matrix(results), **matrix}
    else:
        _check_claimed_matrix(root / "config.json", config["config_matrix"], results, unjudged)
    return TreeJudgement(
        results, unjudged, config, matrix, resolved, date or _run_date(root, config), notes
    )


def _judge_pairs(
    root: Path,
    pairs: list[tuple[int, int]],
    thresholds: dict[str, float],
    workers: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[PairResult | InputError]:
    """Each pair's result, or the InputError that stopped it, in the order given;
    progress(pairs done, pairs) as each one ends."""
    total = len(pairs)
    if workers < 2 or total < 2:
        out: list[PairResult | InputError] = []
        for k, n in pairs:
            out.append(_judge_or_error(root, k, n, thresholds, workers))
            if progress is not None:
                progress(len(out), total)
        return out
    context = multiprocessing.get_context("spawn")  # no lock shared with the caller's threads
    with ProcessPoolExecutor(min(workers, total), mp_context=context) as pool:
        jobs = [pool.submit(_judge_or_error, root, k, n, thresholds, 1) for k, n in pairs]
        for done, _ in enumerate(as_completed(jobs), start=1):
            if progress is not None:
                progress(done, total)
        return [job.result() for job in jobs]


def _judge_or_error(
    root: Path, kv_aligned: int, seed: int, thresholds: dict[str, float], workers: int
) -> PairResult | InputError:
    try:
        return judge_pair(root, kv_aligned, seed, thresholds, workers)
    except InputError as exc:
        return exc


def load_pair_result(root: str | Path, kv_aligned: int, seed: int) -> PairResult:
    """A pair judged earlier, rebuilt from its metrics file (a reattached run's summary)."""
    path = metrics_path(root, kv_aligned, seed)
    try:
        doc = json.loads(path.read_text())
        return PairResult(
            seed=int(doc["seed"]),
            kv_aligned=int(doc["kv_aligned"]),
            dtype=str(doc["dtype"]),
            prompt_len=int(doc["prompt_len"]),
            gen_len=int(doc["gen_len"]),
            pair_count=int(doc["pair_count"]),
            metrics=dict(doc["metrics"]),
            verdict=str(doc["verdict"]),
            thresholds=dict(doc["thresholds"]),
            first_fail=doc["first_fail"],
            diverged_at_token=doc.get("diverged_at_token"),
            tokens=dict(doc.get("tokens") or {}),
            precision=doc.get("precision"),
        )
    except FileNotFoundError:
        raise InputError(
            str(path),
            None,
            "metrics file is missing",
            "rerun `tracedeck analyze` on the run directory",
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(
            str(path),
            None,
            f"not a metrics.json of section 2.2 ({exc})",
            "rerun `tracedeck analyze` on the run directory",
        ) from None
