"""Reads and judges a B3.67 artifact tree (seed section 1 layout); writes nothing.

ROOT/runs/kv_aligned_{k}/seed_{n}/{prefill,decode}/{logits.jsonl.gz,metadata.json} is read, with
ROOT/config.json when present. The documents to write (metrics/, summary.json, the report) are
returned for the caller to write.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from analysis.equivalence import (
    PairResult,
    compare_files,
    resolve_thresholds,
)
from analysis.logits import InputError, read_metadata

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
) -> PairResult:
    """Judges one pair from the tree; returns the result (the caller writes its metrics file)."""
    base = pair_dir(root, kv_aligned, seed)
    logits: dict[str, Path] = {}
    meta: dict[str, dict[str, Any]] = {}
    meta_path: dict[str, Path] = {}
    for mode in MODES:
        logits[mode], meta_path[mode] = _side_files(base / mode, mode)
        meta[mode] = read_metadata(meta_path[mode])
        expected = {"seed": seed, "kv_aligned": kv_aligned, "mode": mode}
        for key, want in expected.items():
            if meta[mode][key] != want:
                raise InputError(
                    meta_path[mode],
                    None,
                    f"'{key}' is {meta[mode][key]!r} but the directory says {want!r}",
                    "the file is in the wrong place, or the runner wrote the wrong metadata",
                )
    for key in ("dtype", "prompt_len", "gen_len"):
        if meta["prefill"][key] != meta["decode"][key]:
            raise InputError(
                meta_path["decode"],
                None,
                f"'{key}' is {meta['decode'][key]!r} here but {meta['prefill'][key]!r} in "
                f"{meta_path['prefill']}: the two sides did not run the same configuration",
                "re-run the pair with one configuration",
            )
    result = compare_files(
        logits["prefill"],
        logits["decode"],
        seed=seed,
        kv_aligned=kv_aligned,
        dtype=meta["prefill"]["dtype"],
        prompt_len=meta["prefill"]["prompt_len"],
        gen_len=meta["prefill"]["gen_len"],
        thresholds=thresholds,
    )
    return result


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


def discover_pairs(root: str | Path) -> list[tuple[int, int]]:
    """(kv_aligned, seed) of every pair in matrix order, after checking the whole layout."""
    root = Path(root)
    runs = root / "runs"
    if not runs.is_dir():
        raise InputError(runs, None, "no runs/ directory", f"point at a B3.67 tree: {LAYOUT}")
    config = read_config(root)
    cfg_path = root / "config.json"
    matrix = (config or {}).get("config_matrix") or {}
    kv_found: list[int] = []
    for entry in sorted(runs.iterdir()):
        match = _KV_DIR.fullmatch(entry.name)
        if not match or not entry.is_dir():
            raise _stray(entry, "kv_aligned_0 or kv_aligned_1 directories")
        kv_found.append(int(match.group(1)))
    if not kv_found:
        raise InputError(runs, None, "empty runs/ tree: no pair to judge", f"layout: {LAYOUT}")
    if "kv_aligned" in matrix:
        order = _int_list(config or {}, "kv_aligned", {0, 1}, cfg_path)
        for k in order:
            if k not in kv_found:
                raise InputError(
                    runs / f"kv_aligned_{k}",
                    None,
                    "missing, but config.json lists it",
                    "run or fetch those pairs, or fix config.json",
                )
        for k in kv_found:
            if k not in order:
                raise InputError(
                    runs / f"kv_aligned_{k}",
                    None,
                    "not in config.json's kv_aligned list",
                    "move it out of the tree, or fix config.json",
                )
    else:
        order = sorted(kv_found, reverse=True)
    seed_key = next((key for key in ("seeds", "seed") if key in matrix), None)
    wanted = _int_list(config or {}, seed_key, None, cfg_path) if seed_key else None
    pairs: list[tuple[int, int]] = []
    for k in order:
        kv_dir = runs / f"kv_aligned_{k}"
        seeds: list[int] = []
        for entry in sorted(kv_dir.iterdir()):
            match = _SEED_DIR.fullmatch(entry.name)
            if not match or not entry.is_dir():
                raise _stray(entry, "seed_<n> directories")
            seeds.append(int(match.group(1)))
        if not seeds:
            raise InputError(kv_dir, None, "no seed_<n> directories", "run or fetch the pairs")
        for n in wanted or []:
            if n not in seeds:
                raise InputError(
                    kv_dir / f"seed_{n}",
                    None,
                    "missing, but config.json lists this seed",
                    "run or fetch the pair, or fix config.json",
                )
        for n in sorted(seeds):
            seed_dir = kv_dir / f"seed_{n}"
            if wanted is not None and n not in wanted:
                raise InputError(
                    seed_dir,
                    None,
                    "not in config.json's seed list",
                    "move it out of the tree, or fix config.json",
                )
            for entry in sorted(seed_dir.iterdir()):
                if entry.name not in MODES or not entry.is_dir():
                    raise _stray(entry, "the prefill and decode directories")
            for mode in MODES:
                _side_files(seed_dir / mode, mode)
            pairs.append((k, n))
    return pairs


def _run_date(root: Path, config: dict[str, Any] | None) -> str:
    if config and isinstance(config.get("date"), str):
        return config["date"]
    for name in (root.name, root.parent.name):
        if _DATE.fullmatch(name):
            return name
    return datetime.now(UTC).strftime("%Y-%m-%d")


def _derived_matrix(order: list[int], results: list[PairResult]) -> dict[str, Any]:
    return {
        "kv_aligned": order,
        "dtype": sorted({r.dtype for r in results}),
        "prompt_len": sorted({r.prompt_len for r in results}),
        "gen_len": sorted({r.gen_len for r in results}),
        "seeds": sorted({r.seed for r in results}),
    }


@dataclass
class TreeJudgement:
    """Every pair of a tree judged, with what its summary needs."""

    results: list[PairResult]
    config: dict[str, Any]
    config_matrix: dict[str, Any]
    thresholds: dict[str, float]
    date: str


def judge_tree(
    root: str | Path,
    thresholds: dict[str, float] | None = None,
    date: str | None = None,
) -> TreeJudgement:
    """Judges every pair of a B3.67 tree.

    Thresholds come from the argument, else config.json's "thresholds", else the seed's.
    """
    root = Path(root)
    pairs = discover_pairs(root)
    config = read_config(root)
    if thresholds is None and config and "thresholds" in config:
        try:
            thresholds = resolve_thresholds(config["thresholds"])
        except (ValueError, AttributeError) as exc:
            raise InputError(
                root / "config.json", None, f"key 'thresholds': {exc}", "fix or remove config.json"
            ) from None
    resolved = resolve_thresholds(thresholds)
    results = [judge_pair(root, k, n, resolved) for k, n in pairs]
    order = list(dict.fromkeys(k for k, _ in pairs))
    matrix = (config or {}).get("config_matrix") or _derived_matrix(order, results)
    return TreeJudgement(results, config or {}, matrix, resolved, date or _run_date(root, config))


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
