"""03C KV-cache invariance (seed 002): the grid judged cell by cell as results come home.

Two sources fill the same grid ([kv_invariance] source):

- ``reference``: one tracedeck cell per grid point (matrix keys d, kv, b, gqa, mask, alibi,
  sinks). The engine writes DIR/result.json and DIR/flows.bin; the preset fetches both
  ([artifacts] fetch) and the cell is judged as soon as they are home. A precondition abort
  exits 4 (EXIT_PRECONDITION) and prints its record on stdout (a failed cell's artifacts are not
  fetched): the judge reads the record from the cell's output and writes DIR/result.json at home
  so `tracedeck analyze` re-judges the same tree.
- ``llamacpp``: llama.cpp's tests/test-kvcache-invariance, its output followed as a trace
  ([traces] follow) and folded line by line (analysis.kv_invariance_llamacpp) for the live
  grid; when the test ends each backend's cells are judged from the fetched log (complete,
  whatever the follower read), or from the followed lines when the log did not come home.

Each cell's verdict is a KvCellVerdict event; the end of the run writes kv_invariance_summary.json
(the verdict the exit code says) into the run's local directory.
"""

from __future__ import annotations

import asyncio
import copy
import json
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import orjson

from analysis.kv_invariance import (
    CHUNK_GATE,
    DETERMINISTIC,
    EXIT_PRECONDITION,
    FAIL_INVARIANCE,
    FORMAT,
    PASS_INVARIANCE,
    POINT_KEYS,
    RESULT,
    SUMMARY,
    UNJUDGED,
    VERDICT_EXIT,
    CellResult,
    describe,
    find_cells,
    grid_of,
    judge_cell_dir,
    once_per_point,
    parse_precondition_line,
    point_label,
    point_of,
    precondition_result,
    summarize,
    unjudged,
)
from analysis.kv_invariance_llamacpp import LOG_NAME, LlamaCppBook, parse_line, read_log
from analysis.run_compare import Item
from runners.atomic import write_atomic
from runners.cells import CellState, cell_name
from runners.events import (
    ArtifactFailed,
    CellFinished,
    Event,
    OutputLines,
    RunFinished,
    event,
)
from runners.exits import EXIT_USAGE
from runners.fetch import changed_since_fetched
from runners.kind import (
    Asked,
    Digest,
    Ending,
    Judge,
    JudgeContext,
    Kind,
    KindPrinter,
    failure_text,
)
from runners.kinds import event_types
from runners.presets import PresetError
from runners.record import EVENTS, RUN_JSON, RunRecord, read_events
from runners.templates import TemplateError, render_plain, template_fields

SOURCES = ("reference", "llamacpp")


@event
class KvCellVerdict(Event):
    """One grid cell judged: BITWISE_EQUAL, DIFFERS, PRECONDITION or UNJUDGED (with why).

    cell: the tracedeck cell it came from; source: "" for the reference engine, else the
    llama.cpp backend; detail: the first differing element and spread (DIFFERS), the rule's fix
    (PRECONDITION), the flows compared (BITWISE_EQUAL).
    """

    type: ClassVar[str] = "kv_cell_verdict"
    cell: int
    point: dict[str, int]
    verdict: str
    source: str = ""
    detail: dict[str, Any] | None = None
    reason: str = ""
    klass: str = ""
    where: str = ""

    def result(self) -> CellResult:
        return CellResult(
            dict(self.point),
            self.verdict,
            source=self.source,
            detail=dict(self.detail or {}),
            reason=self.reason,
            klass=self.klass,
            where=self.where,
        )


def verdict_event(cell: int, r: CellResult) -> KvCellVerdict:
    return KvCellVerdict(
        cell=cell,
        point=dict(r.point),
        verdict=r.verdict,
        source=r.source,
        detail=r.detail,
        reason=r.reason,
        klass=r.klass,
        where=r.where,
    )


def result_dir(artifacts: tuple[str, ...] | list[str]) -> str | None:
    """The directory of a cell's result.json among its artifacts (relative to the run's)."""
    for rel in artifacts:
        path = PurePosixPath(rel)
        if path.name == RESULT:
            return str(path.parent)
    return None


def chunk_gate(env: dict[str, str]) -> bool:
    return str(env.get(CHUNK_GATE, "")) == "1"


# ---------------------------------------------------------------- the judge


class KvInvarianceJudge(Judge):
    def __init__(self, kind: Kind, ctx: JudgeContext) -> None:
        super().__init__(kind, ctx)
        section = ctx.preset.section("kv_invariance")
        self.source: str = section["source"]
        self.required: list[str] = [str(b) for b in section["require_backends"]]
        self.points: dict[int, dict[str, int]] = {}
        self.dirs: dict[int, str] = {}
        if self.source == "reference":
            for cell in ctx.cells:
                self.points[cell.index] = point_of(cell.params)
                self.dirs[cell.index] = result_dir(cell.artifacts) or "."
        self.judged: dict[int, list[KvCellVerdict]] = {}
        self.preconditions: dict[int, dict[str, Any]] = {}
        self.failed_artifacts: dict[int, list[ArtifactFailed]] = {}
        self.book = LlamaCppBook()  # the followed lines, live
        self.final: dict[int, LlamaCppBook] = {}  # per cell, the book its verdicts came from

    # -- folding -------------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        if isinstance(event, KvCellVerdict):
            self.judged.setdefault(event.cell, []).append(event)
        elif isinstance(event, OutputLines) and event.stream == "stdout":
            for line in event.lines:
                record = parse_precondition_line(line)
                if record is not None:
                    self.preconditions.setdefault(event.cell, record)
        elif isinstance(event, ArtifactFailed):
            self.failed_artifacts.setdefault(event.cell, []).append(event)

    def digest(self, cell: int, file: str, lines: list[bytes], first_line: int) -> Digest:
        if self.source != "llamacpp":
            return Digest()
        facts = []
        book = copy.deepcopy(self.book)  # a few grid cells: each fact is checked against the
        for raw in lines:  # facts before it, and the judge's own book changes only when applied
            fact = parse_line(raw.decode("utf-8", "replace"))
            if fact is not None and book.wants(fact):
                book.apply(fact)
                facts.append(fact)
        return Digest({"llamacpp": facts} if facts else None)

    def apply_digest(self, cell: int, file: str, data: dict[str, Any]) -> None:
        for fact in data.get("llamacpp", []):
            self.book.apply(fact)

    # -- judging -------------------------------------------------------------------------------

    async def advance(self) -> None:
        for cell in self.ctx.cells:
            index = cell.index
            done = self.finished.get(index)
            if index in self.judged or done is None:
                continue
            if self.source == "llamacpp":
                book = self.final[index] = await self._llamacpp_book(index)
                cells, _, _ = book.results(done.exit_code, self.required)
                for r in cells:
                    self.ctx.emit(verdict_event(index, r))
                if not cells:
                    self.judged.setdefault(index, [])
                continue
            result = await self._judge_reference(index, done)
            if result is not None:
                self.ctx.emit(verdict_event(index, result))

    async def _llamacpp_book(self, index: int) -> LlamaCppBook:
        """The whole log when it came home, else what was followed of it."""
        cell = next(c for c in self.ctx.cells if c.index == index)
        logs = [
            a for a in cell.artifacts if a.endswith(".log") and a in self.fetched.get(index, ())
        ]
        if not logs:
            return self.book
        text = await asyncio.to_thread(
            (self.ctx.local_dir / logs[0]).read_text, encoding="utf-8", errors="replace"
        )
        return read_log(text)

    async def _judge_reference(self, index: int, done: CellFinished) -> CellResult | None:
        point, rel = self.points[index], self.dirs[index]
        name = cell_name(index, next(c.params for c in self.ctx.cells if c.index == index))
        if done.state == CellState.PASSED:
            failed = self.failed_artifacts.get(index)
            if failed:
                f = failed[0]
                why = f"{name}: exited 0 but {f.path}: {f.reason}"
                return unjudged(point, "engine" if f.missing else "infra", why)
            cell = next(c for c in self.ctx.cells if c.index == index)
            if not set(cell.artifacts) <= self.fetched.get(index, set()):
                return None  # still coming home
            result = await asyncio.to_thread(
                judge_cell_dir,
                self.ctx.local_dir / rel,
                point,
                chunk_gate(cell.env),
                cell.params,
                str(cell.env.get(DETERMINISTIC, "")) == "1",
            )
            result.where = rel
            return result
        if done.state == CellState.FAILED and done.exit_code == EXIT_PRECONDITION:
            record = self.preconditions.get(index)
            if record is None:
                why = (
                    f"{name}: exited {EXIT_PRECONDITION} (the precondition code) but printed no "
                    f"KV_INVARIANCE_PRECONDITION record; {failure_text(done)}"
                )
                return unjudged(point, "engine", why)
            await asyncio.to_thread(self._keep_precondition, rel, point, record)
            return precondition_result(point, record, rel)
        return unjudged(point, "engine", f"{name}: {failure_text(done)}")

    def _keep_precondition(self, rel: str, point: dict[str, int], record: dict[str, Any]) -> None:
        """The abort's result.json at home (the failed cell's own was not fetched)."""
        path = self.ctx.local_dir / rel / RESULT
        if path.exists():
            return
        doc = {
            "format": FORMAT,
            "status": "PRECONDITION",
            "point": point,
            **{k: record.get(k, "") for k in ("rule", "message", "fix", "where")},
            "written_by": "tracedeck, from the engine's stdout record: a cell that exits "
            f"{EXIT_PRECONDITION} has its artifacts left on the target",
        }
        write_atomic(path, json.dumps(doc, indent=2) + "\n")

    # -- the end -------------------------------------------------------------------------------

    def results(self) -> tuple[list[CellResult], list[tuple[str, str]], list[str]]:
        cells: list[CellResult] = []
        problems: list[tuple[str, str]] = []
        notes: list[str] = []
        for cell in self.ctx.cells:
            got = self.judged.get(cell.index)
            cells += [e.result() for e in got or []]
            done = self.finished.get(cell.index)
            how = failure_text(done) if done is not None else "the run ended before it did"
            name = cell_name(cell.index, cell.params)
            if self.source == "llamacpp":
                if done is None or done.state != CellState.PASSED:
                    problems.append(("engine", f"{name}: {how}"))
            elif not got:
                cells.append(unjudged(self.points[cell.index], "engine", f"{name}: {how}"))
        if self.source == "llamacpp":
            for cell in self.ctx.cells:
                done = self.finished.get(cell.index)
                book = self.final.get(cell.index, self.book)
                _, extra, told = book.results(done.exit_code if done else None, self.required)
                problems += extra
                notes += told
        return cells, problems, notes

    def verdict(self, ending: Ending) -> RunFinished:
        cells, problems, notes = self.results()
        summary = summarize(cells, self.ctx.date, problems, notes)
        errors = [e.message for e in self.errors]
        summary["errors"] = errors
        if summary["global_verdict"] == PASS_INVARIANCE and errors:
            summary["global_verdict"] = FAIL_INVARIANCE
            summary["reason"] = f"every cell bitwise equal, but the run had errors: {errors[0]}"
        word = summary["global_verdict"]
        return RunFinished(verdict=word, exit_code=VERDICT_EXIT[word], summary=summary)

    def keep(self, result: RunFinished) -> None:
        write_atomic(self.ctx.local_dir / SUMMARY, json.dumps(result.summary, indent=2) + "\n")


# ---------------------------------------------------------------- headless lines


def final_lines(summary: dict[str, Any]) -> list[str]:
    cells = [CellResult.from_json(c) for c in summary.get("cells") or []]
    lines = [""] if cells else []
    lines += [
        "KV-cache invariance grid ('=' equal, 'X' differs, 'P' precondition, '?' unjudged, "
        "'-' not run):"
    ]
    lines += ["  " + line for line in grid_of(cells).text()] if cells else ["  (no cell)"]
    ff = summary.get("first_fail")
    if ff:
        lines.append(
            f"first fail: {point_label(ff.get('point', {}), ff.get('source', ''))}"
            + (
                f": {ff['flows'][0]} vs {ff['flows'][1]} at batch {ff.get('batch')} head "
                f"{ff.get('head')} index {ff.get('index')}"
                if ff.get("flows") and ff.get("batch") is not None
                else ""
            )
        )
    for p in summary.get("problems") or []:
        lines.append(f"not judged ({p['class']}): {p['why']}")
    for note in summary.get("notes") or []:
        lines.append(f"note: {note}")
    if summary.get("reason"):
        lines.append(f"why: {summary['reason']}")
    return lines


class KvInvariancePrinter(KindPrinter):
    def lines(self, event: Event) -> list[str]:
        if not isinstance(event, KvCellVerdict):
            return []
        return ["kv " + line if i == 0 else line for i, line in enumerate(describe(event.result()))]

    def final(self, event: RunFinished) -> list[str]:
        if "cells" not in event.summary:
            return []
        return final_lines(event.summary)


# ---------------------------------------------------------------- the kind


class KvInvarianceKind(Kind):
    name = "kv_invariance"
    description = (
        "03C KV-cache invariance: single-shot vs incremental vs chunked, bitwise (seed 002)"
    )
    judge_class = KvInvarianceJudge
    judges_items_apart = True
    verdict_key = "global_verdict"
    events = (KvCellVerdict,)
    pass_word, fail_word = PASS_INVARIANCE, FAIL_INVARIANCE
    pass_words = frozenset({PASS_INVARIANCE, "BITWISE_EQUAL"})

    item_events = (KvCellVerdict,)

    def item_of(self, event: Event) -> Item:
        from analysis.compare_items import kv_cell_item

        return kv_cell_item(event.to_dict())

    def compare_items(
        self, events: list[dict[str, Any]], summary: dict[str, Any] | None
    ) -> list[Item]:
        from analysis.compare_items import kv_items

        return kv_items(events)

    smoke = ("kv_invariance_smoke", ())
    sections: ClassVar[dict[str, dict[str, tuple[Any, bool, Any]]]] = {
        "kv_invariance": {
            "source": (str, False, "reference"),
            "require_backends": (list, False, []),
        },
    }

    def exit_code(self, word: str) -> int:
        return VERDICT_EXIT.get(word, super().exit_code(word))

    def matrix_keys_read(self, data: dict[str, Any]) -> set[str]:
        return set(POINT_KEYS)  # a reference cell's grid point

    def check(
        self, data: dict[str, Any], source: str, options: frozenset[str] = frozenset()
    ) -> None:
        section = data["kv_invariance"]
        if section["source"] not in SOURCES:
            raise PresetError(
                source, "kv_invariance.source", f"must be one of {', '.join(SOURCES)}"
            )
        for i, name in enumerate(section["require_backends"]):
            if not isinstance(name, str) or not name:
                raise PresetError(source, f"kv_invariance.require_backends[{i}]", "a backend name")
        if section["source"] == "llamacpp":
            self._check_llamacpp(data, source)
        else:
            self._check_reference(data, source)

    def _check_llamacpp(self, data: dict[str, Any], source: str) -> None:
        if not data["traces"]["follow"]:
            raise PresetError(
                source, "traces.follow", "name the test's output file (stderr and stdout in one)"
            )
        for key, values in data["matrix"].items():
            if len(values) != 1:
                raise PresetError(
                    source,
                    f"matrix.{key}",
                    "a llama.cpp preset runs the test once: one value per key",
                )

    def _check_reference(self, data: dict[str, Any], source: str) -> None:
        matrix = data["matrix"]
        if data["kv_invariance"]["require_backends"]:
            raise PresetError(
                source, "kv_invariance.require_backends", 'only for source = "llamacpp"'
            )
        for key in POINT_KEYS:
            if key not in matrix:
                raise PresetError(source, f"matrix.{key}", "a grid point needs this key")
            for i, value in enumerate(matrix[key]):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise PresetError(source, f"matrix.{key}[{i}]", "must be an integer >= 0")
                if key in ("mask", "alibi", "sinks") and value not in (0, 1):
                    raise PresetError(source, f"matrix.{key}[{i}]", "must be 0 or 1")
        fetch = data["artifacts"]["fetch"]
        results = [f for f in fetch if PurePosixPath(f).name == RESULT]
        flows = [f for f in fetch if PurePosixPath(f).name == "flows.bin"]
        if len(results) != 1 or len(flows) != 1:
            raise PresetError(
                source,
                "artifacts.fetch",
                "must name the cell's DIR/result.json and DIR/flows.bin, once each",
            )
        folder = str(PurePosixPath(results[0]).parent)
        if str(PurePosixPath(flows[0]).parent) != folder:
            raise PresetError(
                source, "artifacts.fetch", "result.json and flows.bin must be in one directory"
            )
        try:
            used = set(template_fields(folder))
        except TemplateError as exc:
            raise PresetError(source, "artifacts.fetch", str(exc)) from None
        shared = [k for k, v in matrix.items() if len(v) > 1 and k not in used]
        if shared and "cell" not in used:
            raise PresetError(
                source,
                "artifacts.fetch",
                f"cells that differ in {', '.join(shared)} would share {folder}/: put "
                f"{{{shared[0]}}} (or {{cell}}) in the directory",
            )
        if "{out}/" + folder not in data["engine"]["command"]:
            raise PresetError(
                source,
                "engine.command",
                f"the engine must write where the results are fetched from: {{out}}/{folder}",
            )

    def printer(self) -> KindPrinter:
        return KvInvariancePrinter()

    # -- tracedeck analyze -----------------------------------------------------------------------

    def claims(self, path: Path) -> bool:
        if path.is_dir():
            return bool(find_cells(path)) or any(path.rglob(LOG_NAME))
        return path.is_file() and _looks_like_log(path)

    def analyze_help(self) -> str:
        return (
            f"a KV-invariance tree (DIR/result.json + flows.bin per cell) or llama.cpp's {LOG_NAME}"
        )

    def analyze(self, path: Path, asked: Asked) -> int:
        try:
            changed = _changed_since_fetched(path)
            if changed:
                asked.err(
                    f"tracedeck: {path}: {len(changed)} file(s) the run judged changed since "
                    f"it fetched them, e.g. {changed[0]}; judging them now would not judge the "
                    "run (nothing was written): `tracedeck fetch` or a rerun brings the real ones"
                )
                return EXIT_USAGE
            cells, problems, notes = _analyze(path)
        except (OSError, ValueError) as exc:
            asked.err(f"tracedeck: {exc}")
            return EXIT_USAGE
        date = datetime.now(UTC).strftime("%Y-%m-%d")
        if not cells and not problems:
            problems = [("input", f"{path}: no kv_invariance result.json and no {LOG_NAME} here")]
        summary = summarize(cells, date, problems, notes)
        # Into the tree (or --output, leaving the tree untouched); a lone log writes nothing
        # unless --output names where.
        output = asked.output
        folder = Path(output) if output is not None else (path if path.is_dir() else None)
        wrote = []
        if folder is not None:
            write_atomic(folder / SUMMARY, json.dumps(summary, indent=2) + "\n")
            wrote.append(folder / SUMMARY)
        code = VERDICT_EXIT[summary["global_verdict"]]
        if asked.json:
            doc = {**summary, "wrote": [str(w) for w in wrote]}
            asked.out(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
            for w in wrote:
                asked.err(f"tracedeck: wrote {w}")
            return code
        for c in cells:
            for line in describe(c):
                asked.out(line)
        for line in final_lines(summary):
            asked.out(line)
        for w in wrote:
            asked.out(f"wrote {w}")
        asked.out(f"global verdict: {summary['global_verdict']}")
        return code


def _changed_since_fetched(root: Path) -> list[str]:
    """runners.fetch.changed_since_fetched for a run's directory; [] for another tree (a
    record that cannot be read raises: a run's cells are judged against its record)."""
    if not (root / RUN_JSON).is_file() or not (root / EVENTS).is_file():
        return []
    try:
        events = read_events(root / EVENTS, event_types()).events
    except TypeError as exc:
        raise ValueError(f"{root / EVENTS}: {exc}") from exc
    return changed_since_fetched(root, events)


def _looks_like_log(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return False
    marks = (b"[kvci]", b"KV invariance:", b"Backends passed:", b"No backends available")
    return any(m in head for m in (*marks, b"[SKIP] ", b"[tracedeck] test-kvcache-invariance"))


def _analyze(path: Path) -> tuple[list[CellResult], list[tuple[str, str]], list[str]]:
    """Re-judge a tree (or one llama.cpp log): the cells, the problems, the notes."""
    if path.is_file():
        return _log_results(path)
    cells = []
    planned = _planned_cells(path)
    for folder in find_cells(path):
        # A run directory's cells are judged as the run judged them: against the point, the
        # parameters and the environment each was planned with.
        cell = planned.get(str(folder.relative_to(path)))
        if cell is None:
            cells.append(judge_cell_dir(folder))
        else:
            env = cell.get("env") or {}
            cells.append(
                judge_cell_dir(
                    folder,
                    point_of(cell["params"]),
                    chunk_gate(env),
                    cell["params"],
                    str(env.get(DETERMINISTIC, "")) == "1",
                )
            )
        cells[-1].where = str(folder.relative_to(path))
    cells = once_per_point(cells)
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    for log in sorted(path.rglob(LOG_NAME)):
        more, extra, told = _log_results(log)
        cells += more
        problems += extra
        notes += told
    cells += _planned_without_result(path, cells)
    return cells, problems, notes


def _planned_cells(root: Path) -> dict[str, dict[str, Any]]:
    """A run directory's reference cells by the directory their result is fetched into."""
    plan = root / "plan.json"
    if not (root / RUN_JSON).is_file() or not plan.is_file():
        return {}
    try:
        record = RunRecord.load(root)
        doc = orjson.loads(plan.read_bytes())
    except (OSError, ValueError, TypeError):
        return {}
    fetch = record.preset_data.get("artifacts", {}).get("fetch") or []
    folder = result_dir(fetch)
    out: dict[str, dict[str, Any]] = {}
    for cell in doc.get("cells") or []:
        params = cell.get("params") or {}
        if folder is None or not all(k in params for k in POINT_KEYS):
            continue
        try:
            out[str(PurePosixPath(render_plain(folder, params)))] = cell
        except (KeyError, ValueError, TemplateError):
            continue
    return out


def _log_results(log: Path) -> tuple[list[CellResult], list[tuple[str, str]], list[str]]:
    """One llama.cpp log judged; its problems name the log."""
    cells, problems, notes = read_log(log.read_text(encoding="utf-8", errors="replace")).results(
        None
    )
    return cells, [(cls, f"{log}: {text}") for cls, text in problems], notes


def _planned_without_result(root: Path, found: list[CellResult]) -> list[CellResult]:
    """For a run directory: planned grid points with no result, named with what the run saw."""
    plan = root / "plan.json"
    if not (root / RUN_JSON).is_file() or not plan.is_file():
        return []
    cells = orjson.loads(plan.read_bytes()).get("cells") or []
    recorded: dict[int, list[KvCellVerdict]] = {}
    if (root / EVENTS).is_file():
        for e in read_events(root / EVENTS, event_types()).events:
            if isinstance(e, KvCellVerdict):
                recorded.setdefault(e.cell, []).append(e)
    have = {tuple(sorted(c.point.items())) for c in found if not c.source}
    out: list[CellResult] = []
    for cell in cells:
        try:
            point = point_of(cell.get("params") or {})
        except (KeyError, TypeError, ValueError):
            continue  # not a reference grid cell (a llama.cpp run)
        if tuple(sorted(point.items())) in have:
            continue
        got = [e for e in recorded.get(int(cell.get("index", -1)), []) if e.verdict == UNJUDGED]
        if got:
            out.append(got[0].result())
        else:
            why = f"{point_label(point)}: planned, but no result.json is in {root}"
            out.append(unjudged(point, "input", why))
    return out


KIND = KvInvarianceKind()
