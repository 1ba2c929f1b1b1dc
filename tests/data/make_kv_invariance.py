"""Writes the 03C fixtures (run: python tests/data/make_kv_invariance.py).

kv_invariance_run/: a recorded run of the acceptance grid (96 cells) as the console replays it:
every cell BITWISE_EQUAL except d=128 kv=1024 b=8 gqa=2 mask=1 alibi=1 (DIFFERS, with a first
differing element), d=256 kv=256 b=1 gqa=1 mask=1 alibi=0 (PRECONDITION) and d=256 kv=1024 b=8
gqa=2 mask=0 alibi=1 (UNJUDGED: the engine was killed); FAIL_INVARIANCE, exit 1.
kv_invariance_llamacpp/: output of llama.cpp's tests/test-kvcache-invariance written by hand from
the test's source (ggml-org/llama.cpp PR #16016): every line it prints, in its order, with the
incremental graphs cut to a few steps per cell (the parser needs only the single-shot ones).
Times are fixed so the screens built from these runs are the same on every machine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from analysis.kv_invariance import (  # noqa: E402
    BITWISE_EQUAL,
    DIFFERS,
    PRECONDITION,
    UNJUDGED,
    point_dir,
)
from runners.events import (  # noqa: E402
    ArtifactFetched,
    CellFinished,
    CellStarted,
    Event,
    LockAcquired,
    OutputLines,
    RunFinished,
    RunStarted,
)
from runners.kinds.kv_invariance import KvCellVerdict  # noqa: E402

HERE = Path(__file__).resolve().parent
T0 = 1_780_000_000.0
RUN_ID = "20260528-210000-kv_invariance-0003"
FLOWS = ["single", "incremental", "chunk8", "chunk33"]
DIFFERS_AT = {"d": 128, "kv": 1024, "b": 8, "gqa": 2, "mask": 1, "alibi": 1, "sinks": 0}
PRECONDITION_AT = {"d": 256, "kv": 256, "b": 1, "gqa": 1, "mask": 1, "alibi": 0, "sinks": 0}
KILLED_AT = {"d": 256, "kv": 1024, "b": 8, "gqa": 2, "mask": 0, "alibi": 1, "sinks": 0}
RULE = {
    "rule": "kv_stride_256",
    "message": "the KV length presented to attention is 237, not a multiple of FATTN_KQ_STRIDE "
    "(256)",
    "fix": "pad the KV view to 256 (a KV cache of a multiple of 256 cells, the tail masked with "
    "-inf), or enable deterministic mode (GGML_DETERMINISTIC=1), which pads it",
    "where": "flow single, step at positions 0..236 (view 237)",
}


def grid() -> list[dict[str, int]]:
    return [
        {"d": d, "kv": kv, "gqa": g, "b": b, "mask": m, "alibi": a, "sinks": 0}
        for d in (64, 128, 256)
        for kv in (256, 1024)
        for g in (1, 2)
        for b in (1, 8)
        for m in (1, 0)
        for a in (0, 1)
    ]


def params(point: dict[str, int]) -> dict[str, Any]:
    return {**point, "heads": 4, "dtype": "fp32", "seed": 0, "inject": "none"}


def verdict(index: int, point: dict[str, int], t: float) -> KvCellVerdict:
    where = f"kv_invariance/{point_dir(point)}"
    flows = FLOWS + (["alone"] if point["b"] > 1 else [])
    same = {k: point[k] for k in ("d", "kv", "b", "gqa", "mask", "alibi", "sinks")}
    if point == DIFFERS_AT:
        return KvCellVerdict(
            cell=index,
            point=same,
            verdict=DIFFERS,
            detail={
                "flows": flows,
                "dtype": "float32",
                "shape": [8, 4, 128],
                "elements": 4096,
                "first": {
                    "flows": ["single", "chunk33"],
                    "batch": 3,
                    "head": 1,
                    "index": 77,
                    "values": [0.123456791, 0.12345680594444275],
                    "abs_diff": 1.49e-08,
                    "ulp": 2,
                },
                "pairs": [
                    {
                        "flows": ["single", "chunk33"],
                        "differing": 12,
                        "max_abs_diff": 5.96e-08,
                        "max_ulp": 4,
                    }
                ],
                "differing": 12,
                "max_abs_diff": 5.96e-08,
                "max_ulp": 4,
            },
            where=where,
            t=t,
        )
    if point == PRECONDITION_AT:
        return KvCellVerdict(
            cell=index,
            point=same,
            verdict=PRECONDITION,
            detail={"rule": RULE["rule"], "fix": RULE["fix"], "at": RULE["where"]},
            reason=RULE["message"],
            where=where,
            t=t,
        )
    if point == KILLED_AT:
        return KvCellVerdict(
            cell=index,
            point=same,
            verdict=UNJUDGED,
            reason=f"cell {index + 1} ({' '.join(f'{k}={v}' for k, v in params(point).items())}): "
            "the engine crashed (exit 137)",
            klass="engine",
            t=t,
        )
    return KvCellVerdict(
        cell=index,
        point=same,
        verdict=BITWISE_EQUAL,
        detail={"flows": flows, "dtype": "float32", "shape": [point["b"], 4, point["d"]]},
        where=where,
        t=t,
    )


def recorded_run() -> None:
    points = grid()
    cells = [
        {
            "index": i,
            "params": params(p),
            "command": f"python3 -m runners.reference kv_invariance --cell {i}",
        }
        for i, p in enumerate(points)
    ]
    t = T0
    events: list[Event] = [
        RunStarted(
            run_id=RUN_ID,
            preset="kv_invariance",
            kind="kv_invariance",
            target="mi300x",
            local_dir="/home/operator/.local/share/tracedeck/runs/kv",
            remote_dir=f"/home/operator/.tracedeck/runs/{RUN_ID}",
            cells=cells,
            profile="cpu",
            env={"GGML_DETERMINISTIC": "1", "RUN_KVCACHE_CHUNK_TESTS": "1"},
            t=t,
        ),
        LockAcquired(
            lock="/tmp/tracedeck.lock",
            holder={
                "user": "operator",
                "console_host": "laptop",
                "preset": "kv_invariance",
                "run_id": RUN_ID,
                "started_at": "2026-05-28T21:00:00+00:00",
                "pgid": 4343,
            },
            t=t + 0.2,
        ),
    ]
    for i, point in enumerate(points):
        t += 1.0
        command = cells[i]["command"]
        events.append(CellStarted(cell=i, params=params(point), command=command, t=t))
        label = " ".join(f"{k}={v}" for k, v in point.items())
        events.append(
            OutputLines(
                cell=i,
                stream="stdout",
                lines=[f"kv_invariance {label}: [bold]not markup[/bold]"],
                file="stdout.log",
                end_offset=80,
                t=t + 0.3,
            )
        )
        rc = 0
        if point == PRECONDITION_AT:
            rc = 4
            events.append(
                OutputLines(
                    cell=i,
                    stream="stdout",
                    lines=["KV_INVARIANCE_PRECONDITION " + orjson.dumps(RULE).decode()],
                    file="stdout.log",
                    end_offset=400,
                    t=t + 0.4,
                )
            )
        elif point == KILLED_AT:
            rc = 137
        events.append(
            CellFinished(
                cell=i,
                state="passed" if rc == 0 else "failed",
                exit_code=rc,
                duration_s=0.8,
                t=t + 0.8,
            )
        )
        if rc == 0:
            for name in ("result.json", "flows.bin"):
                events.append(
                    ArtifactFetched(
                        cell=i,
                        path=f"kv_invariance/{point_dir(point)}/{name}",
                        size=1024,
                        sha256="cd" * 32,
                        t=t + 0.85,
                    )
                )
        events.append(verdict(i, point, t + 0.9))
    results = [e for e in events if isinstance(e, KvCellVerdict)]
    summary = {
        "benchmark": "03C KV-cache invariance",
        "date": "2026-05-28",
        "global_verdict": "FAIL_INVARIANCE",
        "reason": "1 cell(s) not bitwise equal: d=128 kv=1024 b=8 gqa=2 mask=1 alibi=1 sinks=0",
        "counts": {
            w: sum(e.verdict == w for e in results)
            for w in (BITWISE_EQUAL, DIFFERS, PRECONDITION, UNJUDGED)
        },
        "first_fail": None,
        "cells": [e.result().to_json() for e in results],
        "problems": [],
        "notes": [],
        "errors": [],
    }
    events.append(RunFinished(verdict="FAIL_INVARIANCE", exit_code=1, summary=summary, t=t + 1.5))
    folder = HERE / "kv_invariance_run"
    folder.mkdir(exist_ok=True)
    record = {
        "run_id": RUN_ID,
        "preset": "kv_invariance",
        "kind": "kv_invariance",
        "source": "presets/kv_invariance.toml",
        "overrides": [],
        "preset_data": {},
        "target": "mi300x",
        "remote_dir": f"/home/operator/.tracedeck/runs/{RUN_ID}",
        "lock": "/tmp/tracedeck.lock",
        "local_dir": "/home/operator/.local/share/tracedeck/runs/kv_invariance_run",
        "started_at": "2026-05-28T21:00:00+00:00",
        "user": "operator",
        "console_host": "laptop",
        "date": "2026-05-28",
        "extra": {"workdir": "/home/operator", "python": "python3"},
    }
    (folder / "run.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
    (folder / "events.jsonl").write_bytes(b"".join(e.to_json() + b"\n" for e in events))


# ---------------------------------------------------------------- llama.cpp's output


def cell_lines(d: int, kv: int, gqa: int, steps: int = 2) -> list[str]:
    """The [kvci] lines the test prints for one cell: the single-shot graph, then incremental
    graphs (N = 1, KV padded to 256), here the first `steps` and the last."""
    h, h_kv = 8, 8 // gqa
    lines = [f"[kvci] {t} ne=[{d},{kv},{n},1]" for t, n in (("k", h_kv), ("v", h_kv))]
    lines.insert(0, f"[kvci] q ne=[{d},{kv},{h},1]")
    for s in [*range(1, steps + 1), kv]:
        kvp = ((s + 255) // 256) * 256
        lines += [
            f"[kvci] q ne=[{d},1,{h},1]",
            f"[kvci] k ne=[{d},{kvp},{h_kv},1]",
            f"[kvci] v ne=[{d},{kvp},{h_kv},1]",
        ]
    return lines


CELLS = [(d, kv, g) for d in (128, 256) for g in (1, 2) for kv in (256, 1024)]


def backend_lines(name: str, fail_at: tuple[int, int, int] | None = None) -> list[str]:
    lines: list[str] = []
    for d, kv, g in CELLS:
        lines += cell_lines(d, kv, g)
        if (d, kv, g) == fail_at:
            lines += [
                f"[FAIL] KV invariance: backend={name} D={d} KV={kv} gqa={g}",
                f"[FAIL] {name} rc=1",
            ]
            return lines
    return [*lines, f"[OK] {name}"]


def llamacpp_logs() -> None:
    folder = HERE / "kv_invariance_llamacpp"
    folder.mkdir(exist_ok=True)
    logs = {
        # CPU only: every cell bitwise equal.
        "cpu_ok.log": [
            "load_backend: loaded CPU backend from ./build/bin/libggml-cpu.so",
            *backend_lines("CPU"),
            "Backends passed: 1",
            "[tracedeck] test-kvcache-invariance exited 0",
        ],
        # ROCm first: D=128 KV=1024 gqa=2 differs, the test stops there (exit 1). Vulkan could
        # not be initialised (a SKIP), the CPU never ran.
        "rocm_fail.log": [
            "ggml_cuda_init: found 1 ROCm devices:",
            "  Device 0: AMD Instinct MI300X, gfx942:sramecc+:xnack- (0x942), VMM: no, Wave Size: 64",
            "[SKIP] cannot init backend: Vulkan0",
            *backend_lines("ROCm0", fail_at=(128, 1024, 2)),
            "[tracedeck] test-kvcache-invariance exited 1",
        ],
        # The backend threw inside D=256 KV=256 gqa=1; the test still prints [OK] for it and
        # counts it as passed.
        "backend_error.log": [
            *[line for c in CELLS[:4] for line in cell_lines(*c)],
            *cell_lines(256, 256, 1, steps=1)[:4],
            "[SKIP] backend error: graph compute failed (flash_attn_ext)",
            "[OK] CUDA0",
            "Backends passed: 1",
            "[tracedeck] test-kvcache-invariance exited 0",
        ],
        # An abort inside the second cell (a GGML_ASSERT): no [OK], no [FAIL], exit 134.
        "abort.log": [
            *cell_lines(128, 256, 1),
            *cell_lines(128, 1024, 1, steps=1)[:5],
            "/src/ggml/src/ggml-cuda/fattn-common.cuh:750: GGML_ASSERT(K->ne[1] % "
            'FATTN_KQ_STRIDE == 0 && "incorrect KV cache padding") failed',
            "Aborted (core dumped)",
            "[tracedeck] test-kvcache-invariance exited 134",
        ],
        "no_backend.log": [
            "No backends available",
            "[tracedeck] test-kvcache-invariance exited 0",
        ],
    }
    for name, lines in logs.items():
        (folder / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    recorded_run()
    llamacpp_logs()
