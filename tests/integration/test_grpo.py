"""GRPO on the real rollout engine: groups, no reference forward at beta 0, two-step masks."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs import MultiStepCalculatorEnv, multistep_tasks
from agentrl.rollout import SamplingParams, rollout
from agentrl.trainers.common import episodes_to_batch
from agentrl.trainers.grpo import GRPOConfig, GRPOTrainer


def lora(path):
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_grpo_beta_zero_never_computes_reference_logprobs(tiny_base, advantage, monkeypatch):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    trainer = GRPOTrainer(GRPOConfig(tasks_per_step=2, num_generations=4, mini_batch_size=4, learning_rate=1e-2,
                                     advantage=advantage), lora(tiny_base), tok)
    monkeypatch.setattr(trainer, "_ref_logprobs", lambda batch: pytest.fail("reference forward with beta=0"))
    before = {n: p.clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    history = trainer.train(MultiStepCalculatorEnv, multistep_tasks(8), steps=2,
                            sampling=SamplingParams(max_new_tokens=16), progress=False)
    for key in ("grpo/zero_variance_groups", "policy/clipfrac", "policy/kl", "policy/entropy", "env/mean_response_length",
                "env/tool_calls_per_episode", "env/truncation_rate"):
        assert key in history[-1]
    assert history[-1]["policy/kl"] == 0.0
    if any(h["grpo/zero_variance_groups"] < 1 for h in history):
        assert any(not torch.equal(before[n], p) for n, p in trainer.policy.named_parameters() if p.requires_grad)


def test_grpo_with_beta_uses_the_adapter_disabled_reference(tiny_base):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    trainer = GRPOTrainer(GRPOConfig(tasks_per_step=2, num_generations=2, mini_batch_size=4, beta=0.1,
                                     num_iterations=2), lora(tiny_base), tok)
    calls = []
    original = trainer._ref_logprobs
    trainer._ref_logprobs = lambda batch: calls.append(1) or original(batch)
    trainer.train(MultiStepCalculatorEnv, multistep_tasks(4), steps=1, sampling=SamplingParams(max_new_tokens=12),
                  progress=False)
    assert calls and trainer.ref_model is None


def test_two_step_rollout_masks(tiny_base):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    calls = iter(["Thought: First 2 + 3.\nAction: calculator(2 + 3)\n", "Thought: Then 5 * 4.\nAction: calculator(5 * 4)\n"])

    class Scripted(MultiStepCalculatorEnv):
        """Replaces the model's first two turns by a fixed two-call plan, so both observations appear."""

        def step(self, action):
            return super().step(next(calls, action))

    task = {"question": "What is (2 + 3) * 4?", "answer": "20", "expression": "(2 + 3) * 4"}
    ep = rollout(model, tok, Scripted, [task], SamplingParams(max_new_tokens=20),
                 generator=torch.Generator().manual_seed(0))[0]
    assert ep.info["tool_calls"] == 2 and ep.num_turns >= 3
    text_pieces = []
    for obs in ("Observation: 5\n", "Observation: 20\n"):
        ids = tok(obs, add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(ep.token_ids)) if ep.token_ids[i:i + len(ids)] == ids]
        assert starts, obs
        assert ep.loss_mask[starts[0]:starts[0] + len(ids)] == [0] * len(ids)
        text_pieces.append(starts[0])
    assert sum(ep.loss_mask) == len(ep.loss_mask) - 2 * 0 - sum(
        len(tok(o, add_special_tokens=False)["input_ids"]) for o in ("Observation: 5\n", "Observation: 20\n"))
    batch = episodes_to_batch([ep], tok.pad_token_id)
    assert batch.loss_mask.sum().item() == sum(ep.loss_mask)


class FlakyServerEnv(MultiStepCalculatorEnv):
    """Every third episode reports a failure outside the policy (as a dead tool server would) and gets `bonus`
    added to its reward: neither may reach the update."""

    bonus, flag, made = 0.0, True, 0

    def reset(self, task):
        FlakyServerEnv.made += 1
        self.flaky = FlakyServerEnv.made % 3 == 0
        return super().reset(task)

    def step(self, action):
        result = super().step(action)
        if self.flaky:
            result.reward += self.bonus
            if self.flag:
                result.info = {**result.info, "infra_failure": True}
        return result


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_an_episode_failed_outside_the_policy_gives_no_gradient(tiny_base, advantage, monkeypatch):
    """The same step with the failed episodes' rewards changed gives the same weights: they are out of the loss
    and of their groups' baselines; unflagged, the changed rewards do change the update."""
    def trainer():
        return GRPOTrainer(GRPOConfig(tasks_per_step=2, num_generations=4, mini_batch_size=8, learning_rate=1e-2,
                                      advantage=advantage, logprob_mismatch_threshold=None), lora(tiny_base),
                           AutoTokenizer.from_pretrained(tiny_base))

    assert_failures_give_no_gradient(monkeypatch, trainer, multistep_tasks(8), 2 / 8)


def assert_failures_give_no_gradient(monkeypatch, make_trainer, tasks, failure_rate):
    """One step of a fresh trainer on FlakyServerEnv: the failed episodes' rewards changed (+50) leave the weights
    as they were when the episodes are flagged, and change them when they are not."""
    def step(bonus, flag):
        monkeypatch.setattr(FlakyServerEnv, "bonus", bonus)
        monkeypatch.setattr(FlakyServerEnv, "flag", flag)
        monkeypatch.setattr(FlakyServerEnv, "made", 0)
        torch.manual_seed(0)
        trainer = make_trainer()
        stats = trainer.train(FlakyServerEnv, tasks, steps=1, sampling=SamplingParams(max_new_tokens=16),
                              progress=False)[-1]
        return stats, [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]

    stats, plain = step(0.0, True)
    assert stats["env/infra_failure_rate"] == pytest.approx(failure_rate)
    _, bonus = step(50.0, True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, bonus))
    _, unflagged = step(50.0, False)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, unflagged))


def test_step_advantages_land_on_each_turns_tokens(tiny_base):
    """Two episodes of one task: the same first action (same state after it) then different second actions.
    Token-history matching puts them in one step group at turn 1; each turn's tokens carry that turn's value."""
    from agentrl.rollout.engine import Episode

    tok = AutoTokenizer.from_pretrained(tiny_base)
    trainer = GRPOTrainer(GRPOConfig(tasks_per_step=1, num_generations=2, mini_batch_size=2, step_advantage_weight=1.0,
                                     step_gamma=1.0), lora(tiny_base), tok)
    # prompt [1, 2]; turn 0 samples [5, 6], observation [7]; turn 1 samples [8] or [9, 9].
    a = Episode(task={}, prompt_ids=[1, 2], token_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1], logprobs=[0.0] * 4,
                turn_ends=[1, 3], turn_rewards=[0.0, 1.0], state_keys=[None, None])
    b = Episode(task={}, prompt_ids=[1, 2], token_ids=[5, 6, 7, 9, 9], loss_mask=[1, 1, 0, 1, 1], logprobs=[0.0] * 5,
                turn_ends=[1, 4], turn_rewards=[0.0, 0.0], state_keys=[None, None])
    step, stats = trainer._step_advantages([a, b], torch.tensor([True, True]), (2, 6))
    s = 0.5 / (0.5 ** 0.5 + 1e-4)  # returns (1, 0) at both turns: mean 0.5, std sqrt(0.5)
    assert torch.allclose(step[0], torch.tensor([0.0, s, s, 0.0, s, 0.0]), atol=1e-5)  # positions n + j - 1
    assert torch.allclose(step[1], torch.tensor([0.0, -s, -s, 0.0, -s, -s]), atol=1e-5)
    assert stats["grpo/step_states_shared"] == 1.0
    # Different first actions: different states at turn 1, nothing to compare there.
    b.token_ids[0] = 4
    step, stats = trainer._step_advantages([a, b], torch.tensor([True, True]), (2, 6))
    assert step[0, 4] == 0 and step[1, 4] == 0 and stats["grpo/step_states_shared"] == 0.0


def test_grpo_with_step_advantages_trains_on_the_multistep_calculator(tiny_base):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    trainer = GRPOTrainer(GRPOConfig(tasks_per_step=2, num_generations=4, mini_batch_size=8, learning_rate=1e-2,
                                     step_advantage_weight=1.0, logprob_mismatch_threshold=None), lora(tiny_base), tok)
    before = [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad]
    history = trainer.train(MultiStepCalculatorEnv, multistep_tasks(8), steps=2, sampling=SamplingParams(max_new_tokens=16),
                            progress=False)
    assert all(0 <= h["grpo/step_states_shared"] <= 1 for h in history)
    assert all(math.isfinite(h["grpo/loss"]) for h in history)
    after = [p.detach() for p in trainer.policy.parameters() if p.requires_grad]
    signal = any(h["grpo/zero_variance_groups"] < 1 or h["grpo/step_advantages_abs_mean"] > 0 for h in history)
    assert signal == any(not torch.equal(x, y) for x, y in zip(before, after))
