"""Writes the synthetic recorded runs the console tests replay (run: python tests/data/make_synthetic.py).

equivalence_fail/: a B3.67 matrix (kv_aligned [1,0] x seed [0,1,2] x mode [prefill, decode]) where
kv_aligned=1 seed=1 is FAIL_EQUIV with a first_fail; the guardrail fails (FAIL_GUARDRAIL, exit 1).
readout_run/: a B3.11/B3.12 readout run whose trace digests come from the real judge.
(legacy_readout_run/ is not written here: it was recorded by tracedeck 0.1, with whole readout
rows as events, and stays as it is to show that old records still replay. equivalence_fail/ as
checked in was also written by 0.1, without the fields events gained since; rerunning this
script adds them, which replays the same.)
Times are fixed so the screens built from these runs are the same on every machine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from analysis.readout import ReadoutAggregator, to_json  # noqa: E402
from runners.events import (  # noqa: E402
    ArtifactFetched,
    CellFinished,
    CellStarted,
    Event,
    LockAcquired,
    OutputLines,
    RunFinished,
    RunStarted,
    TraceBatch,
)
from runners.kinds.equivalence import PairVerdict  # noqa: E402

HERE = Path(__file__).resolve().parent
T0 = 1_780_000_000.0
THRESHOLDS = {"p99_abs_diff_max": 0.001, "max_abs_diff_max": 0.005, "top1_agreement_min": 0.999}
HOLDER = {
    "user": "operator",
    "console_host": "laptop",
    "preset": "",
    "run_id": "",
    "started_at": "2026-05-28T20:26:40+00:00",
    "pgid": 4242,
}

FIRST_FAIL: dict[str, Any] = {
    "seed": 1,
    "kv_aligned": 1,
    "token_idx": 17,
    "token_id": 4242,
    "metric": "max_abs_diff",
    "value": 0.0123,
    "threshold": 0.005,
    "top5": {
        "prefill": [[4242, 12.5], [311, 11.9], [17, 11.2], [905, 10.8], [66, 10.1]],
        "decode": [[311, 12.49], [4242, 12.48], [17, 11.21], [905, 10.79], [66, 10.12]],
    },
    "where": {
        "prefill": "runs/kv_aligned_1/seed_1/prefill/logits.jsonl.gz:18",
        "decode": "runs/kv_aligned_1/seed_1/decode/logits.jsonl.gz:18",
    },
    "note": "top-1 flips at this token [red]not markup[/red]",
}


def write_run(name: str, record: dict[str, Any], events: list[Event]) -> None:
    folder = HERE / name
    folder.mkdir(exist_ok=True)
    record = {**record, "local_dir": f"/home/operator/.local/share/tracedeck/runs/{name}"}
    (folder / "run.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
    (folder / "events.jsonl").write_bytes(b"".join(e.to_json() + b"\n" for e in events))


def base_record(run_id: str, preset: str, kind: str, started: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "preset": preset,
        "kind": kind,
        "source": f"presets/{preset}.toml",
        "overrides": [],
        "preset_data": {},
        "target": "mi300x",
        "remote_dir": f"/home/operator/.tracedeck/runs/{run_id}",
        "lock": "/tmp/tracedeck.lock",
        "local_dir": "",
        "started_at": started,
        "user": "operator",
        "console_host": "laptop",
        "date": started[:10],
        "extra": {"workdir": "/home/operator", "python": "python3"},
    }


def equivalence() -> None:
    run_id = "20260528-202640-b3_67_equivalence-0001"
    cells = [
        {"kv_aligned": kv, "seed": seed, "mode": mode}
        for kv in (1, 0)
        for seed in (0, 1, 2)
        for mode in ("prefill", "decode")
    ]
    t = T0
    events: list[Event] = [
        RunStarted(
            run_id=run_id,
            preset="b3_67_equivalence",
            kind="equivalence",
            target="mi300x",
            local_dir="/home/operator/.local/share/tracedeck/runs/eq",
            remote_dir=f"/home/operator/.tracedeck/runs/{run_id}",
            cells=[
                {"index": i, "params": p, "command": f"greta_infer --cell {i}"}
                for i, p in enumerate(cells)
            ],
            profile="rocm",
            env={"HIP_LAUNCH_BLOCKING": "1", "AMD_SERIALIZE_KERNEL": "3", "HSA_ENABLE_SDMA": "0"},
            t=t,
        ),
        LockAcquired(
            lock="/tmp/tracedeck.lock",
            holder={**HOLDER, "run_id": run_id, "preset": "b3_67_equivalence"},
            t=t + 0.2,
        ),
    ]
    verdicts = {
        (1, 0): ("PASS_EQUIV", 0.0012, 0.0004, 1.0, 0.99999, None),
        (1, 1): ("FAIL_EQUIV", 0.0123, 0.0021, 0.9921, 0.99871, FIRST_FAIL),
        (1, 2): ("PASS_EQUIV", 0.0009, 0.0003, 1.0, 0.99999, None),
        (0, 0): ("EXPECTED_DRIFT", 0.0410, 0.0102, 0.9844, 0.99512, None),
        (0, 1): ("EXPECTED_DRIFT", 0.0388, 0.0099, 0.9766, 0.99488, None),
        (0, 2): ("EXPECTED_DRIFT", 0.0402, 0.0101, 0.9844, 0.99501, None),
    }
    for index, params in enumerate(cells):
        t += 1.0
        events.append(
            CellStarted(cell=index, params=params, command=f"greta_infer --cell {index}", t=t)
        )
        lines = [
            f"seed={params['seed']} kv_aligned={params['kv_aligned']} mode={params['mode']}",
            "[bold]engine text, not markup[/bold]",
            "wrote logits.jsonl.gz (128 tokens)",
        ]
        events.append(
            OutputLines(
                cell=index,
                stream="stdout",
                lines=lines,
                file="stdout.log",
                end_offset=100,
                t=t + 0.5,
            )
        )
        events.append(
            CellFinished(cell=index, state="passed", exit_code=0, duration_s=1.5, t=t + 1.5)
        )
        rel = f"runs/kv_aligned_{params['kv_aligned']}/seed_{params['seed']}/{params['mode']}"
        events.append(
            ArtifactFetched(
                cell=index, path=f"{rel}/logits.jsonl.gz", size=51234, sha256="ab" * 32, t=t + 1.6
            )
        )
        t += 1.5
        if params["mode"] == "decode":
            kv, seed = params["kv_aligned"], params["seed"]
            word, mx, p99, top1, cos, ff = verdicts[(kv, seed)]
            events.append(
                PairVerdict(
                    seed=seed,
                    kv_aligned=kv,
                    verdict=word,
                    metrics={
                        "max_abs_diff": mx,
                        "p99_abs_diff": p99,
                        "top1_agreement": top1,
                        "cos_sim_mean": cos,
                        "pair_count": 128,
                    },
                    thresholds=THRESHOLDS,
                    first_fail=ff,
                    metrics_path=f"metrics/kv_aligned_{kv}/seed_{seed}_metrics.json",
                    t=t + 0.1,
                )
            )
    events.append(
        RunFinished(
            verdict="FAIL_GUARDRAIL",
            exit_code=1,
            summary={"global_verdict": "FAIL_GUARDRAIL", "first_fail": FIRST_FAIL},
            t=t + 1.0,
        )
    )
    write_run(
        "equivalence_fail",
        base_record(run_id, "b3_67_equivalence", "equivalence", "2026-05-28T20:26:40+00:00"),
        events,
    )


def readout_trace() -> list[dict[str, Any]]:
    template = orjson.loads(
        (ROOT / "presets/samples/b3_12_mi300x.jsonl").read_bytes().splitlines()[0]
    )
    prompts = [
        ("p0_short", 79, [79, 1012, 553, 77, 90, 412, 88, 31], None),
        ("p1_len_16", 4413, [9023, 9023, 118, 5], None),
        ("p2_len_64", 311, [311, 402, 19], 1),
        ("p3_collapsed", 500, [13] * 8, None),
        ("p4_prefill_only", 1200, [], None),
    ]
    records: list[dict[str, Any]] = []
    for name, prefill, steps, bad_step in prompts:
        records.append(
            {
                **template,
                "prompt": name,
                "phase": "prefill_last",
                "step": 0,
                "top1_id": prefill,
                "top2_id": prefill + 1,
                "gap": 0.75,
                "top1_logit": 12.0,
                "top2_logit": 11.25,
                "readout_mismatch": False,
            }
        )
        for n, top1 in enumerate(steps, start=1):
            gap = round(0.5 + 0.25 * (n % 4), 3)
            total = template["tokens_total"] + n
            # a single-token buffer read at physical row 0; the bad step reads the logical
            # index instead (B3.12's bug), and says so in its flag
            used = total - 1 if n == bad_step else 0
            records.append(
                {
                    **template,
                    "prompt": name,
                    "phase": "decode",
                    "readout_buffer_kind": "single_token",
                    "hidden_source_tag": "decode_hidden_single_token",
                    "seq_len": 1,
                    "pos_id": total - 1,
                    "token_index": total - 1,
                    "used_index": used,
                    "logical_last_index": total - 1,
                    "expected_last_index": total - 1,
                    "hidden_token_index_used": used,
                    "step": n,
                    "tokens_total": total,
                    "top1_id": top1,
                    "top2_id": top1 + 1,
                    "gap": gap,
                    "top1_logit": 10.0 + gap,
                    "top2_logit": 10.0,
                    "readout_mismatch": n == bad_step,
                }
            )
    return records


def readout() -> None:
    run_id = "20260528-210000-b3_12_readout-0002"
    trace = f"/home/operator/.tracedeck/runs/{run_id}/artifacts/readout_trace.jsonl"
    t = T0 + 2000
    events: list[Event] = [
        RunStarted(
            run_id=run_id,
            preset="b3_12_readout",
            kind="readout",
            target="mi300x",
            local_dir="/home/operator/.local/share/tracedeck/runs/ro",
            remote_dir=f"/home/operator/.tracedeck/runs/{run_id}",
            cells=[{"index": 0, "params": {"trace": "on"}, "command": "greta_infer"}],
            profile="rocm",
            env={"GRETA_TRACE_READOUT": "1"},
            t=t,
        ),
        LockAcquired(
            lock="/tmp/tracedeck.lock",
            holder={**HOLDER, "run_id": run_id, "preset": "b3_12_readout"},
            t=t + 0.1,
        ),
        CellStarted(cell=0, params={"trace": "on"}, command="greta_infer", t=t + 0.2),
    ]
    aggregator = ReadoutAggregator()
    records = readout_trace()
    offset = 0
    for start in range(0, len(records), 4):
        batch = records[start : start + 4]
        t += 0.5
        facts = []
        for i, record in enumerate(batch):
            fact = aggregator.fact(record, start + i + 1, trace)
            aggregator.apply(fact, trace)
            facts.append(fact)
            offset += len(orjson.dumps(record)) + 1
        events.append(
            TraceBatch(
                cell=0,
                file=trace,
                first_line=start + 1,
                last_line=start + len(batch),
                end_offset=offset,
                digest={"facts": facts},
                t=t,
            )
        )
    t += 0.5
    events.append(CellFinished(cell=0, state="passed", exit_code=0, duration_s=t - T0 - 2000, t=t))
    verdict = aggregator.verdict()
    events.append(
        RunFinished(
            verdict=verdict,
            exit_code=0 if verdict == "OK" else 1,
            summary=to_json(aggregator.rows(), verdict),
            t=t + 0.1,
        )
    )
    write_run(
        "readout_run",
        base_record(run_id, "b3_12_readout", "readout", "2026-05-28T21:00:00+00:00"),
        events,
    )


if __name__ == "__main__":
    equivalence()
    readout()
