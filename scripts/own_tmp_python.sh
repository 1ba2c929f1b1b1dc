#!/usr/bin/env bash
# A Python interpreter with a /tmp of its own: a new mount namespace with a fresh tmpfs on /tmp,
# so each pytest-xdist worker has its own default lock (/tmp/tracedeck.lock) and /tmp state.
# What the main pytest process shares with its workers under /tmp is bound back in: pytest's
# temp root (/tmp/pytest-of-USER: each worker's tmp_path lies where pytest keeps it, and a
# failed test's files outlive the worker) and pytest-textual-snapshot's directory
# ($TEXTUAL_SNAPSHOT_TEMPDIR, where workers leave the snapshots the report is made of), and this
# checkout, whose .venv holds the Python the worker runs (a CI clone may lie under /tmp:
# `mktemp -d`).
# Usage: own_tmp_python.sh PYTHON [ARGS...]   (scripts/test.sh names it in --tx as python=)
# Needs root (CAP_SYS_ADMIN) for unshare -m and mount; scripts/test.sh checks that first.
set -euo pipefail
base="${PYTEST_DEBUG_TEMPROOT:-${TMPDIR:-/tmp}}"
root="${base%/}/pytest-of-$(id -un)"
checkout="$(cd "$(dirname "$0")/.." && pwd -P)"
case "$root" in /tmp/*) mkdir -p -m 700 "$root" ;; esac
exec unshare -m --propagation private sh -c '
set -e
keep=/run/tracedeck-worker-$$
i=0
for p in "$@"; do
  [ "$p" = -- ] && break
  i=$((i+1))
  case "$p" in /tmp/?*)
    if [ -d "$p" ]; then mkdir -p "$keep/$i"; mount --bind "$p" "$keep/$i"; fi;;
  esac
done
mount -t tmpfs -o size=6g,mode=1777 tracedeck-worker-tmp /tmp
i=0
while [ "$1" != -- ]; do
  i=$((i+1))
  if [ -d "$keep/$i" ]; then
    mkdir -p -m 700 "$1"; mount --bind "$keep/$i" "$1"; umount -l "$keep/$i"
  fi
  shift
done
rmdir "$keep"/* "$keep" 2>/dev/null || true
shift
exec "$@"
' sh "$checkout" "$root" "${TEXTUAL_SNAPSHOT_TEMPDIR:-}" -- "$@"
