"""A run's life: launch it detached under the host lock, follow it, judge it, emit events."""

from __future__ import annotations

import asyncio
import datetime as dt
import getpass
import hashlib
import os
import secrets
import shlex
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from runners import plan as plan_mod
from runners.determinism import run_env
from runners.events import (
    ArtifactFetched,
    CellFinished,
    CellStarted,
    Connection,
    Error,
    Event,
    LockAcquired,
    LockBusy,
    OutputLines,
    RunFinished,
    RunStarted,
    TraceRecords,
)
from runners.follow import FileFollower
from runners.judges import EXIT_INFRA, Judge, JudgeContext, judge_for
from runners.plan import RunPlan, build_plan
from runners.presets import Preset, render_plain
from runners.record import EVENTS, Recorder, RunRecord, drop_torn_tail, read_events
from runners.targets.base import ConnectionLost, Target, TargetError
from runners.targets.factory import parse_target

POLL_S = 0.1
ALIVE_EVERY_S = 2.0
CANCEL_GRACE_S = 5.0
EXIT_INTERRUPT = 130
DISCONNECTED = "DISCONNECTED"
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"


class LockBusyError(TargetError):
    def __init__(self, lock: str, holder: dict[str, Any], target: str) -> None:
        self.holder = holder
        who = ", ".join(
            f"{k}={holder.get(k)}"
            for k in ("run_id", "user", "console_host", "preset", "started_at", "pgid")
        )
        super().__init__(
            f"{target}: lock {lock} is held ({who or 'holder unknown'}); wait for that run to "
            f"end, or ask its owner to `tracedeck cancel` it"
        )


def default_out_dir() -> Path:
    base = os.environ.get("TRACEDECK_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share"),
        "tracedeck",
    )
    return Path(base) / "runs"


def new_run_id(preset_name: str) -> str:
    now = dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{preset_name}-{secrets.token_hex(2)}"


@dataclass(slots=True)
class CellState:
    index: int
    params: dict[str, Any]
    command: str
    artifacts: tuple[str, ...] = ()
    started: float | None = None
    finished: bool = False
    passed: bool = False
    fetched_all: bool = False  # every artifact tried once the cell passed
    outputs: dict[str, FileFollower] = field(default_factory=dict)


class Session:
    """Drives one run on one target and turns what happens into events for `emit`."""

    def __init__(
        self,
        record: RunRecord,
        preset: Preset,
        target: Target,
        emit: Callable[[Event], None],
        *,
        reconnect_attempts: int | None = None,
    ) -> None:
        self.record = record
        self.preset = preset
        self.target = target
        self._consumers = emit
        self.local_dir = Path(record.local_dir)
        self.plan: RunPlan | None = None
        self.cells: dict[int, CellState] = {}
        self.traces: dict[str, FileFollower] = {}
        self.finished: RunFinished | None = None
        self.cancelled = False
        self.attempts = (
            reconnect_attempts
            if reconnect_attempts is not None
            else int(preset.section("target")["reconnect_attempts"])
        )
        self._recorder: Recorder | None = None
        self.pgid: int | None = None
        self._cancelling = False
        self.setup_failed = False
        self.judge: Judge = judge_for(
            JudgeContext(preset=preset, local_dir=self.local_dir, date=record.date, emit=self.emit)
        )

    # -- events ---------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        if self._recorder is not None:
            self._recorder(event)
        self._consumers(event)

    # -- creating and launching -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        preset: Preset,
        target_spec: str,
        out_dir: Path,
        emit: Callable[[Event], None],
    ) -> Session:
        tgt = preset.section("target")
        target = parse_target(
            target_spec, connect_timeout=tgt["connect_timeout_s"], keepalive=tgt["keepalive_s"]
        )
        date = dt.date.today().isoformat()
        run_id = new_run_id(preset.name)
        rel = render_plain(preset.section("artifacts")["dir"], {"date": date, "name": preset.name})
        local_dir = _fresh_dir(out_dir / rel)
        record = RunRecord(
            run_id=run_id,
            preset=preset.name,
            kind=preset.kind,
            source=preset.source,
            overrides=preset.overrides,
            preset_data=preset.data,
            target=target_spec,
            remote_dir="",
            lock=tgt["lock"],
            local_dir=str(local_dir),
            started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            user=getpass.getuser(),
            console_host=socket.gethostname(),
            date=date,
        )
        return cls(record, preset, target, emit)

    async def launch(self) -> None:
        """Connect, upload the plan, take the lock and start the run detached."""
        self.local_dir.mkdir(parents=True, exist_ok=True)
        await self.target.connect()
        tgt = self.preset.section("target")
        workdir = await self._resolve_dir(tgt["workdir"], "target.workdir")
        runs = await self._resolve_dir(tgt["runs"], "target.runs")
        python = tgt["python"] or (sys.executable if self.target.name == "local" else "python3")
        run_dir = f"{runs}/{self.record.run_id}"
        pythonpath = f"{run_dir}/pkg" if self.preset.section("engine")["ship_reference"] else ""
        plan = build_plan(
            self.preset,
            run_id=self.record.run_id,
            run_dir=run_dir,
            workdir=workdir,
            python=python,
            date=self.record.date,
            pythonpath=pythonpath,
        )
        self.plan = plan
        self.record.remote_dir = run_dir
        self.record.extra = {"workdir": workdir, "python": python}
        self.record.save()
        self._recorder = Recorder(self.local_dir)

        setup_env = plan.cells[0].env if plan.cells else {}
        files = plan_mod.plan_files(plan, setup_env)
        files["holder.json"] = orjson.dumps(self._holder(None)).decode()
        files["plan.json"] = orjson.dumps(self._plan_doc(plan), option=orjson.OPT_INDENT_2).decode()
        # Each cell's exact command and environment, kept with the local record too.
        (self.local_dir / "plan.json").write_text(files["plan.json"])
        for rel, text in files.items():
            await self.target.write_file(f"{run_dir}/{rel}", text.encode())
        if pythonpath:
            await self._ship_reference(f"{run_dir}/pkg")

        self._init_cells(plan)
        self.emit(self._run_started(plan, attached=False))
        result = await self.target.run(f"sh {shlex.quote(run_dir + '/launch.sh')}")
        out = result.stdout.strip().splitlines()
        if result.exit_status == plan_mod.LOCK_BUSY and out and out[0] == "TRACEDECK_LOCK_BUSY":
            holder = _parse_holder("\n".join(out[1:]))
            self.emit(LockBusy(lock=plan.lock, holder=holder))
            error = LockBusyError(plan.lock, holder, self.target.name)
            self._finish(
                RunFinished(
                    verdict="LOCK_BUSY", exit_code=EXIT_INFRA, summary={"error": str(error)}
                )
            )
            raise error
        if result.exit_status != 0 or not out or not out[-1].startswith("TRACEDECK_STARTED"):
            message = (
                f"{self.target.name}: could not start the run in {run_dir} "
                f"(exit {result.exit_status}): {result.stderr.strip() or result.stdout.strip()}"
            )
            self.emit(Error(message=message, where=run_dir))
            self._finish(
                RunFinished(verdict="NOT_STARTED", exit_code=EXIT_INFRA, summary={"error": message})
            )
            raise TargetError(message)
        self.pgid = int(out[-1].split()[1])
        self.emit(LockAcquired(lock=plan.lock, holder=self._holder(self.pgid)))

    async def _resolve_dir(self, path: str, key: str) -> str:
        """An absolute path on the target; relative paths are relative to the target's home."""
        q = shlex.quote(path)
        result = await self.target.run(f"cd && mkdir -p {q} && cd {q} && pwd")
        if result.exit_status != 0:
            raise TargetError(
                f"{self.target.name}: {key} {path!r} is not usable: "
                f"{result.stderr.strip()}; set {key} to a writable directory"
            )
        return result.stdout.strip()

    async def _ship_reference(self, pkg: str) -> None:
        """Copy the reference engine (stdlib + torch only) so any host with torch can run it."""
        init = REFERENCE_DIR.parent / "__init__.py"
        await self.target.write_file(f"{pkg}/runners/__init__.py", init.read_bytes())
        for path in sorted(REFERENCE_DIR.glob("*.py")):
            await self.target.write_file(f"{pkg}/runners/reference/{path.name}", path.read_bytes())

    def _holder(self, pgid: int | None) -> dict[str, Any]:
        return {
            "user": self.record.user,
            "console_host": self.record.console_host,
            "run_id": self.record.run_id,
            "preset": self.record.preset,
            "started_at": self.record.started_at,
            "pgid": pgid,
        }

    def _plan_doc(self, plan: RunPlan) -> dict[str, Any]:
        return {
            "run_id": plan.run_id,
            "preset": self.preset.name,
            "kind": self.preset.kind,
            "cells": [
                {"index": c.index, "params": c.params, "command": c.command, "env": c.env}
                for c in plan.cells
            ],
            "setup": plan.setup,
        }

    def _init_cells(self, plan: RunPlan) -> None:
        self.cells = {
            c.index: CellState(c.index, c.params, c.command, c.artifacts) for c in plan.cells
        }
        self._progress = FileFollower(self.target, f"{plan.run_dir}/progress.jsonl")
        self._ended = False
        if plan.setup:
            self.cells[-1] = CellState(-1, {"step": "setup"}, " && ".join(plan.setup))
        for template in self.preset.section("traces")["follow"]:
            rel = render_plain(
                template, {**self.preset.vars, "date": self.record.date, "run_id": plan.run_id}
            )
            path = f"{plan.artifacts}/{rel}"
            self.traces[path] = FileFollower(self.target, path)

    def _run_started(self, plan: RunPlan, attached: bool) -> RunStarted:
        return RunStarted(
            run_id=plan.run_id,
            preset=self.preset.name,
            kind=self.preset.kind,
            target=self.target.name,
            local_dir=str(self.local_dir),
            remote_dir=plan.run_dir,
            cells=[
                {"index": c.index, "params": c.params, "command": c.command} for c in plan.cells
            ],
            profile=self.preset.section("determinism")["profile"],
            env=run_env(self.preset.data),
            attached=attached,
        )

    # -- attaching --------------------------------------------------------------------------

    @classmethod
    def attach(
        cls, local_dir: Path, emit: Callable[[Event], None], replay: Callable[[Event], None]
    ) -> Session:
        """Rebuild a session from its record; recorded events go to `replay`, new ones to `emit`."""
        record = RunRecord.load(local_dir)
        preset = Preset(source=record.source, data=record.preset_data, overrides=record.overrides)
        tgt = preset.section("target")
        target = parse_target(
            record.target, connect_timeout=tgt["connect_timeout_s"], keepalive=tgt["keepalive_s"]
        )
        session = cls(record, preset, target, emit)
        extra = record.extra
        session.plan = build_plan(
            preset,
            run_id=record.run_id,
            run_dir=record.remote_dir,
            workdir=extra["workdir"],
            python=extra["python"],
            date=record.date,
            pythonpath=f"{record.remote_dir}/pkg"
            if preset.section("engine")["ship_reference"]
            else "",
        )
        session._init_cells(session.plan)
        events_path = Path(local_dir) / EVENTS
        recorded = read_events(events_path) if events_path.exists() else None
        if recorded is not None:
            drop_torn_tail(events_path, recorded)
            for event in recorded.events:
                if isinstance(event, RunFinished) and event.verdict == DISCONNECTED:
                    continue  # the console gave up following; the run itself went on
                session._restore(event)
                replay(event)
        session._recorder = Recorder(local_dir)
        return session

    def _restore(self, event: Event) -> None:
        self.judge.restore(event)
        if isinstance(event, CellStarted) and event.cell in self.cells:
            self.cells[event.cell].started = event.t
        elif isinstance(event, CellFinished) and event.cell in self.cells:
            self.cells[event.cell].finished = True
            self.cells[event.cell].passed = event.state == "passed"
        elif isinstance(event, OutputLines) and event.cell in self.cells:
            follower = self._output_follower(self.cells[event.cell], event.stream)
            follower.offset = event.end_offset
        elif isinstance(event, TraceRecords) and event.file in self.traces:
            self.traces[event.file].offset = event.end_offset
            self.traces[event.file].lines_read = event.last_line
        elif isinstance(event, RunFinished):
            self.finished = event

    # -- following --------------------------------------------------------------------------

    async def follow(self) -> RunFinished:
        """Follow until the run finishes; reconnect with backoff when the link drops."""
        if self.finished is not None:
            return self.finished
        assert self.plan is not None
        await self._connect_with_retry()
        last_alive = 0.0
        loop = asyncio.get_running_loop()
        while self.finished is None:
            try:
                ended = await self._poll_once()
                now = loop.time()
                if not ended and now - last_alive >= ALIVE_EVERY_S:
                    last_alive = now
                    await self._check_alive()
            except ConnectionLost as exc:
                if not await self._reconnect(str(exc)):
                    return self.finished  # type: ignore[return-value]
                continue
            if self.finished is None:
                await asyncio.sleep(POLL_S)
        return self.finished

    async def _connect_with_retry(self) -> None:
        try:
            await self.target.connect()
        except ConnectionLost as exc:
            if not await self._reconnect(str(exc)):
                raise

    async def _reconnect(self, message: str) -> bool:
        self.emit(Connection(state="lost", message=message))
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
            self.emit(Connection(state="retrying", message=message, attempt=attempt))
            try:
                await self.target.close()
                await self.target.connect()
            except ConnectionLost as exc:
                message = str(exc)
                continue
            self.emit(Connection(state="restored", message="following resumes", attempt=attempt))
            return True
        text = (
            f"{self.target.name}: connection lost and {self.attempts} reconnect attempts failed "
            f"({message}). The run goes on on the target; reattach with: "
            f"tracedeck attach {self.local_dir}"
        )
        self.emit(Error(message=text, where=self.target.name, affects_verdict=False))
        self._finish(
            RunFinished(
                verdict=DISCONNECTED,
                exit_code=EXIT_INFRA,
                summary={"error": text, "attach": str(self.local_dir)},
            )
        )
        return False

    async def _poll_once(self) -> bool:
        """One pass over progress, outputs and traces; True when the run has ended."""
        assert self.plan is not None
        # Work a dropped link interrupted (or a console killed mid-fetch left) is done first.
        await self._catch_up()
        lines = await self._progress.poll()
        for raw in lines.lines if lines else []:
            await self._on_progress(orjson.loads(raw))
        for cell in self.cells.values():
            if cell.started is not None and not cell.finished:
                await self._drain_outputs(cell)
        await self._poll_traces()
        if self._ended and self.finished is None:
            await self._finish_run()
        return self._ended

    async def _on_progress(self, entry: dict[str, Any]) -> None:
        kind = entry.get("e")
        if kind in ("start", "end"):
            name = entry["cell"]
            index = -1 if name == plan_mod.SETUP else int(name)
            cell = self.cells[index]
            if kind == "start" and cell.started is None:
                cell.started = float(entry["t"])
                self.emit(
                    CellStarted(
                        cell=index, params=cell.params, command=cell.command, t=cell.started
                    )
                )
            elif kind == "end" and not cell.finished:
                await self._drain_outputs(cell)
                await self._poll_traces()
                await self._cell_ended(cell, int(entry["rc"]), float(entry["t"]))
        elif kind in ("done", "cancelled"):
            if kind == "cancelled":
                self.cancelled = True
            self.setup_failed = bool(entry.get("setup_failed"))
            self._ended = True

    async def _cell_ended(self, cell: CellState, rc: int, t: float) -> None:
        cell.finished = True
        cell.passed = rc == 0
        duration = t - cell.started if cell.started is not None else None
        event = CellFinished(
            cell=cell.index,
            state="passed" if rc == 0 else "failed",
            exit_code=rc,
            duration_s=duration,
            t=t,
        )
        self.emit(event)
        self.judge.cell_finished(event)
        if rc != 0:
            tail = await self._tail(self.plan.cell_path(cell.index, "stderr.log"))  # type: ignore[union-attr]
            label = "setup" if cell.index < 0 else f"cell {cell.index} ({_label(cell.params)})"
            self._error(f"{label} exited {rc}; stderr ends: {tail}", where=label)
        await self._catch_up()
        await self.judge.advance()

    async def _catch_up(self) -> None:
        """Bring home the artifacts of every passed cell not yet fetched, then judge."""
        pending = [
            c for c in self.cells.values() if c.passed and c.index >= 0 and not c.fetched_all
        ]
        for cell in pending:
            await self._fetch_artifacts(cell)
            cell.fetched_all = True
        if pending:
            await self.judge.advance()

    async def _fetch_artifacts(self, cell: CellState) -> None:
        assert self.plan is not None
        done = set(self.judge.fetched.get(cell.index, []))
        for rel in cell.artifacts:
            if rel in done:
                continue
            local = self.local_dir / rel
            remote = f"{self.plan.artifacts}/{rel}"
            try:
                await self.target.download(remote, local)
            except ConnectionLost:
                raise
            except (TargetError, OSError) as exc:
                self._error(
                    f"cell {cell.index} ({_label(cell.params)}): artifact {rel} could not be "
                    f"fetched from {self.target.name}:{remote}: {exc}",
                    where=f"cell {cell.index}",
                )
                continue
            digest = await asyncio.to_thread(_sha256, local)
            event = ArtifactFetched(
                cell=cell.index, path=rel, size=local.stat().st_size, sha256=digest
            )
            self.emit(event)
            self.judge.artifact_fetched(event)

    def _error(self, message: str, where: str) -> None:
        event = Error(message=message, where=where)
        self.emit(event)
        self.judge.error(event)

    async def _tail(self, path: str, limit: int = 600) -> str:
        data = await self.target.read_from(path, 0, 1 << 20)
        text = (data or b"").decode("utf-8", "replace").strip()
        return ("..." + text[-limit:]) if len(text) > limit else (text or "(empty)")

    def _output_follower(self, cell: CellState, stream: str) -> FileFollower:
        if stream not in cell.outputs:
            assert self.plan is not None
            path = self.plan.cell_path(cell.index, f"{stream}.log")
            cell.outputs[stream] = FileFollower(self.target, path)
        return cell.outputs[stream]

    async def _drain_outputs(self, cell: CellState) -> None:
        for stream in ("stdout", "stderr"):
            follower = self._output_follower(cell, stream)
            got = await follower.poll()
            if got is not None:
                text = [line.decode("utf-8", "replace") for line in got.lines]
                self.emit(
                    OutputLines(
                        cell=cell.index,
                        stream=stream,
                        lines=text,
                        file=follower.path,
                        end_offset=got.end_offset,
                    )
                )

    async def _poll_traces(self) -> None:
        running = [c.index for c in self.cells.values() if c.started and not c.finished]
        cell = running[0] if running else -1
        for path, follower in self.traces.items():
            got = await follower.poll()
            if got is None:
                continue
            records = []
            for n, raw in enumerate(got.lines, start=got.first_line):
                if not raw.strip():
                    continue
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    self._error(
                        f"{path}:{n}: not valid JSON ({exc}); the engine wrote a bad trace line",
                        where=f"{path}:{n}",
                    )
                    continue
                if not isinstance(record, dict):
                    self._error(
                        f"{path}:{n}: a trace line must be a JSON object", where=f"{path}:{n}"
                    )
                    continue
                record["__line__"] = n
                records.append(record)
            event = TraceRecords(
                cell=cell,
                file=path,
                records=records,
                first_line=got.first_line,
                last_line=follower.lines_read,
                end_offset=got.end_offset,
            )
            self.emit(event)
            self.judge.trace(event)

    async def _check_alive(self) -> None:
        assert self.plan is not None
        if self._cancelling or await self._run_alive():
            return  # a cancel in flight writes its own "cancelled" line once the group is dead
        # The run may have written "done" just before exiting: read once more before judging.
        if await self._poll_once():
            return
        tail = await self._tail(f"{self.plan.run_dir}/runner.err")
        self._error(
            f"{self.target.name}: the run in {self.plan.run_dir} ended without finishing "
            f"(remote crash or killed outside tracedeck); runner.err: {tail}",
            where=self.plan.run_dir,
        )
        await self._finish_run(crashed=True)

    async def _run_alive(self) -> bool:
        """Is the run's group leader alive? /proc over the open SFTP session, else kill -0."""
        assert self.plan is not None
        if self.pgid is None:
            raw = await self.target.read_from(f"{self.plan.run_dir}/pgid", 0, 64)
            if raw is None or not raw.strip().isdigit():
                return False
            self.pgid = int(raw)
        stat = await self.target.read_from(f"/proc/{self.pgid}/stat", 0, 4096)
        if stat is not None:
            # Field 3, after the command name in parentheses, is the state; Z is a zombie.
            return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
        if await self.target.read_from("/proc/self/stat", 0, 64) is not None:
            return False  # /proc works on this host and the leader is gone
        result = await self.target.run(plan_mod.alive_command(self.plan.run_dir))
        return result.stdout.strip() == "alive"

    async def _finish_run(self, crashed: bool = False) -> None:
        for cell in self.cells.values():
            if not cell.finished:
                if cell.started:
                    await self._drain_outputs(cell)
                cell.finished = True
                # Cells after a failed setup never ran; otherwise a cell with no end was
                # cut short by a cancel or by the run dying.
                if self.cancelled:
                    state = "cancelled"
                elif self.setup_failed:
                    state = "skipped"
                else:
                    state = "lost"
                event = CellFinished(cell=cell.index, state=state, exit_code=None, duration_s=None)
                self.emit(event)
                self.judge.cell_finished(event)
        await self.judge.advance()
        result = await asyncio.to_thread(self.judge.finish, len(self.plan.cells))  # type: ignore[union-attr]
        if self.cancelled:
            result = RunFinished(
                verdict="CANCELLED", exit_code=EXIT_INTERRUPT, summary=result.summary
            )
        elif crashed:
            result = RunFinished(verdict="CRASHED", exit_code=EXIT_INFRA, summary=result.summary)
        self._finish(result)

    def _finish(self, result: RunFinished) -> None:
        self.finished = result
        self.emit(result)

    # -- cancelling -------------------------------------------------------------------------

    async def cancel(self, grace_s: float = CANCEL_GRACE_S) -> str:
        """TERM the run's process group, KILL after the grace; the follower records the cells."""
        assert self.plan is not None
        self._cancelling = True
        try:
            result = await self.target.run(plan_mod.cancel_script(self.plan.run_dir, grace_s))
        finally:
            self._cancelling = False
        words = result.stdout.split()
        if result.exit_status != 0:
            raise TargetError(
                f"{self.target.name}: cancel of {self.plan.run_dir} failed "
                f"(exit {result.exit_status}): {result.stdout.strip()} {result.stderr.strip()}"
            )
        return words[-1] if words else ""

    async def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        await self.target.close()


def _fresh_dir(path: Path) -> Path:
    """The run's local directory: the preset's layout path, suffixed if a run already used it."""
    candidate, n = path, 1
    while (candidate / "run.json").exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _parse_holder(text: str) -> dict[str, Any]:
    try:
        holder = orjson.loads(text)
        return holder if isinstance(holder, dict) else {"raw": text}
    except orjson.JSONDecodeError:
        return {"raw": text.strip()}


def _label(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
