"""rollout.backend: vllm keeps the context budget the hf sampler keeps: the engine hands the sampler each episode's
room, vLLM is asked for no more tokens than that, and a turn that fills the context ends "context" (the episode
truncated and counted), instead of running on to vLLM's max_model_len. vLLM itself is not needed: the pure pieces
and the engine's hand-over are tested."""

from agentrl.envs.base import StepResult
from agentrl.rollout import SamplingParams, rollout
from agentrl.rollout.sampling import Sample
from agentrl.rollout.vllm_backend import _cut, turn_limits
from fake_tokenizer import FakeTokenizer


class Chatty:
    """Never ends by itself: each turn gets a 5-character observation."""

    stop_patterns, max_turns = (), 10

    def reset(self, task):
        return "Q: hi\n"

    def step(self, action):
        return StepResult("obs.\n", 0.0, False, {})


def vllm_like(contexts, params, eos, pad, room=None, **kwargs):
    """What VLLMRollout.sample does with vLLM's output: asks for turn_limits() tokens, cuts with _cut."""
    limits = turn_limits(params.max_new_tokens, len(contexts), room)
    return [_cut([ord("x")] * limit, [-1.0] * limit, eos, [], None, None if room is None else room[i])
            for i, limit in enumerate(limits)]


def test_turn_limits_and_cut():
    assert turn_limits(48, 3) == [48, 48, 48]
    assert turn_limits(48, 3, [100, 7, 0]) == [48, 7, 1]
    assert _cut([5, 5, 5], [-1.0] * 3, 0, [], None, room=3).finish == "context"
    assert _cut([5, 5, 5], [-1.0] * 3, 0, [], None, room=4).finish == "length"
    assert _cut([5, 0, 5], [-1.0] * 3, 0, [], None, room=2) == Sample([5, 0], [-1.0, -1.0], "eos")


def test_a_sampler_gets_the_room_and_the_episode_stays_within_the_context():
    params = SamplingParams(max_new_tokens=8, max_context=30)
    episodes = rollout(None, FakeTokenizer(), Chatty, [{"question": "a"}], params, sampler=vllm_like)
    ep = episodes[0]
    # Before: the sampler got no room and wrote 8 tokens a turn past the 30-token context.
    assert len(ep.prompt_ids) + len(ep.token_ids) <= 30
    assert ep.truncated and ep.info.get("context_exceeded")
