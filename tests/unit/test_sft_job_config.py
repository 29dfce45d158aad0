"""`agentrl sft` has its own job config: taken from the training job's file (checked whole), evaluating at the
temperature and precision of the trainer that file names, so the RL job's `before` is the SFT job's evaluation."""

import pytest

from agentrl.config import ConfigError
from agentrl.jobs.ppo import load_job
from agentrl.jobs.sft import SFTJobConfig, load_sft_job


def test_without_a_file_it_writes_to_runs_sft_not_the_training_jobs_dir():
    assert load_sft_job(None).out_dir == "runs/sft" == SFTJobConfig().out_dir
    assert load_sft_job(None, ["out_dir=elsewhere"]).out_dir == "elsewhere"


@pytest.mark.parametrize("name", ["quickstart", "grpo", "real"])
def test_it_evaluates_as_the_trainer_its_file_names(name):
    job, sft = load_job(name), load_sft_job(name)
    trainer = job.ppo if job.algo == "ppo" else job.grpo
    assert (sft.eval_temperature, sft.eval_precision) == (trainer.temperature, trainer.mixed_precision)
    assert (sft.out_dir, sft.model, sft.env, sft.rollout, sft.sft) == (job.out_dir, job.model, job.env, job.rollout,
                                                                       job.sft)


def test_the_training_sections_of_its_file_are_still_checked():
    with pytest.raises(ConfigError, match="ppo.learning_rat"):
        load_sft_job("quickstart", ["ppo.learning_rat=1e-3"])
