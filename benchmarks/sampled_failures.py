"""Where sampled (T=1) held-out episodes fail, for any job config: one JSON line of failure classes.

    python benchmarks/sampled_failures.py --config quickstart --model runs/base-model [--adapter runs/quickstart/adapter]

Each episode is sampled once, as `summary.json`'s `after_sampled` is (same tasks, same seed), and given the
first class that fits, in the order a turn meets them:
    decision     no tool call at all and no malformed one (the model guessed)
    format       only malformed calls, or a call but no parsable final answer
    length       a turn hit max_new_tokens
    call_copy    the tool ran but no tool result holds the right answer (the expression / query was miscopied,
                 or, multi-step, a later call of the chain went wrong)
    result_copy  some tool result holds the right answer but the final answer differs (the result was miscopied)
Also reported per turn kind: the mean probability of the sampled tokens and the fraction of tokens sampled
with probability < 0.9 (how spread the policy is where it copies).
"""

import argparse
import json
import re
from collections import Counter

import torch


def classify(ep, tokenizer) -> str:
    info = ep.info
    if info.get("correct"):
        return "correct"
    if ep.truncated:
        return "length"
    if not info.get("tool_calls"):
        return "format" if info.get("format_errors") else "decision"
    if info.get("answer") is None:
        return "format"
    observations = tokenizer.decode([t for t, m in zip(ep.token_ids, ep.loss_mask) if not m])
    answer = str(ep.task.get("answer", ""))
    # A tool result "holds" the answer when it appears there as a whole number / word.
    if answer and re.search(rf"(?<![\w.-]){re.escape(answer)}(?![\w.])", observations):
        return "result_copy"
    return "call_copy"


def turn_spread(episodes) -> dict:
    """Mean sampled-token probability and share of tokens sampled at p < 0.9, for first and last turns."""
    out = {}
    for name, pick in (("first_turn", lambda ends: 0), ("last_turn", lambda ends: len(ends) - 1)):
        probs = []
        for ep in episodes:
            if len(ep.turn_ends) < 2:
                continue  # one-turn episodes (no tool) have no copying to measure
            k = pick(ep.turn_ends)
            start = 0 if k == 0 else ep.turn_ends[k - 1] + 1
            probs += [torch.tensor(lp).exp().item() for lp, m in
                      zip(ep.logprobs[start:ep.turn_ends[k] + 1], ep.loss_mask[start:ep.turn_ends[k] + 1]) if m]
        if probs:
            out[name] = {"mean_p": round(sum(probs) / len(probs), 4),
                         "share_p_below_0.9": round(sum(p < 0.9 for p in probs) / len(probs), 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="quickstart", help="a job config (for the env, tasks, rollout)")
    parser.add_argument("--model", required=True, help="base model directory")
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--examples", type=int, default=0, help="print this many failed episodes per class")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from agentrl.envs.base import load_tasks, make_env
    from agentrl.jobs.evaluate import load_policy
    from agentrl.jobs.ppo import load_job
    from agentrl.rollout.engine import rollout
    from agentrl.rollout.sampling import SamplingParams

    job = load_job(args.config, args.overrides)
    model, tokenizer = load_policy(args.model, args.adapter)
    tasks = load_tasks(job.env.tasks, args.tasks, job.eval_seed, "eval")
    params = SamplingParams(max_new_tokens=job.rollout.max_new_tokens, temperature=args.temperature)
    generator = torch.Generator().manual_seed(job.eval_seed)  # the draw evaluate() makes
    with torch.no_grad():
        episodes = rollout(model, tokenizer, lambda: make_env(job.env.name, job.env.kwargs), tasks, params,
                           generator=generator)
    classes = [classify(ep, tokenizer) for ep in episodes]
    counts = Counter(classes)
    n = len(episodes)
    report = {"model": args.model, "adapter": args.adapter, "tasks": n, "temperature": args.temperature,
              "classes": {k: round(counts.get(k, 0) / n, 4) for k in
                          ("correct", "decision", "format", "length", "call_copy", "result_copy")},
              "spread": turn_spread(episodes)}
    print(json.dumps(report))
    for kind in ("decision", "format", "length", "call_copy", "result_copy"):
        shown = [ep for ep, c in zip(episodes, classes) if c == kind][:args.examples]
        for ep in shown:
            print(f"--- {kind}: {ep.task.get('question')} (answer {ep.task.get('answer')})")
            print(tokenizer.decode(ep.token_ids, skip_special_tokens=False))


if __name__ == "__main__":
    main()
