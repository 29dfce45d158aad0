"""Context budgets of a rollout: a prompt over the context is one error naming the task; a turn that would run
past the model's positions stops there; an observation over its budget is never appended (a 10 MB one is not
even tokenized); such episodes end, truncated, and are counted. Episodes within budget are left as they were."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs import StepResult
from agentrl.rollout import SamplingParams, episode_metrics, rollout
from agentrl.rollout.engine import ContextError
from agentrl.trainers.common import check_batch, episodes_to_batch


class Chatty:
    """Never done; answers every turn with `observation` (its text is set per test)."""

    stop_patterns = (r"\n",)
    max_turns = 50
    eos_ends_episode = False  # EOS ends a turn only: nothing but the context ends these episodes
    observation = "Observation: ok\n"

    def reset(self, task):
        return task["question"]

    def step(self, action):
        return StepResult(self.observation, 0.1, False, {"correct": False})


def run(tiny_base, env, tasks, **params):
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)
    episodes = rollout(model, tok, env, tasks, SamplingParams(max_new_tokens=16, **params),
                       generator=torch.Generator().manual_seed(0))
    return model, tok, episodes


def test_turns_stop_at_the_models_positions(tiny_base):
    model, tok, episodes = run(tiny_base, Chatty, [{"question": "Question: What is 1 + 1?\n"}] * 3)
    limit = model.config.max_position_embeddings  # 256 for the tiny model
    for ep in episodes:
        assert len(ep.prompt_ids) + len(ep.token_ids) <= limit
        assert ep.truncated and ep.info["context_exceeded"] and ep.done
    assert episode_metrics(episodes)["env/context_cut_rate"] == 1.0
    check_batch(episodes, episodes_to_batch(episodes, tok.pad_token_id))  # still a valid batch


def test_max_context_and_observation_budget(tiny_base):
    class Flood(Chatty):
        observation = "x" * 10_000_000  # 10 MB: refused without tokenizing

    _, _, episodes = run(tiny_base, Flood, [{"question": "Question: What is 2 + 2?\n"}], max_context=200)
    (ep,) = episodes
    assert ep.num_turns == 1 and ep.info["context_exceeded"] and ep.truncated
    assert sum(1 for m in ep.loss_mask if m == 0) == 0  # nothing of the flood was appended

    class Wordy(Chatty):
        observation = "Observation: " + "word " * 30 + "\n"

    _, tok, episodes = run(tiny_base, Wordy, [{"question": "Question: What is 3 + 3?\n"}], max_observation_tokens=8)
    assert episodes[0].num_turns == 1 and episodes[0].info["context_exceeded"]
    _, _, episodes = run(tiny_base, Chatty, [{"question": "Question: What is 3 + 3?\n"}], max_context=120)
    assert len(episodes[0].prompt_ids) + len(episodes[0].token_ids) <= 120 and episodes[0].info["context_exceeded"]


def test_a_prompt_over_the_context_ends_unplayed_and_a_batch_of_them_is_one_error(tiny_base):
    with pytest.warns(UserWarning, match=r"1 of 2 tasks do not fit the context .* a task \('Question: What is .*'\): "
                                         r"its prompt is \d+ tokens, and an episode may hold 256"):
        _, _, episodes = run(tiny_base, Chatty, [{"question": "Question: What is 1 + 1?\n"},
                                                 {"question": "Question: What is " + "1 + " * 400 + "1?\n"}])
    assert episodes[0].num_turns >= 1 and not episodes[0].infra_failure
    assert episodes[1].num_turns == 0 and episodes[1].infra_failure and episodes[1].info["context_exceeded"]
    with pytest.raises(ContextError, match=r"a task \('Question: What is .*'\): its prompt is \d+ tokens"):
        run(tiny_base, Chatty, [{"question": "Question: What is " + "1 + " * 400 + "1?\n"}])
    with pytest.raises(ContextError, match=r"its prompt is 2000000 characters, far over the 256 tokens"):
        run(tiny_base, Chatty, [{"question": "y" * 2_000_000}])
