"""The vLLM rollout backend on CPU: the Episode contract, weight sync, mismatch and TIS metrics in real PPO steps.

Runs only where vLLM imports: the venv of benchmarks/vllm_cpu_setup.sh (`bash benchmarks/vllm_cpu_check.sh`
runs this file there). Skipped in the main venv and in CI (building that venv alone takes minutes). The model has
head_dim 32 (hidden 64, 2 heads): vLLM's CPU attention rejects the default embedded model's 16.
"""

import os
import re

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from agentrl import PPOConfig, PPOTrainer  # noqa: E402
from agentrl.envs import CalculatorEnv, MultiStepCalculatorEnv, calculator_tasks, multistep_tasks  # noqa: E402
from agentrl.rollout import SamplingParams, rollout  # noqa: E402
from agentrl.rollout.sampling import sample_batch  # noqa: E402
from agentrl.trainers.common import check_batch, episodes_to_batch, lm_logprobs  # noqa: E402

STOP = (r"Action:[^\n]*\n",)


@pytest.fixture(scope="module")
def hd32_base(tmp_path_factory):
    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    out = tmp_path_factory.mktemp("hd32") / "model"
    return str(build_base_model(out, BaseModelConfig(num_heads=2, steps=60, batch_size=32, warmup_steps=5),
                                progress=False))


@pytest.fixture(scope="module")
def engine(hd32_base):
    from agentrl.rollout.vllm_backend import VLLMRollout

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a quarter of the machine
    return VLLMRollout(hd32_base, "float32", max_model_len=256, enforce_eager=True)


def lora(path, seed=0):
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      task_type="CAUSAL_LM", modules_to_save=["norm"]))
    with torch.no_grad():  # a trained-looking adapter: B != 0, norm gains moved
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_samples_follow_the_hf_contract(engine, hd32_base):
    tok = AutoTokenizer.from_pretrained(hd32_base)
    policy = lora(hd32_base)
    engine.sync_weights(policy)
    contexts = [tok(f"Question: What is {i} + {2 * i}?\n")["input_ids"] for i in range(8)]
    samples = engine.sample(contexts, SamplingParams(max_new_tokens=24), tok.eos_token_id, tok.pad_token_id, tok, STOP)
    assert {s.finish for s in samples} <= {"eos", "stop", "length"}
    for s in samples:
        assert len(s.ids) == len(s.logprobs) > 0
        if s.finish == "eos":
            assert s.ids[-1] == tok.eos_token_id and tok.eos_token_id not in s.ids[:-1]
        if s.finish == "stop":  # cut right after the first match, as the hf sampler stops
            assert re.search(STOP[0], tok.decode(s.ids))
            assert not any(re.search(STOP[0], tok.decode(s.ids[:k])) for k in range(1, len(s.ids)))
    # Greedy: after the sync vLLM decodes as the merged policy does in transformers.
    greedy = SamplingParams(max_new_tokens=16, do_sample=False)
    ours = engine.sample(contexts, greedy, tok.eos_token_id, tok.pad_token_id, tok, STOP)
    theirs = sample_batch(policy, contexts, greedy, tok.eos_token_id, tok.pad_token_id, tok, STOP)
    agree = sum(a.ids == b.ids for a, b in zip(ours, theirs))
    assert agree >= 7, [(tok.decode(a.ids), tok.decode(b.ids)) for a, b in zip(ours, theirs)]


def test_episodes_keep_ids_masks_and_logprobs_the_trainer_reproduces(engine, hd32_base):
    tok = AutoTokenizer.from_pretrained(hd32_base)
    policy = lora(hd32_base, seed=1)
    engine.sync_weights(policy)

    class Scripted(MultiStepCalculatorEnv):
        """The first turn's action is replaced by a tool call, so every episode gets an observation; the
        sampled ids stay in the episode, the next turns are sampled after the observation's ids."""

        def step(self, action):
            first, self.first = getattr(self, "first", True), False
            return super().step("Thought: 2 + 3 first.\nAction: calculator(2 + 3)\n" if first else action)

    episodes = rollout(policy, tok, Scripted, multistep_tasks(12, seed=3), SamplingParams(max_new_tokens=24),
                       sampler=engine.sample)
    batch = episodes_to_batch(episodes, tok.pad_token_id)
    check_batch(episodes, batch)  # exact ids, mask 1 on exactly the sampled tokens
    # Observations are masked and followed by more sampled turns (an EOS in the first turn ends an episode early).
    assert any(0 in ep.loss_mask and ep.num_turns >= 2 for ep in episodes)
    with torch.no_grad():
        recomputed = lm_logprobs(policy, batch, 1.0)
    diff = ((recomputed - batch.logprobs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert diff < 1e-3, diff  # float32 on both sides: only kernel noise
    # The sync really moved vLLM: with the adapter's weights gone, the same tokens score differently.
    with torch.no_grad(), policy.disable_adapter():
        base = lm_logprobs(policy, batch, 1.0)
    assert ((base - batch.logprobs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum() > 10 * diff


def test_ppo_steps_with_vllm_rollouts_log_mismatch_tis_and_sync(engine, hd32_base):
    tok = AutoTokenizer.from_pretrained(hd32_base)
    trainer = PPOTrainer(PPOConfig(batch_size=16, mini_batch_size=8, ppo_epochs=1, learning_rate=5e-3,
                                   tis_clip=2.0), lora(hd32_base, seed=2), None, tok)
    trainer.rollout_backend = engine
    history = trainer.train(CalculatorEnv, calculator_tasks(64, seed=5), steps=2,
                            sampling=SamplingParams(max_new_tokens=24), progress=False)
    for row in history:
        for key in ("rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max", "tis/weight_mean",
                    "tis/clipfrac", "time/weight_sync", "time/rollout"):
            assert key in row, key
        assert row["rollout/logprob_mismatch_mean"] < 1e-3 and 0.9 < row["tis/weight_mean"] <= 2.0
