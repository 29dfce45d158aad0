"""The real thing, small: the embedded base model learns *when* to call the tool from a few PPO steps."""

import pytest

from agentrl.pipeline import load_job, run_job


@pytest.mark.slow
def test_ppo_teaches_the_embedded_model_to_call_the_tool(tmp_path):
    # The full-size embedded model (about 100 s to build), then 12 PPO steps and 100 held-out tasks.
    job = load_job("quickstart", [f"out_dir={tmp_path / 'run'}", f"model.base_dir={tmp_path / 'base'}", "steps=12",
                                  "env.eval_tasks=100", "progress=false"])
    summary = run_job(job)
    before, after = summary["before"], summary["after"]
    assert before["tool_call_rate"] < 0.3 and before["accuracy"] < 0.3  # the base model prefers guessing
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.4
    assert after["accuracy"] > before["accuracy"] + 0.3
