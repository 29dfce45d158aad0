"""DPO on the tiny model: the guide's snippet, the tool-token mask, pairs, and row-level data errors."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.preferences import PreferenceDataError, build_pairs, load_preferences, tokenize_row
from agentrl.rollout.engine import Episode

ROWS = [
    {"prompt": "Question: What is 12 * 3?\n",
     "chosen": "Thought: I need to calculate 12 * 3.\nAction: calculator(12 * 3)\n",
     "rejected": "Thought: I can answer 12 * 3 directly.\nAnswer: 38"},
    {"prompt": "Question: What is 7 + 5?\n",
     "chosen": "Thought: I need to calculate 7 + 5.\nAction: calculator(7 + 5)\n",
     "rejected": "Thought: I can answer 7 + 5 directly.\nAnswer: 13"},
]


def test_the_guides_dpo_snippet_runs(tiny_base, tmp_path):
    """Seed 003, sections 3.2-3.4: imports changed to agentrl, a local model, fp16 off, no 4-bit."""
    from datasets import Dataset
    from peft import TaskType
    from transformers import TrainingArguments

    from agentrl import DPOTrainer

    dataset = Dataset.from_list(ROWS * 4)
    model = AutoModelForCausalLM.from_pretrained(tiny_base, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    tokenizer.pad_token = tokenizer.eos_token
    lora_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "k_proj", "o_proj"],
                             lora_dropout=0.1, bias="none", task_type=TaskType.CAUSAL_LM)
    model = get_peft_model(model, lora_config)
    training_args = TrainingArguments(output_dir=str(tmp_path / "dpo_finetuned"), per_device_train_batch_size=4,
                                      gradient_accumulation_steps=4, learning_rate=5e-5, num_train_epochs=3,
                                      logging_steps=10, save_steps=500, fp16=False, remove_unused_columns=False,
                                      report_to="none")
    dpo_trainer = DPOTrainer(model=model, ref_model=None, args=training_args, train_dataset=dataset,
                             tokenizer=tokenizer, beta=0.1, max_length=512, max_prompt_length=256)
    dpo_trainer.train()
    dpo_trainer.save_model(str(tmp_path / "dpo_final_model"))
    assert (tmp_path / "dpo_final_model" / "adapter_config.json").exists()
    assert dpo_trainer.ref_model is None  # the reference is the adapter-disabled base
    last = dpo_trainer.history[-1]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "learning_rate"):
        assert key in last


def test_fp16_on_cpu_is_one_clear_error(tiny_base):
    from agentrl import DPOConfig, DPOTrainer

    with pytest.raises(ValueError, match="dpo.fp16: fp16 needs a CUDA GPU"):
        DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_base), args=DPOConfig(fp16=True),
                   train_dataset=ROWS, tokenizer=AutoTokenizer.from_pretrained(tiny_base))


def test_dpo_learns_the_preference_and_precompute_keeps_no_reference(tiny_base):
    from agentrl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer = DPOTrainer(model=model, args=DPOConfig(per_device_train_batch_size=2, learning_rate=5e-3, max_steps=12,
                                                     logging_steps=4, precompute_ref_log_probs=True, progress=False),
                         train_dataset=ROWS, tokenizer=tok)
    assert trainer.ref_model is None and all(ex.ref_chosen_logp is not None for ex in trainer.examples)
    history = trainer.train()
    assert history[-1]["rewards/margins"] > 0 and history[-1]["loss"] < history[0]["loss"]


@pytest.mark.parametrize("precompute", [False, True])
def test_under_bf16_the_reference_runs_at_the_policys_precision(tiny_base, precompute):
    """At the first step the LoRA policy equals its reference (B = 0), so under bf16 autocast both must give the
    same logprobs: implicit rewards exactly 0. A reference left in fp32 gives bf16 rounding (~1e-4) instead."""
    from accelerate.state import AcceleratorState

    from agentrl import DPOConfig, DPOTrainer
    from agentrl.trainers.common import _HEAD_OK

    tok = AutoTokenizer.from_pretrained(tiny_base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    AcceleratorState._reset_state(True)  # one process-wide accelerate state: this trainer's mixed precision
    trainer = DPOTrainer(model=model, args=DPOConfig(per_device_train_batch_size=2, max_steps=1, bf16=True,
                                                     precompute_ref_log_probs=precompute, progress=False),
                         train_dataset=ROWS, tokenizer=tok)
    row = trainer.train()[0]
    AcceleratorState._reset_state(True)
    assert row["rewards/chosen"] == 0.0 and row["rewards/rejected"] == 0.0
    assert row["logps/chosen"] != 0.0
    # The check that lets only assistant positions reach the LM head held under mixed precision too (it used to
    # compare the prepared model's bf16 logits with an fp32 head and turn the fast paths off for the run).
    assert _HEAD_OK[model.get_base_model()] is not None


def test_rpo_alpha_raises_the_chosen_likelihood(tiny_base):
    """RPO's NLL term on the chosen completions: the same run ends with the chosen logprob higher than plain DPO."""
    from agentrl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    ends = {}
    for alpha in (None, 1.0):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                               LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        trainer = DPOTrainer(model=model, args=DPOConfig(per_device_train_batch_size=2, learning_rate=5e-3, max_steps=8,
                                                         logging_steps=4, rpo_alpha=alpha, progress=False),
                             train_dataset=ROWS, tokenizer=tok)
        ends[alpha] = trainer.train()[-1]
    assert "nll/chosen" in ends[1.0] and "nll/chosen" not in ends[None]
    assert ends[1.0]["logps/chosen"] > ends[None]["logps/chosen"] + 1.0


def test_tool_tokens_are_masked_out_of_sequence_logprobs(tiny_base):
    from agentrl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    traj = [{"role": "assistant", "content": "Thought: t\nAction: calculator(2 + 2)\n"},
            {"role": "tool", "content": "Observation: 4\n"},
            {"role": "assistant", "content": "Answer: 4"}]
    other = [dict(m) for m in traj]
    other[1]["content"] = "Observation: 9999999999\n"  # a different tool output changes nothing
    row = {"prompt": "Question: What is 2 + 2?\n", "chosen": traj, "rejected": other}
    ex = tokenize_row(row, tok, "test", 512, 256)
    obs = tok("Observation: 4\n", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ex.chosen_ids)) if ex.chosen_ids[i:i + len(obs)] == obs)
    assert ex.chosen_mask[start:start + len(obs)] == [0] * len(obs)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_base), train_dataset=[row], tokenizer=tok,
                         args=DPOConfig(progress=False))
    with torch.no_grad():
        c, r = trainer.sequence_logps(trainer.model, [ex])
        # the assistant tokens' logprobs depend on the context, so compare against a manual sum
        batch = trainer._batch([ex])
        from agentrl.trainers.common import lm_logprobs

        per_token = lm_logprobs(trainer.model, batch, 1.0)
        assert torch.allclose(c, (per_token[0] * batch.loss_mask[0]).sum())
        assert batch.loss_mask[0].sum().item() == sum(ex.chosen_mask)
        assert sum(ex.chosen_mask) == sum(ex.rejected_mask)  # only the masked tool text differs


def ep(score):
    return Episode(task={}, prompt_ids=[1], token_ids=[5], loss_mask=[1], turn_rewards=[score], turn_ends=[0])


def test_pair_building():
    pairs, ties = build_pairs([ep(1.0), ep(-1.0), ep(0.2), ep(0.2), ep(0.2), ep(0.2)], group_size=2)
    assert ties == 2 and len(pairs) == 1 and pairs[0][0].score == 1.0 and pairs[0][1].score == -1.0
    pairs, ties = build_pairs([ep(1.0), ep(0.0)], group_size=1)  # K = 1: every group is a tie
    assert pairs == [] and ties == 2
    pairs, ties = build_pairs([ep(0.5)] * 4, group_size=4)
    assert pairs == [] and ties == 1
    with pytest.raises(ValueError):
        build_pairs([ep(0.0)] * 3, group_size=2)


def test_row_level_errors_name_file_row_and_field(tiny_base, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_base)
    path = tmp_path / "pairs.jsonl"
    bad_rows = [ROWS[0], {"prompt": "Q\n", "chosen": "A"}, {"prompt": "Q\n", "chosen": 3, "rejected": "B"},
                {"prompt": "Q\n", "chosen": "", "rejected": "B"}, {"prompt": "x " * 400, "chosen": "A", "rejected": "B"}]
    expected = ["row 2: missing field 'rejected'", "row 2: field 'chosen' must be", "row 2: field 'chosen' is empty",
                "row 2: field 'prompt' is"]  # each file: a good row 1, then the bad row
    for k, message in enumerate(expected):
        path.write_text("\n".join(json.dumps(r) for r in [bad_rows[0], bad_rows[k + 1]]) + "\n")
        with pytest.raises(PreferenceDataError) as err:
            load_preferences(path, tok, max_prompt_length=256)
        assert str(path) in str(err.value) and message in str(err.value)
    path.write_text("\n".join(json.dumps(r) for r in bad_rows) + "\n")
    examples, skipped = load_preferences(path, tok, skip_bad_rows=True)
    assert len(examples) == 1 and skipped == 4
