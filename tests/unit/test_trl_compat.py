"""TRL 0.11's `trl.core`, value-head model and PPOConfig, as `agentrl.core` / `agentrl` (tiny local models)."""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from agentrl import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, set_seed
from agentrl import core, create_reference_model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from agentrl.models.tiny import build_tokenizer

    tok = build_tokenizer(["this morning i went to the park", "a good movie", "a bad movie"] * 20, 120)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=3, n_head=2, n_positions=64))
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_masked_helpers_match_the_unmasked_computation():
    x, mask = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert core.masked_mean(x, mask) == torch.mean(x[1:3])
    assert core.masked_var(x, mask) == torch.var(x[1:3])
    assert torch.allclose(core.masked_whiten(x, mask)[1:3], core.whiten(x[1:3]), atol=1e-6)
    assert torch.allclose(core.masked_whiten(x, mask, shift_mean=False)[1:3].mean(), torch.tensor(2.5), atol=1e-6)
    assert torch.isnan(core.masked_mean(x, torch.zeros(4)))  # TRL semantics: an empty mask is NaN ...
    with pytest.raises(ValueError, match="sum of the mask is zero"):
        core.masked_var(x, torch.zeros(4))  # ... and its variance an error


def test_core_tensor_helpers():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[0, 1, 2], [4, 3, 2]])
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(core.logprobs_from_logits(logits, labels), expected)
    assert core.logprobs_from_logits(logits, None, gather=False).shape == (2, 3, 5)
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(core.entropy_from_logits(logits), entropy, atol=1e-5)
    assert torch.equal(core.clip_by_value(torch.tensor([-2.0, 0.5, 3.0]), torch.tensor(-1.0), torch.tensor(1.0)),
                       torch.tensor([-1.0, 0.5, 1.0]))
    assert core.flatten_dict({"a": {"b": 1, "c": {"d": 2}}}) == {"a/b": 1, "a/c/d": 2}
    stacked = core.stack_dicts([{"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([3.0])}])
    assert stacked["x"].tolist() == [[1.0, 2.0], [3.0, core.WANDB_PADDING]]
    stats = core.convert_to_scalar(core.stats_to_np({"a": torch.tensor([2.0]), "b": torch.ones(3), "c": 1}))
    assert stats["a"] == 2.0 and isinstance(stats["b"], np.ndarray) and stats["c"] == 1
    filtered = core.top_k_top_p_filtering(torch.tensor([[1.0, 3.0, 2.0]]), top_k=2)
    assert torch.isinf(filtered[0, 0]) and torch.isfinite(filtered[0, 1:]).all()


def test_length_sampler_and_set_seed():
    set_seed(3)
    sampler = core.LengthSampler(4, 8)
    first = [int(sampler()) for _ in range(20)]
    assert set(first) <= {4, 5, 6, 7} and len(set(first)) > 1
    set_seed(3)
    assert [int(sampler()) for _ in range(20)] == first


def test_respond_to_batch_samples_new_tokens(gpt2_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir)
    query = torch.tensor([[1, 2, 3]])
    out = core.respond_to_batch(model, query, txt_len=5)
    assert out.shape == (1, 5) and out.dtype == torch.long


def test_seq2seq_name_imports_and_refuses_to_be_used():
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        AutoModelForSeq2SeqLMWithValueHead.from_pretrained("t5-small")


def test_value_head_kwargs_stay_out_of_transformers(gpt2_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        gpt2_dir, summary_dropout_prob=0.0, v_head_init_strategy="normal", v_head_initializer_range=0.5)
    assert model.v_head.dropout.p == 0.0
    assert model.v_head.summary.bias.abs().sum() == 0 and 0.2 < model.v_head.summary.weight.std() < 1.0
    # stack_llama's rl_training.py passes load_in_8bit, which transformers 5 takes only as a quantization_config
    zero_init = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir, load_in_8bit=False)
    assert torch.count_nonzero(zero_init.v_head.summary.weight) == 0
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir, v_head_init_strategy="xavier")


def test_state_dict_has_trl_keys_and_loads_both_ways(gpt2_dir, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir, v_head_init_strategy="normal")
    state = model.state_dict()
    assert "v_head.summary.weight" in state and "transformer.wte.weight" in state
    assert not any(k.startswith("pretrained_model.") for k in state)
    other = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir)
    other.load_state_dict(state)  # TRL's layout
    assert torch.equal(other.v_head.summary.weight, model.v_head.summary.weight)
    torch_layout = {f"pretrained_model.{k}": v for k, v in state.items() if not k.startswith("v_head.")}
    other.load_state_dict({**torch_layout, "v_head.summary.weight": torch.ones(1, 16), "v_head.summary.bias": state[
        "v_head.summary.bias"]})  # torch's own layout
    assert other.v_head.summary.weight.sum() == 16
    # save_pretrained puts v_head.* into model.safetensors, where TRL 0.11's from_pretrained reads them
    model.save_pretrained(tmp_path / "ckpt")
    assert "v_head.summary.weight" in load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    (tmp_path / "ckpt" / "value_head.safetensors").unlink()  # only TRL's copy left
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(loaded.v_head.summary.weight, model.v_head.summary.weight)


def test_peft_state_dict_is_the_value_head_only(gpt2_dir):
    from peft import LoraConfig

    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        gpt2_dir, peft_config=LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    assert model.is_peft_model and sorted(model.state_dict()) == ["v_head.summary.bias", "v_head.summary.weight"]
    model.load_state_dict(model.state_dict())


def test_lm_methods_are_forwarded(gpt2_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir)
    model.gradient_checkpointing_enable()
    assert model.pretrained_model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.pretrained_model.is_gradient_checkpointing
    model.enable_input_require_grads()
    assert model.prepare_inputs_for_generation(torch.tensor([[1, 2]]))["input_ids"].shape[-1] >= 1
    logits, loss, value, cache = model(torch.tensor([[1, 2, 3]]), return_past_key_values=True)
    assert logits.shape[:2] == value.shape == (1, 3) and cache is not None


def test_create_reference_model_shares_and_freezes_the_first_layers(gpt2_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir)
    ref = create_reference_model(model, num_shared_layers=1)
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert params["pretrained_model.transformer.h.0.attn.c_attn.weight"] is ref_params[
        "pretrained_model.transformer.h.0.attn.c_attn.weight"]
    assert not params["pretrained_model.transformer.wte.weight"].requires_grad
    assert not params["pretrained_model.transformer.h.0.mlp.c_fc.weight"].requires_grad
    assert params["pretrained_model.transformer.h.1.mlp.c_fc.weight"].requires_grad
    assert params["pretrained_model.transformer.h.1.mlp.c_fc.weight"] is not ref_params[
        "pretrained_model.transformer.h.1.mlp.c_fc.weight"]
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    full = create_reference_model(model)
    assert all(a is not b for a, b in zip(model.parameters(), full.parameters()))
    with pytest.raises(ValueError, match="pattern"):
        create_reference_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), num_shared_layers=1)


@dataclass
class ScriptArguments:
    use_peft: bool = field(default=False, metadata={"help": "whether to use peft"})
    lora_r: int = field(default=16, metadata={"help": "the lora r parameter"})


def test_hf_argument_parser_parses_ppo_config():
    args, config = HfArgumentParser((ScriptArguments, PPOConfig)).parse_args_into_dataclasses(
        ["--use_peft", "--batch_size", "8", "--mini_batch_size", "4", "--log_with", "tensorboard",
         "--learning_rate", "1e-4", "--kl_penalty", "abs", "--score_clip", "0.5"])
    assert args.use_peft and config.batch_size == 8 and config.mini_batch_size == 4
    assert config.log_with == "tensorboard" and config.learning_rate == 1e-4 and config.kl_penalty == "abs"
    assert config.score_clip == 0.5 and config.backward_batch_size == 4
    assert config.to_dict()["batch_size"] == 8 and PPOConfig(steps=300, batch_size=128).total_ppo_epochs == 3


def test_the_agent_trainer_carries_no_trl_only_api():
    """TRL 0.11's sample-by-hand API lives in the adapter; the agent trainer is the loop and the update."""
    import agentrl
    from agentrl.trainers import ppo
    from agentrl.trl_compat import PPOTrainer as Adapter

    assert agentrl.PPOTrainer is Adapter and issubclass(Adapter, ppo.PPOTrainer)
    for name in ("generate", "step", "log_stats", "batched_forward_pass", "compute_rewards", "prepare_dataloader"):
        assert hasattr(Adapter, name) and not hasattr(ppo.PPOTrainer, name), name


# TRL 0.11.4's PPOConfig field names, in its order.
TRL_PPO_CONFIG_FIELDS = (
    "exp_name seed log_with task_name model_name query_dataset reward_model remove_unused_columns tracker_kwargs "
    "accelerator_kwargs project_kwargs tracker_project_name push_to_hub_if_best_kwargs steps learning_rate "
    "adap_kl_ctrl init_kl_coef kl_penalty target horizon gamma lam cliprange cliprange_value vf_coef batch_size "
    "forward_batch_size mini_batch_size gradient_accumulation_steps world_size ppo_epochs max_grad_norm "
    "optimize_cuda_cache optimize_device_cache early_stopping target_kl compare_steps ratio_threshold "
    "use_score_scaling use_score_norm score_clip whiten_rewards gradient_checkpointing is_encoder_decoder "
    "is_peft_model backward_batch_size global_backward_batch_size global_batch_size dataset_num_proc").split()


def test_trl_config_has_every_trl_field_and_the_agent_config_only_what_the_update_reads():
    from dataclasses import fields

    from agentrl.trainers import ppo

    trl_fields = {f.name for f in fields(PPOConfig)}
    agent_fields = {f.name for f in fields(ppo.PPOConfig)}
    assert set(TRL_PPO_CONFIG_FIELDS) <= trl_fields and agent_fields < trl_fields
    only_trl = set(TRL_PPO_CONFIG_FIELDS) - agent_fields
    assert {"query_dataset", "reward_model", "score_clip", "forward_batch_size", "push_to_hub_if_best_kwargs",
            "exp_name"} <= only_trl
    # an agent config is accepted by the TRL API, with TRL's defaults for the rest
    lifted = PPOConfig.of(ppo.PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=3e-4))
    assert isinstance(lifted, PPOConfig) and lifted.learning_rate == 3e-4 and lifted.mini_batch_size == 2
    assert lifted.query_dataset == "stanfordnlp/imdb" and lifted.total_ppo_epochs == 5000
    with pytest.warns(UserWarning, match="forward_batch_size"):
        assert PPOConfig(batch_size=8, forward_batch_size=4).mini_batch_size == 4


def test_a_job_config_refuses_trl_only_ppo_keys():
    from agentrl.config import ConfigError, load_config
    from agentrl.jobs.ppo import JobConfig

    with pytest.raises(ConfigError, match="query_dataset"):
        load_config(JobConfig, None, ["ppo.query_dataset=imdb"])
