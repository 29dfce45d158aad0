"""PPOTrainer as TRL 0.11 scripts and tests use it: datasets, schedulers, optimizers, public step pieces."""

import copy
from functools import partial

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

from agentrl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from agentrl.models.tiny import build_tokenizer

    tok = build_tokenizer(["this morning i went to the park", "a good movie", "a bad movie"] * 20, 120)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2, n_positions=64)).save_pretrained(path)
    tok.save_pretrained(path)
    BloomForCausalLM(BloomConfig(vocab_size=len(tok), hidden_size=16, n_layer=2, n_head=2)).save_pretrained(path / "bloom")
    return path


def make(gpt2_dir, **config):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir, v_head_init_strategy="normal")
    return model, AutoTokenizer.from_pretrained(gpt2_dir), PPOConfig(**{"batch_size": 2, "mini_batch_size": 1, **config})


class TupleDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, i + 8])


def test_tuple_dataset_default_collation_scheduler_and_callers_zero_grad(gpt2_dir):
    model, tok, config = make(gpt2_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    trainer = PPOTrainer(config, model, None, tok, dataset=TupleDataset(), optimizer=optimizer, lr_scheduler=scheduler)
    assert isinstance(trainer.lr_scheduler.scheduler, torch.optim.lr_scheduler.ExponentialLR)  # prepared
    trainer.optimizer.zero_grad = partial(trainer.optimizer.zero_grad, set_to_none=False)
    queries, responses = next(iter(trainer.dataloader))  # torch's default collation: two (2, 4) tensors
    assert queries.shape == responses.shape == (2, 4)
    first = trainer.step(list(queries), list(responses), [torch.tensor(1.0), torch.tensor(0.0)])
    second = trainer.step(list(queries), list(responses), [torch.tensor(1.0), torch.tensor(0.0)])
    assert first["ppo/learning_rate"] == pytest.approx(0.01) and second["ppo/learning_rate"] == pytest.approx(0.005)
    assert all(p.grad is not None for p in trainer.model.parameters())  # the caller's set_to_none=False held
    for key in ("objective/kl_dist", "ppo/policy/advantages", "ppo/val/var", "time/ppo/calc_stats",
                "objective/logprobs", "tokens/queries_dist"):
        assert key in second
    assert second["objective/kl_dist"].shape == (2,) and isinstance(second["ppo/val/var"], float)
    with pytest.raises(ValueError, match="1-dimensional"):
        trainer.step(list(queries), list(responses), [torch.tensor([[1.0]]), torch.tensor([[0.0]])])
    trainer.step(list(queries), list(responses), [torch.tensor([1.0]), torch.tensor([0.0])])  # 1-D is fine


def test_warnings_num_shared_layers_and_references(gpt2_dir):
    model, tok, config = make(gpt2_dir)
    with pytest.warns(UserWarning, match="No dataset is provided"):
        PPOTrainer(config, copy.deepcopy(model), None, tok)
    with pytest.warns(UserWarning, match="num_shared_layers is ignored"):
        PPOTrainer(config, copy.deepcopy(model), copy.deepcopy(model), tok, num_shared_layers=1)
    trainer = PPOTrainer(config, model, None, tok, num_shared_layers=1)
    assert isinstance(trainer.ref_model, AutoModelForCausalLMWithValueHead)
    frozen = {n for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert "pretrained_model.transformer.h.0.attn.c_attn.weight" in frozen
    assert "pretrained_model.transformer.h.1.attn.c_attn.weight" not in frozen
    q, r = [torch.tensor([1, 2, 3])] * 2, [torch.tensor([4, 5])] * 2
    trainer.step(q, r, [1.0, 0.0])
    assert all(p.grad is None for p in trainer.ref_model.parameters())


@pytest.mark.parametrize("arch", ["gpt2", "bloom"])
def test_batched_forward_pass_is_independent_of_padding_and_chunking(gpt2_dir, arch):
    model, tok, config = make(gpt2_dir)
    if arch == "bloom":
        model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir / "bloom", v_head_init_strategy="normal")
    tok.padding_side = "left"  # positions must follow the mask, not the padding
    trainer = PPOTrainer(config, model, None, tok)
    queries, responses = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4, 5, 6, 7])], [
        torch.tensor([5, 6, 7, 8, 9]), torch.tensor([8, 9, 10, 11, 12, 13])]
    inputs = trainer.prepare_model_inputs(queries, responses)
    assert inputs["attention_mask"][0, 0] == 0  # left-padded
    logp, logits, values, masks = trainer.batched_forward_pass(model, queries, responses, inputs, return_logits=True)
    assert logits.shape[:2] == logp.shape == values.shape == masks.shape == (2, 12)
    assert masks.sum(-1).tolist() == [5, 6]
    single = trainer.batched_forward_pass(model, queries[:1], responses[:1],
                                          trainer.prepare_model_inputs(queries[:1], responses[:1]))
    assert torch.allclose(logp[0][masks[0].bool()], single[0][0][single[3][0].bool()], atol=1e-5)
    assert torch.allclose(values[0][masks[0].bool()], single[2][0][single[3][0].bool()], atol=1e-5)


def test_rewards_advantages_and_loss_pieces(gpt2_dir):
    model, tok, config = make(gpt2_dir, init_kl_coef=0.5, adap_kl_ctrl=False, gamma=1.0, lam=1.0)
    trainer = PPOTrainer(config, model, None, tok)
    logprobs, ref = torch.tensor([[0.0, -1.0, -2.0, 0.0]]), torch.tensor([[0.0, -1.5, -1.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    rewards, non_score, kls = trainer.compute_rewards(torch.tensor([2.0]), logprobs, ref, mask)
    assert torch.allclose(kls, torch.tensor([[0.0, 0.5, -1.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[0.0, -0.25, 0.5 + 2.0, 0.0]]))
    values = torch.tensor([[9.0, 1.0, 2.0, 9.0]])
    v, adv, ret = trainer.compute_advantages(values, rewards, mask)
    # gamma = lam = 1: returns are reward-to-go over the response (2.25, 2.5); advantages are whitened
    assert torch.allclose(ret, torch.tensor([[0.0, 2.25, 2.5, 0.0]])) and v[0, 0] == 0
    # raw advantages 1.25, 0.5 (GAE by hand); whitened over the two response tokens: +-1/sqrt(2)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5 ** 0.5, -(0.5 ** 0.5), 0.0]]), atol=1e-5)
    logits = torch.randn(1, 4, 7)
    pg, vf, stats = trainer.loss(logprobs, v, logits, v + 0.1, logprobs, mask, adv, ret)
    assert pg.abs() < 1e-6 and stats["policy/ratio"] == 1.0 and vf > 0
    with pytest.warns(UserWarning, match="exceeds threshold"):
        pg, vf, stats = trainer.loss(logprobs, v, logits, v, logprobs + 5.0, mask, adv, ret)  # ratio e^5 > 10
    assert pg == 0 and vf == 0
    out = trainer.record_step_stats(kl_coef=0.5, scores=torch.tensor([2.0, 0.0]), logprobs=logprobs.repeat(2, 1),
                                    ref_logprobs=ref.repeat(2, 1), non_score_reward=non_score.repeat(2, 1),
                                    masks=mask.repeat(2, 1), kls=kls.repeat(2, 1), queries=[torch.ones(3)] * 2,
                                    responses=[torch.ones(2)] * 2,
                                    train_stats={"val/error": torch.tensor([[1.0]]), "returns/var": torch.tensor([[4.0]])})
    assert out["objective/kl"] == pytest.approx(-0.5) and out["ppo/val/var_explained"] == pytest.approx(0.75)
    assert out["tokens/queries_len_mean"] == 3 and isinstance(out["tokens/responses_dist"], np.ndarray)


def test_reward_adapter_scores_with_its_own_head(gpt2_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids = torch.tensor([[1, 2, 3, 4, 5]])
    rm = get_peft_model(AutoModelForSequenceClassification.from_pretrained(gpt2_dir, num_labels=2),
                        LoraConfig(r=2, target_modules=["c_attn"], task_type="SEQ_CLS"))
    with torch.no_grad():
        for name, p in rm.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_()  # a trained reward adapter differs from the base
    rm.eval()
    expected = rm(ids).logits
    rm.save_pretrained(tmp_path / "rm")
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(gpt2_dir),
                            LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(policy, reward_adapter=str(tmp_path / "rm"))
    scores = model.compute_reward_score(ids)
    assert scores.shape == (1, 5, 2) and torch.allclose(scores[:, -1], expected, atol=1e-5)
    assert model.pretrained_model.active_adapter == "default"
    assert not any(p.requires_grad for n, p in model.named_parameters() if "reward" in n or "score" in n)
    with pytest.raises(ValueError, match="reward modeling adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir).compute_reward_score(ids)


def test_sentiment_example_runs(tiny_base):
    """examples/sentiment_ppo.py (TRL 0.11's sentiment example): classifier reward, reference responses, log_stats."""
    from examples.sentiment_ppo import main

    history = main(tiny_base, steps=2, batch_size=4, mini_batch_size=2)
    assert len(history) == 2
    assert all(np.isfinite([h["reward"], h["ref_reward"], h["kl"]]).all() for h in history)


def test_anneal_lr_refuses_a_scheduler_of_its_own(gpt2_dir):
    model, tok, config = make(gpt2_dir)
    config.anneal_lr = True
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="anneal_lr"):
        PPOTrainer(config, model, None, tok, optimizer=optimizer,
                   lr_scheduler=torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5))
