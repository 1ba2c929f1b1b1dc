"""A run's life: launch it under the host lock, follow it to the end, judge it, emit events.

The session wires the parts together and owns the one path every event takes: recorded,
folded into the follower (its place in the files) and the judge (its verdict state), then
handed to the consumers. Attach replays the record through the same fold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import getpass
import os
import secrets
import shlex
import shutil
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from runners import kinds
from runners.cells import CellState
from runners.changes import Changes
from runners.config import fleet_hosts, run_lock
from runners.determinism import run_env
from runners.events import (
    CellFinished,
    Connection,
    EngineVersion,
    Error,
    Event,
    LockAcquired,
    LockBusy,
    RunFinished,
    RunStarted,
)
from runners.exits import EXIT_INFRA
from runners.follower import RunFollower
from runners.kind import Ending, Judge, JudgeContext
from runners.launchers.base import Launcher, LockBusyError, NotStartedError
from runners.launchers.detached import DetachedLauncher
from runners.launchers.slurm import SlurmLauncher, slurm_settings
from runners.leftovers import report_leftovers
from runners.plan import (
    RunPlan,
    build_plan,
    cell_scripts,
    dir_command,
    interpreter,
    plan_document,
)
from runners.presets import Preset
from runners.record import (
    BY_ID,
    EVENTS,
    FLEET,
    RECORD_LOCK,
    RUN_JSON,
    Recorder,
    RecordError,
    RunRecord,
    drop_torn_tail,
    iter_events,
)
from runners.reference import SHIPPED_WITH
from runners.remote_judge import RemoteJudge
from runners.targets.base import ConnectionLost, Target, TargetError
from runners.targets.factory import parse_target
from runners.templates import render, render_plain

POLL_S = 0.1
NOT_RECORDED = "NOT_RECORDED"
NOT_JUDGED = "NOT_JUDGED"  # tracedeck itself failed while following: nothing was judged
ALIVE_EVERY_S = 2.0
CANCEL_GRACE_S = 5.0
DISCONNECTED = "DISCONNECTED"
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"

__all__ = ["LockBusyError", "Session", "default_out_dir"]


VERSION_TIMEOUT_S = 30.0  # [engine] version_command: a version query, not work


def default_out_dir() -> Path:
    base = os.environ.get("TRACEDECK_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share"),
        "tracedeck",
    )
    return Path(base) / "runs"


async def ship_reference(target: Target, pkg: str) -> None:
    """Copy the reference engine (stdlib + torch only) so any host with torch can run it."""
    for name in SHIPPED_WITH:
        source = REFERENCE_DIR.parent / name
        await target.write_file(f"{pkg}/runners/{name}", source.read_bytes())
    for path in sorted(REFERENCE_DIR.glob("*.py")):
        await target.write_file(f"{pkg}/runners/reference/{path.name}", path.read_bytes())


def make_launcher(spec: str, target: Target, preset: Preset) -> Launcher:
    """The launcher a run's target spec and preset call for: Slurm, or detached on the host."""
    settings = slurm_settings(spec, preset)
    if settings is not None:
        return SlurmLauncher(target, settings)
    return DetachedLauncher(target)


def by_id_link(out_dir: Path, run_id: str) -> Path:
    """Where a run's local directory is linked by its id: OUT/by-id/RUN_ID."""
    return Path(out_dir) / BY_ID / run_id  # a relative symlink to the run's directory


def link_by_id(link: Path, local_dir: Path) -> None:
    """OUT/by-id/RUN_ID -> the run's directory (relative, so the out dir can move whole)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(os.path.relpath(local_dir, link.parent), target_is_directory=True)


async def resolve_dir(target: Target, path: str, key: str) -> str:
    """An absolute path on the target, made when missing: absolute as written; `~`, `~/x` and
    relative paths under the target's home (the login user's, on the local target $HOME)."""
    result = await target.run(dir_command(path, create=True))
    if result.exit_status != 0:
        raise TargetError(
            f"{target.name}: {key} {path!r} is not usable: "
            f"{result.stderr.strip()}; set {key} to a writable directory"
        )
    return result.stdout.strip()


def new_record(
    preset: Preset,
    target_spec: str,
    out_dir: Path,
    *,
    lock: str,
    extra: dict[str, Any] | None = None,
) -> RunRecord:
    """The record of a run about to launch: a new id, a fresh local directory named by the
    preset's artifacts.dir (-2, -3 when taken), who and where from."""
    date = dt.date.today().isoformat()
    rel = render_plain(preset.section("artifacts")["dir"], {"date": date, "name": preset.name})
    return RunRecord(
        run_id=new_run_id(preset.name),
        preset=preset.name,
        kind=preset.kind,
        source=preset.source,
        overrides=preset.overrides,
        preset_data=preset.data,
        target=target_spec,
        remote_dir="",
        lock=lock,
        local_dir=str(_fresh_dir(out_dir / rel)),
        started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        user=getpass.getuser(),
        console_host=socket.gethostname(),
        date=date,
        extra=extra or {},
        options=sorted(preset.options),
    )


def new_run_id(preset_name: str) -> str:
    now = dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{preset_name}-{secrets.token_hex(2)}"


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
        self.kind = kinds.get(preset.kind)
        self._consumers = emit
        self.local_dir = Path(record.local_dir)
        self.by_id: Path | None = None  # OUT/by-id/RUN_ID, made at launch (Session.create)
        self.launcher: Launcher = make_launcher(record.target, target, preset)
        self.plan: RunPlan | None = None
        self.judge: Judge | None = None
        self.follower: RunFollower | None = None
        self.finished: RunFinished | None = None
        self.attempts = (
            reconnect_attempts
            if reconnect_attempts is not None
            else int(preset.section("target")["reconnect_attempts"])
        )
        self._recorder: Recorder | None = None
        self._made_local = False
        self._changes: Changes | None = None
        self._cancelling = False
        # How far launch() got: "" (not begun), "connecting", "uploading", "starting" (the
        # launcher was asked; the run may be going), "started".
        self.stage = ""
        # The consumer says it is behind (the console's buffer is full): wait before reading
        # more, so a backlog of any size flows through in bounded steps.
        self.pressure: Callable[[], bool] | None = None

    # -- the one path of every event ---------------------------------------------------------

    def _fold(self, event: Event) -> None:
        if self.follower is not None:
            self.follower.fold(event)
        if self.judge is not None:
            self.judge.fold(event)
        if isinstance(event, RunFinished):
            self.finished = event

    def emit(self, event: Event) -> None:
        if self._recorder is not None:
            self._recorder(event)
        self._fold(event)
        self._consumers(event)

    def _use_plan(self, plan: RunPlan) -> None:
        self.plan = plan
        self.judge = self.kind.judge(
            JudgeContext(
                preset=self.preset,
                local_dir=self.local_dir,
                date=self.record.date,
                emit=self.emit,
                cells=list(plan.cells),
                progress=self._consumers,
            )
        )
        self.follower = RunFollower(
            self.target,
            plan,
            self.judge,
            self.local_dir,
            self.emit,
            progress=self._consumers,
            progress_files=self.launcher.progress_files(plan),
        )

    # -- creating and launching ----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        preset: Preset,
        target_spec: str,
        out_dir: Path,
        emit: Callable[[Event], None],
    ) -> Session:
        hosts = fleet_hosts(target_spec)
        if hosts is not None:
            from runners.fleet import FleetSession

            return FleetSession.create_fleet(preset, target_spec, hosts, out_dir, emit)
        tgt = preset.section("target")
        target = parse_target(
            target_spec, connect_timeout=tgt["connect_timeout_s"], keepalive=tgt["keepalive_s"]
        )
        record = new_record(preset, target_spec, out_dir, lock=run_lock(target_spec, preset))
        session = cls(record, preset, target, emit)
        session.by_id = by_id_link(out_dir, record.run_id)
        return session

    async def launch(self) -> None:
        """Connect, upload the plan, take the lock and start the run detached.

        A launch refused by the lock leaves no directory behind, here or on the target: nothing
        ran, there is nothing to see; nor does one that never reached the target. (A launch that
        failed while uploading keeps its record, which says why it never started.)
        """
        try:
            await self._launch()
        except LockBusyError:
            await self._discard(remote=True)
            raise
        except NotStartedError:
            raise  # its record says why it never started
        except BaseException:
            if self.stage == "connecting":  # the target was not reached: nothing was written
                await self._discard(remote=False)
            raise

    async def abandon(self) -> None:
        """Remove what was made for a launch that never began (an interrupt came first)."""
        await self._discard(remote=False)
        await self.target.close()

    async def _discard(self, remote: bool) -> None:
        """Remove what this launch made: the local directory, its by-id link, and (remote) the
        run's directory on the target. Only ever this run's own fresh directories."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self.by_id is not None and self.by_id.is_symlink():
            self.by_id.unlink()
        local = self.local_dir
        if self._made_local:
            shutil.rmtree(local, ignore_errors=True)
            with contextlib.suppress(OSError):
                local.parent.rmdir()  # the date directory, when this run was its only one
        else:  # a directory that was there before: only the files this launch wrote
            for name in (RUN_JSON, EVENTS, RECORD_LOCK, "plan.json"):
                with contextlib.suppress(OSError):
                    (local / name).unlink()
        run_dir = self.record.remote_dir
        if remote and run_dir.endswith("/" + self.record.run_id):
            with contextlib.suppress(TargetError):
                await self.target.run(f"rm -rf -- {shlex.quote(run_dir)}")

    async def _launch(self) -> None:
        self.stage = "connecting"
        self._made_local = not self.local_dir.exists()
        self.local_dir.mkdir(parents=True, exist_ok=True)
        await self.target.connect()
        tgt = self.preset.section("target")
        workdir = await self._resolve_dir(tgt["workdir"], "target.workdir")
        runs = await self._resolve_dir(tgt["runs"], "target.runs")
        python = interpreter(self.target.name, tgt["python"])
        run_dir = f"{runs}/{self.record.run_id}"
        ship = self.preset.section("engine")["ship_reference"]
        plan = build_plan(
            self.preset,
            run_id=self.record.run_id,
            run_dir=run_dir,
            workdir=workdir,
            python=python,
            date=self.record.date,
            lock=self.record.lock,
            pythonpath=f"{run_dir}/pkg" if ship else "",
        )
        self._use_plan(plan)
        self.record.remote_dir = run_dir
        self.record.extra = {"workdir": workdir, "python": python}
        self.stage = "uploading"
        self.record.save()
        if self.by_id is not None:
            with contextlib.suppress(OSError):  # a convenience: find_run also scans the out dir
                link_by_id(self.by_id, self.local_dir)
        self._recorder = Recorder(self.local_dir)

        plan_json = orjson.dumps(plan_document(plan, self.preset), option=orjson.OPT_INDENT_2)
        (self.local_dir / "plan.json").write_bytes(plan_json)
        files = {
            **cell_scripts(plan),
            **self.launcher.files(plan, self._holder()),
            "plan.json": plan_json.decode(),
        }
        for rel, text in files.items():
            await self.target.write_file(f"{run_dir}/{rel}", text.encode())
        if ship:
            await self._ship_reference(f"{run_dir}/pkg")
        notes = await self._place_judging(plan)
        self.record.save()

        self.emit(self._run_started(plan, attached=False, notes=notes))
        version = await self._engine_version(workdir, python)
        if version is not None:
            self.emit(version)
        self.stage = "starting"
        try:
            started = await self.launcher.start(plan)
        except LockBusyError as error:
            self.emit(LockBusy(lock=plan.lock, holder=error.holder))
            self.emit(
                RunFinished(
                    verdict="LOCK_BUSY", exit_code=EXIT_INFRA, summary={"error": str(error)}
                )
            )
            raise
        except NotStartedError as error:
            self.emit(Error(message=str(error), where=run_dir))
            self.emit(
                RunFinished(
                    verdict="NOT_STARTED", exit_code=EXIT_INFRA, summary={"error": str(error)}
                )
            )
            raise
        self.stage = "started"
        if started.events:
            for event in started.events:
                self.emit(event)
        else:
            self.emit(LockAcquired(lock=plan.lock, holder=started.holder))

    async def _engine_version(self, workdir: str, python: str) -> EngineVersion | None:
        """The engine's identity from [engine] version_command, run in the workdir (None when
        the preset has none). A failure is recorded, never fatal: it says nothing of results."""
        template = self.preset.section("engine")["version_command"]
        if not template:
            return None
        values = {**self.preset.section("vars"), "python": python, "workdir": workdir}
        command = render(template, values)
        line = f"cd {shlex.quote(workdir)} && {command}"
        try:
            done = await self.target.run(line, timeout=VERSION_TIMEOUT_S)
        except TargetError as exc:
            return EngineVersion(command=command, version="", error=str(exc))
        except TimeoutError:
            why = f"no answer within {VERSION_TIMEOUT_S:g}s"
            return EngineVersion(command=command, version="", error=why)
        first = next((ln.strip() for ln in done.stdout.splitlines() if ln.strip()), "")
        if done.exit_status != 0 or not first:
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            why = f"exit {done.exit_status}: {tail[0][:200]}" if done.exit_status else "no output"
            return EngineVersion(command=command, version=first[:200], error=why)
        return EngineVersion(command=command, version=first[:200])

    async def _place_judging(self, plan: RunPlan) -> list[str]:
        """Judge on the target when the kind can and its python has what that needs ([judge]
        on); the run's header says where, and why not there."""
        spec = self.kind.host_judging
        cfg = self.preset.section("judge")
        self.record.extra["judge_on"] = "console"
        if spec is None:
            return []
        if cfg["on"] == "console":
            return ["judged on this console ([judge] on = console): every artifact is fetched"]
        if cfg["on"] == "auto" and self.target.name == "local":
            return []  # the data is already here: nothing to save by judging "there"
        remote = self._remote_judge(plan, cfg["python"] or plan.python)
        await remote.ship(spec)
        why = await remote.unusable(spec, spec.entry)
        if why is not None:
            if cfg["on"] == "host":
                raise TargetError(
                    f"[judge] on = host, but {why}. Install it there, name another python with "
                    f"[judge] python, or set [judge] on = auto"
                )
            return [f"judged on this console, not on the host: {why}; every artifact is fetched"]
        self.record.extra.update(judge_on="host", judge_python=remote.python)
        assert self.judge is not None
        self.judge.ctx.host = remote
        return [
            f"judged on {self.target.name}: what is judged there stays there (`tracedeck fetch "
            f"{self.local_dir}` brings it home)"
        ]

    def _remote_judge(self, plan: RunPlan, python: str) -> RemoteJudge:
        return RemoteJudge(
            self.target, python, f"{plan.run_dir}/judge", plan.artifacts, self.local_dir
        )

    async def _resolve_dir(self, path: str, key: str) -> str:
        return await resolve_dir(self.target, path, key)

    async def _ship_reference(self, pkg: str) -> None:
        await ship_reference(self.target, pkg)

    def _holder(self) -> dict[str, Any]:
        return {
            "user": self.record.user,
            "console_host": self.record.console_host,
            "run_id": self.record.run_id,
            "preset": self.record.preset,
            "started_at": self.record.started_at,
        }

    def _run_started(
        self, plan: RunPlan, attached: bool, notes: list[str] | None = None
    ) -> RunStarted:
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
            notes=list(notes or []),
        )

    # -- attaching -----------------------------------------------------------------------------

    @classmethod
    def from_record(cls, local_dir: Path, emit: Callable[[Event], None]) -> Session:
        """A session for a recorded run, its plan rebuilt; nothing replayed, nothing written."""
        record = RunRecord.load(local_dir)
        if FLEET in record.extra:
            from runners.fleet import FleetSession

            return FleetSession.fleet_from_record(record, emit)
        preset = Preset(
            source=record.source,
            data=record.preset_data,
            overrides=record.overrides,
            options=frozenset(record.options),
        )
        tgt = preset.section("target")
        target = parse_target(
            record.target, connect_timeout=tgt["connect_timeout_s"], keepalive=tgt["keepalive_s"]
        )
        session = cls(record, preset, target, emit)
        extra = record.extra
        ship = preset.section("engine")["ship_reference"]
        session._use_plan(
            build_plan(
                preset,
                run_id=record.run_id,
                run_dir=record.remote_dir,
                workdir=extra["workdir"],
                python=extra["python"],
                date=record.date,
                lock=record.lock,
                pythonpath=f"{record.remote_dir}/pkg" if ship else "",
            )
        )
        if extra.get("judge_on") == "host" and session.judge is not None:
            assert session.plan is not None
            session.judge.ctx.host = session._remote_judge(session.plan, extra["judge_python"])
        return session

    @classmethod
    def attach(
        cls, local_dir: Path, emit: Callable[[Event], None], replay: Callable[[Event], None]
    ) -> Session:
        """Rebuild a session from its record, as the record's one writer; recorded events go to
        `replay`, new ones to `emit`. RecordBusy when another console writes the record."""
        record = RunRecord.load(local_dir)
        if FLEET in record.extra:
            from runners.fleet import FleetSession

            return FleetSession.fleet_attach(record, emit, replay)
        session = cls.from_record(local_dir, emit)
        recorder = Recorder(local_dir)  # the writer lock first: no two consoles append
        try:
            events_path = Path(local_dir) / EVENTS
            if events_path.exists():
                drop_torn_tail(events_path)
                for event in iter_events(events_path):
                    if isinstance(event, RunFinished) and event.verdict == DISCONNECTED:
                        continue  # the console gave up following; the run itself went on
                    session._fold(event)
                    replay(event)
        except BaseException:
            recorder.close()
            raise
        session._recorder = recorder
        return session

    # -- following -----------------------------------------------------------------------------

    async def follow(self) -> RunFinished:
        """Follow until the run finishes; reconnect with backoff when the link drops."""
        if self.finished is not None:
            return self.finished
        assert self.plan is not None and self.follower is not None
        await self._connect_with_retry()
        changes = self._changes = Changes(self.target, self.plan.python, self.plan.run_id)
        await changes.start()
        last_alive = 0.0
        loop = asyncio.get_running_loop()
        while self.finished is None:
            if self.pressure is not None and self.pressure():
                await asyncio.sleep(POLL_S / 2)
                continue
            try:
                ended = await self.follower.poll()
                if ended:
                    await self._finish_run(
                        Ending("cancelled" if self.follower.cancelled else "done")
                    )
                    continue
                now = loop.time()
                if now - last_alive >= ALIVE_EVERY_S:
                    last_alive = now
                    await self._check_alive()
            except ConnectionLost as exc:
                if not await self._reconnect(str(exc)):
                    break
                await changes.start()
                continue
            except RecordError as exc:
                self._stop_recording(exc)
                break
            except Exception as exc:  # noqa: BLE001 - tracedeck's own fault: said, and recorded
                self._following_failed(exc)
                break
            if self.finished is None and self.follower.behind:
                await asyncio.sleep(0)  # a backlog is read step after step
            elif self.finished is None:
                # Wait for more to be written: woken by the target, or at the poll at the latest.
                changes.watch(self.follower.watched())
                await changes.wait(POLL_S)
        assert self.finished is not None
        return self.finished

    def _following_failed(self, exc: Exception) -> None:
        """Following or judging raised what nothing expected: the record still gets its end (the
        error, where it came from, how to go on), never a bare traceback and no end."""
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {Path(where.filename).name}:{where.lineno}" if where is not None else ""
        message = (
            f"tracedeck failed while following run {self.record.run_id}: "
            f"{type(exc).__name__}{at}: {exc}. The run goes on on {self.target.name}; reattach: "
            f"tracedeck attach {self.local_dir}; cancel: tracedeck cancel {self.local_dir}"
        )
        for event in (
            Error(message=message, where=str(self.local_dir), affects_verdict=False),
            RunFinished(verdict=NOT_JUDGED, exit_code=EXIT_INFRA, summary={"error": message}),
        ):
            if self._recorder is not None:
                self._recorder(event)
            with contextlib.suppress(Exception):  # the judge that failed may fail again
                self._fold(event)
            if isinstance(event, RunFinished):
                self.finished = event
            self._consumers(event)

    def _stop_recording(self, exc: RecordError) -> None:
        """The record cannot be written (a full disk): stop following, say so, never guess."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        message = str(exc.strerror or exc)
        for event in (
            Error(message=message, where=str(self.local_dir), affects_verdict=False),
            RunFinished(verdict=NOT_RECORDED, exit_code=EXIT_INFRA, summary={"error": message}),
        ):
            self._fold(event)
            self._consumers(event)

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
        self.emit(
            RunFinished(
                verdict=DISCONNECTED,
                exit_code=EXIT_INFRA,
                summary={"error": text, "attach": str(self.local_dir)},
            )
        )
        return False

    async def _check_alive(self) -> None:
        assert self.plan is not None and self.follower is not None
        for event in await self.launcher.watch(self.plan):
            self.emit(event)
        if self._cancelling or await self.launcher.alive(self.plan):
            return  # a cancel in flight writes its own "cancelled" line once the group is dead
        # The run may have written "done" just before exiting: read once more before judging.
        if await self.follower.poll():
            await self._finish_run(Ending("cancelled" if self.follower.cancelled else "done"))
            return
        outcome = await self.launcher.outcome(self.plan, self.follower)
        if outcome is not None:
            for event in await self.launcher.watch(self.plan):
                self.emit(event)
            await self.follower.drain_started()
            for finished in outcome.cells:
                self.emit(finished)
            await self._finish_run(outcome.ending)
            return
        run_dir = self.plan.run_dir
        if await self.target.read_from(f"{run_dir}/pgid", 0, 64) is None:
            # No process group was ever recorded: the console stopped during the launch.
            message = (
                f"{self.target.name}: the run never started: {run_dir} holds its plan but no "
                f"process group (the console stopped during the launch); nothing ran, no lock "
                f"is held; start it again"
            )
            self.emit(Error(message=message, where=run_dir))
            await self._finish_run(Ending("not_started", message))
            return
        if await self.target.read_from(f"{run_dir}/cancel", 0, 0) is not None:
            # Cancelled from elsewhere: its script records the cancel once every process died.
            for _ in range(50):
                if await self.follower.poll():
                    break
                await asyncio.sleep(POLL_S)
            await self._finish_run(Ending("cancelled"))
            return
        tail = await self.follower.tail(f"{self.plan.run_dir}/runner.err")
        message = (
            f"{self.target.name}: the run in {self.plan.run_dir} ended without finishing "
            f"(remote crash or killed outside tracedeck); runner.err: {tail}"
        )
        self.emit(Error(message=message, where=self.plan.run_dir))
        await self._finish_run(Ending("crashed"))

    async def _finish_run(self, ending: Ending) -> None:
        assert self.follower is not None and self.judge is not None
        follower = self.follower
        await follower.drain_started()
        await follower.drain_rest()
        for index, track in follower.cells.items():
            if track.finished:
                continue
            # Cells after a failed setup, or of a run that never started, never ran; otherwise
            # a cell with no end was cut short by a cancel or by the run dying.
            if ending.how == "cancelled":
                state = CellState.CANCELLED
            elif follower.setup_failed or ending.how == "not_started":
                state = CellState.SKIPPED
            else:
                state = CellState.LOST
            self.emit(CellFinished(cell=index, state=state, exit_code=None, duration_s=None))
        for path in follower.never_appeared():
            self.emit(
                Error(
                    message=f"trace file {self.target.name}:{path} never appeared: the engine "
                    f"wrote no trace there (check [traces] follow and the engine's trace path)",
                    where=path,
                )
            )
        await report_leftovers(self.target, self.launcher, self.plan, self.local_dir, self.emit)
        await self.judge.advance()
        if self.preset.section("judge")["fetch_held"]:
            await follower.fetch_held()
        self.emit(await self._judged_end(ending))

    async def _judged_end(self, ending: Ending) -> RunFinished:
        """The judge's verdict on the run, its documents written (a thread: they may be large);
        NOT_RECORDED (exit 3) when this machine cannot write them."""
        assert self.judge is not None
        try:
            return await asyncio.to_thread(self.judge.finish, ending)
        except OSError as exc:
            where = exc.filename or self.local_dir
            return RunFinished(
                verdict=NOT_RECORDED,
                exit_code=EXIT_INFRA,
                summary={"error": f"cannot write the run's documents in {where}: {exc.strerror}"},
            )

    async def fetch_held(self) -> int:
        """Bring home every artifact judged on the target and not fetched yet; how many."""
        assert self.follower is not None
        count = len(self.follower.held_artifacts())
        await self.follower.fetch_held()
        return count

    # -- cancelling ------------------------------------------------------------------------------

    async def cancel(self, grace_s: float = CANCEL_GRACE_S) -> str:
        """TERM the run's process group, KILL after the grace; the follower records the cells."""
        assert self.plan is not None
        self._cancelling = True
        try:
            return await self.launcher.cancel(self.plan, grace_s)
        finally:
            self._cancelling = False

    async def close(self) -> None:
        if self._changes is not None:
            await self._changes.close()
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        await self.target.close()


async def fetch_held_into(local_dir: Path, emit: Callable[[Event], None]) -> int:
    """Bring home what a run left on its host, recorded in its record (as its writer: raises
    RecordBusy while another console follows it); how many files."""
    session = Session.attach(local_dir, emit, replay=lambda event: None)
    try:
        assert session.follower is not None
        if not session.follower.held_artifacts():
            return 0
        await session.target.connect()
        return await session.fetch_held()
    finally:
        await session.close()


def _fresh_dir(path: Path) -> Path:
    """The run's local directory: the preset's layout path, suffixed if a run already used it."""
    candidate, n = path, 1
    while (candidate / "run.json").exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
