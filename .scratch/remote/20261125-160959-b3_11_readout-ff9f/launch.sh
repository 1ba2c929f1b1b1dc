#!/bin/sh
# Written by tracedeck: take the host lock, record the holder, start run.sh detached.
cd /work/wt/i20-readout-kv/.scratch/remote/20261125-160959-b3_11_readout-ff9f || exit 70
exec 9>>/work/wt/i20-readout-kv/.scratch/lock
if ! flock -n 9; then
  echo TRACEDECK_LOCK_BUSY
  cat /work/wt/i20-readout-kv/.scratch/lock.json 2>/dev/null
  exit 75
fi
setsid sh /work/wt/i20-readout-kv/.scratch/remote/20261125-160959-b3_11_readout-ff9f/run.sh < /dev/null > runner.out 2> runner.err &
pid=$!
# Not a group leader (no job control here), so setsid did not fork: $! is the new group's id.
echo "$pid" > pgid.part && mv pgid.part pgid
sed "s/\"pgid\": *null/\"pgid\":$pid/" holder.json > /work/wt/i20-readout-kv/.scratch/lock.json.part && mv /work/wt/i20-readout-kv/.scratch/lock.json.part /work/wt/i20-readout-kv/.scratch/lock.json
echo "TRACEDECK_STARTED $pid"
