#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs OpenSSH sshd and the Python deps, lints, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/sbin/sshd ]; then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq openssh-server >/dev/null
fi
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
