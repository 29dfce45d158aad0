"""The job behind `agentrl compare`: two policies on the same tasks and seeds, win-rate with a 95% interval
(the before/after comparison of an RLHF tutorial)."""

from __future__ import annotations

import json
import math

import torch


def parse_spec(spec: str) -> tuple[str, str | None]:
    """"MODEL_DIR" or "MODEL_DIR:ADAPTER_DIR"."""
    model, _, adapter = spec.partition(":")
    return model, adapter or None


def wilson_interval(wins: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion wins / n (ties count half in `wins`)."""
    if n == 0:
        return 0.0, 1.0
    p = wins / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def count_outcomes(scores_a: list[float], scores_b: list[float]) -> dict:
    """Wins, ties and losses of A against B, the win-rate (ties count half) and its 95% interval."""
    if len(scores_a) != len(scores_b):
        raise ValueError(f"{len(scores_a)} scores for A but {len(scores_b)} for B")
    wins = sum(a > b for a, b in zip(scores_a, scores_b))
    losses = sum(a < b for a, b in zip(scores_a, scores_b))
    ties = len(scores_a) - wins - losses
    n = len(scores_a)
    rate = (wins + 0.5 * ties) / n if n else 0.0
    low, high = wilson_interval(wins + 0.5 * ties, n)
    return {"wins": wins, "ties": ties, "losses": losses, "n": n, "win_rate": rate, "ci95": [low, high]}


def compare(spec_a: str, spec_b: str, env_factory, tasks: list[dict], judge: str = "env", greedy: bool = True,
            temperature: float = 1.0, max_new_tokens: int = 48, seed: int = 0, show: int = 3,
            samples_path: str | None = None, samples: int = 50) -> dict:
    """Win-rate of A against B; `samples_path`: also write the first `samples` A/B episode pairs there
    (samples.jsonl, kind "compare") for `agentrl report`."""
    from agentrl.jobs.evaluate import load_policy
    from agentrl.rollout.engine import rollout
    from agentrl.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=not greedy)
    runs = []
    for spec in (spec_a, spec_b):
        model, tokenizer = load_policy(*parse_spec(spec))
        episodes = rollout(model, tokenizer, env_factory, tasks, params, generator=torch.Generator().manual_seed(seed))
        runs.append((episodes, tokenizer))
    if judge == "env":
        scores = [[ep.score for ep in eps] for eps, _ in runs]
    elif judge.startswith("reward-model:"):
        from agentrl.trainers.reward import RewardModelScorer

        scores = []
        for eps, tok in runs:
            scorer = RewardModelScorer([judge.removeprefix("reward-model:")], tok, weight=1.0, env_weight=0.0)
            scorer(eps)
            scores.append([ep.info["reward_model_score"] for ep in eps])
    else:
        raise ValueError(f"judge must be 'env' or 'reward-model:PATH', got {judge!r}")
    result = count_outcomes(*scores)
    if samples_path:
        from agentrl.samples import SamplesLog

        SamplesLog(samples_path, every=1, per_step=samples, source="compare").write_pairs(
            0, list(zip(runs[0][0], runs[1][0])), kind="compare", names=("a", "b"),
            extra=[{"name_a": f"A: {spec_a}", "name_b": f"B: {spec_b}", "score_a": sa, "score_b": sb}
                   for sa, sb in zip(*scores)], tokenizers=(runs[0][1], runs[1][1]))
    result["judge"] = judge
    result["samples"] = [
        {"task": tasks[i].get("question", str(tasks[i])),
         "a": runs[0][1].decode(runs[0][0][i].token_ids, skip_special_tokens=True), "score_a": scores[0][i],
         "b": runs[1][1].decode(runs[1][0][i].token_ids, skip_special_tokens=True), "score_b": scores[1][i]}
        for i in range(min(show, len(tasks)))]
    return result


def run_compare(a: str, b: str, env: str, env_kwargs: str | None, task_source: str, tasks: int, seed: int,
                judge: str, sample: bool, max_new_tokens: int, out: str | None,
                samples_path: str | None = None, tasks_kwargs: str | None = None) -> dict:
    """`agentrl compare`: held-out tasks of `task_source`, compared, written to `out` if set; the A/B episodes
    to `samples_path` (for `agentrl report`)."""
    from agentrl.checkpoint import write_json
    from agentrl.envs.base import load_tasks, make_env

    kwargs = json.loads(env_kwargs) if env_kwargs else {}
    task_list = load_tasks(task_source, tasks, seed, "eval", json.loads(tasks_kwargs) if tasks_kwargs else None)
    result = compare(a, b, lambda: make_env(env, kwargs), task_list, judge, greedy=not sample,
                     max_new_tokens=max_new_tokens, seed=seed, samples_path=samples_path)
    if out:
        write_json(out, result)
    return result
