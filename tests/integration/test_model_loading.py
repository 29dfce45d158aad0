"""The model.* loading options of every job config: dtype, device_map, attn_implementation, gradient checkpointing,
4-bit (refused with a clear error without a GPU), and accelerate's mixed precision, on the tiny model."""

import math

import pytest
import torch
from transformers import AutoTokenizer

from agentrl import PPOConfig, PPOTrainer
from agentrl.config import ConfigError
from agentrl.jobs.common import ModelSection, add_lora, load_base
from agentrl.jobs.ppo import load_job
from agentrl.trainers.common import TokenBatch, eval_mode, lm_logprobs


def test_bfloat16_device_map_and_attention_load_as_asked(tiny_base):
    model, _ = load_base(tiny_base, ModelSection(dtype="bfloat16", device_map="cpu", attn_implementation="eager"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager" and {p.device.type for p in model.parameters()} == {"cpu"}
    default, _ = load_base(tiny_base, ModelSection())
    assert {p.dtype for p in default.parameters()} == {torch.float32}


def test_bad_loading_options_name_their_key(tiny_base, monkeypatch):
    with pytest.raises(ConfigError, match=r"model.dtype: 'float64' is not one of"):
        load_job("quickstart", ["model.dtype=float64"])
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        load_base(tiny_base, ModelSection(attn_implementation="no_such_kernel"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.load_in_4bit: needs a CUDA GPU"):
        load_base(tiny_base, ModelSection(load_in_4bit=True))
    with pytest.raises(ConfigError, match="model.load_in_4bit: .*model.lora=true"):
        load_base(tiny_base, ModelSection(load_in_4bit=True, lora=False))


def _batch(tok) -> TokenBatch:
    ids = [tok(f"Question: What is {i} + 3?\nThought: I can do it.\nAnswer: {i + 3}")["input_ids"] for i in range(3)]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    return TokenBatch(input_ids, attention, attention[:, 1:].float(), torch.zeros(3, width - 1))


def _lora_grads(tiny_base, checkpointing: bool):
    """LoRA gradients of one backward in the trainers' eval mode, and how often layer 0's q_proj ran."""
    model, tok = load_base(tiny_base, ModelSection())
    torch.manual_seed(0)
    model = add_lora(model, ModelSection(gradient_checkpointing=checkpointing, target_modules=["q_proj", "v_proj"]))
    calls = []
    model.get_base_model().model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    eval_mode(model)
    batch = _batch(tok)
    logprobs = lm_logprobs(model, batch, 1.0)
    (-(logprobs * batch.loss_mask).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, len(calls)


def test_gradient_checkpointing_with_lora_recomputes_and_gives_the_same_gradients(tiny_base):
    plain, plain_calls = _lora_grads(tiny_base, False)
    checkpointed, checkpointed_calls = _lora_grads(tiny_base, True)
    # Checkpointing really happened in eval mode (dropout off): layer 0's q_proj ran again in the backward.
    assert (plain_calls, checkpointed_calls) == (1, 2)
    assert plain.keys() == checkpointed.keys() and any("lora_B" in n for n in plain)
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6), name


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state: a trainer with another mixed_precision needs it reset, after too."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_a_ppo_step_with_gradient_checkpointing_and_bf16_mixed_precision(tiny_base, fresh_accelerate_state):
    model, tok = load_base(tiny_base, ModelSection())
    model = add_lora(model, ModelSection(gradient_checkpointing=True, target_modules=["q_proj", "v_proj"]))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-2,
                                   mixed_precision="bf16"), model, None, tok)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    q = [tok("Question: What is 2 + 2?\n", return_tensors="pt")["input_ids"][0]] * 2
    stats = trainer.step(q, trainer.generate(q, return_prompt=False, max_new_tokens=6), [1.0, -1.0])
    assert math.isfinite(stats["ppo/loss/total"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    # Under mixed precision the old logprobs come from a forward: the sampler's would fail the reuse check
    # (REUSE_TOLERANCE), after a wasted forward.
    assert not trainer._reuses_rollout and trainer._rollout_value_head is None


def test_a_ppo_step_on_bfloat16_weights(tiny_base):
    model, tok = load_base(tiny_base, ModelSection(dtype="bfloat16"))
    model = add_lora(model, ModelSection(target_modules=["q_proj", "v_proj"]))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-2,
                                   logprob_mismatch_threshold=None), model, None, tok)
    q = [tok("Question: What is 2 + 2?\n", return_tensors="pt")["input_ids"][0]] * 2
    stats = trainer.step(q, trainer.generate(q, return_prompt=False, max_new_tokens=6), [1.0, -1.0])
    assert math.isfinite(stats["ppo/loss/total"])


def test_tokenizer_is_untouched_by_loading_options(tiny_base):
    _, tok = load_base(tiny_base, ModelSection(dtype="float16"))
    assert tok.eos_token_id == AutoTokenizer.from_pretrained(tiny_base).eos_token_id
