"""Where the multi-step calculator fails: which call of the chain goes wrong, and whether the base model can copy.

    python benchmarks/multistep_failures.py --model runs/base-model-multistep [--adapter runs/grpo/adapter] [--greedy]

Two measurements, one JSON line:
- episodes: the 200 held-out tasks run once (sampled at T=1 with the evaluation's seed, or greedy), each failure
  given the first step of the right chain it departs from: `stopped` (answered before the last call),
  `call_k` (the k-th call is not the right single operation: an operand miscopied from the question or from an
  earlier observation), `extra_calls`, `answer` (every call right, the final answer miscopied).
- probe: teacher-forced on complete demonstrations of the same tasks, the share whose argmax departs from the
  demonstration anywhere except at a turn's first token (the decision to call again or to answer, which the
  corpus leaves to RL), split by the number of digits of the question's first operand.
"""

import argparse
import json
import random
import re
from collections import Counter

import torch


def chain_failure(ep, steps: list[tuple[str, str]], text: str) -> str:
    if ep.info.get("correct"):
        return "correct"
    calls = [c.strip() for c in re.findall(r"Action: calculator\((.*?)\)\n", text)]
    for k, (step, _) in enumerate(steps):
        if k >= len(calls):
            return "stopped"
        if calls[k] != step:
            return f"call_{k + 1}"
    return "extra_calls" if len(calls) > len(steps) else "answer"


@torch.no_grad()
def copy_probe(model, tokenizer, tasks: list[dict]) -> dict:
    from agentrl.envs import multistep_demonstration
    from agentrl.trainers.sft import encode_demonstrations, read_demonstrations

    rows = [multistep_demonstration(t, True, random.Random(0)) for t in tasks]
    examples, _, _ = encode_demonstrations(read_demonstrations(rows), tokenizer)
    wrong, total = Counter(), Counter()
    for (ids, labels), task in zip(examples, tasks):
        digits = len(re.findall(r"\d+", task["expression"])[0])
        total[digits] += 1
        predicted = model(torch.tensor([ids])).logits[0, :-1].argmax(-1)
        labels = torch.tensor(labels[1:])
        # (T-1,) trained positions except the first of each turn (its decision: call again or answer)
        trained = labels != -100
        scored = trained & torch.cat([torch.tensor([False]), trained[:-1]])
        wrong[digits] += int(((predicted != labels) & scored).any())
    return {f"{d}-digit first operand": f"{wrong[d]}/{total[d]}" for d in sorted(total)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="base model directory")
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--greedy", action="store_true", help="greedy episodes instead of sampled at T=1")
    args = parser.parse_args()

    from agentrl.envs import MultiStepCalculatorEnv, multistep_tasks
    from agentrl.envs.calculator import _steps_of
    from agentrl.jobs.evaluate import load_policy
    from agentrl.jobs.ppo import load_job
    from agentrl.rollout.engine import rollout
    from agentrl.rollout.sampling import SamplingParams

    job = load_job("grpo", [])
    model, tokenizer = load_policy(args.model, args.adapter)
    tasks = multistep_tasks(args.tasks, job.eval_seed, "eval")
    params = SamplingParams(max_new_tokens=job.rollout.max_new_tokens, do_sample=not args.greedy)
    generator = torch.Generator().manual_seed(job.eval_seed)  # the draw evaluate() makes
    with torch.no_grad():
        episodes = rollout(model, tokenizer, MultiStepCalculatorEnv, tasks, params, generator=generator)
    classes = Counter(chain_failure(ep, _steps_of(ep.task["expression"]), tokenizer.decode(ep.token_ids))
                      for ep in episodes)
    report = {"model": args.model, "adapter": args.adapter, "decoding": "greedy" if args.greedy else "sampled(T=1)",
              "episodes": {k: round(v / len(episodes), 3) for k, v in sorted(classes.items())}}
    if args.adapter is None:
        report["probe_copy_errors"] = copy_probe(model, tokenizer, tasks)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
