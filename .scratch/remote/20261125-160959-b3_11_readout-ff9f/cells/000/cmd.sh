set -euo pipefail
cd /work/wt/i20-readout-kv/.scratch/home
export PYTHONPATH=/work/wt/i20-readout-kv/.scratch/remote/20261125-160959-b3_11_readout-ff9f/pkg${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=1
export MKL_NUM_THREADS=1
export GRETA_DETERMINISTIC=1
export GRETA_TRACE_READOUT=1
export GRETA_TRACE_READOUT_OUT=/work/wt/i20-readout-kv/.scratch/remote/20261125-160959-b3_11_readout-ff9f/artifacts/b3_11_readout.jsonl
/work/wt/i20-readout-kv/.venv/bin/python -m runners.reference readout --prompt-name p0_short --prompt-len 48 --gen-len 8 --vocab 8192 --inject none
