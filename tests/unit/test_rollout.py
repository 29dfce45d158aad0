"""Rollout masks and token-in-token-out, on a real tiny model."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs import CalculatorEnv, calculator_tasks
from agentrl.rollout import SamplingParams, rollout, sample_batch
from agentrl.trainers.common import episodes_to_batch, lm_logprobs


def test_masks_and_sampled_ids(tiny_base):
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)

    class ForcedCall(CalculatorEnv):  # make sure at least one observation is appended
        def step(self, action):
            if self.turns == 0:
                action = "Action: calculator(2 + 3)\n"
            return super().step(action)

    tasks = calculator_tasks(8, seed=0, split="eval")
    episodes = rollout(model, tok, ForcedCall, tasks, SamplingParams(max_new_tokens=24),
                       generator=torch.Generator().manual_seed(0))
    for ep in episodes:
        assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
        obs = tok("Observation: 5\n", add_special_tokens=False)["input_ids"]
        first_end = ep.turn_ends[0] + 1
        if ep.num_turns > 1:
            # the observation tokens follow the first turn and are masked out
            assert ep.token_ids[first_end:first_end + len(obs)] == obs
            assert ep.loss_mask[first_end:first_end + len(obs)] == [0] * len(obs)
        assert all(m == 1 for m in ep.loss_mask[:first_end])  # sampled tokens
    batch = episodes_to_batch(episodes, tok.pad_token_id)
    assert batch.loss_mask.sum() == sum(sum(ep.loss_mask) for ep in episodes)
    # the prompt is never a target
    for i, ep in enumerate(episodes):
        assert batch.loss_mask[i, : len(ep.prompt_ids) - 1].sum() == 0
        assert batch.scores[i].sum().item() == pytest.approx(ep.score)
        last = len(ep.prompt_ids) + ep.turn_ends[-1] - 1  # the position predicting the last turn's last token
        assert batch.scores[i, last].item() == pytest.approx(ep.turn_rewards[-1] + (ep.turn_rewards[0] if ep.num_turns == 1 else 0.0))


def test_sampled_logprobs_match_a_recomputed_forward(tiny_base):
    """The logprobs kept at sampling time are those a fresh forward computes on the same ids."""
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)
    contexts = [tok("Question: What is 1 + 2?\n")["input_ids"], tok("Question: What is 33 * 41?\n")["input_ids"]]
    samples = sample_batch(model, contexts, SamplingParams(max_new_tokens=12, temperature=0.7), tok.eos_token_id,
                           tok.pad_token_id, generator=torch.Generator().manual_seed(1))
    from agentrl.trainers.common import build_batch

    rows = [(c + s.ids, [0] * len(c) + [1] * len(s.ids), []) for c, s in zip(contexts, samples)]
    batch = build_batch(rows, tok.pad_token_id)
    recomputed = lm_logprobs(model, batch, 0.7)
    for i, (c, s) in enumerate(zip(contexts, samples)):
        got = recomputed[i, len(c) - 1: len(c) - 1 + len(s.ids)]
        assert torch.allclose(got, torch.tensor(s.logprobs), atol=1e-4)


def test_stop_pattern_ends_the_turn(tiny_base):
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)
    samples = sample_batch(model, [tok("Question: What is 1 + 2?\n")["input_ids"]] * 4,
                           SamplingParams(max_new_tokens=30), tok.eos_token_id, tok.pad_token_id, tokenizer=tok,
                           stop_patterns=(r"\n",), generator=torch.Generator().manual_seed(0))
    for s in samples:
        text = tok.decode(s.ids)
        if s.finish == "stop":
            assert text.count("\n") == 1 and text.endswith("\n")


def test_prompts_get_one_bos_whether_or_not_the_template_writes_it(tiny_base):
    from agentrl.rollout.engine import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_base)
    plain = encode_prompt(tok, "Question: What is 1 + 1?\n")
    written = encode_prompt(tok, tok.bos_token + "Question: What is 1 + 1?\n")  # as Llama 3's template does
    assert plain == written and plain.count(tok.bos_token_id) == 1
