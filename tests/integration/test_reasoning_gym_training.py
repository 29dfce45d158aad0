"""The reasoning-gym training check: the embedded tiny model learns leg_counting's answer format from the family's
own answers, half of them wrong (SFT), then GRPO raises its held-out accuracy (agentrl/configs/reasoning-gym.yaml;
figures in docs/ecosystems-reasoning-gym.md). 4-5 minutes on a loaded 2-core machine (2.5-3 min of CPU)."""

import pytest

pytest.importorskip("reasoning_gym")


@pytest.mark.slow
def test_grpo_after_sft_raises_held_out_accuracy_on_a_reasoning_gym_family(tmp_path):
    from agentrl.jobs.ppo import load_job, run_job

    job = load_job("reasoning-gym", [f"out_dir={tmp_path / 'run'}", f"model.base_dir={tmp_path / 'base'}",
                                     "progress=false"])
    assert job.env.eval_tasks == 200 and job.model.base == "embedded" and job.env.demonstrations
    summary = run_job(job)
    before, after = summary["before_sampled"], summary["after_sampled"]  # the policy GRPO trains: T=1 samples
    print(f"held-out accuracy sampled {before['accuracy']} -> {after['accuracy']}, greedy "
          f"{summary['before']['accuracy']} -> {summary['after']['accuracy']}; {summary['wall_seconds']} s")
    assert before["tasks"] == after["tasks"] == 200
    assert before["format_error_rate"] < 0.05  # SFT taught the format ...
    assert before["accuracy"] < 0.5  # ... and, from half-wrong rows, answers right less than half the time
    assert after["accuracy"] >= before["accuracy"] + 0.15
    assert summary["after"]["accuracy"] >= summary["before"]["accuracy"] - 0.05  # greedy answers not worse
