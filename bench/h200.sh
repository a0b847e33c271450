#!/usr/bin/env bash
# The train step's GPU checks on one H200 (docs/scale.md "The train step on a GPU"), in one run of
# about 7 minutes: token_logprobs' two paths at the paper's shape, larger micro-batches, the top
# kernels and where the peak memory goes, each peak beside rloo.memory_per_rank's estimate (the
# arithmetic of soar.py's check before it loads). The training half only: no vLLM needed.
#   bash bench/h200.sh [OUT]        # each check's log in OUT (default bench/out), a summary here
#   SHAPE=tiny bash bench/h200.sh   # the same checks on the tiny shape (a CPU try of the script)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/out}
SHAPE=${SHAPE:-llama3b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)" >>"$OUT/gpu.txt"
cat "$OUT/gpu.txt"

check() {   # check NAME SECONDS [bench flags]: one bench run, its log kept, its figures shown
  local name=$1 seconds=$2
  shift 2
  echo "== $name: bench_rloo.py --shape $SHAPE --train_only $*"
  timeout "$seconds" python bench/bench_rloo.py --shape "$SHAPE" --train_only \
    --workdir /tmp/bench_rloo "$@" >"$OUT/$name.log" 2>&1
  echo "   (exit $?)"
  grep -E "^(shape|train step|estimate|single /|memory:)" "$OUT/$name.log"
}

check paths 240                                         # both paths, 16384-token micro-batches
check single-32k 150 --prompt_pass single --micro_batch_tokens 32768
check profile-memory 180 --prompt_pass single --profile --memory
sed -n '/^profile:/,/^Self CUDA time total/p' "$OUT/profile-memory.log" | cut -c1-160 | head -25
