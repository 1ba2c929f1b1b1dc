#!/usr/bin/env bash
# Creates .venv with tracedeck, the CPU torch build for the reference engine, and the test tools.
# An operator with a ROCm or CUDA torch can install with: pip install -e '.[engine]' instead.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch pinned: 2.13.0 is a CPU build; an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -e '.[engine,test]' 'torch==2.13.0'
  touch "$stamp"
fi
