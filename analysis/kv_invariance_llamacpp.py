"""llama.cpp's own KV-invariance test (tests/test-kvcache-invariance.cpp, ggml-org/llama.cpp
PR #16016) read line by line and mapped onto the 03C grid.

What the test does (read from the PR's source): for each ggml backend, for D in (128, 256),
gqa in (1, 2) (8 query heads) and KV in (256, 1024), it builds the single-shot graph (N = P =
KV) and then P incremental graphs (N = 1, KV padded to 256), and compares the last token's
output bytes. Every graph prints ``[kvci] q ne=[D,N,H,1]`` and ``[kvci] k ne=[D,KV,Hkv,1]`` on
stderr; the first mismatch prints ``[FAIL] KV invariance: backend=<name> D=<d> KV=<kv>
gqa=<g>`` and ``[FAIL] <name> rc=1`` and ends the test (exit 1). A backend that ran everything
prints ``[OK] <name>``; ``[SKIP] cannot init backend: <name>``, ``[SKIP] backend error: <what>``,
``[SKIP] No backend initialized``, ``No backends available`` and ``Backends passed: N`` complete
the vocabulary. Run it with stderr into stdout (2>&1) so the lines keep their order.

Two things the test does that a verdict must not: a backend that threw (``[SKIP] backend
error``) is then printed ``[OK]`` and counted as passed; and a backend stops at its first
failure, so its later cells never ran. Here the first is a cell that could not be judged and the
second cells that were not run; neither is ever shown as equal.

The grid point of a llama.cpp cell is d, kv, gqa as the test names them, b=1, mask=1 (the test
always passes a mask), alibi=0, sinks=0; its source is the backend's name.

Pure: facts from lines (``parse_line``), folded in order (``LlamaCppBook.apply``), so the judge,
the panel and a replay build the same state from the same facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from analysis.kv_invariance import (
    BITWISE_EQUAL,
    DIFFERS,
    CellResult,
    precondition_result,
    unjudged,
)

LOG_NAME = "test-kvcache-invariance.log"
EXIT_LINE = "[tracedeck] test-kvcache-invariance exited {rc}"
HEADS = 8
# (D, KV, gqa) in the order the test runs them: D, then gqa, then KV.
GRID: tuple[tuple[int, int, int], ...] = tuple(
    (d, kv, g) for d in (128, 256) for g in (1, 2) for kv in (256, 1024)
)
REPORTED_BY = "llama.cpp tests/test-kvcache-invariance"

_Q = re.compile(r"^\[kvci\] q ne=\[(\d+),(\d+),(\d+),(\d+)\]")
_K = re.compile(r"^\[kvci\] k ne=\[(\d+),(\d+),(\d+),(\d+)\]")
_FAIL_CELL = re.compile(r"^\[FAIL\] KV invariance: backend=(.+?) D=(\d+) KV=(\d+) gqa=(\d+)\s*$")
_FAIL = re.compile(r"^\[FAIL\] (.+) rc=(-?\d+)\s*$")
_OK = re.compile(r"^\[OK\] (.+?)\s*$")
_SKIP_INIT = re.compile(r"^\[SKIP\] cannot init backend: (.+?)\s*$")
_SKIP_ERROR = re.compile(r"^\[SKIP\] backend error: (.*?)\s*$")
_NONE = re.compile(r"^(\[SKIP\] No backend initialized|No backends available)\s*$")
_PASSED = re.compile(r"^Backends passed: (\d+)\s*$")
_EXIT = re.compile(r"^\[tracedeck\] test-kvcache-invariance exited (\d+)\s*$")
_FATAL = re.compile(
    r"GGML_ASSERT|GGML_ABORT|terminate called|core dumped|Segmentation fault|Aborted|fatal|"
    r"error|not found|No such file",
    re.IGNORECASE,
)
# fattn-common.cuh's shape asserts ("Incorrect KV cache padding.", "... requires the mask to be
# padded ..."): an abort on the deterministic policy, i.e. a precondition, not a crash.
_POLICY = re.compile(r"KV cache padding|FATTN_KQ_STRIDE|mask to be padded|KQ_MASK_PAD", re.I)
POLICY_FIX = (
    "pad the KV cache to a multiple of 256 (FATTN_KQ_STRIDE) and the KQ mask to PAD(N, 64), "
    "or build and run with deterministic mode (GGML_DETERMINISTIC=1), which pads them"
)
TEXT_LIMIT = 300


def parse_line(line: str) -> list[Any] | None:
    """One output line as a fact, or None for a line that says nothing to the verdict.

    Facts: ["q", D, N, H], ["k", KV, Hkv], ["fail_cell", backend, D, KV, gqa, line],
    ["fail", backend, rc], ["ok", backend], ["skip_init", backend], ["skip_error", what],
    ["none", line], ["passed", N], ["exit", rc], ["fatal", line]. The exit line is the one the
    shipped preset's command appends (EXIT_LINE), so the log carries the test's exit code.
    """
    line = line.rstrip("\r\n")
    if line.startswith("[kvci] "):
        m = _Q.match(line)
        if m:
            return ["q", int(m[1]), int(m[2]), int(m[3])]
        m = _K.match(line)
        if m:
            return ["k", int(m[2]), int(m[3])]
        return None
    m = _FAIL_CELL.match(line)
    if m:
        return ["fail_cell", m[1], int(m[2]), int(m[3]), int(m[4]), line[:TEXT_LIMIT]]
    m = _FAIL.match(line)
    if m:
        return ["fail", m[1], int(m[2])]
    m = _OK.match(line)
    if m:
        return ["ok", m[1]]
    m = _SKIP_INIT.match(line)
    if m:
        return ["skip_init", m[1]]
    m = _SKIP_ERROR.match(line)
    if m:
        return ["skip_error", m[1][:TEXT_LIMIT]]
    if _NONE.match(line):
        return ["none", line.strip()]
    m = _PASSED.match(line)
    if m:
        return ["passed", int(m[1])]
    m = _EXIT.match(line)
    if m:
        return ["exit", int(m[1])]
    if _FATAL.search(line):
        return ["fatal", line.strip()[:TEXT_LIMIT]]
    return None


def point(d: int, kv: int, gqa: int) -> dict[str, int]:
    return {"d": d, "kv": kv, "b": 1, "gqa": gqa, "mask": 1, "alibi": 0, "sinks": 0}


@dataclass
class Backend:
    index: int
    name: str | None = None
    states: dict[tuple[int, int, int], str] = field(default_factory=dict)
    current: tuple[int, int, int] | None = None
    pending: tuple[int, int, int] | None = None  # (D, N, H) of a single-shot q line
    incremental: set[tuple[int, int, int]] = field(default_factory=set)  # cells with N=1 seen
    odd: list[str] = field(default_factory=list)  # graphs outside the test's grid
    outcome: str = "running"  # running | ok | fail | skipped | error
    error: str = ""
    policy: str = ""  # a shape assert that aborted the test inside this backend
    reported: str = ""
    rc: int | None = None

    @property
    def label(self) -> str:
        return self.name or f"backend {self.index + 1}"


class LlamaCppBook:
    """The test's output folded fact by fact: per backend, each grid cell's state."""

    def __init__(self) -> None:
        self.backends: list[Backend] = []
        self.none = ""
        self.passed: int | None = None
        self.exit_code: int | None = None  # from the preset's exit line, when the log has it
        self.fatal: list[str] = []
        self.exits_seen: list[int] = []  # exit lines after the first (a log is one run)

    def open(self) -> Backend:
        if self.backends and self.backends[-1].outcome == "running":
            return self.backends[-1]
        backend = Backend(len(self.backends))
        self.backends.append(backend)
        return backend

    def wants(self, fact: list[Any]) -> bool:
        """Does the fact change anything? (Only a cell's single-shot q and k lines and its first
        incremental q line do: a digest keeps a backend's ~10^4 [kvci] lines down to those.)"""
        if fact[0] == "q":
            if int(fact[2]) > 1:
                return True
            last = self.backends[-1] if self.backends else None
            return (
                last is not None
                and last.outcome == "running"
                and last.current is not None
                and last.current not in last.incremental
            )
        if fact[0] == "k":
            last = self.backends[-1] if self.backends else None
            return (
                last is not None
                and last.outcome == "running"
                and last.pending is not None
                and int(fact[1]) == last.pending[1]
            )
        return True

    def apply(self, fact: list[Any]) -> None:
        word = fact[0]
        if word == "q":
            d, n, h = int(fact[1]), int(fact[2]), int(fact[3])
            if n > 1:  # a single-shot graph: a new cell begins, so the one before passed
                b = self.open()
                _close(b)
                b.current, b.pending = None, (d, n, h)
            elif self.backends:
                current = self.backends[-1].current
                if current is not None:
                    self.backends[-1].incremental.add(current)
        elif word == "k":
            b = self.open()
            if b.pending is not None and int(fact[1]) == b.pending[1] and int(fact[2]) > 0:
                d, n, h = b.pending
                hkv = int(fact[2])
                cell = (d, n, h // hkv)
                if h % hkv or h != HEADS or cell not in GRID:
                    b.odd.append(
                        f"a graph with q ne=[{d},{n},{h},1] and k ne=[{d},{n},{hkv},1] is not a "
                        f"cell of the test's grid (D 128/256, KV 256/1024, {HEADS} heads, "
                        "gqa 1/2)"
                    )
                    b.pending = None
                    return
                if cell in b.states:
                    # The test runs each cell once per backend: a second run must not turn the
                    # first one's verdict (a [FAIL] above all) into another.
                    b.odd.append(
                        f"cell D={cell[0]} KV={cell[1]} gqa={cell[2]} is run twice (it was "
                        f"{b.states[cell]}): the test runs each cell once per backend, so this "
                        "log is not one run of it"
                    )
                    b.pending = None
                    if b.states[cell] != "running":
                        return
                b.states[cell] = "running"
                b.current, b.pending = cell, None
        elif word == "fail_cell":
            b = self.open()
            b.name = str(fact[1])
            cell = (int(fact[2]), int(fact[3]), int(fact[4]))
            if b.current != cell:
                _close(b)
            b.states[cell] = "differs"
            b.reported = str(fact[5]) if len(fact) > 5 else ""
            b.current = None
        elif word == "fail":
            b = self.open()
            b.name = str(fact[1])
            b.outcome, b.rc = "fail", int(fact[2])
        elif word == "ok":
            b = self.open()
            b.name = str(fact[1])
            if b.error:
                b.outcome = "error"
            else:
                # [OK] vouches for nothing by itself: a cell is equal only when its single-shot
                # and incremental graphs were seen run (the test compares right after them).
                _close(b)
                b.outcome = "ok"
            b.current = None
        elif word == "skip_init":
            self.backends.append(Backend(len(self.backends), name=str(fact[1]), outcome="skipped"))
        elif word == "skip_error":
            b = self.open()
            b.error = str(fact[1])
            if b.current is not None:
                b.states[b.current] = "error"
        elif word == "none":
            self.none = str(fact[1])
        elif word == "passed":
            self.passed = int(fact[1])
        elif word == "exit":
            if self.exit_code is not None:
                # The shipped command appends one exit line after the test: a second one was
                # written by something else (the test itself, or a process it left behind).
                self.exits_seen.append(int(fact[1]))
            self.exit_code = int(fact[1])
        elif word == "fatal":
            self.fatal = [*self.fatal, str(fact[1])][-5:]
            if _POLICY.search(str(fact[1])) and self.backends:
                last = self.backends[-1]
                if last.outcome == "running" and not last.policy:
                    last.policy = str(fact[1])

    # -- reading the state -----------------------------------------------------------------

    def live(self) -> list[tuple[str, dict[str, int], str | None]]:
        """(backend, point, state) of every cell of every backend that ran: state is
        BITWISE_EQUAL, DIFFERS, UNJUDGED, "RUNNING" or None (not reached yet)."""
        words = {"equal": BITWISE_EQUAL, "differs": DIFFERS, "error": "UNJUDGED"}
        out = []
        for b in self.backends:
            if b.outcome == "skipped":
                continue
            for cell in GRID:
                state = b.states.get(cell)
                out.append(
                    (
                        b.label,
                        point(*cell),
                        "RUNNING" if state == "running" else words.get(state or ""),
                    )
                )
        return out

    def running(self) -> str:
        for b in self.backends:
            if b.outcome == "running" and b.current is not None:
                d, kv, g = b.current
                return f"llama.cpp {b.label}: D={d} KV={kv} gqa={g}"
        return ""

    def results(
        self, exit_code: int | None, required: list[str] | None = None
    ) -> tuple[list[CellResult], list[tuple[str, str]], list[str]]:
        """Once the test ended: (cells, problems (class, why), notes). The log's own exit line
        wins over exit_code (the cell's, which the shipped command keeps 0)."""
        if self.exit_code is not None:
            exit_code = self.exit_code
        cells: list[CellResult] = []
        problems: list[tuple[str, str]] = []
        notes: list[str] = []
        fatal = f" (the log ends: {' | '.join(self.fatal[-2:])})" if self.fatal else ""
        for b in self.backends:
            if b.outcome == "skipped":
                notes.append(f"backend {b.label} was skipped: the test could not initialise it")
                continue
            if b.outcome == "error":
                notes.append(
                    f"backend {b.label} threw ({b.error}); the test printed [OK] {b.label} and "
                    f"counted it as passed, tracedeck does not"
                )
            for cell in GRID:
                cells.append(self._cell(b, cell, exit_code, fatal))
        ok = [b for b in self.backends if b.outcome == "ok"]
        threw = [b for b in self.backends if b.outcome == "error"]
        if self.passed is not None and self.passed != len(ok):
            said = (
                f"the test says 'Backends passed: {self.passed}'; {len(ok)} backend(s) ran every "
                f"cell bitwise equal"
            )
            # The test counts a backend that threw as passed (read from its source); any other
            # count contradicts its own lines.
            if self.passed == len(ok) + len(threw):
                notes.append(said)
            else:
                problems.append(("output", f"{said}: its count contradicts its own lines"))
        if self.exits_seen:
            problems.append(
                (
                    "output",
                    f"the log has {len(self.exits_seen) + 1} exit lines (the last says "
                    f"{self.exit_code}): the shipped command writes one, after the test ended, "
                    "so this log is not one run of it",
                )
            )
        for b in self.backends:
            problems += [("output", f"backend {b.label}: {text}") for text in b.odd[:3]]
        ran = [b for b in self.backends if b.outcome != "skipped"]
        if not ran:
            why = self.none or "the test printed no [OK], [FAIL] or [kvci] line"
            problems.append(("engine", f"no backend ran: {why}{fatal}"))
        for name in required or []:
            named = [b for b in self.backends if b.name == name]
            if not named:
                seen = ", ".join(b.label for b in self.backends) or "none"
                problems.append(("engine", f"required backend {name} did not run (seen: {seen})"))
            elif named[0].outcome == "skipped":
                problems.append(("engine", f"required backend {name} could not be initialised"))
        failed = any(b.outcome == "fail" for b in self.backends)
        if exit_code is not None and exit_code not in (0, 1):
            problems.append(("engine", f"the test exited {exit_code}{fatal}"))
        elif exit_code == 1 and not failed:
            problems.append(("engine", f"the test exited 1 without a [FAIL] line{fatal}"))
        elif exit_code == 0 and failed:
            problems.append(("output", "the test printed [FAIL] but exited 0"))
        return cells, problems, notes

    def _cell(
        self, b: Backend, cell: tuple[int, int, int], exit_code: int | None, fatal: str
    ) -> CellResult:
        p = point(*cell)
        state = b.states.get(cell)
        if state == "equal":
            return CellResult(
                p,
                BITWISE_EQUAL,
                source=b.label,
                detail={"flows": ["single", "incremental"], "reported_by": REPORTED_BY},
            )
        if state == "differs":
            return CellResult(
                p,
                DIFFERS,
                source=b.label,
                detail={
                    "first": {"flows": ["single", "incremental"]},
                    "reported": b.reported,
                    "reported_by": REPORTED_BY,
                },
            )
        if state == "error":
            return unjudged(p, "engine", f"the backend threw: {b.error}", b.label)
        if state == "no_incremental":
            why = (
                "its single-shot graph was seen but no incremental graph ([kvci] q ne=[D,1,H,1]) "
                "followed it: the comparison was never seen run"
            )
            return unjudged(p, "output", why, b.label)
        if state is None and b.outcome == "ok":
            why = (
                f"the test printed [OK] {b.label}, but no [kvci] line shows this cell run (its "
                f"single-shot q ne=[{cell[0]},{cell[1]},{HEADS},1] and k lines, then incremental "
                "ones): a cell not seen judged is never taken as equal"
            )
            return unjudged(p, "output", why, b.label)
        if state == "running" and b.policy:
            record = {"rule": "llama.cpp assert", "message": b.policy, "fix": POLICY_FIX}
            result = precondition_result(p, record)
            result.source = b.label
            return result
        if state == "running":
            return unjudged(
                p, "engine", f"the test ended (exit {exit_code}) inside this cell{fatal}", b.label
            )
        if b.outcome == "fail":
            why = "not run: the test stops a backend at its first failure"
            return unjudged(p, "not_run", why, b.label)
        if b.outcome == "error":
            return unjudged(p, "not_run", f"not run: the backend threw ({b.error})", b.label)
        if b.policy:
            why = f"not run: the test aborted on a precondition before this cell ({b.policy})"
            return unjudged(p, "not_run", why, b.label)
        return unjudged(
            p, "engine", f"not reached: the test ended (exit {exit_code}){fatal}", b.label
        )


def _close(b: Backend) -> None:
    """The backend's current cell ended without a [FAIL]: equal once both its graphs were seen."""
    if b.current is not None and b.states.get(b.current) == "running":
        b.states[b.current] = "equal" if b.current in b.incremental else "no_incremental"
    b.current = None


def read_log(text: str) -> LlamaCppBook:
    book = LlamaCppBook()
    for line in text.splitlines():
        fact = parse_line(line)
        if fact is not None and book.wants(fact):
            book.apply(fact)
    return book
