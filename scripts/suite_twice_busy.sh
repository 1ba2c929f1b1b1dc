#!/usr/bin/env bash
# The suite twice in a row, each on a fresh clone of COMMIT (default HEAD), on a machine kept
# busy by another job (a nice-10 CPU spinner) - how CI's shared machines run it. Logs, the load
# (every 30 s) and a line per run go to OUT (default ./suite-twice-busy).
# Usage: bash scripts/suite_twice_busy.sh [COMMIT] [OUT]
set -u
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="${1:-HEAD}"
out="$(mkdir -p "${2:-suite-twice-busy}" && cd "${2:-suite-twice-busy}" && pwd)"
python3 -c 'while True: pass' &
spin=$!
renice -n 10 -p "$spin" >>"$out/load"
(while true; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/load"; sleep 30; done) &
loadlog=$!
trap 'kill "$spin" "$loadlog" 2>>"$out/load"' EXIT
for i in 1 2; do
  clone="$out/clone-$i"
  rm -rf "$clone"
  git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
  start=$(date +%s)
  (cd "$clone" && CI=true bash .ci/run) >"$out/run-$i.log" 2>&1
  rc=$?
  echo "run $i $(git -C "$clone" rev-parse --short HEAD) rc=$rc $(($(date +%s) - start)) s: $(tail -n 1 "$out/run-$i.log")" | tee -a "$out/summary"
done
