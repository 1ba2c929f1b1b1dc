"""Test helper: a real one-node Slurm cluster (Debian's slurm-wlm: slurmctld, slurmd, munged)
on this machine, with a generated slurm.conf in a directory of its own, on free ports, its
daemons started in the foreground by this process and stopped by their PIDs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from sshd import free_port

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
PARTITION = "debug"


def missing() -> list[str]:
    """What of Slurm and munge this machine lacks (install: apt-get install slurm-wlm munge)."""
    gone = [d for d in DAEMONS if not os.access(d, os.X_OK)]
    gone += [c for c in CLIENTS if shutil.which(c) is None]
    if os.geteuid() != 0:
        gone.append("root (slurmd runs jobs as their user)")
    return gone


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path
    node: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args),
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
        )

    def expire(self, job: str, timeout: float = 30.0) -> None:
        """Set a running job's end time to now, as an admin would.

        scontrol reads 'now' on its clock and slurmctld refuses an end time already past on
        its own, so a second boundary between the two gives 'Invalid time specified': ask
        again until it is taken."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.run("scontrol", "update", f"JobId={job}", "EndTime=now", check=False)
            if done.returncode == 0:
                return
            if "Invalid time specified" not in done.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"scontrol could not end job {job}: {done.stderr.strip()}")

    def jobs(self) -> list[str]:
        """The ids of every job Slurm still holds (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%A", check=False).stdout
        return out.split()

    def log(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.dir.glob("*.log"))
        )

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()

    def wait_idle(self, timeout: float = 30.0, states: tuple[str, ...] = ("idle",)) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.node_state() in states:
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"the Slurm node is {self.node_state()!r}, not {' or '.join(states)}; logs:\n"
            f"{self.log()}"
        )

    def resume_node(self) -> None:
        """After a test set the node DOWN: bring it back into service."""
        self.run("scontrol", "update", f"NodeName={self.node}", "State=RESUME", check=False)
        self.wait_idle(states=("idle", "mixed", "allocated"))

    def stop(self) -> None:
        """Cancel what is left, let Slurm end it, then stop the daemons by their PIDs (and any
        slurmstepd of this cluster that outlived its slurmd)."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            ids = self.jobs()
            if ids:
                self.run("scancel", *ids, check=False)
                deadline = time.monotonic() + 15
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged: by PID
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
        for pid in self.steps():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def steps(self) -> list[int]:
        """Live slurmstepd processes of this cluster (their environment names its conf)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if b"slurmstepd" not in (entry / "cmdline").read_bytes():
                    continue
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
            except OSError:
                continue
        return out


def slurm_conf(d: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return "\n".join(
        [
            "ClusterName=tracedeck-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=300",
            "KillWait=2",
            "OverTimeLimit=0",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def start_cluster(d: Path) -> SlurmCluster:
    """munged, slurmctld and slurmd in the foreground, on free ports; the node idle."""
    node = socket.gethostname().split(".")[0]
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = d / "slurm.conf"
    conf.write_text(slurm_conf(d, node, os.cpu_count() or 1, free_port(), free_port()))
    cluster = SlurmCluster(d, conf, node)
    env = {**os.environ, **cluster.env}
    munge = d / "munge"
    starts = [
        [
            "/usr/sbin/munged",
            "--foreground",
            "--force",
            f"--socket={munge / 'munge.socket'}",
            f"--key-file={key}",
            f"--log-file={munge / 'munged.log'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}",
        ],
        ["/usr/sbin/slurmctld", "-D", "-c", "-f", str(conf)],
        ["/usr/sbin/slurmd", "-D", "-N", node, "-f", str(conf)],
    ]
    try:
        for argv in starts:
            with (d / f"{Path(argv[0]).name}.out").open("ab") as out:
                cluster.procs.append(
                    subprocess.Popen(
                        argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
                    )
                )
            if argv[0].endswith("munged"):
                _wait_for(munge / "munge.socket", cluster)
            time.sleep(0.5)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(path: Path, cluster: SlurmCluster, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        if any(p.poll() is not None for p in cluster.procs):
            break
        time.sleep(0.05)
    raise RuntimeError(f"{path} never appeared; logs:\n{cluster.log()}")
