"""`tracedeck diff`, --junit / --summary-md and [notify], on real runs of the shipped presets.

Each preset runs at the smallest size its smoke allows: once clean, once again clean (B3.67),
and once with the canary its seed names (readout_offset, split_reduction, b3_11). B3.67 and 03C
run on the torch-free toy engine (tests/engines/toy.py: the same files; GIT_COMMIT and the
readout_offset and split_reduction canaries honoured): what is tested is the diff of two runs'
records, not the engine's numbers, which test_reference_engine, test_equivalence_runs and
test_kv_invariance_runs check on torch. B3.11 and DSA (no toy) run on torch.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import xmlschema
from runhelp import cli_env, events, run_dirs, toy_override, tracedeck, write_lines_preset

SCHEMA = Path(__file__).parent / "data" / "junit.xsd"

SMALL = {
    "b3_67_smoke": ["matrix.seed=[0]", "matrix.kv_aligned=[1]"],
    "kv_invariance_smoke": ["matrix.b=[1]", "matrix.mask=[1]"],
    "b3_11_readout": ['matrix.prompt=["p0_short"]'],
    "dsa_smoke": [],
}
TOY = {"b3_67_smoke", "kv_invariance_smoke"}  # presets run on the toy engine
CANARY = {
    "b3_67_smoke": "readout_offset",
    "kv_invariance_smoke": "split_reduction",
    "b3_11_readout": "b3_11",
    "dsa_smoke": "block_off_by_one",
}
ENGINES = {
    ("b3_67_smoke", "pass"): ("abc123", "greta_infer 1.0"),
    ("b3_67_smoke", "again"): ("def456", "greta_infer 1.1"),
}
NOTIFY_SCRIPT = """
import sys
from pathlib import Path
Path(sys.argv[1]).write_text("\\n".join(sys.argv[2:]) + "\\n")
"""


class Runs:
    """Runs of the shipped presets, made once for the module, by (preset, name)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir()
        self.out = root / "out"
        self.made: dict[tuple[str, str], Path] = {}
        self.results: dict[tuple[str, str], object] = {}
        self.notified = root / "notified.txt"

    def env(self) -> dict[str, str]:
        return cli_env(self.home)

    def get(self, preset: str, name: str, *extra: str) -> Path:
        if (preset, name) in self.made:
            return self.made[(preset, name)]
        before = set(run_dirs(self.out))
        sets = [*SMALL[preset], *([toy_override(preset)] if preset in TOY else [])]
        canary = name.startswith("canary")
        if canary:
            sets.append(f'matrix.inject=["{CANARY[preset]}"]')
        if (preset, name) in ENGINES:  # the engine says who it is (seed 000 git_commit)
            commit, version = ENGINES[(preset, name)]
            sets.append(f'engine.env={{GIT_COMMIT="{commit}"}}')
            sets.append(f'engine.version_command="echo {version}"')
        args = ["run", preset, "--out", str(self.out)]
        args += ["--set", f'target.runs="{self.root}/remote"']
        args += ["--set", f'target.lock="{self.root}/lock"']
        for s in sets:
            args += ["--set", s]
        done = tracedeck(*args, *extra, env=self.env(), timeout=600)
        assert done.returncode == (1 if canary else 0), done.stdout + done.stderr
        [local] = set(run_dirs(self.out)) - before
        self.made[(preset, name)] = local
        self.results[(preset, name)] = done
        return local


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("diffruns"))


def diff(runs: Runs, a: Path | str, b: Path | str, *extra: str):  # type: ignore[no-untyped-def]
    return tracedeck("diff", str(a), str(b), "--out", str(runs.out), *extra, env=runs.env())


def test_two_passing_b3_67_runs_diff_clean(runs: Runs) -> None:
    a = runs.get("b3_67_smoke", "pass")
    b = runs.get("b3_67_smoke", "again")
    done = diff(runs, a, b)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 item(s) compared: 1 same" in done.stdout
    assert "RESULT: NO_REGRESSION (exit 0)" in done.stdout
    # What changed is the engine: its commit (metadata.json) and its version_command.
    assert "engine git_commit: abc123 -> def456" in done.stdout
    assert "engine version: greta_infer 1.0 -> greta_infer 1.1" in done.stdout


def test_b3_67_readout_offset_canary_is_a_regression_naming_pairs_and_deltas(runs: Runs) -> None:
    a = runs.get("b3_67_smoke", "pass")
    b = runs.get("b3_67_smoke", "canary")
    done = diff(runs, a, b)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "REGRESSED pair kv_aligned=1 seed=0: PASS_EQUIV -> FAIL_EQUIV" in out
    assert "engine switch matrix.inject: ['none'] -> ['readout_offset']" in out
    assert "max_abs_diff 0 -> " in out and "CROSSED INTO FAILURE" in out
    assert "RESULT: REGRESSION (exit 1)" in out
    # By run id too, and as JSON: the deltas are the two runs' recorded metrics.
    ids = [json.loads((p / "run.json").read_text())["run_id"] for p in (a, b)]
    as_json = diff(runs, ids[0], ids[1], "--json")
    assert as_json.returncode == 1, as_json.stderr
    doc = json.loads(as_json.stdout)
    [pair] = [c for c in doc["changes"] if c["key"] == "kv_aligned=1 seed=0"]
    assert pair["change"] == "regressed"
    deltas = {d["metric"]: d for d in pair["deltas"]}
    recorded = _pair_metrics(b)
    assert deltas["max_abs_diff"]["b"] == recorded["max_abs_diff"]
    assert deltas["max_abs_diff"]["crossed"] and deltas["top1_agreement"]["crossed"]
    assert pair["first_fail_moved"][1].startswith("token ")
    # The other way round the canary's failures are fixed: no regression.
    back = diff(runs, b, a)
    assert back.returncode == 0, back.stdout
    assert "FIXED     pair kv_aligned=1 seed=0: FAIL_EQUIV -> PASS_EQUIV" in back.stdout


def _pair_metrics(local: Path) -> dict[str, float]:
    for line in (local / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "pair_verdict":
            return event["metrics"]
    raise AssertionError("no pair_verdict recorded")


def test_kv_split_reduction_canary_flips_grid_cells(runs: Runs) -> None:
    a = runs.get("kv_invariance_smoke", "pass")
    b = runs.get("kv_invariance_smoke", "canary")
    done = diff(runs, a, b)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "REGRESSED cell d=64 kv=256 b=1 gqa=2 mask=1 alibi=1 sinks=1: BITWISE_EQUAL -> DIFFERS"
        in done.stdout
    )
    assert "differing 0 -> " in done.stdout and "differ first at batch" in done.stdout


def test_readout_b3_11_canary_changes_top1_per_prompt(runs: Runs) -> None:
    a = runs.get("b3_11_readout", "pass")
    b = runs.get("b3_11_readout", "canary")
    done = diff(runs, a, b)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "REGRESSED prompt p0_short: OK -> NO OK" in done.stdout
    assert "decode0_top1 " in done.stdout and "CROSSED INTO FAILURE" in done.stdout


def test_dsa_block_off_by_one_canary_regresses_its_trace_and_shards(runs: Runs) -> None:
    a = runs.get("dsa_smoke", "pass")
    b = runs.get("dsa_smoke", "canary")
    done = diff(runs, a, b, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    changes = {(c["class"], c["key"]): c for c in doc["changes"]}
    trace = changes[("trace", "dsa/block16")]
    assert trace["change"] == "regressed" and trace["b"]["verdict"] == "TRACE_INVALID"
    assert trace["b"]["first_fail"] and trace["first_fail_moved"][0] == "-"
    shards = [c for (klass, _), c in changes.items() if klass == "shard"]
    assert shards and all(c["a"]["verdict"] == "OK" for c in shards if c["a"])
    assert any(c["change"] == "regressed" and c["b"]["metrics"]["invalid"] > 0 for c in shards)
    # The two runs' paths differ (their run directories); the items are matched all the same.
    assert not [c for c in doc["changes"] if c["change"] in ("new", "gone")]


def test_runs_of_different_presets_are_incomparable(runs: Runs) -> None:
    done = diff(runs, runs.get("b3_67_smoke", "pass"), runs.get("b3_11_readout", "pass"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "INCOMPARABLE: different presets: b3_67_smoke (A) vs b3_11_readout (B)" in done.stdout


def test_a_missing_run_is_a_usage_error(runs: Runs) -> None:
    done = diff(runs, runs.get("b3_67_smoke", "pass"), "no-such-run")
    assert done.returncode == 2
    assert "diff: run B no-such-run: no run 'no-such-run'" in done.stderr


def test_junit_of_a_failing_run_validates_and_fails_once_per_failing_pair(
    runs: Runs, tmp_path: Path
) -> None:
    local = runs.get("b3_67_smoke", "canary")
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    done = tracedeck(
        "replay", str(local), "--headless", "--junit", str(junit), "--summary-md", str(summary),
        env=runs.env(),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    schema = xmlschema.XMLSchema(str(SCHEMA))
    schema.validate(str(junit))
    doc = schema.to_dict(str(junit))
    [suite] = doc["testsuite"]
    cases = suite["testcase"]
    failing = [c for c in cases if "failure" in c]
    assert [c["@name"] for c in failing] == ["kv_aligned=1 seed=0"]
    first_fail = json.loads(
        next(
            line
            for line in (local / "events.jsonl").read_text().splitlines()
            if '"pair_verdict"' in line
        )
    )["first_fail"]
    message = failing[0]["failure"]["@message"]
    assert message.startswith("FAIL_EQUIV: token_idx=" + str(first_fail["token_idx"]))
    assert str(first_fail["token_ids"]["decode"]) in message
    assert int(suite["@failures"]) == 1 and int(suite["@tests"]) == len(cases)
    text = summary.read_text()
    assert "FAIL_GUARDRAIL (exit 1)" in text and "| pair kv_aligned=1 seed=0 | FAIL_EQUIV |" in text


def test_junit_of_a_run_is_written_by_run_itself(runs: Runs, tmp_path: Path) -> None:
    junit = tmp_path / "kv.xml"
    local = runs.get("kv_invariance_smoke", "again", "--junit", str(junit))
    xmlschema.XMLSchema(str(SCHEMA)).validate(str(junit))
    text = junit.read_text()
    assert 'name="d=64 kv=256 b=1 gqa=2 mask=1 alibi=1 sinks=1"' in text
    assert "<failure" not in text and local.is_dir()


def test_notify_command_hears_of_a_failed_headless_run(runs: Runs, tmp_path: Path) -> None:
    config = runs.home / ".config" / "tracedeck" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "notify.py"
    script.write_text(NOTIFY_SCRIPT)
    heard = tmp_path / "heard.txt"
    command = shlex.join([sys.executable, str(script), str(heard)])
    config.write_text(f"[notify]\ncommand = {json.dumps(command)}\n")
    summary = tmp_path / "summary.md"
    try:
        local = runs.get("b3_11_readout", "canary-notify", "--summary-md", str(summary))
    finally:
        config.unlink()
    record = json.loads((local / "run.json").read_text())
    assert heard.read_text().splitlines() == [
        record["run_id"],
        "b3_11_readout",
        "NO OK",
        "1",
        str(summary),
    ]
    assert "NO OK (exit 1)" in summary.read_text()


def test_notify_hears_of_a_run_that_never_reached_its_host(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = home / ".config" / "tracedeck" / "config.toml"
    config.parent.mkdir(parents=True)
    script = tmp_path / "notify.py"
    script.write_text(NOTIFY_SCRIPT)
    heard = tmp_path / "heard.txt"
    command = shlex.join([sys.executable, str(script), str(heard)])
    config.write_text(f"[notify]\ncommand = {json.dumps(command)}\n")
    done = tracedeck(
        "run", "b3_67_smoke", "--target", "ssh://127.0.0.1:1", "--out", str(tmp_path / "out"),
        env=cli_env(home),
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    run_id, preset, verdict, code, report = heard.read_text().splitlines()
    assert run_id.endswith(tuple("0123456789abcdef")) and "-b3_67_smoke-" in run_id
    assert (preset, verdict, code, report) == ("b3_67_smoke", "NOT_STARTED", "3", "-")


def test_analyze_of_a_recorded_run_writes_its_junit(runs: Runs, tmp_path: Path) -> None:
    local = runs.get("b3_67_smoke", "canary")
    junit = tmp_path / "analyze.xml"
    done = tracedeck(
        "analyze", str(local), "--output", str(tmp_path / "docs"), "--junit", str(junit),
        env=runs.env(),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    xmlschema.XMLSchema(str(SCHEMA)).validate(str(junit))
    assert junit.read_text().count("<failure ") == 1
    # A bare trace file has no run record to report from: said, and nothing is written.
    trace = tmp_path / "trace.jsonl"
    trace.write_text("")
    bare = tracedeck("analyze", str(trace), "--junit", str(tmp_path / "bare.xml"), env=runs.env())
    assert bare.returncode != 0 and not (tmp_path / "bare.xml").exists()
    assert "--junit and --summary-md report a recorded run" in bare.stderr


def test_a_failing_version_command_is_recorded_and_never_fails_the_run(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    done = tracedeck(
        "run", str(preset), "--out", str(tmp_path / "out"),
        "--set", "engine.version_command=\"sh -c 'echo no such engine >&2; exit 5'\"",
        env=cli_env(home),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine:      unknown (exit 5: no such engine)" in done.stdout
    [local] = run_dirs(tmp_path / "out")
    [version] = [e for e in events(local) if e["type"] == "engine_version"]
    assert version["version"] == "" and version["error"] == "exit 5: no such engine"
