"""Benchmark: tracedeck's B3.67 analyzer against a literal seed-section-8 implementation and
against the floor of this machine, all measured in the same run.

Writes one pair of TOKENS x VOCAB logits.jsonl.gz files (float32 logits with a realistic
spread; decode = prefill + small noise) in a temporary B3.67 tree, and a 6-pair tree of hard
links to it. Then, each in a fresh child process (numpy loaded as the tracedeck program loads
it) that reports its wall time, CPU time (user + sys, all threads, its helper processes
included) and peak RSS: the literal section 8 analyzer (json.loads and np.array per
line); tracedeck on the pair with 1 worker and with 2 (the decode side read by a second
process); tracedeck on the 6-pair tree with 1 worker and with 2 (pairs in a pool); and the
floor: both files inflated with ISA-L on two threads, and one file's lines parsed by orjson
alone. Prints the ratios the issue asks for and checks that tracedeck and the literal analyzer
agree on every metric.

Run: python bench/bench_analyzer.py [--tokens 128] [--vocab 128256] [--repeat 1]
(CPU-bound: run it on an otherwise idle machine; the ratios are of the same run.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- data


def write_pair(root: Path, tokens: int, vocab: int, noise: float, seed: int = 0) -> None:
    """A kv_aligned=1, seed_0 pair in the seed section 1 layout."""
    rng = np.random.default_rng(seed)
    base = root / "runs" / "kv_aligned_1" / "seed_0"
    sides = {mode: base / mode for mode in ("prefill", "decode")}
    files: dict[str, Any] = {}
    for mode, side in sides.items():
        side.mkdir(parents=True)
        meta = {
            "dtype": "bf16",
            "prompt_len": 512,
            "gen_len": tokens,
            "seed": 0,
            "kv_aligned": 1,
            "mode": mode,
            "timestamp": "2026-02-07T20:00:00Z",
        }
        (side / "metadata.json").write_text(json.dumps(meta, indent=2))
        # Level 1 keeps generation quick; inflate speed hardly depends on the level.
        files[mode] = gzip.open(side / "logits.jsonl.gz", "wb", compresslevel=1)  # noqa: SIM115
    opt = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
    try:
        for i in range(tokens):
            # Logit-like rows: a broad body, a long upper tail, a few clear favourites.
            row = rng.normal(-2.0, 2.5, vocab).astype(np.float32)
            row[rng.integers(0, vocab, 8)] += rng.uniform(6.0, 14.0, 8).astype(np.float32)
            other = row + rng.normal(0.0, noise, vocab).astype(np.float32)
            token_id = int(np.argmax(row))
            for mode, values in (("prefill", row), ("decode", other)):
                line = {"token_idx": i, "token_id": token_id, "logits": values}
                files[mode].write(orjson.dumps(line, option=opt))
    finally:
        for fh in files.values():
            fh.close()


# ---------------------------------------------------------------- the literal baseline


def literal_load_logits(path: str) -> tuple[np.ndarray, list[int]]:
    rows, ids = [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            obj = json.loads(line)
            rows.append(np.array(obj["logits"]))
            ids.append(obj["token_id"])
    return np.array(rows), ids


def max_abs_diff(logits_a: Any, logits_b: Any) -> float:
    diffs = np.abs(np.array(logits_a) - np.array(logits_b))
    return float(np.max(diffs))


def p99_abs_diff(logits_a: Any, logits_b: Any) -> float:
    diffs = np.abs(np.array(logits_a) - np.array(logits_b))
    return float(np.percentile(diffs, 99))


def top1_agreement(logits_a: Any, logits_b: Any) -> float:
    argmax_a = np.argmax(logits_a)
    argmax_b = np.argmax(logits_b)
    return float(argmax_a == argmax_b)


def cos_sim_mean(logits_a: Any, logits_b: Any) -> float:
    a = np.array(logits_a)
    b = np.array(logits_b)
    cos_sim = np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))
    return float(cos_sim)


PAIRS = 6


def write_tree(root: Path, pairs: int) -> None:
    """tree/: `pairs` seeds of kv_aligned_1, each side a hard link to the pair's file."""
    pair = root / "runs" / "kv_aligned_1" / "seed_0"
    for seed in range(pairs):
        for mode in ("prefill", "decode"):
            side = root / "tree" / "runs" / "kv_aligned_1" / f"seed_{seed}" / mode
            side.mkdir(parents=True)
            os.link(pair / mode / "logits.jsonl.gz", side / "logits.jsonl.gz")
            meta = json.loads((pair / mode / "metadata.json").read_text())
            (side / "metadata.json").write_text(json.dumps({**meta, "seed": seed}))
    config = {"config_matrix": {"kv_aligned": [1], "seeds": list(range(pairs))}}
    (root / "tree" / "config.json").write_text(json.dumps(config))


def literal_judge(root: Path) -> dict[str, float]:
    base = root / "runs" / "kv_aligned_1" / "seed_0"
    a, ids_a = literal_load_logits(str(base / "prefill" / "logits.jsonl.gz"))
    b, ids_b = literal_load_logits(str(base / "decode" / "logits.jsonl.gz"))
    assert ids_a == ids_b, "token ids do not pair"
    return {
        "max_abs_diff": max_abs_diff(a, b),
        "p99_abs_diff": p99_abs_diff(a, b),
        "top1_agreement": float(np.mean([top1_agreement(x, y) for x, y in zip(a, b, strict=True)])),
        "cos_sim_mean": float(np.mean([cos_sim_mean(x, y) for x, y in zip(a, b, strict=True)])),
    }


def tracedeck_judge(root: Path, workers: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO))
    from analysis.equivalence_tree import judge_pair

    return judge_pair(root, 1, 0, workers=workers).metrics


def tracedeck_tree(root: Path, workers: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO))
    from analysis.equivalence_tree import judge_tree

    judged = judge_tree(root, workers=workers)
    assert not judged.unjudged, judged.unjudged
    return judged.results[0].metrics


def floor_inflate(root: Path) -> dict[str, float]:
    """Both files inflated at once on two threads with ISA-L (it releases the GIL)."""
    import threading

    from isal import isal_zlib

    def inflate(path: Path) -> None:
        isal_zlib.decompressobj(31).decompress(path.read_bytes())

    pair = sorted((root / "runs").rglob("logits.jsonl.gz"))
    threads = [threading.Thread(target=inflate, args=(p,)) for p in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {}


def floor_parse(root: Path) -> dict[str, float]:
    """orjson.loads of one file's lines (inflated before the clock starts)."""
    path = next((root / "runs").rglob("logits.jsonl.gz"))
    lines = gzip.decompress(path.read_bytes()).splitlines()
    start = time.perf_counter()
    for line in lines:
        orjson.loads(line)
    return {"parse_s": time.perf_counter() - start}


# ---------------------------------------------------------------- children


def _cpu_s() -> float:
    """This process's CPU time and its ended children's (a side reader, a pool of pairs)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def child(which: str, root: Path) -> None:
    start, cpu = time.perf_counter(), _cpu_s()
    judges = {
        "literal": lambda: literal_judge(root),
        "pair, 1 worker": lambda: tracedeck_judge(root, 1),
        "pair, 2 workers": lambda: tracedeck_judge(root, 2),
        "tree, 1 worker": lambda: tracedeck_tree(root / "tree", 1),
        "tree, 2 workers": lambda: tracedeck_tree(root / "tree", 2),
        "floor: inflate": lambda: floor_inflate(root),
        "floor: parse": lambda: floor_parse(root),
        "none": dict,
    }
    metrics = judges[which]()
    wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
    if "parse_s" in metrics:
        wall = metrics.pop("parse_s")  # the parse alone, not the inflate before it
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    report = {"wall_s": wall, "cpu_s": cpu, "peak_rss_mib": peak_kib / 1024, "metrics": metrics}
    print(json.dumps(report))


def run_child(which: str, root: Path) -> dict[str, Any]:
    # Each child loads numpy as the tracedeck program does (console/quiet_blas.py): without
    # OpenBLAS's pool, whose threads spin ~0.1 s of CPU at load; no child multiplies matrices.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, str(root)],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--noise", type=float, default=1e-4)
    parser.add_argument("--repeat", type=int, default=1, help="runs per judge; best is kept")
    parser.add_argument("--child", nargs=2, metavar=("WHICH", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="bench_b367_"))
    try:
        start = time.perf_counter()
        write_pair(tmp, args.tokens, args.vocab, args.noise)
        sizes = [p.stat().st_size for p in tmp.rglob("logits.jsonl.gz")]
        print(
            f"pair: {args.tokens} tokens x {args.vocab} vocab, 2 files, "
            f"{sum(sizes) / 2**20:.1f} MiB gzip, written in {time.perf_counter() - start:.1f} s"
        )
        write_tree(tmp, PAIRS)
        floor = run_child("none", tmp)
        names = [
            "literal",
            "pair, 1 worker",
            "pair, 2 workers",
            "tree, 1 worker",
            "tree, 2 workers",
            "floor: inflate",
            "floor: parse",
        ]
        runs: dict[str, list[dict[str, Any]]] = {which: [] for which in names}
        for _ in range(args.repeat):
            for which in runs:
                runs[which].append(run_child(which, tmp))
        best = {which: min(rs, key=lambda r: r["wall_s"]) for which, rs in runs.items()}
        ours, lit = best["pair, 2 workers"], best["literal"]
        cpus = len(os.sched_getaffinity(0))
        print(f"cpus available: {cpus}; load average: {os.getloadavg()[0]:.2f}")
        print(f"peak RSS of an import-only child: {floor['peak_rss_mib']:.0f} MiB")
        print(f"{'judge':<16} {'wall s':>8} {'cpu s':>7} {'peak RSS MiB':>13}   all walls")
        for which in runs:
            walls = ", ".join(f"{r['wall_s']:.2f}" for r in runs[which])
            b = best[which]
            print(
                f"{which:<16} {b['wall_s']:>8.2f} {b['cpu_s']:>7.2f} {b['peak_rss_mib']:>13.0f}"
                f"   [{walls}]"
            )
        # The floor for a pair: both files inflated (ISA-L, two threads), plus one
        # file's lines parsed by orjson (the sides are parsed at once, one per core).
        pair_floor = best["floor: inflate"]["wall_s"] + best["floor: parse"]["wall_s"]
        one = best["pair, 1 worker"]["wall_s"]
        print(f"pair floor (inflate both + parse one): {pair_floor:.2f} s")
        print(f"speed ratio literal / pair (2 workers): {lit['wall_s'] / ours['wall_s']:.2f}x")
        print(f"speed ratio literal / pair (1 worker):  {lit['wall_s'] / one:.2f}x")
        print(f"pair (2 workers) / floor: {ours['wall_s'] / pair_floor:.2f}x")
        tree1, tree2 = best["tree, 1 worker"]["wall_s"], best["tree, 2 workers"]["wall_s"]
        print(f"tree of {PAIRS} pairs, 1 worker / 2 workers: {tree1 / tree2:.2f}x")
        print(f"cpu ratio (literal / pair, all processes): {lit['cpu_s'] / ours['cpu_s']:.2f}x")
        above = (lit["peak_rss_mib"] - floor["peak_rss_mib"]) / max(
            ours["peak_rss_mib"] - floor["peak_rss_mib"], 1e-9
        )
        print(
            "memory ratio (literal / tracedeck peak RSS): "
            f"{lit['peak_rss_mib'] / ours['peak_rss_mib']:.2f}x (above the import floor: "
            f"{above:.2f}x)"
        )
        # The literal judge parses the text to float64, tracedeck to float32 (seed section 4:
        # normalise to float32), so |Δ| may differ by about one float32 ulp of the logits.
        ulp = float(np.spacing(np.float32(16.0)))
        tolerances = {"max_abs_diff": 2 * ulp, "p99_abs_diff": 2 * ulp, "top1_agreement": 0.0}
        tolerances["cos_sim_mean"] = 1e-6
        agree = True
        for key, tol in tolerances.items():
            a, b = ours["metrics"][key], lit["metrics"][key]
            ok = abs(a - b) <= tol
            agree &= ok
            print(f"  {key:<15} tracedeck {a:.9g}  literal {b:.9g}  {'ok' if ok else 'DIFFER'}")
        print("metrics agree" if agree else "METRICS DISAGREE")
        return 0 if agree else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
