"""PPO with the calculator served by a stdio MCP server trains as PPO with the in-process calculator.

The full-size check (the embedded chat model, 60 steps, 200 held-out tasks) is a documented command in
docs/ecosystems-mcp.md; this is the same comparison, shorter: a smaller build of the chat model, 6 steps, 40 held-out tasks."""

import json

import psutil
import pytest

pytest.importorskip("mcp")

from agentrl.envs.ecosystems.mcp_tools import close_servers  # noqa: E402
from agentrl.jobs.ppo import load_job, run_job  # noqa: E402



@pytest.mark.slow
def test_ppo_with_the_mcp_calculator_matches_the_in_process_one(tmp_path):
    common = [f"model.base_dir={tmp_path / 'base'}", "model.builder.steps=300", "steps=6", "env.eval_tasks=40",
              "progress=false"]
    local = run_job(load_job("chat", [f"out_dir={tmp_path / 'chat'}", *common]))
    served = run_job(load_job("chat-mcp", [f"out_dir={tmp_path / 'chat-mcp'}", *common]))
    for key in ("after", "after_sampled"):
        assert abs(served[key]["accuracy"] - local[key]["accuracy"]) <= 0.05, (key, served[key], local[key])
    assert served["after_sampled"]["tool_call_rate"] > 0.2  # the tool was really used through the server
    # Same ids, masks and rewards at every step make the same training run: every step's statistics agree.
    steps = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
             for run in ("chat", "chat-mcp")]
    assert len(steps[0]) == len(steps[1]) == 6
    for a, b in zip(*steps):
        same = {k: v for k, v in a.items() if not k.startswith("time/")}  # wall-clock figures differ
        assert same == {k: b[k] for k in same}
    close_servers()
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE and "mcp_calculator_server" in " ".join(p.cmdline())]
