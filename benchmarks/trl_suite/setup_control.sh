#!/usr/bin/env bash
# Optional control: a venv with real TRL 0.11.4 (and a transformers it supports), so `run.sh trl` runs the
# identical patched test file on the identical tiny models. Needs PyPI once.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${TRL_SUITE_STATE:-$(cd "$HERE/../.." && pwd)/runs/trl-suite}"
[ -x "$STATE/control/venv/bin/python" ] && exit 0
python3 -m venv "$STATE/control/venv"
# torch pinned: an unpinned torch pulls a multi-GB CUDA build
"$STATE/control/venv/bin/pip" install -q torch==2.13.0
"$STATE/control/venv/bin/pip" install -q transformers==4.46.3 accelerate==1.0.1 peft==0.13.2 \
  datasets==3.0.2 trl==0.11.4 rich pytest parameterized==0.9.0
