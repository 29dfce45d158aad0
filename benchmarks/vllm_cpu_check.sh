#!/usr/bin/env bash
# The vLLM rollout backend on this CPU machine, end to end: builds its venv if missing
# (benchmarks/vllm_cpu_setup.sh), runs its tests, then the same few PPO steps of the quickstart on the
# calculator with hf and with vLLM rollouts, and writes OUT/comparison.json (learning, logprob mismatch,
# TIS, engine start-up, weight sync and rollout seconds per step).
#   bash benchmarks/vllm_cpu_check.sh            # STEPS=15 VENV=.venv-vllm OUT=runs/vllm-check
# Not in CI: building the venv alone takes ~7 minutes here, the tests ~3.5 more.
# The model is the embedded calculator model with 2 heads (head_dim 32): vLLM's CPU attention rejects the
# default's head_dim 16.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
STEPS=${STEPS:-15}
OUT=${OUT:-runs/vllm-check}
[ -x "$VENV/bin/python" ] || bash benchmarks/vllm_cpu_setup.sh "$VENV"
PY=$VENV/bin/python
export PYTHONPATH=$PWD VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB of KV cache: plenty here
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # -p no:logging: pytest's log capture of vLLM's start-up alone costs minutes
  $PY -m pytest -q -p no:logging -p no:cacheprovider -m vllm tests/integration/test_vllm_backend.py
fi
COMMON=(--config quickstart "steps=$STEPS" model.builder.num_heads=2 "model.base_dir=$OUT/base-model-hd32"
        checkpoint_every=0 progress=false)
$PY -m agentrl.cli ppo "${COMMON[@]}" rollout.backend=hf "out_dir=$OUT/hf"
$PY -m agentrl.cli ppo "${COMMON[@]}" rollout.backend=vllm rollout.vllm_enforce_eager=true ppo.tis_clip=2.0 \
    "out_dir=$OUT/vllm"
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
result = {}
for backend in ("hf", "vllm"):
    rows = [json.loads(line) for line in (out / backend / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / backend / "summary.json").read_text())
    mean = lambda key: round(sum(r[key] for r in rows if r.get(key) is not None) / len(rows), 4)  # noqa: E731
    first, last = rows[: len(rows) // 3], rows[-(len(rows) // 3):]
    result[backend] = {
        "steps": len(rows),
        "train_accuracy_first_third": round(sum(r["env/accuracy"] for r in first) / len(first), 4),
        "train_accuracy_last_third": round(sum(r["env/accuracy"] for r in last) / len(last), 4),
        "eval_greedy_accuracy_before_after": [summary["before"]["accuracy"], summary["after"]["accuracy"]],
        "eval_sampled_accuracy_before_after": [summary["before_sampled"]["accuracy"], summary["after_sampled"]["accuracy"]],
        "rollout_seconds_per_step": mean("time/rollout"),
        "update_seconds_per_step": mean("time/ppo/total"),
        "logprob_mismatch_mean": mean("rollout/logprob_mismatch_mean"),
        "logprob_mismatch_max": round(max(r["rollout/logprob_mismatch_max"] for r in rows), 4),
    }
    if backend == "vllm":
        result[backend].update({"engine_startup_seconds": summary.get("vllm_startup_seconds"),
                                "weight_sync_seconds_per_step": mean("time/weight_sync"),
                                "tis_weight_mean": mean("tis/weight_mean"), "tis_clipfrac": mean("tis/clipfrac")})
(out / "comparison.json").write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=2))
PYEOF
