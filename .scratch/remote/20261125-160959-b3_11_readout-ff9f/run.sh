#!/bin/sh
# Written by tracedeck: runs detached (setsid) and holds the host lock through fd 9.
cd /work/wt/i20-readout-kv/.scratch/remote/20261125-160959-b3_11_readout-ff9f
mkdir -p artifacts  # {out}: there when the first cell starts; below it is the engine's
export TRACEDECK_RUN_ID=20261125-160959-b3_11_readout-ff9f
now() { date +%s.%N; }
ev() { printf '%s\n' "$1" >> progress.jsonl; }
sizes() {
  for f in /work/wt/i20-readout-kv/.scratch/remote/20261125-160959-b3_11_readout-ff9f/artifacts/b3_11_readout.jsonl; do
    [ -f "$f" ] && printf '%s\t%s\n' "$(stat -c %s "$f" 2>/dev/null || echo 0)" "$f"
  done
  return 0
}
run_pids() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    line=
    { read -r line < "$d/stat"; } 2>/dev/null || continue
    s=${line##*) }
    [ "${s%% *}" = Z ] && continue
    { grep -qzxF "$1" "$d/environ"; } 2>/dev/null && echo "$p"
  done
  return 0
}
reap_cell() {
  left=$(run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1")
  [ -z "$left" ] && return 0
  echo "$left" > "cells/$1/leftover"
  kill -TERM $left 2>/dev/null
  i=0
  while [ -n "$(run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1")" ] && [ $i -lt 20 ]; do
    sleep 0.1; i=$((i+1))
  done
  kill -KILL $(run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1") 2>/dev/null
  return 0
}
run_cell() {
  ev "{\"e\":\"start\",\"cell\":\"$1\",\"t\":$(now)}"
  TRACEDECK_CELL="$TRACEDECK_RUN_ID/$1" bash "cells/$1/cmd.sh" > "cells/$1/stdout.log" \
    2> "cells/$1/stderr.log" < /dev/null
  rc=$?
  echo "$rc" > "cells/$1/exit_code"
  reap_cell "$1"
  sizes > "cells/$1/trace_sizes"
  ev "{\"e\":\"end\",\"cell\":\"$1\",\"rc\":$rc,\"t\":$(now)}"
  return "$rc"
}
run_cell 000
run_cell 001
ev "{\"e\":\"done\",\"t\":$(now)}"
