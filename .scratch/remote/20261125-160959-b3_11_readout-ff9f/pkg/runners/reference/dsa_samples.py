"""Small sample data in each real workload format, made by the project (no dataset text).

The engine reads these when a data flag is "@sample" (so presets run on any target the engine
is shipped to); presets/samples/ holds the same content as files, to show the formats and to
feed `--sharegpt-json PATH` and friends (a test keeps the two equal).
"""

from __future__ import annotations

import csv
import io
import json
import random

_TOPICS = ("tide tables", "bread starters", "bicycle gears", "lighthouse lamps", "paper kites")
_SYSTEM = (
    "You are a patient assistant for a community workshop. Answer in short numbered steps, "
    "name the tools needed, say what can go wrong and how to notice it early, and keep the "
    "whole answer under two hundred words. "
)


def sharegpt() -> list[dict[str, object]]:
    """Conversations ({"id", "conversations": [{"from", "value"}]}), three to four turns each."""
    rng = random.Random(4)
    out = []
    for i, topic in enumerate(_TOPICS):
        turns = []
        for t in range(rng.randrange(3, 5)):
            ask = f"{_SYSTEM if t == 0 else ''}Question {t + 1} about {topic}: how do I check that the {topic} are set up right before the weekend session?"
            turns.append({"from": "human", "value": ask})
            turns.append(
                {
                    "from": "gpt",
                    "value": f"1. Look at the {topic} in daylight. 2. Compare with last week's notes. 3. Ask a second person to check.",
                }
            )
        out.append({"id": f"sample{i}", "conversations": turns})
    return out


def longbench() -> list[dict[str, object]]:
    """LongBench v2 samples (the last one is too long for the shipped preset's prompt limit)."""
    out = []
    for i, (topic, n) in enumerate(zip(_TOPICS[:3], (8, 12, 60), strict=True)):
        context = " ".join(
            f"Record {k}: the {topic} were inspected and found in order." for k in range(n)
        )
        out.append(
            {
                "_id": f"lb-sample-{i}",
                "domain": "Single-Document QA",
                "sub_domain": "Workshop logs",
                "difficulty": "easy",
                "length": "short" if n < 30 else "medium",
                "question": f"How were the {topic} found in record {n // 2}?",
                "choice_A": "In order",
                "choice_B": "Broken",
                "choice_C": "Missing",
                "choice_D": "Not inspected",
                "answer": "A",
                "context": context,
            }
        )
    return out


def burstgpt() -> str:
    """A BurstGPT CSV (Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type)."""
    rng = random.Random(7)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
    )
    t = 5.0
    for _ in range(40):
        t += rng.choice((0.0, 0.0, 0.5, 1.0, 3.0))  # bursts: several requests at one instant
        req, resp = rng.randrange(40, 400), rng.randrange(4, 60)
        w.writerow([f"{t:.1f}", "ChatGPT", req, resp, req + resp, "Conversation log"])
    return buf.getvalue()


FILES = {
    "dsa_sharegpt_sample.json": lambda: json.dumps(sharegpt(), indent=1) + "\n",
    "dsa_longbench_v2_sample.json": lambda: json.dumps(longbench(), indent=1) + "\n",
    "dsa_burstgpt_sample.csv": burstgpt,
}
