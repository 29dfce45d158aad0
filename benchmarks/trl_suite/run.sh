#!/usr/bin/env bash
# Run TRL v0.11.4's own tests/test_ppo_trainer.py against agentrl, offline, on tiny local models.
#
#   usage: benchmarks/trl_suite/run.sh REPO_DIR [extra pytest args...]   (REPO_DIR: an agentrl checkout, e.g. .)
#          benchmarks/trl_suite/run.sh trl      [extra pytest args...]   control: the same patched file and models
#              against real TRL 0.11.4 (venv STATE/control/venv: transformers 4.46.3, peft 0.13.2; see setup_control.sh)
#
# First run (needs PyPI): downloads the trl-0.11.4 sdist (sha256-pinned; or set TRL_GIT=<trl git dir> to
# take the file from tag v0.11.4) and the `parameterized` wheel into STATE/cache/. Every run: re-extracts and
# re-patches the test file into STATE/work-*/ (patch_tests.py), builds the tiny models into STATE/models/ if missing
# (build_models.py), and runs pytest with PYTHONPATH=REPO_DIR. Afterwards fully offline and deterministic.
# STATE is $TRL_SUITE_STATE, by default runs/trl-suite of this checkout. TRL's test file is downloaded and
# patched at run time; it is not part of agentrl. Nothing else is written into REPO_DIR (PYTHONDONTWRITEBYTECODE=1).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CHECKOUT="$(cd "$HERE/../.." && pwd)"
STATE="${TRL_SUITE_STATE:-$CHECKOUT/runs/trl-suite}"
if [ "${1:?usage: run.sh REPO_DIR|trl [pytest args]}" = trl ]; then
  TARGET=trl; REPO_DIR=""; PY="${PYTHON:-$STATE/control/venv/bin/python}"
  [ -x "$PY" ] || { echo "no control venv: run $HERE/setup_control.sh first" >&2; exit 2; }
else
  TARGET=agentrl; REPO_DIR="$(cd "$1" && pwd)"; PY="${PYTHON:-$REPO_DIR/.venv/bin/python}"
fi
shift
TRL_VERSION=0.11.4
SDIST="$STATE/cache/trl-$TRL_VERSION.tar.gz"
SDIST_SHA=de52a023fc35d580ab809fd74cd4f362a259e463bb968580e0e97e1b98a0fe79
SDIST_URL=https://files.pythonhosted.org/packages/07/39/a78c0608190cc412c49631dfb8c3e57f5c5b2fb0d79709071c992e707aa4/trl-0.11.4.tar.gz
WORK="$STATE/work-$TARGET"; MODELS="$STATE/models"; DEPS="$STATE/pydeps"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false WANDB_DISABLED=true \
       CUDA_VISIBLE_DEVICES=""
mkdir -p "$STATE/cache" "$WORK"

# 1. TRL's test file and helper (tests/testing_constants.py), fresh every run
rm -rf "$WORK"/*
if [ -n "${TRL_GIT:-}" ]; then
  git -C "$TRL_GIT" show "v$TRL_VERSION:tests/test_ppo_trainer.py" > "$WORK/test_ppo_trainer.orig.py"
  git -C "$TRL_GIT" show "v$TRL_VERSION:tests/testing_constants.py" > "$WORK/testing_constants.py"
else
  if ! echo "$SDIST_SHA  $SDIST" | sha256sum -c --status 2>/dev/null; then
    echo "downloading trl-$TRL_VERSION sdist from PyPI" >&2
    "$PY" -c "import urllib.request,sys; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$SDIST_URL" "$SDIST.part"
    mv "$SDIST.part" "$SDIST"
    echo "$SDIST_SHA  $SDIST" | sha256sum -c --status || { echo "sha256 mismatch for $SDIST" >&2; exit 2; }
  fi
  tar -xzOf "$SDIST" "trl-$TRL_VERSION/tests/test_ppo_trainer.py" > "$WORK/test_ppo_trainer.orig.py"
  tar -xzOf "$SDIST" "trl-$TRL_VERSION/tests/testing_constants.py" > "$WORK/testing_constants.py"
fi
printf '[pytest]\n' > "$WORK/pytest.ini"   # pins rootdir to work/, no config picked up from elsewhere

# 2. pytest-side dependency the test file imports and agentrl's venv lacks: parameterized (kept out of the venv)
if [ ! -d "$DEPS/parameterized" ]; then
  ls "$STATE"/cache/parameterized-0.9.0-*.whl >/dev/null 2>&1 || \
    "$PY" -m pip download -q --no-deps parameterized==0.9.0 -d "$STATE/cache"
  "$PY" -m pip install -q --no-index --find-links "$STATE/cache" --target "$DEPS" parameterized==0.9.0
fi

# 3. tiny random models standing in for the Hub ones (rebuilt when build_models.py changes)
STAMP="$(sha256sum "$HERE/build_models.py" | cut -d' ' -f1)"
if [ "$(cat "$MODELS/BUILT" 2>/dev/null)" != "$STAMP" ]; then
  rm -rf "$MODELS"
  BUILD_PY="${BUILD_PYTHON:-$CHECKOUT/.venv/bin/python}"   # transformers 5 API, whichever target runs
  "$BUILD_PY" "$HERE/build_models.py" "$MODELS" >/dev/null 2>&1 || "$BUILD_PY" "$HERE/build_models.py" "$MODELS"
  echo "$STAMP" > "$MODELS/BUILT"
fi

# 4. patch (trl -> agentrl, hub ids -> local models; see patch_tests.py) and run
"$PY" "$HERE/patch_tests.py" "$WORK/test_ppo_trainer.orig.py" "$WORK/test_ppo_trainer.py" "$MODELS" "$TARGET"
cd "$WORK"
set +e
PYTHONPATH="$REPO_DIR:$DEPS" "$PY" -m pytest -q -p no:cacheprovider -rfEs -W ignore::DeprecationWarning \
  --junitxml="$WORK/results.xml" test_ppo_trainer.py "$@" > "$WORK/pytest.log" 2>&1
rc=$?
set -e
tail -n 40 "$WORK/pytest.log" | grep -E "passed|failed|error|skipped" | tail -n 1
echo "(full log: $WORK/pytest.log)"
"$PY" "$HERE/summarize.py" "$WORK/results.xml" "$TARGET" || true
if [ "$TARGET" = agentrl ]; then
  echo "agentrl at $REPO_DIR, commit $(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo n/a)$(git -C "$REPO_DIR" diff --quiet 2>/dev/null || echo ' + uncommitted changes')"
else
  echo "control: $("$PY" -c 'import trl,transformers,peft,torch;print("trl",trl.__version__,"transformers",transformers.__version__,"peft",peft.__version__,"torch",torch.__version__)')"
fi
exit $rc
