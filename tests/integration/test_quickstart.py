"""The real thing, small: the embedded base model learns *when* to call the tool, by PPO and by DPO."""

import pytest

from agentrl.jobs.ppo import load_job, run_job


@pytest.mark.slow
def test_ppo_teaches_the_embedded_model_to_call_the_tool(embedded_base, tmp_path):
    job = load_job("quickstart", [f"out_dir={tmp_path / 'run'}", f"model.base={embedded_base}", "steps=12",
                                  "env.eval_tasks=100", "progress=false"])
    summary = run_job(job)
    before, after = summary["before"], summary["after"]
    assert before["tool_call_rate"] < 0.3 and before["accuracy"] < 0.3  # the base model prefers guessing
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.4
    assert after["accuracy"] > before["accuracy"] + 0.3


@pytest.mark.slow
def test_one_round_of_iterative_dpo_teaches_it_too(embedded_base, tmp_path):
    from agentrl.jobs.dpo import load_dpo_job, run_dpo_job

    job = load_dpo_job("dpo", [f"out_dir={tmp_path / 'dpo'}", f"model.base={embedded_base}", "iterative.rounds=1",
                               "iterative.tasks_per_round=256", "env.eval_tasks=100", "progress=false"])
    summary = run_dpo_job(job)
    assert summary["pairs"] > 50 and summary["rounds"][0]["rewards/accuracies"] > 0.8
    assert summary["after"]["tool_call_rate"] > summary["before"]["tool_call_rate"] + 0.4
