"""Where a policy fails on the held-out word problems: accuracy per problem family, and the failing episodes.

    python benchmarks/word_problem_failures.py runs/real-sft/model runs/real-ppo/adapter [--tasks 200] [--greedy]
        [--bf16] [--show 25]

The job's summary gives one accuracy; this splits it by the family of the question (agentrl.envs.word_problems'
_PROBLEMS: which operations the expression needs) and prints what the policy wrote where it failed, so a wrong
operator, a call whose JSON is malformed and a guess without a call can be told apart. The tasks and the sampling
seed are the jobs' (held-out split, eval_seed 0, temperature 1, 48 new tokens a turn).
"""

from __future__ import annotations

import argparse
import collections
import re

import torch

from agentrl.envs import WordProblemEnv, word_problem_tasks
from agentrl.envs.word_problems import _PROBLEMS
from agentrl.jobs.evaluate import load_policy
from agentrl.rollout.engine import rollout
from agentrl.rollout.sampling import SamplingParams


def family_patterns() -> list[tuple[re.Pattern, str]]:
    """(a regex matching every question of a phrasing, the family's expression) for every phrasing."""
    patterns = []
    for phrasings, expression, _ in _PROBLEMS:
        for phrasing in phrasings:
            pattern = re.escape(phrasing)
            for name in ("a", "b", "c"):
                pattern = pattern.replace(re.escape("{" + name + "}"), r"\d+")
            patterns.append((re.compile(pattern), expression))
    return patterns


def family_of(question: str, patterns) -> str:
    return next((expression for pattern, expression in patterns if pattern.fullmatch(question)), "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the base model directory (or preset) the adapter was trained on")
    parser.add_argument("adapter", nargs="?", default=None, help="a PEFT adapter directory (none: the model alone)")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling at T=1")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (only where the CPU has native bf16)")
    parser.add_argument("--show", type=int, default=25, help="failing episodes printed")
    args = parser.parse_args()

    model, tokenizer = load_policy(args.model, args.adapter)
    model.eval()
    tasks = word_problem_tasks(args.tasks, 0, "eval")
    params = SamplingParams(max_new_tokens=48, temperature=1.0, do_sample=not args.greedy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        episodes = rollout(model, tokenizer, lambda: WordProblemEnv(format="chat"), tasks, params,
                           generator=torch.Generator().manual_seed(0))

    patterns, counts, failures = family_patterns(), collections.defaultdict(lambda: [0, 0]), []
    for episode in episodes:
        family = family_of(episode.task["question"], patterns)
        correct = bool(episode.info.get("correct"))
        counts[family][0] += correct
        counts[family][1] += 1
        if not correct:
            failures.append((family, episode.task["question"], tokenizer.decode(episode.token_ids)))
    right, decoding = sum(c for c, _ in counts.values()), "greedy" if args.greedy else "sampled (T=1)"
    print(f"{decoding}: accuracy {right / len(episodes):.3f} on {len(episodes)} tasks")
    for family, (c, n) in sorted(counts.items()):
        print(f"  {family:18} {c:3d} / {n:3d} = {c / n:.2f}")
    for family, question, text in failures[:args.show]:
        print(f"\n[{family}] {question}\n  {text[:200]!r}")


if __name__ == "__main__":
    main()
