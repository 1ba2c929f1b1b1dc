"""How many processes judge: the operator's --workers, else the cores and memory allow."""

from __future__ import annotations

import pytest

from runners import resources


def test_the_default_is_bounded_by_cores_and_by_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "cores", lambda: 8)
    monkeypatch.setattr(resources, "available_memory", lambda: 3 * resources.PER_WORKER_BYTES)
    assert resources.judge_workers() == 3  # memory for three
    monkeypatch.setattr(resources, "available_memory", lambda: 64 * resources.PER_WORKER_BYTES)
    assert resources.judge_workers() == 8  # cores for eight
    monkeypatch.setattr(resources, "available_memory", lambda: 1)
    assert resources.judge_workers() == 1  # never none


def test_dsa_reading_uses_the_cores_unless_this_process_does_most_of_the_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resources, "cores", lambda: 4)
    monkeypatch.setattr(resources, "available_memory", lambda: None)
    assert resources.dsa_workers() == 4  # analyze, what-if, a csv export
    assert resources.dsa_workers(answers_heavy=True) == 1  # a parquet export, the tier replay
    assert resources.dsa_workers(3, answers_heavy=True) == 3  # the operator's word goes
    assert resources.dsa_workers(0) == 1
