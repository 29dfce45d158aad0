"""The job behind `agentrl preferences`: sample K trajectories per task, score them with the environment,
and write best-vs-worst pairs as DPO / reward-model data."""

from __future__ import annotations

import json


def sample_pairs(model, tokenizer, env_factory, tasks: list[dict], samples: int, sampling, score_hook=None):
    """K trajectories per task, scored by the environment, or by `score_hook` (an LLM judge: agentrl/judge.py)
    after it -> (pairs, ties, rows for a JSONL file)."""
    from agentrl.preferences import build_pairs, pair_to_row
    from agentrl.rollout.engine import rollout

    episodes = rollout(model, tokenizer, env_factory, [t for t in tasks for _ in range(samples)], sampling)
    if score_hook is not None:
        score_hook(episodes)
    pairs, ties = build_pairs(episodes, samples)
    return pairs, ties, [pair_to_row(b, w, tokenizer) for b, w in pairs]

def run_preferences(model: str, adapter: str | None, env: str, env_kwargs: str | None, task_source: str, tasks: int,
                    seed: int, split: str, samples: int, temperature: float, max_new_tokens: int, out: str,
                    tasks_kwargs: str | None = None, judge: str | None = None) -> dict:
    import torch

    from agentrl.checkpoint import write_jsonl
    from agentrl.envs.base import load_tasks, make_env
    from agentrl.jobs.evaluate import load_policy
    from agentrl.rollout.sampling import SamplingParams

    torch.manual_seed(seed)
    policy, tokenizer = load_policy(model, adapter)
    kwargs = json.loads(env_kwargs) if env_kwargs else {}
    task_list = load_tasks(task_source, tasks, seed, split, json.loads(tasks_kwargs) if tasks_kwargs else None)
    scorer = preference_judge(judge, tokenizer, out)
    pairs, ties, rows = sample_pairs(policy, tokenizer, lambda: make_env(env, kwargs), task_list, samples,
                                     SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature), scorer)
    write_jsonl(out, rows)
    return {"tasks": len(task_list), "samples": samples, "pairs": len(pairs), "ties_skipped": ties, "out": out,
            **({} if scorer is None else {"judge": scorer.summary()})}


def preference_judge(spec: str | None, tokenizer, out: str):
    """--judge '{"mode": "ranking", "model": "smollm2-135m"}' (JudgeSection's keys, JSON) -> a judge whose verdicts
    are cached beside the pairs file (OUT.judge-cache.jsonl); None without one."""
    if not spec:
        return None
    from pathlib import Path

    from agentrl.config import ConfigError, from_dict
    from agentrl.judge import JudgeScorer, JudgeSection, check_judge

    try:
        fields = json.loads(spec)
    except ValueError as e:
        raise ConfigError(f"--judge: not a JSON object ({e})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"--judge: not a JSON object: {spec[:80]}")
    section = from_dict(JudgeSection, fields, prefix="--judge.")
    check_judge(section, "--judge")
    return JudgeScorer(section, tokenizer, Path(f"{out}.judge-cache.jsonl"))
