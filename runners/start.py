"""Starting a run's batches: a run on one host is launched whole before it is followed (the
launch raises what refused it); a fleet's hosts each start their next batch as they follow.
Either way a batch is planned on its host's paths, told where it is judged, uploaded and
started under its host's lock.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil

import orjson

from runners.determinism import run_env
from runners.events import (
    Error,
    HostAssigned,
    LockAcquired,
    LockBusy,
    RunFinished,
    RunStarted,
)
from runners.exits import DISCONNECTED, EXIT_INFRA
from runners.host_prep import engine_version, resolve_dir
from runners.launchers.base import LockBusyError, NotStartedError
from runners.local_run import link_by_id
from runners.member import Member, reconnect
from runners.placement import CONSOLE, HOST
from runners.plan import RunPlan, interpreter, plan_document
from runners.record import EVENTS, FLEET, RECORD_LOCK, RUN_JSON, Recorder
from runners.run_core import RunCore
from runners.scheduler import CONNECTING, IDLE, RUNNING, Slot
from runners.targets.base import ConnectionLost, TargetError


async def launch(run: RunCore) -> None:
    """Record the run; on one host connect, upload the plan, take the lock and start it
    detached (a fleet's hosts each start their part as they follow).

    A launch refused by the lock leaves no directory behind, here or on the target: nothing
    ran, there is nothing to see; nor does one that never reached the target. (A launch that
    failed while uploading keeps its record, which says why it never started.)
    """
    made_local = not run.local_dir.exists()
    try:
        await _launch(run)
    except LockBusyError:
        await discard(run, made_local, remote=True)
        raise
    except NotStartedError:
        raise  # its record says why it never started
    except BaseException:
        if run.stage == "connecting":  # the target was not reached: nothing was written
            await discard(run, made_local, remote=False)
        raise


async def discard(run: RunCore, made_local: bool, remote: bool) -> None:
    """Remove what this launch made: the local directory, its by-id link, and (remote) the
    run's directory on the target. Only ever this run's own fresh directories."""
    run.stop_recording()
    if run.by_id is not None and run.by_id.is_symlink():
        run.by_id.unlink()
    local = run.local_dir
    if made_local:
        shutil.rmtree(local, ignore_errors=True)
        with contextlib.suppress(OSError):
            local.parent.rmdir()  # the date directory, when this run was its only one
    else:  # a directory that was there before: only the files this launch wrote
        for name in (RUN_JSON, EVENTS, RECORD_LOCK, "plan.json"):
            with contextlib.suppress(OSError):
                (local / name).unlink()
    run_dir = run.record.remote_dir
    if remote and run_dir.endswith("/" + run.record.run_id):
        with contextlib.suppress(TargetError):
            await run.only.target.run(f"rm -rf -- {shlex.quote(run_dir)}")


def _open_record(run: RunCore, plan: RunPlan) -> None:
    run.record.save()
    if run.by_id is not None:
        with contextlib.suppress(OSError):  # a convenience: find_run also scans the out dir
            link_by_id(run.by_id, run.local_dir)
    run.recorder = Recorder(run.local_dir)
    doc = plan_document(plan, run.preset)
    (run.local_dir / "plan.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


async def _launch(run: RunCore) -> None:
    run.stage = "connecting"
    run.local_dir.mkdir(parents=True, exist_ok=True)
    if run.fleet:
        _open_record(run, run.nominal)
        run.emit(_run_started(run, run.nominal, _notes(run)))
        run.stage = "started"
        return
    slot = run.only
    await slot.target.connect()
    member = await _member(run, slot, None)
    run.sched.take(slot)  # one host: everything at once
    plan = member.plan
    run.record.remote_dir = plan.run_dir
    run.record.extra = {"workdir": plan.workdir, "python": plan.python, "judge_on": "console"}
    run.stage = "uploading"
    _open_record(run, plan)
    await member.upload(run.preset, _holder(run))
    judge_python, note = await _judging(run, member)
    if judge_python:
        run.record.extra.update(judge_on="host", judge_python=judge_python)
    run.record.save()
    run.emit(_run_started(run, plan, _notes(run) or ([note] if note else [])))
    version = await engine_version(run.preset, slot.target, plan.workdir, plan.python)
    if version is not None:
        run.emit(version)
    run.stage = "starting"
    try:
        started = await member.start()
    except (LockBusyError, NotStartedError) as error:
        busy = isinstance(error, LockBusyError)
        if isinstance(error, LockBusyError):
            run.emit(LockBusy(lock=plan.lock, holder=error.holder))
        else:
            run.emit(Error(message=str(error), where=plan.run_dir))
        word, summary = "LOCK_BUSY" if busy else "NOT_STARTED", {"error": str(error)}
        run.emit(RunFinished(verdict=word, exit_code=EXIT_INFRA, summary=summary))
        raise
    run.stage = "started"
    for event in started.events or (LockAcquired(lock=plan.lock, holder=started.holder),):
        run.emit(event)
    member.started = True


async def batch(run: RunCore, slot: Slot, groups: list[list[int]]) -> Member | None:
    """A fleet host's next batch, uploaded and started under the host's lock; None (the
    groups back in the queue) when the host cannot take it now."""
    sched, spec, cells = run.sched, slot.place.spec, sorted(c for g in groups for c in g)
    if not slot.state:
        sched.set_state(slot, CONNECTING)
    if not await connect(run, slot):
        sched.give_back(groups)
        return None
    try:
        if slot.waited and not await sched.lock_free(slot):
            sched.give_back(groups)
            return None
        member = await _member(run, slot, cells)
        plan = member.plan
        judge_python, note = await _judging(run, member)
        if note and not judge_python:
            run.emit_at(slot, Error(message=f"{spec}: {note}", where=spec, affects_verdict=False))
        assigned = HostAssigned(
            member=plan.run_id, cells=cells, run_dir=plan.run_dir, lock=plan.lock,
            workdir=plan.workdir, python=plan.python, judge_python=judge_python,
        )  # fmt: skip
        run.emit_at(slot, assigned)
        keys = ("member", "cells", "run_dir", "lock", "workdir", "python", "judge_python")
        batches = run.record.extra.setdefault(FLEET, {}).setdefault("members", [])
        batches.append({"host": spec, **{k: getattr(assigned, k) for k in keys}})
        run.record.save()
        await member.upload(run.preset, {**_holder(run), "member": plan.run_id, "host": spec})
        started = await member.start()
    except LockBusyError as error:
        sched.give_back(groups)
        sched.busy(slot, error, run.record.run_id)
        return None
    except (ConnectionLost, NotStartedError, TargetError, OSError) as exc:
        sched.give_back(groups)
        if slot.active is not None:
            slot.active.ended = True
        if not isinstance(exc, ConnectionLost):
            sched.fail(slot, str(exc))
        elif (
            said := await reconnect(slot.target, run.attempts, run.emitter(slot), str(exc))
        ) is None:
            sched.set_state(slot, IDLE, "reconnected; the batch goes back to the queue")
        else:
            sched.lose(slot, said, run.attempts)
        return None
    for event in started.events or (LockAcquired(lock=plan.lock, holder=started.holder),):
        run.emit_at(slot, event)
    sched.set_state(slot, RUNNING, f"cells {', '.join(str(c + 1) for c in cells)}")
    return member


async def _member(run: RunCore, slot: Slot, cells: list[int] | None) -> Member:
    """The next batch on a host, planned on its paths (RUNS/RUN_ID alone; RUNS/RUN_ID/SLUG-N,
    with its own marker, in a fleet)."""
    if slot.dirs is None:
        tgt = run.preset.section("target")
        workdir = await resolve_dir(slot.target, tgt["workdir"], "target.workdir")
        runs = await resolve_dir(slot.target, tgt["runs"], "target.runs")
        slot.dirs = (workdir, runs, interpreter(slot.target.name, tgt["python"]))
    workdir, runs, python = slot.dirs
    run_id, name = run.record.run_id, f"{slot.place.slug}-{len(slot.members) + 1}"
    plan = run.placement.plan(
        run_id=run_id,
        run_dir=f"{runs}/{run_id}/{name}" if run.fleet else f"{runs}/{run_id}",
        workdir=workdir,
        python=python,
        date=run.record.date,
        lock=slot.place.lock,
        cells=cells,
        marker=f"{run_id}@{name}" if run.fleet else "",
    )
    return run.new_member(slot, plan)


async def _judging(run: RunCore, member: Member) -> tuple[str, str]:
    """Judge on the batch's host when the placement says so and its python has what that
    needs: (that python, or "" when judged here; what the run says of it)."""
    judging, spec = run.placement.judging, run.kind.host_judging
    if judging is None or spec is None or judging.where == CONSOLE:
        return "", ""
    got = await member.judge_here(spec, judging.python or member.plan.python, run.local_dir)
    if isinstance(got, str):
        if judging.where == HOST:
            raise TargetError(
                f"[judge] on = host, but {got}. Install it there, name another python with "
                f"[judge] python, or set [judge] on = auto"
            )
        return "", f"judged on this console, not on the host: {got}; every artifact is fetched"
    run.judge.ctx.hosts.update({c.index: got for c in member.plan.cells})
    return got.python, (
        f"judged on {member.target.name}: what is judged there stays there (`tracedeck fetch "
        f"{run.local_dir}` brings it home)"
    )


def _notes(run: RunCore) -> list[str]:
    """Where the run is judged, when the placement says so before any host is asked."""
    judging = run.placement.judging
    if judging is None:
        return []
    if run.preset.section("judge")["on"] == "console":
        return ["judged on this console ([judge] on = console): every artifact is fetched"]
    if not run.fleet:
        return []
    if judging.where == CONSOLE:
        return [f"judged on this console: {judging.why}"]
    return [
        f"judged on each host whose python can: what is judged there stays there "
        f"(`tracedeck fetch {run.local_dir}` brings it home)"
    ]


def _holder(run: RunCore) -> dict[str, str]:
    keys = ("user", "console_host", "run_id", "preset", "started_at")
    return {k: getattr(run.record, k) for k in keys}


def _run_started(run: RunCore, plan: RunPlan, notes: list[str]) -> RunStarted:
    runs, run_id = run.preset.section("target")["runs"], run.record.run_id
    return RunStarted(
        run_id=run_id,
        preset=run.preset.name,
        kind=run.preset.kind,
        target=run.target_name,
        local_dir=str(run.local_dir),
        remote_dir=f"{runs}/{run_id}/HOST-N on each host of {', '.join(run.slots)}"
        if run.fleet
        else plan.run_dir,
        cells=[{"index": c.index, "params": c.params, "command": c.command} for c in plan.cells],
        profile=run.preset.section("determinism")["profile"],
        env=run_env(run.preset.data),
        notes=notes,
    )


async def connect(run: RunCore, slot: Slot) -> bool:
    """Connect (with the run's reconnect attempts); False when the host is lost."""
    try:
        await slot.target.connect()
        return True
    except ConnectionLost as exc:
        said = await reconnect(slot.target, run.attempts, run.emitter(slot), str(exc))
        if said is not None:
            link_lost(run, slot, said)
        return said is None
    except TargetError as exc:  # a host key or a login refused: no retry mends it
        if not run.fleet:
            raise
        run.sched.fail(slot, str(exc))
        return False


def link_lost(run: RunCore, slot: Slot, message: str) -> None:
    """Reconnecting failed: a fleet host is lost (its cells go elsewhere); a run on one
    host stops being followed (it goes on there)."""
    if run.fleet:
        run.sched.lose(slot, message, run.attempts)
        return
    text = (
        f"{slot.target.name}: connection lost and {run.attempts} reconnect attempts failed "
        f"({message}). The run goes on on the target; reattach with: "
        f"tracedeck attach {run.local_dir}"
    )
    run.emit(Error(message=text, where=slot.target.name, affects_verdict=False))
    summary = {"error": text, "attach": str(run.local_dir)}
    run.emit(RunFinished(verdict=DISCONNECTED, exit_code=EXIT_INFRA, summary=summary))
