"""DeepSeek DSA top-k traces (seed 004): shards followed live, every record judged as it comes.

The engine (the reference `dsa` command or the real demo) writes
<trace-out>/block<N>/trace_steps_<start>_<end>.jsonl shards and, at the end, summary.json. The
preset follows the shards with a pattern ([traces] follow = [".../trace_steps_*.jsonl"]), so
shards that appear during the run are followed from when they appear; each batch of lines is
judged (analysis.dsa_stream) and recorded as its digest: counts, aggregate increments, the
first invalid record, and the little state the cross-record checks carry (never the records).
At the end summary.json comes home and is compared with the statistics recomputed live.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from analysis.dsa_record import torn_marker
from analysis.dsa_stream import BLOCK_DIR, SHARD, TraceStream
from analysis.dsa_tree import (
    TRACE_INVALID,
    TRACE_OK,
    NotATrace,
    analyze_dir,
    block_dirs,
    format_result,
    read_summary,
    serving_latency,
    serving_summary,
    trace_verdict,
)
from analysis.run_compare import Item
from runners.dsa_worker import BookFeeder
from runners.events import CellFinished, Event, RunFinished, TraceBatch
from runners.exits import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, EXIT_USAGE
from runners.kind import (
    ENGINE_ERROR,
    Asked,
    Digest,
    Ending,
    Judge,
    JudgeContext,
    Kind,
    KindPrinter,
    Option,
)
from runners.presets import PresetError
from runners.targets.base import TargetError

SERVING = "serving.jsonl"


class TraceBook:
    """Every followed trace directory's judge state, folded from digests (judge, printer, panel)."""

    def __init__(
        self, topk: int | None = None, layers: int | None = None, topk_source: str = ""
    ) -> None:
        self.topk = topk
        self.topk_source = topk_source
        self.layers = layers
        self.streams: dict[str, TraceStream] = {}
        self.latency: dict[str, list[float]] = {}  # dir -> serving latency_ms (BurstGPT)
        self.serving_bad: dict[str, tuple[int, str]] = {}  # dir -> lines that were no entry
        self.last: dict[str, Any] = {}  # the newest position: dir, file, request, layer, step

    def stream(self, file: str) -> TraceStream:
        folder = file.rsplit("/", 1)[0]
        if folder not in self.streams:
            self.streams[folder] = TraceStream(
                topk=self.topk, layers=self.layers, topk_source=self.topk_source
            )
        return self.streams[folder]

    def feed(self, file: str, lines: list[bytes], first_line: int) -> dict[str, Any]:
        if file.endswith("/" + SERVING):
            return self._serving(file, lines, first_line)
        digest = self.stream(file).feed(file, lines, first_line)
        self._note(file, digest)
        return digest

    def apply(self, event: TraceBatch) -> bool:
        if not event.digest:
            return False
        self.apply_data(event.file, event.digest)
        return True

    def apply_data(self, file: str, digest: dict[str, Any]) -> None:
        """Rebuild from a digest what feed() left."""
        folder = file.rsplit("/", 1)[0]
        if "serving" in digest:
            self.latency.setdefault(folder, []).extend(v for _, v in digest["serving"])
            for line, why in digest.get("bad", []):
                self._bad_serving(file, line, why)
            return
        self.stream(file).apply(file, digest)
        self._note(file, digest)

    def learn(self, folder: str, engine: dict[str, Any]) -> list[str]:
        """summary.json appeared: the top-k it states judges the records that waited for it."""
        config = engine.get("config") if isinstance(engine.get("config"), dict) else {}
        topk = config.get("index_topk")
        stream = self.streams.get(folder)
        if stream is None:
            stream = self.streams[folder] = TraceStream(
                topk=self.topk, layers=self.layers, topk_source=self.topk_source
            )
        if stream.topk is not None or type(topk) is not int or topk < 1:
            return []
        found = stream.set_topk(topk, "summary.json config.index_topk")
        lines = [f"dsa: {folder}: top-{topk} from summary.json config.index_topk"]
        if found:
            lines.append(f"dsa: FIRST INVALID RECORD {found[0]['message']}")
        return lines

    def serving_stats(self, folder: str) -> dict[str, Any] | None:
        """serving.jsonl as followed: what summary.json serving must say (None: none followed)."""
        lat = self.latency.get(folder)
        if lat is None:
            return None
        bad, first = self.serving_bad.get(folder, (0, ""))
        return serving_summary(lat, bad, first)

    def _bad_serving(self, file: str, line: int, why: str) -> None:
        folder = file.rsplit("/", 1)[0]
        bad, first = self.serving_bad.get(folder, (0, ""))
        self.serving_bad[folder] = (bad + 1, first or f"{file}:{line}: {why}")

    def _note(self, file: str, digest: dict[str, Any]) -> None:
        reqs = (digest.get("state") or {}).get("reqs") or {}
        if reqs:
            req = max(reqs, key=int)
            st = reqs[req]
            self.last = {"file": file, "request": int(req), "step": st[1], "layer": st[2] - 1}

    def _serving(self, file: str, lines: list[bytes], first_line: int) -> dict[str, Any]:
        """serving.jsonl lines, read by analyze's rule; a line that is no entry is counted."""
        got, bad = [], []
        for n, raw in enumerate(lines, first_line):
            if not raw.strip():
                continue
            value = serving_latency(raw)
            if isinstance(value, str):
                bad.append([n, value])
                self._bad_serving(file, n, value)
            else:
                got.append([n, value])
        folder = file.rsplit("/", 1)[0]
        self.latency.setdefault(folder, []).extend(v for _, v in got)
        return {"serving": got, "bad": bad} if bad else {"serving": got}

    def totals(self) -> dict[str, int]:
        return {
            "records": sum(s.records for s in self.streams.values()),
            "invalid": sum(s.invalid for s in self.streams.values()),
            "shards": sum(1 for s in self.streams.values() for f in s.files if _is_shard(f)),
            "requests": sum(len(s.reqs) for s in self.streams.values()),
        }

    def first_fail(self) -> dict[str, Any] | None:
        for s in self.streams.values():
            if s.first is not None:
                return s.first
        return None


def _is_shard(file: str) -> bool:
    return bool(SHARD.fullmatch(file.rsplit("/", 1)[-1]))


class DsaJudge(Judge):
    """TRACE_OK when every record holds, every step and shard is whole and every cell passed."""

    def __init__(self, kind: Kind, ctx: JudgeContext) -> None:
        super().__init__(kind, ctx)
        dsa = ctx.preset.section("dsa")
        topk = dsa["topk"] or None
        self.book = TraceBook(topk, dsa["layers"] or None, "preset dsa.topk" if topk else "")
        # The reader checks each record against the ones before it (its digests say what it
        # found); the book, which the verdict reads, changes only by applying digests, live and
        # on attach alike. (Checking on a copy of the book instead costs most of a feed again.)
        self.reader = TraceBook(topk, dsa["layers"] or None, "preset dsa.topk" if topk else "")
        self.read_ahead = 0  # digests the reader made itself and so need not apply again
        self.said_first: set[str] = set()  # trace directories whose first invalid record was said
        # batches are judged in a helper process (parsing holds the interpreter): the console
        # drawing this run keeps its core, and the judge gets one of its own; it folds each
        # digest into the reader as the reader's own feed would
        self.feeder = BookFeeder(self.reader)

    def submit_lines(self, cell: int, file: str, lines: list[bytes], first_line: int) -> None:
        self.feeder.submit(file, lines, first_line)

    def torn_last_line(self, file: str, data: bytes) -> bytes | None:
        """As analyze reads it: a shard's is a torn record, serving.jsonl's a line as any."""
        if file.endswith("/" + SERVING):
            return data
        return torn_marker(len(data)) if _is_shard(file) else None

    def digest(self, cell: int, file: str, lines: list[bytes], first_line: int) -> Digest:
        stream = self.reader.stream(file) if not file.endswith("/" + SERVING) else None
        data = self.feeder.feed(file, lines, first_line)
        self.read_ahead += 1
        errors = []
        # the batch that holds its trace's first invalid record says so, once: told by the
        # digest (another host's batch may have been folded into the reader before this one's)
        folder = file.rsplit("/", 1)[0]
        found = data.get("first")
        if stream is not None and found and found == stream.first and folder not in self.said_first:
            self.said_first.add(folder)
            first = stream.first
            where = f"{first['file']}:{first['line']}" if first["line"] else first["file"]
            errors.append((f"first invalid DSA record: {first['message']}", where))
        return Digest(data, errors)

    def apply_digest(self, cell: int, file: str, data: dict[str, Any]) -> None:
        self.book.apply_data(file, data)
        if self.read_ahead:
            self.read_ahead -= 1
        else:  # recorded before this console followed it: the reader goes on from there
            self.reader.apply_data(file, data)

    def verdict(self, ending: Ending) -> RunFinished:
        self.feeder.close()
        base = super().verdict(ending)
        traces = [self._judge_dir(folder, s) for folder, s in sorted(self.book.streams.items())]
        for cell in self.ctx.cells:
            wanted = [a for a in cell.artifacts if a.endswith("summary.json")]
            for rel in wanted:
                folder = rel.rsplit("/", 1)[0]
                if not any(t["dir"].endswith("/artifacts/" + folder) for t in traces):
                    traces.append(_missing_dir(folder))
        ok = all(t["verdict"] == TRACE_OK for t in traces) and bool(traces)
        summary = {**base.summary, "traces": traces, **self.book.totals()}
        ok = ok and base.exit_code == EXIT_PASS
        return RunFinished(
            verdict=TRACE_OK if ok else TRACE_INVALID,
            exit_code=EXIT_PASS if ok else EXIT_FAIL,
            summary=summary,
        )

    def _judge_dir(self, folder: str, stream: TraceStream) -> dict[str, Any]:
        rel = folder.split("/artifacts/", 1)[-1]
        home = self.ctx.local_dir / rel
        engine, why = read_summary(home / "summary.json")
        if why:
            why += " (the engine writes it at the end of a run, seed 004 5.3; list it in [artifacts] fetch)"  # fmt: skip
        serving = self.book.serving_stats(folder)
        return trace_verdict(folder, stream, engine, why, None, serving)


def _not_as_followed(stream: TraceStream, result: dict[str, Any], home: Path) -> list[str]:
    """What the shards in a run's directory say against the run's record of the same trace
    followed live: each shard's records, and no fewer invalid records than the live judge
    found. Shards put there after the run (a passing run's, or edited) judge another trace."""
    live = {file.rsplit("/", 1)[-1]: n for file, n in stream.files.items()}
    here = {name: result["shard_records"].get(name, 0) for name in result.get("shards", [])}
    out = []
    if live != here:
        out.append(
            f"{home}: its shards are not the ones the run followed (records per shard: live "
            f"{dict(sorted(live.items()))}, here {dict(sorted(here.items()))}); judging them "
            "would not judge the run"
        )
    if int(result.get("invalid", 0)) < stream.invalid:
        out.append(
            f"{home}: the run found {stream.invalid} invalid record(s) in this trace while it ran, "
            f"its shards here hold {result.get('invalid', 0)}: they were replaced or edited after "
            "the run; judging them would not judge the run"
        )
    return out


def _missing_dir(folder: str) -> dict[str, Any]:
    message = f"{folder}: no trace record was followed there (the engine wrote no shard)"
    fail = {"file": folder, "line": None, "field": "records", "message": message}
    return {
        "dir": folder,
        "verdict": TRACE_INVALID,
        "records": 0,
        "invalid": 0,
        "requests": 0,
        "layers": None,
        "first_fail": fail,
        "problems": [fail],
    }


class DsaPrinter(KindPrinter):
    """A line when a shard appears, the first invalid record, a progress line every few seconds."""

    EVERY_S = 2.0

    def __init__(self) -> None:
        self.book = TraceBook()
        self.shards: set[str] = set()
        self.shown_first = False
        self.last_t = 0.0

    def lines(self, event: Event) -> list[str]:
        if not isinstance(event, TraceBatch) or not self.book.apply(event):
            return []
        out = []
        name = event.file.rsplit("/", 1)[-1]
        if _is_shard(event.file) and event.file not in self.shards:
            self.shards.add(event.file)
            out.append(f"dsa: following shard {name}")
        first = self.book.first_fail()
        if first is not None and not self.shown_first:
            self.shown_first = True
            out.append(f"dsa: FIRST INVALID RECORD {first['message']}")
        if event.t - self.last_t >= self.EVERY_S:
            self.last_t = event.t
            t = self.book.totals()
            out.append(
                f"dsa: {t['records']} records, {t['requests']} requests, {t['shards']} shards, "
                f"{t['invalid']} invalid"
            )
        return out

    def final(self, event: RunFinished) -> list[str]:
        lines = [""]
        for t in event.summary.get("traces", []):
            lines.append(
                f"DSA trace {t['dir']}: {t['records']} records, {t['requests']} requests, "
                f"{t['layers']} layers; {t['invalid']} invalid -> {t['verdict']}"
            )
            if t.get("topk_from"):
                lines.append(f"  {t['topk_from']}")
            if t.get("first_fail"):
                lines.append(f"  first fail: {t['first_fail']['message']}")
            for p in t.get("problems", [])[:8]:
                if p.get("message") != (t.get("first_fail") or {}).get("message"):
                    lines.append(f"  problem: {p['message']}")
            for w in t.get("warnings", []):  # runs recorded before summary.json was a verdict
                lines.append(f"  summary.json (recorded as a warning): {w}")
            summary_bad = any(
                str(p.get("file", "")).endswith("summary.json") for p in t.get("problems", [])
            )
            if t["records"] and not summary_bad and not t.get("warnings"):
                lines.append("  summary.json: equal to the statistics recomputed live")
        return lines if len(lines) > 1 else []


class DsaTraceKind(Kind):
    name = "dsa_trace"
    description = "DeepSeek DSA top-k traces (seed 004): every dsa_topk record judged live"
    judge_class = DsaJudge
    pass_word, fail_word = TRACE_OK, TRACE_INVALID
    pass_words = frozenset({TRACE_OK})

    def compare_items(
        self, events: list[dict[str, Any]], summary: dict[str, Any] | None
    ) -> list[Item]:
        from analysis.compare_items import dsa_items

        return dsa_items(events, summary)

    sections = {
        "dsa": {
            "topk": (int, False, 0),  # the engine's index_topk; 0: summary.json config.index_topk
            "layers": (int, False, 0),  # 0: learned from the trace's first whole step
        }
    }
    smoke = ("dsa_smoke", ())
    watch_dirs = True  # `tracedeck watch DIR` follows a directory of this kind's traces

    def check(self, data: dict[str, Any], source: str, options: frozenset[str]) -> None:
        follow = data["traces"]["follow"]
        if not any("trace_steps" in f for f in follow):
            raise PresetError(
                source,
                "traces.follow",
                'name the shards, e.g. ["dsa/block64/trace_steps_*.jsonl"] (seed 004 5.1)',
            )
        if not any(str(a).endswith("summary.json") for a in data["artifacts"]["fetch"]):
            raise PresetError(
                source,
                "artifacts.fetch",
                'bring summary.json home, e.g. ["dsa/block64/summary.json"]',
            )
        dsa = data["dsa"]
        if dsa["topk"] < 0 or dsa["layers"] < 0:
            raise PresetError(source, "dsa", "topk and layers must be >= 0 (0: learned)")
        for key in ("topk", "layers"):
            value = data["vars"].get(key)
            if value is not None and dsa[key] and value != dsa[key]:
                raise PresetError(
                    source, f"dsa.{key}", f"{dsa[key]} differs from vars.{key} = {value}"
                )

    def printer(self) -> KindPrinter:
        return DsaPrinter()

    watch_options = (
        Option(
            "dsa_topk",
            "DSA: the index top-k (default: summary.json config.index_topk, read as soon as it "
            "appears; records wait for it)",
            parse=int,
        ),
        Option("dsa_layers", "DSA: layers per step (default: learned)", parse=int),
    )

    def watch(self, asked: Asked) -> int:
        """`tracedeck watch`: follow a trace directory (local or ssh://) with no preset or lock."""
        return watch_headless(asked)

    def claims(self, path: Path) -> bool:
        try:
            return path.is_dir() and bool(block_dirs(path))
        except NotATrace:
            return False

    def analyze_help(self) -> str:
        return "a DSA trace directory (--trace-out, with block<N>/trace_steps_*.jsonl)"

    analyze_options = (
        Option("dsa_topk", "DSA: the index top-k (default: summary.json's, else 2048)", parse=int),
        Option(
            "dsa_layers", "DSA: layers per step (default: summary.json's, else learned)", parse=int
        ),
    )

    def analyze(self, path: Path, asked: Asked) -> int:
        if (path / "run.json").is_file():
            return rejudge_run(path, asked)
        if asked.output is not None:
            asked.err(f"tracedeck: {self.name} analyze writes no file; --output is not used")
        from analysis.dsa_parallel import WorkerError
        from runners.resources import dsa_workers

        workers = dsa_workers(asked["workers"])
        try:
            result = analyze_dir(path, asked["dsa_topk"], asked["dsa_layers"], workers)
        except NotATrace as exc:
            asked.err(f"tracedeck: {exc}")
            return EXIT_USAGE
        except OSError as exc:  # a shard that is no readable file: named, and what to do
            asked.err(
                f"tracedeck: {exc.filename or path}: cannot read ({exc.strerror or exc}); each "
                "trace_steps_*.jsonl of a block directory must be a readable file: fix or move it"
            )
            return EXIT_USAGE
        except WorkerError as exc:
            asked.err(f"tracedeck: {path}: not judged: {exc}")
            return EXIT_INFRA
        if asked.json:
            asked.out(json.dumps(result, indent=2))
        else:
            asked.out(format_result(result))
        return EXIT_PASS if result["verdict"] == TRACE_OK else EXIT_FAIL


KIND = DsaTraceKind()


# -- tracedeck analyze RUN_DIR: a finished run re-judged from what it kept ---------------------


def rejudge_run(run_dir: Path, asked: Asked) -> int:
    """A DSA run's directory judged again. Its traces stay on the host (only summary.json comes
    home), so each trace is re-judged from the run's record: the digests of every batch as the
    console judged it (counts, first fails, the claims the cross-record checks tally, the exact
    aggregates) folded again, then the end-of-trace checks and summary.json recomputed against
    them. Shards copied into the run directory (<dir>/<trace-out>/block<N>/) are judged whole
    from their records instead. Nothing in the run directory is written."""
    from runners.kinds import event_types
    from runners.record import EVENTS, RunRecord, iter_events

    try:
        record = RunRecord.load(run_dir)
        events = list(iter_events(run_dir / EVENTS, event_types()))
    except (OSError, ValueError, TypeError) as exc:
        asked.err(f"tracedeck: {exc}")
        return EXIT_USAGE
    dsa = record.preset_data.get("dsa") if isinstance(record.preset_data.get("dsa"), dict) else {}
    topk, source = asked["dsa_topk"], "--dsa-topk"
    if topk is None and isinstance(dsa.get("topk"), int) and dsa["topk"] > 0:
        topk, source = dsa["topk"], "preset dsa.topk"
    layers = asked["dsa_layers"] or (dsa.get("layers") if isinstance(dsa.get("layers"), int) else 0)
    book = TraceBook(topk, layers or None, source if topk else "")
    recorded: RunFinished | None = None
    failed_cells: list[str] = []
    for event in events:
        if isinstance(event, TraceBatch):
            book.apply(event)
        elif isinstance(event, RunFinished):
            recorded = event
        elif isinstance(event, CellFinished) and event.exit_code not in (0, None):
            failed_cells.append(f"cell {event.cell} exited {event.exit_code}")
    traces: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for folder, stream in sorted(book.streams.items()):
        home = run_dir / folder.split("/artifacts/", 1)[-1]
        seen.add(home)
        traces.append(_rejudge_dir(home, folder, stream, book, topk, layers))
    for summary in sorted(run_dir.glob("**/block*/summary.json")):
        if summary.parent not in seen and BLOCK_DIR.fullmatch(summary.parent.name):
            traces.append(_rejudge_dir(summary.parent, str(summary.parent), None, book, topk, layers))  # fmt: skip
    if not traces:
        asked.err(
            f"tracedeck: {run_dir}: the run recorded no DSA trace batch and holds no trace "
            "directory: nothing to re-judge"
        )
        return EXIT_USAGE
    ok = all(t["verdict"] == TRACE_OK for t in traces) and not failed_cells
    verdict, code = (TRACE_OK, EXIT_PASS) if ok else (TRACE_INVALID, EXIT_FAIL)
    if recorded is not None and recorded.verdict == ENGINE_ERROR:
        verdict, code = ENGINE_ERROR, EXIT_INFRA  # the engine did not finish: never a pass
    result = {
        "verdict": verdict,
        "recorded_verdict": recorded.verdict if recorded is not None else None,
        "failed_cells": failed_cells,
        "traces": traces,
        **book.totals(),
    }
    if asked.json:
        asked.out(json.dumps(result, indent=2))
        return code
    asked.out(f"{run_dir}: re-judged from the run's record (its traces stay on the host)")
    for line in DsaPrinter().final(RunFinished(verdict=verdict, exit_code=code, summary=result)):
        asked.out(line)
    for cell in failed_cells:
        asked.out(f"  {cell}")
    shown = recorded.verdict if recorded is not None else "none (the run did not end here)"
    asked.out(f"recorded verdict: {shown} (left as it was)")
    asked.out(f"RESULT: {verdict}")
    return code


def _rejudge_dir(
    home: Path,
    folder: str,
    stream: TraceStream | None,
    book: TraceBook,
    topk: int | None,
    layers: int | None,
) -> dict[str, Any]:
    """One trace: whole from its shards when they are here, else from the recorded digests."""
    from analysis.dsa_tree import analyze_block, shard_files

    if home.is_dir() and shard_files(home):
        result = analyze_block(home, topk, layers or None)
        result["from"] = "the shards in the run directory"
        if stream is not None:  # followed live: the shards here must be the ones judged then
            for message in _not_as_followed(stream, result, home):
                fail = {"file": str(home), "line": None, "field": "shards", "message": message}
                result["problems"] = [*result.get("problems", []), fail]
                result["first_fail"] = result.get("first_fail") or fail
                result["verdict"] = TRACE_INVALID
        return result
    if stream is None:
        return _missing_dir(folder)
    engine, why = read_summary(home / "summary.json")
    result = trace_verdict(folder, stream, engine, why, None, book.serving_stats(folder))
    result["from"] = "the run's recorded digests"
    return result


# -- tracedeck watch: follow a trace directory some other process writes ----------------------


def split_watch_spec(spec: str) -> tuple[str, str]:
    """("local" | "ssh://user@host:port", directory) from DIR or ssh://[user@]host[:port]/DIR."""
    if spec.startswith("ssh://"):
        rest = spec[len("ssh://") :]
        host, slash, path = rest.partition("/")
        if not host or not slash or not path:
            raise ValueError(f"{spec}: use ssh://[user@]host[:port]/DIR (an absolute directory)")
        return f"ssh://{host}", "/" + path
    return "local", str(Path(spec).resolve())


async def watch_dir(
    spec: str,
    sink: Any,
    idle_s: float = 0.0,
    poll_s: float = 0.05,
    topk: int | None = None,
    layers: int | None = None,
    max_bytes: int | None = None,
    stop: Callable[[], bool] | None = None,
    say: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Follow every shard (and serving.jsonl) under a trace directory as it is written; each
    batch goes to `sink` as a TraceBatch. Returns the verdict once the writer's summary.json is
    there and nothing new came for idle_s seconds (idle_s 0: until cancelled, or until `stop()`
    says so). A batch is at most about max_bytes of lines (the follower's default: 4 MiB); it
    polls again at once while a file has more waiting, else after poll_s. A directory not
    there yet is waited for (`say` is told once); a block directory or shard that is a symbolic
    link is refused (ValueError naming it): watch reads only inside the directory it was given."""
    import asyncio

    from analysis.dsa_stream import BLOCK_DIR
    from runners.follow import POLL_BYTES, FileFollower
    from runners.targets.factory import parse_target

    target_spec, root = split_watch_spec(spec)
    target = parse_target(target_spec)
    await target.connect()
    book = TraceBook(topk, layers, "--dsa-topk" if topk else "")
    learned: set[str] = set()
    followers: dict[str, FileFollower] = {}
    sink_note = note or (lambda line: None)
    loop = asyncio.get_running_loop()
    quiet = loop.time()
    checked: set[str] = set()
    waiting = False
    try:
        while True:
            names = await target.list_dir(root)
            if names is None:
                if not waiting and say is not None:
                    say(f"waiting for {root} to appear on {target.name} (Ctrl-C to stop)")
                waiting = True
                if stop is not None and stop():
                    break
                await asyncio.sleep(poll_s)
                continue
            base = root.rsplit("/", 1)[-1]
            dirs = (
                [root]
                if BLOCK_DIR.fullmatch(base)
                else [f"{root}/{n}" for n in sorted(names) if BLOCK_DIR.fullmatch(n)]
            )
            summaries = 0
            await _refuse_links(target, root, [d for d in dirs if d != root], checked)
            for folder in dirs:
                new = []
                for name in sorted(await target.list_dir(folder) or []):
                    path = f"{folder}/{name}"
                    if (_is_shard(path) or name == SERVING) and path not in followers:
                        new.append(path)
                    summaries += name == "summary.json"
                    if name == "summary.json" and folder not in learned:
                        learned.add(folder)  # the top-k from the trace's own summary, at once
                        engine, _ = await _read_summary(target, folder)
                        for line in book.learn(folder, engine):
                            sink_note(line)
                await _refuse_links(target, root, new, checked)
                for path in new:
                    followers[path] = FileFollower(target, path)
            got_any = False
            behind = False
            for path, follower in sorted(followers.items()):
                got = await follower.poll(max_bytes=max_bytes or POLL_BYTES)
                behind = behind or not follower.caught_up
                if got is None:
                    continue
                got_any = True
                digest = book.feed(path, got.lines, got.first_line)
                sink(
                    TraceBatch(
                        cell=-2,
                        file=path,
                        first_line=got.first_line,
                        last_line=got.first_line + len(got.lines) - 1,
                        end_offset=got.end_offset,
                        digest=digest,
                    )
                )
            now = loop.time()
            if got_any:
                quiet = now
            elif idle_s and dirs and summaries == len(dirs) and now - quiet >= idle_s:
                break
            if stop is not None and stop():
                break
            await asyncio.sleep(0 if behind else poll_s)
        traces = []
        for folder, stream in sorted(book.streams.items()):
            engine, why = await _read_summary(target, folder)
            shards = [f for f in followers if f.startswith(folder + "/") and _is_shard(f)]
            traces.append(
                trace_verdict(folder, stream, engine, why, shards, book.serving_stats(folder))
            )
        ok = bool(traces) and all(t["verdict"] == TRACE_OK for t in traces)
        verdict = TRACE_OK if ok else TRACE_INVALID
        return {"verdict": verdict, "traces": traces, **book.totals()}
    finally:
        await target.close()


async def _refuse_links(target: Any, root: str, paths: list[str], checked: set[str]) -> None:
    """ValueError naming the first of `paths` (not checked before) that is a symbolic link."""
    import shlex

    fresh = [p for p in paths if p not in checked]
    if not fresh:
        return
    words = " ".join(shlex.quote(p) for p in fresh)
    result = await target.run(f'for p in {words}; do [ -L "$p" ] && printf "%s\\n" "$p"; done; :')
    links = result.stdout.splitlines()
    if links:
        raise ValueError(
            f"{links[0]} on {target.name} is a symbolic link: watch reads only inside {root}; "
            "watch the directory it points to instead, or copy the files in"
        )
    checked.update(fresh)


def watch_headless(asked: Asked) -> int:
    """`tracedeck watch DIR --headless`: the run's headless lines, then the verdict."""
    import asyncio

    printer = DsaPrinter()

    def sink(event: TraceBatch) -> None:
        for line in printer.lines(event):
            asked.out(line)

    try:
        result = asyncio.run(
            watch_dir(
                asked["dir"],
                sink,
                asked["idle"],
                topk=asked["dsa_topk"],
                layers=asked["dsa_layers"],
                say=lambda text: asked.err(f"tracedeck: {text}"),
                note=asked.out,
            )
        )
    except (ValueError, FileNotFoundError) as exc:
        asked.err(f"tracedeck: {exc}")
        return EXIT_USAGE
    except TargetError as exc:  # the host did not answer, the link dropped: infrastructure
        asked.err(f"tracedeck: watch {asked['dir']}: {exc}")
        return EXIT_INFRA
    for line in printer.final(RunFinished(verdict=result["verdict"], exit_code=0, summary=result)):
        asked.out(line)
    asked.out(f"RESULT: {result['verdict']}")
    return EXIT_PASS if result["verdict"] == TRACE_OK else EXIT_FAIL


async def _read_summary(target: Any, folder: str) -> tuple[dict[str, Any], str]:
    """A followed trace directory's summary.json (the engine's, seed 5.3), or why there is none."""
    raw = await target.read_from(f"{folder}/summary.json", 0, 1 << 24)
    if not raw:
        return {}, "missing"
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"unreadable ({exc})"
    except RecursionError:
        return {}, "unreadable (nested deeper than a JSON parser reads)"
    return (data, "") if isinstance(data, dict) else ({}, "not a JSON object")
