"""The multi-turn rollout engine: the model acts, the environment answers, until the episode ends.

Token-in-token-out. Each episode keeps the prompt ids, then the exact ids the model sampled and the
ids of each observation, side by side with
    loss_mask: 1 on tokens the policy sampled (its EOS included), 0 on observation tokens
(prompt and padding are outside `token_ids` and get 0 wherever a batch is built).
Observations are tokenized on their own and appended; nothing sampled is ever re-tokenized, and earlier
turns are never re-rendered (chat environments hand over only the template's text for the new messages).
"""

from __future__ import annotations

import concurrent.futures
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from agentrl.envs.base import (INFRA_FAILURE, Environment, EnvTimeout, StepResult, _user_call, check_attributes,
                               checked_reset, checked_step, env_option)
from agentrl.errors import UserError
from agentrl.precision import frozen_casts_cached
from agentrl.rollout.sampling import KVState, Sample, SamplingParams, sample_batch

STEP_WORKERS = 16  # threads stepping environments that allow it (concurrent_steps)


@dataclass
class Episode:
    task: dict
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # actions and observations, after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1 sampled, 0 observation
    logprobs: list[float] = field(default_factory=list)  # sampling logprobs, 0.0 on observations
    values: list[float] | None = None  # PPO's values at the positions predicting each token (rollout(value_head=))
    turn_ends: list[int] = field(default_factory=list)  # index in token_ids of each turn's last token
    turn_rewards: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    truncated: bool = False  # some turn hit max_new_tokens before its stop pattern or EOS
    done: bool = False
    messages: list[dict] | None = None  # chat environments: the conversation as messages, prompt included
    tools: list[dict] | None = None  # chat environments: the tool schemas the template rendered
    chat_template_kwargs: dict | None = None  # chat environments: extra template arguments (enable_thinking, ...)
    state_keys: list = field(default_factory=list)  # per turn, the environment's info["state_key"] after it (None
    # when it gives none): which states of different episodes are the same (GRPO's step advantages)

    @property
    def score(self) -> float:
        """Episode score: the sum of the environment's turn rewards."""
        return float(sum(self.turn_rewards))

    @property
    def num_turns(self) -> int:
        return len(self.turn_ends)

    @property
    def infra_failure(self) -> bool:
        """The environment reported a failure outside the policy (info["infra_failure"]): leave it out of the loss."""
        return bool(self.info.get(INFRA_FAILURE))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids as the policy sees them: the tokenizer's special tokens (BOS) added, unless the text
    already starts with BOS (chat templates that write it, such as Llama 3's), which would double it."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def rollout(
    model: torch.nn.Module,
    tokenizer,
    env_factory: Callable[[], Environment],
    tasks: list[dict],
    params: SamplingParams,
    batch_size: int = 256,
    generator: torch.Generator | None = None,
    value_head: torch.nn.Module | None = None,
    sampler: Callable[..., list[Sample]] | None = None,
) -> list[Episode]:
    """Run one episode per task, all tasks batched turn by turn. Returns episodes in task order.

    value_head: PPO's; each episode then keeps the values the sampler read (`Episode.values`, 0.0 on
    observation tokens), so the trainer needs no forward pass for them.
    sampler: another sampler of each turn, with sample_batch's arguments after `model` and whole contexts
    (rollout/vllm_backend.py's VLLMRollout.sample); it keeps no values and no KV cache of ours.

    Context budgets (params.max_context, default the model's max_position_embeddings; params.max_observation_tokens):
    a prompt over the context is an error naming the task; a turn stops where the context is full, and an
    observation over its budget is not appended: either way the episode ends there, truncated, with
    info["context_exceeded"] (counted as env/context_cut_rate). A `sampler` gets the same `room=` (per context,
    the tokens it may still sample) where some episode has less than max_new_tokens left.
    """
    episodes: list[Episode] = []
    with frozen_casts_cached(model):  # under bf16 autocast, each frozen weight cast once, not at every token
        for start in range(0, len(tasks), batch_size):
            episodes.extend(_rollout_chunk(model, tokenizer, env_factory, tasks[start:start + batch_size], params,
                                           generator, None if sampler else value_head, sampler))
    return episodes


def _rollout_chunk(model, tokenizer, env_factory, tasks, params, generator, value_head=None,
                   sampler=None) -> list[Episode]:
    envs = [env_factory() for _ in tasks]
    for env in envs:
        if env_option(env, "bind_tokenizer") is not None:
            _user_call(env.bind_tokenizer, f"{type(env).__name__}.bind_tokenizer", tokenizer)
    if not envs:
        return []
    # A factory of the user's own may not go through make_env, which checks these too.
    max_turns, stop_patterns = check_attributes(envs[0])
    eos_ends = env_option(envs[0], "eos_ends_episode")
    # Chat environments must see the turn-end marker they sampled (a special token) to append the next
    # segment exactly after it; every other environment gets plain text.
    skip_special = not env_option(envs[0], "keep_special_tokens")
    limit = context_limit(model, params)
    timeout = env_option(envs[0], "step_timeout")
    episodes = _start_episodes(envs, tasks, tokenizer, limit, timeout, value_head is not None)
    kv, cached, previous = (KVState() if params.reuse_kv and sampler is None else None), [0] * len(episodes), []
    for turn in range(max_turns):
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        rooms = None
        if limit is not None:  # tokens each live episode may still sample before its context is full
            rooms = [limit - len(episodes[i].prompt_ids) - len(episodes[i].token_ids) for i in live]
            for i, room in zip(live, rooms):
                if room < 1:
                    _cut(episodes[i])
            rooms = [room for room in rooms if room >= 1]
            live = [i for i in live if not episodes[i].done]
            rooms = rooms if rooms and min(rooms) < params.max_new_tokens else None
        if not live:
            break
        contexts = [episodes[i].prompt_ids + episodes[i].token_ids for i in live]
        if kv is not None and kv.cache is not None:  # only what the cache lacks: last sampled token, observation
            kv.select([previous.index(i) for i in live])
            contexts = [c[cached[i]:] for i, c in zip(live, contexts)]
        if sampler is not None:
            samples = sampler(contexts, params, tokenizer.eos_token_id, tokenizer.pad_token_id,
                              tokenizer=tokenizer, stop_patterns=stop_patterns, generator=generator,
                              **({"room": rooms} if rooms is not None else {}))
        else:
            samples = sample_batch(model, contexts, params, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                   tokenizer=tokenizer, stop_patterns=stop_patterns, generator=generator,
                                   value_head=value_head, kv=kv, room=rooms)
        previous = live
        actions = [tokenizer.decode(sample.ids, skip_special_tokens=skip_special) for sample in samples]
        results = _step_all([envs[i] for i in live], actions, timeout)
        for i, sample, result in zip(live, samples, results):
            _record_turn(episodes[i], envs[i], sample, result, eos_ends and sample.finish == "eos",
                         turn == max_turns - 1)
            cached[i] = len(episodes[i].prompt_ids) + len(episodes[i].token_ids) - 1  # all but the last sampled
            # token are in kv
            if not episodes[i].done and result.observation:
                _append_observation(episodes[i], tokenizer, result.observation, limit, params.max_observation_tokens)
    for ep, env in zip(episodes, envs):  # so preference rows can be written as messages, not template text
        if env_option(env, "messages") is not None:
            ep.messages = _user_call(lambda: list(env.messages), f"{type(env).__name__}.messages")
            ep.tools = env_option(env, "schemas")
            ep.chat_template_kwargs = env_option(env, "chat_template_kwargs") or None
    return episodes


def _start_episodes(envs: list, tasks: list[dict], tokenizer, limit: int | None, timeout: float | None,
                    with_values: bool) -> list[Episode]:
    """One episode per task from env.reset(task): its prompt ids, checked against the context budget. A task whose
    prompt does not fit ends unplayed, left out of the loss and counted (env/context_cut_rate), so one over-long
    task cannot end a long run; when no task of the batch fits, that is an error naming the first."""
    episodes, over = [], []
    for env, task in zip(envs, tasks):
        try:
            prompt = checked_reset(env, task, timeout)
        except EnvTimeout as e:  # no prompt: an episode of no turns, left out of the loss
            episodes.append(_timed_out(_unplayed(task, tokenizer), env, "reset", e))
            continue
        problem, ids = None, None
        if limit is not None and len(prompt) > _MAX_CHARS_PER_TOKEN * limit:  # not worth tokenizing
            problem = f"its prompt is {len(prompt)} characters, far over the {limit} tokens an episode may hold " \
                      f"(rollout.max_context)"
        else:
            ids = encode_prompt(tokenizer, prompt)
            if limit is not None and len(ids) >= limit:
                problem = f"its prompt is {len(ids)} tokens, and an episode may hold {limit} (rollout.max_context; " \
                          f"default: the model's max_position_embeddings)"
        if problem:
            over.append(f"a task ({str(task.get('question', task))[:60]!r}): {problem}")
            ep = _unplayed(task, tokenizer)
            ep.info = {INFRA_FAILURE: True, "context_exceeded": True}
            episodes.append(ep)
            continue
        episodes.append(Episode(task=task, prompt_ids=ids, values=[] if with_values else None))
    if over and len(over) == len(episodes):
        raise ContextError(over[0] + (f" (and the other {len(over) - 1} tasks of the batch)" if len(over) > 1 else ""))
    if over:
        warnings.warn(f"{len(over)} of {len(episodes)} tasks do not fit the context and end unplayed, left out of "
                      f"the loss (env/context_cut_rate): {over[0]}", stacklevel=3)
    return episodes


def _unplayed(task: dict, tokenizer) -> Episode:
    """An episode that ends before its first turn (no usable prompt): done, with a one-token stand-in prompt."""
    return Episode(task=task, prompt_ids=encode_prompt(tokenizer, "") or [tokenizer.eos_token_id], done=True)


def _record_turn(ep: Episode, env, sample: Sample, result: StepResult, eos_ended: bool, last_turn: bool) -> None:
    """Append one sampled turn and the environment's answer to it (reward, info, done) to `ep`."""
    ep.token_ids += sample.ids
    ep.loss_mask += [1] * len(sample.ids)
    ep.logprobs += sample.logprobs
    if ep.values is not None:
        ep.values += sample.values
    ep.turn_ends.append(len(ep.token_ids) - 1)
    ep.truncated |= sample.finish == "length"
    ep.turn_rewards.append(float(result.reward))
    ep.state_keys.append(result.info.get("state_key"))
    # The last step's info, but a failure outside the policy, once reported, stays with the episode.
    ep.info = {**result.info, INFRA_FAILURE: True} if ep.info.get(INFRA_FAILURE) else result.info
    # EOS ends the episode, whatever the environment would allow, unless the environment says its turns end
    # with that token (eos_ends_episode False: chat templates whose end-of-turn token is the EOS).
    ep.done = result.done or eos_ended or last_turn
    if result.info.get("env_timeout"):
        _timed_out(ep, env, "step", result.info["env_timeout"])
    if sample.finish == "context":
        _cut(ep)


def _append_observation(ep: Episode, tokenizer, text: str, limit: int | None, max_tokens: int | None) -> None:
    """Append an observation's ids (masked out of the loss), or end the episode, marked, when it is over its
    budget instead of overflowing."""
    obs_ids = _observation_ids(tokenizer, text, ep, limit, max_tokens)
    if obs_ids is None:
        _cut(ep)
        return
    ep.token_ids += obs_ids
    ep.loss_mask += [0] * len(obs_ids)
    ep.logprobs += [0.0] * len(obs_ids)
    if ep.values is not None:
        ep.values += [0.0] * len(obs_ids)


class ContextError(UserError):
    """A prompt longer than the context an episode may hold."""


# No tokenizer writes more characters than this per token in practice; text longer than this many characters
# per token of its budget is over it without being tokenized (a 10 MB observation costs nothing to refuse).
_MAX_CHARS_PER_TOKEN = 64


def context_limit(model, params: SamplingParams) -> int | None:
    """The tokens an episode may hold, prompt included: params.max_context, else the model's positions."""
    if params.max_context is not None:
        return params.max_context
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def _cut(ep: Episode) -> None:
    """End an episode at its context budget: done, truncated, and counted (info "context_exceeded")."""
    ep.done = ep.truncated = True
    ep.info = {**ep.info, "context_exceeded": True}


def _observation_ids(tokenizer, text: str, ep: Episode, limit: int | None, max_tokens: int | None) -> list[int] | None:
    """The observation's ids, or None when it does not fit: over max_observation_tokens, or leaving the episode
    no room for one more sampled token."""
    budget = min(max_tokens if max_tokens is not None else float("inf"),
                 limit - len(ep.prompt_ids) - len(ep.token_ids) - 1 if limit is not None else float("inf"))
    if len(text) > _MAX_CHARS_PER_TOKEN * budget:
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if len(ids) <= budget else None


def _step_all(envs: list, actions: list[str], timeout: float | None = None) -> list:
    """env.step(action) for every live episode of a turn. Environments that declare `concurrent_steps = True`
    (ToolEnv: its tools may wait on I/O, a network search, a subprocess) are stepped from a thread pool, so a
    batch's tool calls overlap instead of running one after the other; results keep their order. A step past
    `timeout` seconds gives a StepResult whose info["env_timeout"] says so."""
    def step(env, action):
        try:
            return checked_step(env, action, timeout)
        except EnvTimeout as e:
            return StepResult(None, 0.0, True, {"env_timeout": e})

    if len(envs) > 1 and env_option(envs[0], "concurrent_steps"):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(STEP_WORKERS, len(envs)))
        try:
            return list(pool.map(step, envs, actions))
        finally:  # not `with`: on a stop signal its exit would wait for a step that hangs (no deadline)
            pool.shutdown(wait=False, cancel_futures=True)
    return [step(env, action) for env, action in zip(envs, actions)]


def _timed_out(ep: Episode, env, method: str, error: EnvTimeout) -> Episode:
    """End an episode whose environment hung: done, an infrastructure failure (left out of the loss, counted as
    env/infra_failure_rate and env/timeout_rate)."""
    warnings.warn(f"{type(env).__name__}.{method} {error}: its episode ends as an infrastructure failure "
                  f"(counted as env/timeout_rate)", stacklevel=2)
    ep.done = True
    ep.info = {**ep.info, INFRA_FAILURE: True, "env_timeout": True}
    return ep


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Environment health metrics over a batch of episodes (the `env/*` stats)."""
    n = max(len(episodes), 1)
    info = [ep.info for ep in episodes]
    return {
        "env/accuracy": sum(bool(i.get("correct")) for i in info) / n,
        "env/tool_call_rate": sum(i.get("tool_calls", 0) > 0 for i in info) / n,
        "env/tool_calls_per_episode": sum(i.get("tool_calls", 0) for i in info) / n,
        "env/format_error_rate": sum(i.get("format_errors", 0) > 0 for i in info) / n,
        "tools/malformed_calls_per_episode": sum(i.get("malformed_calls", 0) for i in info) / n,
        "tools/failure_rate": sum(i.get("tool_failures", 0) for i in info) / max(
            sum(i.get("tool_failures", 0) + i.get("tool_calls", 0) for i in info), 1),
        "env/mean_turns": sum(ep.num_turns for ep in episodes) / n,
        "env/mean_score": sum(ep.score for ep in episodes) / n,
        "env/truncation_rate": sum(ep.truncated for ep in episodes) / n,
        "env/context_cut_rate": sum(bool(i.get("context_exceeded")) for i in info) / n,
        "env/infra_failure_rate": sum(ep.infra_failure for ep in episodes) / n,
        "env/timeout_rate": sum(bool(i.get("env_timeout")) for i in info) / n,
        "env/mean_response_length": sum(sum(ep.loss_mask) for ep in episodes) / n,
    }
