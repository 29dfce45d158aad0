"""GRPO dynamic sampling: groups with all-equal scores leave the update, more are rolled out in their place."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs.base import StepResult
from agentrl.rollout import SamplingParams
from agentrl.trainers.grpo import GRPOConfig, GRPOTrainer


class HalfConstantEnv:
    """Tasks marked "constant" score 1.0 whatever the model writes (their groups carry no signal); the others
    score the parity of the sampled text's length, which varies within a group."""

    stop_patterns = ()
    max_turns = 1

    def reset(self, task):
        self.task = task
        return task["question"]

    def step(self, action):
        reward = 1.0 if self.task["constant"] else float(len(action) % 2)
        return StepResult(None, reward, True, {"correct": reward > 0})


TASKS = [{"question": f"Question {i}: What is {i} + {i}?\n", "constant": i % 2 == 0} for i in range(40)]


def trainer(tiny_base, dynamic: bool, rounds: int = 3):
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return GRPOTrainer(GRPOConfig(tasks_per_step=4, num_generations=4, mini_batch_size=16, learning_rate=1e-3,
                                  dynamic_sampling=dynamic, max_sampling_rounds=rounds,
                                  logprob_mismatch_threshold=None), model, AutoTokenizer.from_pretrained(tiny_base))


def updates(t, steps=2):
    """Each update's groups' score spreads."""
    seen = []
    real = t._update

    def spy(episodes):
        scores = torch.tensor([ep.score for ep in episodes]).view(-1, 4)
        seen.append((scores.max(1).values - scores.min(1).values).tolist())
        return real(episodes)

    t._update = spy
    history = t.train(HalfConstantEnv, TASKS, steps=steps, sampling=SamplingParams(max_new_tokens=8), progress=False)
    return seen, history


def test_dynamic_sampling_fills_the_update_with_groups_that_differ(tiny_base):
    plain, plain_history = updates(trainer(tiny_base, False))
    dynamic, history = updates(trainer(tiny_base, True))
    assert all(len(spreads) == 4 for spreads in plain + dynamic)  # tasks_per_step groups every step, either way
    equal_plain = sum(s == 0 for spreads in plain for s in spreads)
    equal_dynamic = sum(s == 0 for spreads in dynamic for s in spreads)
    assert equal_plain >= 4  # half the tasks are constant
    assert equal_dynamic < equal_plain
    for row, spreads in zip(history, dynamic):
        assert row["grpo/dropped_groups"] > 0 and 1 <= row["grpo/sampling_rounds"] <= 3
        assert row["grpo/uninformative_groups_used"] == pytest.approx(sum(s == 0 for s in spreads) / 4)
    assert "grpo/dropped_groups" not in plain_history[0]


def test_one_round_only_drops_nothing(tiny_base):
    """max_sampling_rounds=1: no extra rollout; the dropped groups fill the update again (same as plain)."""
    seen, history = updates(trainer(tiny_base, True, rounds=1), steps=1)
    assert history[0]["grpo/sampling_rounds"] == 1 and len(seen[0]) == 4
