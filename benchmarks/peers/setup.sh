#!/usr/bin/env bash
# Build the peers' virtual environments, outside agentrl's dependencies (TRL is never one of them).
#
#   bash benchmarks/peers/setup.sh [DIR]        # default DIR: .venv-peers (ignored by git)
#
# DIR/trl011: TRL 0.11.4 (the last TRL with the classic PPOTrainer) with the stack it was released against:
#             transformers 4.46.3, peft 0.13.2, accelerate 1.0.1 (and rich, which trl 0.11.4 imports but does not declare).
# DIR/trl116: TRL 1.16.0 on agentrl's own stack: the same torch, transformers, peft and accelerate versions as
#             the Python that runs this script (PYTHON, default .venv/bin/python), so both sides run the same kernels.
# torch 2.13.0 is installed FIRST and pinned in every later step: an unpinned resolve can pull a multi-GB CUDA build.
set -euo pipefail
DIR=${1:-.venv-peers}
PYTHON=${PYTHON:-.venv/bin/python}
TORCH=${TORCH:-torch==2.13.0}
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
TF=$(version transformers); PEFT=$(version peft); ACC=$(version accelerate)
mkdir -p "$DIR"

make_venv() {  # name, then the packages to add next to torch
    local venv="$DIR/$1"; shift
    if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
    "$venv/bin/pip" install -q "$TORCH"
    "$venv/bin/pip" install -q "$TORCH" psutil "$@"
    "$venv/bin/python" -c "import torch, transformers, trl; print('$venv', 'torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__)"
}

make_venv trl011 trl==0.11.4 rich transformers==4.46.3 peft==0.13.2 accelerate==1.0.1 &
make_venv trl116 trl==1.16.0 "transformers==$TF" "peft==$PEFT" "accelerate==$ACC" &
wait
