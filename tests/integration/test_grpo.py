"""GRPO on the real rollout engine: groups, no reference forward at beta 0, two-step masks."""

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
    for key in ("grpo/zero_variance_groups", "grpo/clipfrac", "grpo/kl", "grpo/entropy", "env/mean_response_length",
                "env/tool_calls_per_episode", "env/truncation_rate"):
        assert key in history[-1]
    assert history[-1]["grpo/kl"] == 0.0
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
    def step(bonus, flag):
        monkeypatch.setattr(FlakyServerEnv, "bonus", bonus)
        monkeypatch.setattr(FlakyServerEnv, "flag", flag)
        monkeypatch.setattr(FlakyServerEnv, "made", 0)
        torch.manual_seed(0)
        trainer = GRPOTrainer(GRPOConfig(tasks_per_step=2, num_generations=4, mini_batch_size=8, learning_rate=1e-2,
                                         advantage=advantage, logprob_mismatch_threshold=None), lora(tiny_base),
                              AutoTokenizer.from_pretrained(tiny_base))
        stats = trainer.train(FlakyServerEnv, multistep_tasks(8), steps=1, sampling=SamplingParams(max_new_tokens=16),
                              progress=False)[-1]
        return stats, [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad]

    stats, plain = step(0.0, True)
    assert stats["env/infra_failure_rate"] == pytest.approx(2 / 8)
    _, bonus = step(50.0, True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, bonus))
    _, unflagged = step(50.0, False)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, unflagged))
