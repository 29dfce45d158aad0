"""The pieces the real-model job is made of, on tiny models built here: SFT's sparse logits at a large
vocabulary, the approx-KL warning, the word-problem task, SFT replay, the retention metrics, model.base
resolution and the stored evaluation a PPO job starts from."""

import random
import warnings

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl import PPOConfig
from agentrl.envs import word_problem_demonstration, word_problem_tasks
from agentrl.envs.safe_eval import format_number, safe_eval
from agentrl.errors import UserError
from agentrl.jobs.common import EnvSection, RolloutSection, eval_key, store_eval, stored_eval
from agentrl.jobs.retention import GENERAL_PROMPTS, REPLAY_PROMPTS, retention_metrics, _answer_logprobs
from agentrl.models import pretrained
from agentrl.trainers.ppo import warn_if_approx_kl_explodes
from agentrl.trainers.sft import SPARSE_LOGITS_MIN_VOCAB, sft_loss


def tiny_llama(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_sparse_logits_sft_loss_equals_the_full_loss():
    model = tiny_llama(SPARSE_LOGITS_MIN_VOCAB)
    ids = torch.randint(0, SPARSE_LOGITS_MIN_VOCAB, (3, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 5:9], labels[1, 3:6], labels[2, 8:12] = ids[0, 5:9], ids[1, 3:6], ids[2, 8:12]
    attention = torch.ones_like(ids)
    attention[1, 10:] = 0
    batch = {"input_ids": ids, "labels": labels, "attention_mask": attention}
    full = model(**batch).loss
    sparse = sft_loss(model, batch)
    assert sparse.item() == pytest.approx(full.item(), rel=1e-5)
    model.zero_grad()
    sparse.backward()
    g_sparse = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()
    model(**batch).loss.backward()
    assert torch.allclose(g_sparse, model.model.layers[0].self_attn.q_proj.weight.grad, atol=1e-6)


def test_shared_prefix_sft_loss_equals_the_full_loss():
    """Two kinds of rows, as in an agent's SFT batch with replay: four that share a long prompt (the system message
    and tool schemas) and differ after it, two that share another, and one alone; right-padded to one width."""
    from agentrl.trainers.common import TokenBatch, prefix_groups
    from agentrl.trainers.sft import shared_prefix_loss

    model = tiny_llama(SPARSE_LOGITS_MIN_VOCAB, seed=1)
    g = torch.Generator().manual_seed(0)
    tools, other = torch.randint(0, 1000, (9,), generator=g), torch.randint(1000, 2000, (4,), generator=g)
    rows, prompts = [], [(tools, 4), (tools, 5), (tools, 3), (tools, 4), (other, 3), (other, 6), (None, 5)]
    for shared, own in prompts:
        prompt = torch.randint(2000, 3000, (own,), generator=g)
        prompt = prompt if shared is None else torch.cat([shared, prompt])
        answer = torch.randint(3000, 4000, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        rows.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.cat([p, a])
        labels[i, len(p): len(p) + len(a)] = a
        attention[i, : len(p) + len(a)] = 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": attention}
    trained = (labels[:, 1:] != -100).float()
    groups = prefix_groups(TokenBatch(ids, attention, trained, torch.zeros_like(trained)))
    assert sorted((sorted(r.tolist()), p) for r, p in groups) == [([0, 1, 2, 3], 9), ([4, 5], 4), ([6], 0)]

    grads = []
    for loss_of in (lambda: model(**batch).loss, lambda: shared_prefix_loss(model, batch),
                    lambda: sft_loss(model, batch, share_prefix=True)):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    for value, grad in grads[1:]:
        assert value == pytest.approx(grads[0][0], rel=1e-5)
        for a, b in zip(grad, grads[0][1]):
            assert torch.allclose(a, b, atol=1e-6)


def test_prefix_groups_keep_untrained_rows_alone():
    from agentrl.trainers.common import TokenBatch, prefix_groups

    ids = torch.tensor([[5, 6, 7, 8, 1], [5, 6, 7, 9, 2], [5, 6, 7, 8, 3], [5, 6, 4, 4, 4]])
    trained = torch.zeros((4, 4))
    trained[0, 3:], trained[1, 3:], trained[2, 2:] = 1, 1, 1  # row 3 trains on nothing
    groups = prefix_groups(TokenBatch(ids, torch.ones_like(ids), trained, trained))
    # Rows 0 and 2 share 4 prompt tokens but row 2's prompt ends after 3: all three share 3.
    assert sorted((sorted(r.tolist()), p) for r, p in groups) == [([0, 1, 2], 3), ([3], 0)]


def test_approx_kl_warning():
    config = PPOConfig(batch_size=2, mini_batch_size=2)
    with pytest.warns(UserWarning, match=r"PPO step 3: approx-KL 2\.98 .*exceeds ppo\.approx_kl_warning=0\.5"):
        warn_if_approx_kl_explodes(2.98, config, 3)
    with pytest.warns(UserWarning, match="approx-KL nan"):
        warn_if_approx_kl_explodes(float("nan"), config, 1)
    with pytest.warns(UserWarning, match="approx-KL 0.7"):  # several processes: one value each, gathered
        warn_if_approx_kl_explodes(np.array([0.01, 0.7]), config, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_approx_kl_explodes(0.02, config, 1)
        warn_if_approx_kl_explodes(np.array([0.01, 0.02]), config, 1)
        warn_if_approx_kl_explodes(5.0, PPOConfig(batch_size=2, mini_batch_size=2, approx_kl_warning=None), 1)


def test_word_problems_split_answers_and_demonstrations():
    train, held_out = word_problem_tasks(2000, 0, "train"), word_problem_tasks(300, 0, "eval")
    assert not {t["question"] for t in train} & {t["question"] for t in held_out}
    assert word_problem_tasks(50, 0, "eval") == held_out[:50]  # reproducible
    for task in train + held_out:
        assert task["answer"] == format_number(safe_eval(task["expression"]))
        assert float(task["answer"]) > 0 and float(task["answer"]).is_integer()
    two_ops = sum(task["expression"].count(" ") > 2 for task in held_out) / len(held_out)
    assert 0.2 < two_ops < 0.6  # some, not all, need two operations
    rng = random.Random(0)
    rows = [word_problem_demonstration(t, rng) for t in train[:400]]
    calls = [r for r in rows if any(m.get("tool_calls") for m in r["messages"])]
    assert 0.4 < len(calls) / len(rows) < 0.6  # half call the tool, half guess
    for row in calls[:20]:
        call = row["messages"][1]["tool_calls"][0]["function"]
        task = next(t for t in train if t["question"] == row["messages"][0]["content"])
        assert call["arguments"]["expression"] == task["expression"] and row["messages"][2]["content"] == task["answer"]
    guess = next(r for r in rows if r not in calls)["messages"][-1]["content"]
    assert guess.startswith("I think it is ")


def test_replay_rows_are_mixed_in_at_their_share(monkeypatch):
    from agentrl.jobs import retention, sft
    from agentrl.trainers.sft import SFTConfig

    replay = [{"messages": [{"role": "user", "content": f"general {i}"}, {"role": "assistant", "content": "ok"}]}
              for i in range(5)]
    monkeypatch.setattr(retention, "replay_demonstrations", lambda *a, **k: replay)
    task_rows = [{"segments": [[f"task {i}", False], ["x", True]]} for i in range(60)]
    mixed, name = sft.with_replay(task_rows, "demos", SFTConfig(replay_fraction=0.25), None, None, 48)
    assert len(mixed) == 80 and name == "demos + 20 replay rows"
    assert [r for r in mixed if "segments" in r] == task_rows  # task rows kept, in order
    first_half = mixed[:40]
    assert sum("messages" in r for r in first_half) == 10  # spread through the rows, not appended at the end
    assert not set(GENERAL_PROMPTS) & set(REPLAY_PROMPTS) and len(set(REPLAY_PROMPTS)) == 50


def test_retention_metrics_against_the_reference_itself_and_a_changed_policy():
    reference, changed = tiny_llama(64, seed=0), tiny_llama(64, seed=1)
    rows = [{"prompt": [1, 2, 3], "answer": [4, 5, 6, 7]}, {"prompt": [9, 8], "answer": [7]}]
    ref_logprobs = _answer_logprobs(reference, rows)
    same = retention_metrics(reference, rows, ref_logprobs)
    other = retention_metrics(changed, rows, ref_logprobs)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["tokens"] == 5 and same["prompts"] == 2
    assert other["kl"] > 0.001
    manual = -sum(ref_logprobs[0][i, t].item() for i, t in enumerate([4, 5, 6, 7])) - ref_logprobs[1][0, 7].item()
    assert same["nll"] == pytest.approx(manual / 5, abs=1e-4)


def test_model_base_resolution(tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert pretrained.resolve_model_dir(str(plain)) == str(plain)  # a model directory is used as it is
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(UserError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\); name one of them"):
        pretrained.resolve_model_dir(str(two))
    monkeypatch.setitem(pretrained.PRESETS, "nowhere", pretrained.Preset("agentrl_no_such_package", "m.gguf",
                                                                        "pip install nowhere", "a test preset"))
    with pytest.raises(UserError, match=r"model\.base: 'nowhere' \(a test preset\) is not installed: pip install nowhere"):
        pretrained.resolve_model_dir("nowhere")


def test_stored_evaluation_is_reused_only_for_the_same_key_and_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    key = eval_key(EnvSection(), 0, RolloutSection(), 1.0, "bf16")
    result = {"greedy": {"accuracy": 0.5}, "sampled": {"accuracy": 0.25}}
    store_eval(str(tmp_path), key, result)
    assert stored_eval(str(tmp_path), key) == result
    assert stored_eval(str(tmp_path), eval_key(EnvSection(), 0, RolloutSection(), 1.0, "no")) is None  # precision
    assert stored_eval(str(tmp_path), eval_key(EnvSection(eval_tasks=100), 0, RolloutSection(), 1.0, "bf16")) is None
    assert stored_eval(str(tmp_path), eval_key(EnvSection(), 0, RolloutSection(max_context=128), 1.0, "bf16")) is None
    assert stored_eval(str(tmp_path), eval_key(EnvSection(), 0, RolloutSection(share_prefix=True), 1.0, "bf16")) is None
    (tmp_path / "model.safetensors").write_bytes(b"other weights")  # the model changed since
    assert stored_eval(str(tmp_path), key) is None


def test_report_shows_retention_escaped():
    from agentrl.jobs.report import retention_html

    run = {"name": "<b>run</b>", "summary": {"retention": {"reference": {"nll": 0.7, "kl": 0.0},
                                                           "before": {"nll": 0.8, "kl": 0.1},
                                                           "after": {"nll": 0.77, "kl": "<script>"},
                                                           "nll_rise": 0.1}}}
    html = retention_html(run)
    assert "&lt;b&gt;run&lt;/b&gt;" in html and "<script>" not in html and "rose by 10.0%" in html
    assert "<td>after training</td><td>0.770</td>" in html
    assert retention_html({"name": "x", "summary": {}}) == ""


def test_train_norms_final_trains_only_the_norm_before_the_lm_head():
    from agentrl.jobs.common import ModelSection, add_lora
    from agentrl.trainers.common import norm_gain_parameters

    model = add_lora(tiny_llama(64), ModelSection(lora=True, lora_r=2, target_modules=["q_proj"], train_norms="final"))
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n)
    assert trained == ["base_model.model.model.norm.modules_to_save.default.weight"], trained
    assert len(norm_gain_parameters(model)) == 1  # the norm's own learning rate reaches it
    every = add_lora(tiny_llama(64), ModelSection(lora=True, lora_r=2, target_modules=["q_proj"], train_norms=True))
    assert len([n for n, p in every.named_parameters() if p.requires_grad and "lora_" not in n]) == 3  # 2 + final
