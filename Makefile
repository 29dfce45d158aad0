# Two commands on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned: the CPU wheel on disk. An unpinned torch pulls a CUDA build.
PY := .venv/bin/python
STAMP := .venv/.agentrl-installed

.PHONY: install demo demo-grpo demo-dpo demo-chat demo-search test clean

$(PY):
	python3 -m venv .venv

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
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

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf runs .pytest_cache
