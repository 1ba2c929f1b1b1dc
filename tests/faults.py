"""The fault harness: what every fault scenario checks after it, and ways to cause faults.

Every scenario ends with `assert_run_gone`: no process of the run alive (group or escaped,
zombies aside, and tracedeck's own change notifier), the host lock free: checked, not assumed.
A process of the run is found on the host itself, not from the run's record: by the run's
marker in its environment, by holding the lock file open, by a working directory, open file or
argument inside the run's directory, and (when the tests run in their own mount namespace, as
/work/bin/isotest gives them) by having started in this namespace after the run did and not
being this test's own process: so a process that scrubbed its environment, left the session
and closed the lock fd is still caught. Processes of other mount namespaces are left out: their
/tmp paths have the same names but are other files.
The proxy to cut links lives in sshd.py (CuttableProxy); `small_disk` mounts a tmpfs that fills;
the `impostor` fixture (conftest.py) is a second sshd with a host key nobody trusted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
from runhelp import live_processes, notifier_alive, run_alive


def record_of(local_dir: Path) -> dict:
    return orjson.loads((local_dir / "run.json").read_bytes())


def lock_free(lock: str) -> bool:
    """Can the host lock be taken right now (nobody holds it)?"""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise AssertionError("/proc/stat has no btime")


def _own_lineage() -> set[int]:
    """This test process and its ancestors (they are not the run's)."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            break
        pid = int(stat[stat.rfind(b")") + 2 :].split()[1])
    return pids


def _descendants(root: int) -> set[int]:
    """The processes under `root` (the test's own children: consoles, sshd fixtures)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_bytes()
            parent[int(entry.name)] = int(stat[stat.rfind(b")") + 2 :].split()[1])
    under: set[int] = set()
    for pid in parent:
        chain, p = [], pid
        while p > 1 and p not in under and p != root and len(chain) < 4096:
            chain.append(p)
            p = parent.get(p, 0)
        if p == root or p in under:
            under.update(chain)
    return under


def _isolated() -> bool:
    """Do the tests run in a mount namespace of their own (isotest), apart from the shell that
    started them? (PID 1's may not be readable, so the test's own ancestors are asked.)"""
    mine = os.readlink("/proc/self/ns/mnt")
    return any(_mnt_ns(pid) not in (None, mine) for pid in _own_lineage())


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def stray_processes(record: dict, locks: list[str]) -> list[str]:
    """Live processes (zombies aside) that belong to the run by what the host shows: they hold a
    lock file open, or have their working directory, an open file or an argument inside the
    run's directory, or (isolated tests) started after the run in this mount namespace."""
    remote = (record.get("remote_dir") or "").rstrip("/")
    lock_paths = {os.path.realpath(lock) for lock in locks if lock}
    here = os.readlink("/proc/self/ns/mnt")
    ns = here if _isolated() else None
    since = 0.0
    if ns is not None:
        started = dt.datetime.fromisoformat(record["started_at"]).timestamp() - 1
        since = (started - _boot_time()) * os.sysconf("SC_CLK_TCK")
    mine = _own_lineage()
    ours = _descendants(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            stat = (entry / "stat").read_bytes()
            fields = stat[stat.rfind(b")") + 2 :].split()
            if fields[0] == b"Z":
                continue
            if os.readlink(entry / "ns/mnt") != here:
                continue  # another mount namespace: its /tmp paths are not ours (isotest)
            why = ""
            if ns is not None and int(fields[19]) >= since and int(entry.name) not in ours:
                why = "started in this namespace during the run, not by this test"
            paths = [os.readlink(entry / "cwd")]
            with contextlib.suppress(OSError):
                paths += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            for path in paths:
                if path in lock_paths:
                    why = why or f"holds the lock {path} open"
                elif remote and (path == remote or path.startswith(remote + "/")):
                    why = why or f"uses {path}"
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if remote and any(remote.encode() in a for a in args):
                why = why or "names the run directory"
            if why:
                found.append(f"{entry.name} ({why}: {b' '.join(args)[:120]!r})")
        except (OSError, IndexError, ValueError):
            continue
    return found


# The fleet "hosts" of the tests (sshd.start_host): name -> pid of its sshd, whose mount namespace
# (its own /tmp, so its own default lock) is that host's. Filled by the fleet_servers fixture.
HOSTS: dict[str, int] = {}
DEFAULT_LOCK = "/tmp/tracedeck.lock"

# What the scenarios checked after them found, for the summary at the end of the session.
TALLY = {"scenarios": 0, "processes_left": 0, "locks_held": 0}
# The bad inputs tried (test_bad_inputs, test_run_bad_traces), how many were handled (the right
# exit, the located message), and how many printed a traceback.
INPUTS = {"tried": 0, "handled": 0, "tracebacks": 0}


def bad_input(text: str) -> Callable[[], None]:
    """Count a bad input tried and whether its output holds a traceback; call what it returns
    once every check of its handling passed."""
    INPUTS["tried"] += 1
    INPUTS["tracebacks"] += "Traceback" in text

    def handled() -> None:
        INPUTS["handled"] += 1

    return handled


def host_path(host: str, path: str) -> str:
    """`path` as the fleet host `host` sees it (through its sshd's root); as is elsewhere."""
    pid = HOSTS.get(host.removesuffix("-direct"))
    return f"/proc/{pid}/root{path}" if pid and path.startswith("/") else path


def host_strays(pid: int) -> list[str]:
    """Live processes in the mount namespace of `pid` (a fleet host's sshd) other than sshd's own
    (the listener, a session not yet closed): after a scenario, anything else there is left."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return []  # the host is down: nothing of it can be left
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if os.readlink(entry / "ns/mnt") != ns:
                continue
            stat = (entry / "stat").read_bytes()
            if stat[stat.rfind(b")") + 2 :].split()[0] == b"Z" or b"(sshd)" in stat[:64]:
                continue
            found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:120]!r}")
    return found


def _using(tmp: Path, locks: tuple[str, ...]) -> list[str]:
    """Processes of this mount namespace (this test's own aside) with a working directory or an
    open file under `tmp`, or one of `locks` open."""
    root = str(tmp.resolve())
    mine = _own_lineage()
    here = os.readlink("/proc/self/ns/mnt")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_bytes()
            if stat[stat.rfind(b")") + 2 :].split()[0] == b"Z":
                continue
            if os.readlink(entry / "ns/mnt") != here:
                continue  # another mount namespace: same path names, other files
            paths = [os.readlink(entry / "cwd")]
            with contextlib.suppress(OSError):
                paths += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            if any(p in locks or p == root or p.startswith(root + "/") for p in paths):
                found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:120]!r}")
    return found


def _records(tmp: Path) -> list[dict]:
    """The run records under tmp (a hand-made broken record, a bad-input case, has no run)."""
    out = []
    for path in sorted(tmp.glob("**/run.json")):
        with contextlib.suppress(OSError, orjson.JSONDecodeError):
            record = orjson.loads(path.read_bytes())
            if isinstance(record, dict) and {"run_id", "lock", "started_at"} <= record.keys():
                out.append(record)
    return out


def _marked(marker: str) -> list[str]:
    mark = f"TRACEDECK_RUN_ID={marker}"
    return [f"{pid}: marked {mark}" for pid, _, env in live_processes() if mark in env]


def scan_left(tmp: Path | None, locks: tuple[str, ...] = (DEFAULT_LOCK,)) -> tuple[list, list]:
    """One look at the hosts: (processes left, locks held). Every run recorded under `tmp`: its
    processes by marker, change notifier, lock open or directory used (stray_processes), its
    lock on each of its hosts; any process using a path under `tmp` or holding one of `locks`;
    those locks; and on every fleet host (its own mount namespace), any process but sshd's and
    its default lock."""
    procs: list[str] = []
    held: list[str] = []
    for record in _records(tmp) if tmp is not None else []:
        markers, parts = run_parts(record)
        for marker in markers:
            procs += _marked(marker)
            if notifier_alive(marker):
                procs.append(f"the change notifier of {marker}")
        procs += stray_processes(record, [lock for _, lock in parts])
        held += [f"{h or 'here'}:{lock}" for h, lock in parts if not lock_free(host_path(h, lock))]
    if tmp is not None:
        procs += _using(tmp, locks)
    held += [lock for lock in locks if not lock_free(lock)]
    for name, pid in sorted(HOSTS.items()):
        procs += [f"on {name}: {p}" for p in host_strays(pid)]
        if not lock_free(host_path(name, DEFAULT_LOCK)):
            held.append(f"{name}:{DEFAULT_LOCK}")
    return sorted(set(procs)), sorted(set(held))


def left_after(
    tmp: Path | None, locks: tuple[str, ...] = (DEFAULT_LOCK,), timeout: float = 15.0
) -> tuple[list, list]:
    """scan_left until nothing is left (its last processes may take a moment to exit), or the
    timeout: what is left then."""
    deadline = time.monotonic() + timeout
    procs, held = scan_left(tmp, locks)
    while (procs or held) and time.monotonic() < deadline:
        time.sleep(0.1)
        procs, held = scan_left(tmp, locks)
    return procs, held


def after_scenario(tmp: Path | None) -> None:
    """The check every fault scenario ends with (conftest.py runs it after each test marked
    `fault`): nothing of any run left alive, no lock held, on this host and every fleet host;
    counted in TALLY for the session's summary."""
    procs, held = left_after(tmp)
    TALLY["scenarios"] += 1
    TALLY["processes_left"] += len(procs)
    TALLY["locks_held"] += len(held)
    assert not procs and not held, f"left after the scenario: processes {procs}, locks {held}"


def assert_nothing_left(tmp: Path, locks: tuple[str, ...] = (DEFAULT_LOCK,)) -> None:
    """After a scenario that may or may not have launched: every run recorded under `tmp` is
    gone, no process uses a path under `tmp` or holds one of `locks` (or a lock file under tmp)
    open, and those locks are free. Checked on the hosts (/proc, flock)."""
    procs, held = left_after(tmp, locks)
    assert not procs, f"processes left using {tmp}: {procs}"
    assert not held, f"a lock is still held: {held}"


def run_parts(record: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """The markers (TRACEDECK_RUN_ID) and (host, lock) pairs of a run: one of each on one host;
    one per batch and per host of a fleet run."""
    fleet = (record.get("extra") or {}).get("fleet")
    if not fleet:
        return [record["run_id"]], [("", record["lock"])]
    members = fleet.get("members") or []
    locks = sorted({(m["host"], m["lock"]) for m in members})
    return [m["member"] for m in members], locks


def slurm_jobs(record: dict) -> list[str]:
    """The Slurm job ids a run submitted (its slurm/job_id), if it went to Slurm."""
    remote = record.get("remote_dir") or ""
    path = Path(remote) / "slurm" / "job_id"
    return path.read_text().split() if remote and path.is_file() else []


def assert_run_gone(
    local_dir: Path,
    timeout: float = 15.0,
    lock_free_on: Callable[[str, str], bool] | None = None,
    slurm_env: dict[str, str] | None = None,
) -> None:
    """No process of the run lives and its lock is free; for a fleet run, on every host (the
    lock of a host seen through `lock_free_on(host, lock)`); for a Slurm run, no task of its
    job is left in the queue either (squeue with `slurm_env`)."""
    record = record_of(local_dir)
    markers, locks = run_parts(record)
    jobs = slurm_jobs(record)
    free = lock_free_on or (lambda host, lock: lock_free(host_path(host, lock)))

    def queued() -> list[str]:
        if not jobs:
            return []
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs), "-o", "%i %T"],
            env={**os.environ, **(slurm_env or {})},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.split("\n")[:-1]

    lock_files = [lock for _, lock in locks]

    def gone() -> bool:
        return (
            not any(run_alive(m) or notifier_alive(m) for m in markers)
            and all(free(h, lock) for h, lock in locks)
            and not queued()
            and not stray_processes(record, lock_files)
        )

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone():
            return
        time.sleep(0.1)
    raise AssertionError(
        f"run {record['run_id']}: processes alive={[m for m in markers if run_alive(m)]}, "
        f"notifier alive={[m for m in markers if notifier_alive(m)]}, "
        f"locks free={[(h, lock, free(h, lock)) for h, lock in locks]}, queued={queued()}, "
        f"strays={stray_processes(record, lock_files)}"
    )


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at path (root only), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def grow_disk(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)
