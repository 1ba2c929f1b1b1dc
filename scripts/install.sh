#!/usr/bin/env bash
# Creates .venv with tracedeck, the CPU torch build for the reference engine, and the test tools.
# An operator with a ROCm or CUDA torch can install with: pip install -e '.[engine]' instead.
# It says what it does on stderr: the first install takes minutes and must not look hung.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed
say() { echo "tracedeck install: $*" >&2; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ -f "$stamp" ]; then
    say "pyproject.toml changed since the last install: updating $PWD/.venv"
  else
    say "first start: creating $PWD/.venv (a Python virtual environment for tracedeck)"
  fi
  python3 -m venv .venv
  say "upgrading pip in .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  say "installing tracedeck and its dependencies (textual, asyncssh, numpy, torch 2.13.0" \
    "CPU build, the test tools): several hundred MB, a few minutes, only this once"
  # torch pinned: 2.13.0 is a CPU build; an unpinned torch pulls a multi-GB CUDA build.
  # --no-compile: pip would compile every installed file one at a time (torch's whole tree, ~20
  # s of CPU); compile_imports.py compiles what tracedeck and its tests import, by importing it.
  .venv/bin/python -m pip install -q --no-compile -e '.[engine,test]' 'torch==2.13.0'
  say "compiling what tracedeck imports (torch, textual, numpy, ...)"
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python scripts/compile_imports.py
  touch "$stamp"
  say "done. The command is $PWD/.venv/bin/tracedeck; to type just \`tracedeck\`, put it on" \
    "PATH: export PATH=\"$PWD/.venv/bin:\$PATH\" (add that line to ~/.bashrc to keep it)"
fi
# The project's own modules compiled ahead (incremental: only what changed). Where
# PYTHONDONTWRITEBYTECODE is set, as in this project's CI image, Python never caches them, and
# every tracedeck process, console, engine or judge, would compile them again at its start
# (~0.1 s of CPU each; the test suite starts hundreds).
.venv/bin/python -m compileall -q -j0 console runners analysis tests
