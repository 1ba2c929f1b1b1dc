#!/usr/bin/env bash
# A Python interpreter with a /tmp of its own: a new mount namespace with a fresh tmpfs on /tmp,
# so each pytest-xdist worker has its own default lock (/tmp/tracedeck.lock) and /tmp state.
# pytest's temp root (/tmp/pytest-of-USER) is bound back in, so each worker's tmp_path lies
# where pytest keeps it (a failed test's files outlive the worker) and the tests' files stay on
# the disk they were on.
# Usage: own_tmp_python.sh PYTHON [ARGS...]   (scripts/test.sh names it in --tx as python=)
# Needs root (CAP_SYS_ADMIN) for unshare -m and mount; scripts/test.sh checks that first.
set -euo pipefail
base="${PYTEST_DEBUG_TEMPROOT:-${TMPDIR:-/tmp}}"
root="${base%/}/pytest-of-$(id -un)"
exec unshare -m --propagation private sh -c '
set -e
root=$1
shift
keep=""
case "$root" in /tmp/*)
  mkdir -p -m 700 "$root"
  keep=/run/tracedeck-worker-$$
  mkdir -p "$keep"
  mount --bind "$root" "$keep";;
esac
mount -t tmpfs -o size=6g,mode=1777 tracedeck-worker-tmp /tmp
if [ -n "$keep" ]; then
  mkdir -p -m 700 "$root"
  mount --bind "$keep" "$root"
  umount -l "$keep"
  rmdir "$keep" 2>/dev/null || true
fi
exec "$@"
' sh "$root" "$@"
