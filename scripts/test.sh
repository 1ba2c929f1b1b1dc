#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs OpenSSH sshd, Slurm (slurm-wlm: slurmctld,
# slurmd) and munge when missing, the Python deps; lints, tests. The Slurm tests start their
# own one-node cluster (as root); where Slurm is missing they are skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
{ [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ]; } || need+=(slurm-wlm)
[ -x /usr/sbin/munged ] || need+=(munge)
if [ "${#need[@]}" -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  log="${TMPDIR:-/tmp}/tracedeck-apt.log"
  echo "installing ${need[*]} (log: $log)"
  if ! { $sudo_cmd apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}"; } >"$log" 2>&1; then
    echo "apt-get could not install ${need[*]}; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
fi
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# In parallel where each worker can have a /tmp of its own (a mount namespace: root or
# CAP_SYS_ADMIN), so no two tests share /tmp/tracedeck.lock; one at a time otherwise.
# TRACEDECK_TEST_WORKERS=N sets the number of workers (1: one at a time); by default twice the
# cores, at most 4: most of a test's time is spent waiting on a run, an ssh link or a child.
parallel=()
cores="$(nproc 2>/dev/null || echo 1)"
default_workers=$((cores * 2 > 4 ? 4 : cores * 2))
workers="${TRACEDECK_TEST_WORKERS:-$default_workers}"
if [ "$workers" -gt 1 ] && unshare -m --propagation private true 2>/dev/null; then
  wrap="$PWD/scripts/own_tmp_python.sh $PWD/.venv/bin/python"
  parallel=(--dist loadgroup --tx "$workers*popen//python=$wrap")
  echo "tests: $workers parallel workers, each with its own /tmp" >&2
elif [ "$workers" -gt 1 ]; then
  echo "tests: one at a time (a private /tmp per worker needs unshare -m, i.e. root;" \
    "the tests need their own /tmp: run them as root or in a container)" >&2
fi
# Bytecode is cached for the tests (pytest's rewritten test modules, the reference engine's copy
# each run ships and its cells share): where PYTHONDONTWRITEBYTECODE is set, as in CI, each
# worker and each engine start compiled them again.
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
