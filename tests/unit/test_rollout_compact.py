"""rollout.compact: rows whose turn has ended leave the decoding batch; what is sampled stays the same."""

import dataclasses

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs import CalculatorEnv, calculator_tasks
from agentrl.rollout import SamplingParams, rollout
from agentrl.rollout import sampling
from agentrl.rollout.sampling import sample_rows

unpark = sampling._unpark


def test_sample_rows_draws_what_multinomial_draws_and_keeps_each_rows_numbers():
    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 3, -1)
    drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7)).squeeze(-1)
    assert torch.equal(sample_rows(probs, list(range(6)), 6, torch.Generator().manual_seed(7)), drawn)
    # Rows 1 and 4 alone, in a batch of 6: each gets the token it gets in the full batch.
    assert torch.equal(sample_rows(probs[[1, 4]], [1, 4], 6, torch.Generator().manual_seed(7)), drawn[[1, 4]])


class ForcedCall(CalculatorEnv):
    """Half the episodes call the calculator first (a second turn on the KV cache), half answer at once."""

    eos_ends_episode = False  # the tiny model's EOS after a forced call must not end the episode

    def reset(self, task):
        self.forced = int(task["answer"]) % 2 == 0
        return super().reset(task)

    def step(self, action):
        if self.turns == 0 and self.forced:
            action = "Action: calculator(2 + 3)\n"
        return super().step(action)


def test_compact_rollout_samples_the_same_episodes(tiny_base, monkeypatch):
    unparked = []  # rows that left the batch in a turn and were put back for the next one
    monkeypatch.setattr(sampling, "_unpark", lambda *a: unparked.append(len(a[3])) or unpark(*a))
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)
    tasks = calculator_tasks(12, seed=1, split="eval")
    params = SamplingParams(max_new_tokens=24)
    plain = rollout(model, tok, ForcedCall, tasks, params, generator=torch.Generator().manual_seed(0))
    compact = rollout(model, tok, ForcedCall, tasks, dataclasses.replace(params, compact=True),
                      generator=torch.Generator().manual_seed(0))
    lengths = [len(ep.token_ids) for ep in plain]
    assert min(lengths) < max(lengths) and any(ep.num_turns > 1 for ep in plain)
    assert unparked and max(unparked) >= 3  # rows did leave the batch, and came back for the second turn
    for a, b in zip(plain, compact):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.turn_ends == b.turn_ends
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
