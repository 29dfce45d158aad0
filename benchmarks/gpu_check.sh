#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU (nothing downloaded at run time):
#   bash benchmarks/gpu_check.sh [OUT_DIR] [--model LOCAL_MODEL_DIR] [--steps N]   # OUT_DIR default: $OUT or runs/gpu-check
#   bash benchmarks/gpu_check.sh /tmp/gpu-dry --dry-run                           # on CPU: checks the script itself
#   bash benchmarks/gpu_check.sh OUT --qwen2.5-0.5b DIR --qwen3-0.6b DIR           # + the real-model job (SFT -> PPO,
#                                                     configs/real-qwen*.yaml) on local copies of those instruct models
# Cases (benchmarks/gpu_check.py): fp32; bf16 weights; bf16 mixed precision + gradient checkpointing; hf vs vLLM
# rollouts at bf16 (when vLLM imports: `pip install -e '.[vllm]'` beforehand); 2 processes with torchrun when 2
# GPUs exist. Writes OUT_DIR/gpu_check.json (figures per case: rollout/update s per step, sampled tokens per
# rollout second, peak GPU memory, logprob mismatch, accuracy), gpu_check.log, and one log per case.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${OUT:-runs/gpu-check}
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then DIR=$1; shift; fi
mkdir -p "$DIR"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
{
  echo "== $(date -u) $(hostname)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  $PY benchmarks/gpu_check.py --out "$DIR" "$@"
  status=$?
  echo "== exit $status"
  exit $status  # the group runs in a subshell of the pipeline: this is its status
} 2>&1 | tee "$DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
