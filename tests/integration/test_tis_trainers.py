"""TIS in real PPO and GRPO steps with the hf sampler (weights ~1: the trainer is the sampler), and the
rollout engine's `sampler` hook, which the vLLM backend plugs into."""

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl import PPOConfig, PPOTrainer
from agentrl.envs import CalculatorEnv, calculator_tasks
from agentrl.rollout import SamplingParams
from agentrl.rollout.sampling import sample_batch
from agentrl.trainers.grpo import GRPOConfig, GRPOTrainer


def lora(path):
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


class CountingSampler:
    """A stand-in for a backend: samples with the policy, through the engine's sampler hook."""

    def __init__(self, model):
        self.model, self.calls, self.syncs = model, 0, 0

    def sync_weights(self, policy):
        self.syncs += 1
        return 0.0

    def sample(self, *args, **kwargs):
        self.calls += 1
        return sample_batch(self.model, *args, **kwargs)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_tis_weights_are_one_when_the_trainer_samples(tiny_base, algo):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    if algo == "ppo":
        trainer = PPOTrainer(PPOConfig(batch_size=8, mini_batch_size=8, ppo_epochs=1, tis_clip=2.0), lora(tiny_base),
                             None, tok)
    else:
        trainer = GRPOTrainer(GRPOConfig(tasks_per_step=2, num_generations=4, mini_batch_size=8, tis_clip=2.0),
                              lora(tiny_base), tok)
    backend = trainer.rollout_backend = CountingSampler(trainer.policy)
    row = trainer.train(CalculatorEnv, calculator_tasks(16), steps=1, sampling=SamplingParams(max_new_tokens=16),
                        progress=False)[-1]
    assert backend.syncs == 1 and backend.calls >= 1 and "time/weight_sync" in row
    assert row["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4) and row["tis/clipfrac"] == 0.0
