"""B3.67 on the host: judge one pair of the tree in the current directory; say its metrics.

    python -I -c BOOT JUDGE_DIR MANIFEST runners.hosted.equivalence --kv K --seed N
        --thresholds JSON [--workers W]            (runners/hosted/boot.py; runners/remote_judge)

Prints one JSON line on stdout, the console's channel: {"ok": true, "document": METRICS} with
the seed section 2.2 metrics document, or {"ok": false, "error": MESSAGE} (exit 2) when the
pair cannot be judged (the message names the file and line, as `tracedeck analyze` would).
Nothing is written on the host: the console checks the document, recomputes its verdict and
writes the metrics file itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from analysis.equivalence import PairResult, metrics_document
from analysis.equivalence_tree import judge_pair, metrics_path
from analysis.logits import InputError
from runners.atomic import write_atomic


def write_pair_metrics(root: Path, result: PairResult, hosts: dict[str, str] | None = None) -> Path:
    """The pair's metrics file (seed section 2.2) under root; the one writer, console or host.

    hosts: the fleet host that ran each side (mode -> host), written beyond section 2.2."""
    path = metrics_path(root, result.kv_aligned, result.seed)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = metrics_document(result, stamp)
    if hosts:
        doc["hosts"] = dict(hosts)
    write_atomic(path, json.dumps(doc, indent=2, allow_nan=False, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--thresholds", type=json.loads, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    root = Path.cwd()
    try:
        result = judge_pair(root, args.kv, args.seed, args.thresholds, args.workers)
    except InputError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 2
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = metrics_document(result, stamp)
    print(json.dumps({"ok": True, "document": doc}, allow_nan=False, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
