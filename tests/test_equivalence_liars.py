"""Issue 20, the liar matrix of B3.67 judged on a host: every claim the host's judge (or the
engine beside it) makes, told as a lie, is refused or recomputed, never believed.

The honest documents come from the real shipped judge, run as the console runs it
(runners/remote_judge.py: `python -I -c BOOT`, checked against the console's hashes) on a tree
written here; each lie is one field of such a document changed. The sshd attacks (a planted
judge, an overwritten shipped judge, a lying host) are in tests/test_host_judging.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_equivalence_tree import write_tree

from analysis.equivalence import THRESHOLDS
from analysis.equivalence_claims import ClaimError, checked_pair
from analysis.equivalence_tree import judge_pair, read_pair_metadata
from runners.kinds.equivalence import HOST_JUDGING
from runners.remote_judge import RemoteJudge
from runners.targets.local import LocalTarget

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

PAIRS = {"pass": (1, 0), "fail": (1, 1), "drift": (0, 0)}
# Planted where the engine writes (the judge's working directory) and on PYTHONPATH: any of
# them imported leaves its mark, and the judge's word is then a lie.
PLANTS = ("json.py", "numpy.py", "hashlib.py", "runners/__init__.py", "analysis/__init__.py")


def plant(where: Path, marks: Path) -> None:
    for rel in PLANTS:
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"open({str(marks / rel.replace('/', '_'))!r}, 'w').close()\n")
    hosted = where / "runners" / "hosted"
    hosted.mkdir(parents=True, exist_ok=True)
    (hosted / "__init__.py").write_text("")
    (hosted / "equivalence.py").write_text(
        f"open({str(marks / 'entry')!r}, 'w').close()\n"
        'print(\'{"ok": true, "document": {"verdict": "PASS_EQUIV"}}\')\n'
    )


class Host:
    """A tree, the judge shipped beside it, and the command the console runs there."""

    def __init__(self, tmp: Path) -> None:
        self.tree = tmp / "run" / "artifacts"
        self.tree.mkdir(parents=True)
        write_tree(self.tree, {1: {0: 1e-5, 1: 3e-2}, 0: {0: 0.5}})
        self.marks = tmp / "marks"
        self.marks.mkdir()
        self.planted = tmp / "planted"
        plant(self.tree, self.marks)
        plant(self.planted, self.marks)
        self.remote = RemoteJudge(
            LocalTarget(), sys.executable, str(tmp / "run" / "judge"), str(self.tree), tmp / "home"
        )
        asyncio.run(self.remote.ship(HOST_JUDGING))

    def judge(self, kv: int, seed: int) -> tuple[int, dict[str, Any]]:
        args = ["--kv", str(kv), "--seed", str(seed), "--thresholds", json.dumps(THRESHOLDS)]
        command = self.remote.command(HOST_JUDGING, HOST_JUDGING.entry, args)
        done = subprocess.run(
            f"cd {self.tree} && {command}",
            shell=True,
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(self.planted), "PYTHONSTARTUP": str(self.planted / "json.py")},
        )
        return done.returncode, json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return Host(tmp_path_factory.mktemp("liars"))


@pytest.fixture(scope="module")
def honest(host: Host) -> dict[str, dict[str, Any]]:
    docs = {}
    for name, (kv, seed) in PAIRS.items():
        code, said = host.judge(kv, seed)
        assert code == 0 and said["ok"] is True, said
        docs[name] = said["document"]
    return docs


def check(host: Host, name: str, doc: Any) -> Any:
    kv, seed = PAIRS[name]
    return checked_pair(
        doc,
        kv_aligned=kv,
        seed=seed,
        thresholds=dict(THRESHOLDS),
        metadata=read_pair_metadata(host.tree, kv, seed),
        where="gpu-a",
    )


def test_the_shipped_judge_runs_only_its_checked_code_and_writes_nothing_there(
    host: Host, honest: dict[str, dict[str, Any]]
) -> None:
    """Modules planted in the engine's directory and on PYTHONPATH are never imported; the
    honest documents are accepted and equal judging the same pair here."""
    assert sorted(p.name for p in host.marks.iterdir()) == []
    assert not (host.tree / "metrics").exists()  # the answer came over stdout only
    for name, (kv, seed) in PAIRS.items():
        got = check(host, name, honest[name])
        here = judge_pair(host.tree, kv, seed, THRESHOLDS)
        assert (got.verdict, got.metrics, got.first_fail) == (
            here.verdict,
            here.metrics,
            here.first_fail,
        )
        assert (got.pair_count, got.tokens, got.precision) == (
            here.pair_count,
            here.tokens,
            here.precision,
        )
    assert [honest[n]["verdict"] for n in PAIRS] == ["PASS_EQUIV", "FAIL_EQUIV", "EXPECTED_DRIFT"]


def test_a_shipped_judge_changed_after_it_was_shipped_is_refused_before_any_of_it_runs(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    shipped = Path(host.remote.judge_dir) / "analysis" / "equivalence.py"
    text = shipped.read_text()
    shipped.write_text(f"open({str(host.marks / 'tampered')!r}, 'w').close()\n" + text)
    code, said = host.judge(1, 1)
    assert code == 3 and said["ok"] is False
    assert str(shipped) in said["tampered"] and "changed after it was shipped" in said["tampered"]
    assert not (host.marks / "tampered").exists()

    shipped.unlink()  # gone: refused too, not looked for elsewhere
    code, said = host.judge(1, 1)
    assert code == 3 and "cannot be read" in said["tampered"]


def test_a_module_of_the_shipped_packages_that_was_not_shipped_is_refused(tmp_path: Path) -> None:
    host = Host(tmp_path)
    extra = Path(host.remote.judge_dir) / "runners" / "hosted" / "extra.py"
    extra.write_text(f"open({str(host.marks / 'extra')!r}, 'w').close()\n")
    command = host.remote.command(HOST_JUDGING, "runners.hosted.check", ["runners.hosted.extra"])
    done = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=host.tree)
    assert done.returncode == 1 and "not shipped with the judge" in done.stdout
    assert not (host.marks / "extra").exists()


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def lie(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = doc
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return lie


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.pop(key)


def _issue_liar(doc: dict[str, Any]) -> None:
    """The issue's file: PASS_EQUIV with max_abs_diff 14.09 and top1_agreement 0.889."""
    doc["verdict"] = "PASS_EQUIV"
    doc["metrics"]["max_abs_diff"] = 14.09
    doc["metrics"]["top1_agreement"] = 0.889
    doc["first_fail"] = None


def _consistent_liar(doc: dict[str, Any]) -> None:
    """Failing metrics that are otherwise self-consistent, with a passing word and no first fail."""
    doc["verdict"] = "PASS_EQUIV"
    doc["first_fail"] = None


def _unsorted_top5(doc: dict[str, Any]) -> None:
    doc["first_fail"]["top5"]["prefill"].reverse()


def _same_argmax(doc: dict[str, Any]) -> None:
    ff = doc["first_fail"]
    ff["metric"], ff["value"], ff["threshold"] = "top1_agreement", 0.0, 0.999
    ff["tripped"] = ["top1_agreement"]
    ff["top5"]["decode"] = copy.deepcopy(ff["top5"]["prefill"])


def _other_decode_id(doc: dict[str, Any]) -> None:
    ids = doc["first_fail"]["token_ids"]
    ids["decode"] = ids["prefill"] + 1


def _loosened(doc: dict[str, Any]) -> None:
    doc["thresholds"]["max_abs_diff_max"] = 100.0


# (claim, the pair lied about, the lie, words the refusal must carry)
LIES: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    # verdict words, per pair (the global word is computed from these, never received)
    ("verdict PASS on a failing pair", "fail", _consistent_liar, "make it FAIL_EQUIV"),
    ("the issue's PASS_EQUIV 14.09 / 0.889", "pass", _issue_liar, "refused"),
    ("verdict FAIL on a passing pair", "pass", _set("verdict", "FAIL_EQUIV"), "make it PASS"),
    ("verdict PASS on a drift pair", "drift", _set("verdict", "PASS_EQUIV"), "EXPECTED_DRIFT"),
    ("verdict drift on a kv_aligned=1 pair", "fail", _set("verdict", "EXPECTED_DRIFT"), "FAIL"),
    ("a global verdict alongside", "fail", _set("global_verdict", "PASS_GUARDRAIL"), "unknown"),
    ("a summary alongside", "pass", _set("summary", {"fail_equiv": 0}), "unknown key"),
    # metrics
    ("max_abs_diff under the threshold", "fail", _set("metrics.max_abs_diff", 1e-4), "p99"),
    ("p99 above max", "pass", _set("metrics.p99_abs_diff", 1.0), "between 0 and max"),
    ("top1 not a whole number of tokens", "pass", _set("metrics.top1_agreement", 0.9991), "whole"),
    ("top1 above 1", "pass", _set("metrics.top1_agreement", 1.5), "whole number"),
    ("a NaN metric", "pass", _set("metrics.cos_sim_mean", float("nan")), "finite"),
    ("a metric as text", "pass", _set("metrics.max_abs_diff", "0"), "finite"),
    ("a metric as a boolean", "pass", _set("metrics.top1_agreement", True), "finite"),
    ("a cosine of 1.5", "pass", _set("metrics.cos_sim_mean", 1.5), "not a cosine"),
    ("a metric missing", "pass", lambda d: d["metrics"].pop("p99_abs_diff"), "exactly"),
    ("a metric extra", "pass", _set("metrics.passed", 1.0), "exactly"),
    # first fail
    ("no first fail on a FAIL", "fail", _set("first_fail", None), "needs a first_fail"),
    ("a first fail on a PASS", "pass", lambda d: d.update(first_fail={"seed": 0}), "first fail"),
    ("first fail past the tokens", "fail", _set("first_fail.token_idx", 99), "token_idx"),
    ("first fail of another seed", "fail", _set("first_fail.seed", 7), "names seed"),
    ("first fail that does not break", "fail", _set("first_fail.value", 0.001), "does not break"),
    ("first fail threshold not ours", "fail", _set("first_fail.threshold", 0.5), "threshold"),
    ("first fail metric not tripped", "fail", _set("first_fail.tripped", ["token_id"]), "tripped"),
    ("first fail elsewhere", "fail", _set("first_fail.where.decode", "x.gz:1"), "where"),
    ("first fail top-5 unsorted", "fail", _unsorted_top5, "highest first"),
    ("argmax split with the same top-1", "fail", _same_argmax, "top-1 is the same id"),
    ("first fail token ids", "fail", _other_decode_id, "contradict"),
    # metadata, shapes and counts
    ("dtype", "pass", _set("dtype", "fp32"), "metadata.json"),
    ("gen_len", "pass", _set("gen_len", 5), "metadata.json"),
    ("prompt_len", "pass", _set("prompt_len", 17), "metadata.json"),
    ("seed", "pass", _set("seed", 1), "metadata.json"),
    ("kv_aligned", "pass", _set("kv_aligned", 0), "metadata.json"),
    ("token lines short of gen_len", "pass", _set("tokens", {"prefill": 5, "decode": 5}), "gen"),
    ("sides of different lengths", "pass", _set("tokens", {"prefill": 6, "decode": 7}), "same"),
    ("pair_count", "pass", _set("pair_count", 3), "pair_count"),
    ("a divergence on a PASS", "pass", _set("diverged_at_token", 5), "different tokens"),
    ("thresholds echoed loosened", "pass", _loosened, "this run's"),
    ("a key missing", "pass", _drop("tokens"), "missing key"),
    ("not a document", "pass", lambda d: d.clear(), "missing key"),
    # precision context
    ("ulp", "fail", _set("precision.ulp", 1.0), "precision"),
    (
        "precision spot past the tokens",
        "fail",
        _set("precision.max_abs_diff_at.token_idx", 6),
        "at",
    ),
]


@pytest.mark.parametrize(("claim", "pair", "lie", "words"), LIES, ids=[c[0] for c in LIES])
def test_a_lying_claim_is_refused_naming_the_pair(
    host: Host,
    honest: dict[str, dict[str, Any]],
    claim: str,
    pair: str,
    lie: Callable[[dict[str, Any]], None],
    words: str,
) -> None:
    doc = copy.deepcopy(honest[pair])
    lie(doc)
    kv, seed = PAIRS[pair]
    with pytest.raises(ClaimError) as refused:
        check(host, pair, doc)
    said = str(refused.value)
    assert said.startswith(f"kv_aligned_{kv}/seed_{seed}: the metrics judged on gpu-a"), said
    assert words in said, said


def test_a_document_that_is_no_object_is_refused(host: Host) -> None:
    for doc in (None, [], "PASS_EQUIV"):
        with pytest.raises(ClaimError, match="kv_aligned_1/seed_0.*not a metrics document"):
            check(host, "pass", doc)
