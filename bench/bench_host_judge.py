"""Bytes over the link for a full-size B3.67 run: judged on the host vs judged on the console.

    python bench/bench_host_judge.py [--pairs 1] [--tokens 128] [--vocab 128256]

A stand-in engine writes full-size logits (TOKENS x VOCAB float32 as JSON, gzip level 1: about
80 MB a side at the defaults) for each side of each pair, on a real OpenSSH sshd on loopback
reached through a counting TCP proxy. The same preset runs twice in this process: judged on the
host ([judge] on = "host") and judged on the console ([judge] on = "console", the baseline:
every logits file comes home). Prints the bytes through the proxy each way, the logits bytes the
run wrote, the share of them that crossed the link, the verdicts (the same) and the times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from runhelp import cli_env, run_dirs  # noqa: E402
from sshd import CuttableProxy, make_ssh_home, start_sshd  # noqa: E402

ENGINE = """
import gzip, json, os, sys
import numpy as np, orjson
mode, kv, seed, tokens, vocab, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(seed)
ids = []
with gzip.open(os.path.join(out, "logits.jsonl.gz"), "wb", compresslevel=1) as fh:
    for t in range(tokens):
        row = rng.normal(0, 3, vocab).astype(np.float32)
        if mode == "decode":
            row = row + np.float32(1e-5) * np.random.default_rng(1000 + t).normal(0, 1, vocab).astype(np.float32)
        tid = int(np.argmax(row))
        fh.write(orjson.dumps({"token_idx": t, "token_id": tid, "logits": row}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\\n")
meta = {"dtype": "bf16", "prompt_len": 512, "gen_len": tokens, "seed": seed, "kv_aligned": kv, "mode": mode}
open(os.path.join(out, "metadata.json"), "w").write(json.dumps(meta))
"""

PRESET = """
[preset]
name = "b3_67_full"
kind = "equivalence"

[target]
python = "{python}"
runs = "{tmp}/remote"
lock = "{tmp}/lock"

[engine]
command = "{{python}} {engine} {{mode}} {{kv_aligned}} {{seed}} {tokens} {vocab} {{out}}/runs/kv_aligned_{{kv_aligned}}/seed_{{seed}}/{{mode}}"

[matrix]
kv_aligned = [1]
seed = {seeds}
mode = ["prefill", "decode"]

[artifacts]
fetch = [
    "runs/kv_aligned_{{kv_aligned}}/seed_{{seed}}/{{mode}}/logits.jsonl.gz",
    "runs/kv_aligned_{{kv_aligned}}/seed_{{seed}}/{{mode}}/metadata.json",
]
"""


def run(proxy: CuttableProxy, env: dict[str, str], preset: Path, out: Path, on: str) -> dict:
    up, down = proxy.bytes_up, proxy.bytes_down
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "console.cli", "run", str(preset), "--target", proxy.spec]
        + ["--out", str(out), "--set", f'judge.on="{on}"'],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    took = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"judge on {on}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    local = run_dirs(out)[0]
    summary = json.loads((local / "summary.json").read_text())
    return {
        "up": proxy.bytes_up - up,
        "down": proxy.bytes_down - down,
        "seconds": took,
        "verdict": summary["global_verdict"],
        "metrics": summary.get("first_fail"),
        "remote": json.loads((local / "run.json").read_text())["remote_dir"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="td-hostjudge-") as name:
        tmp = Path(name)
        engine = tmp / "engine.py"
        engine.write_text(ENGINE)
        preset = tmp / "full.toml"
        preset.write_text(
            PRESET.format(
                python=sys.executable,
                tmp=tmp,
                engine=engine,
                tokens=args.tokens,
                vocab=args.vocab,
                seeds=list(range(args.pairs)),
            )
        )
        server = start_sshd(tmp / "sshd")
        home = make_ssh_home(server, tmp / "home")
        proxy = CuttableProxy(server.host, server.port).start()
        with home.known_hosts.open("a") as fh:
            fh.write(server.known_hosts_line(proxy.port))
        env = cli_env(home.path)
        env.pop("SSH_AUTH_SOCK", None)
        try:
            host = run(proxy, env, preset, tmp / "out-host", "host")
            console = run(proxy, env, preset, tmp / "out-console", "console")
        finally:
            proxy.stop()
            server.stop()
        logits = sum(
            p.stat().st_size for p in (Path(host["remote"]) / "artifacts").rglob("logits.jsonl.gz")
        )
    mib = 1 << 20
    print(
        f"{args.pairs} pair(s) of {args.tokens} x {args.vocab} logits: "
        f"{logits / mib:.1f} MiB of logits.jsonl.gz written on the host"
    )
    for name, r in (("judged on the host", host), ("judged on the console", console)):
        total = r["up"] + r["down"]
        print(
            f"{name:<22} {total / mib:9.2f} MiB over the link ({r['down'] / mib:.2f} down, "
            f"{r['up'] / mib:.2f} up) = {100 * total / logits:6.2f}% of the logits; "
            f"{r['seconds']:.1f} s; {r['verdict']}"
        )
    same = host["verdict"] == console["verdict"] and host["metrics"] == console["metrics"]
    ratio = (console["up"] + console["down"]) / max(1, host["up"] + host["down"])
    print(f"bytes console / host: {ratio:.0f}x; same verdict and first fail: {same}")
    share = (host["up"] + host["down"]) / logits
    print(f"host judging moved {100 * share:.2f}% of the logits bytes (goal: under 1%)")
    return 0 if same and share < 0.01 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
