"""How often an LLM judge agrees with the word-problem verifier (numeric_match against the known answer).

Trajectories (half right, a quarter guessing a wrong number, a quarter calling the calculator with a wrong operator
and reporting its result confidently) are written from the task's truth, so the verifier's label is known; each
is judged with the reference answer shown. A judge "says right" when its score is >= 0.5.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/judge_agreement.py --n 100 --modes yes_no rating
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/judge_agreement.py --n 100 --modes yes_no rating \
        --base-url http://127.0.0.1:8123/v1 --model ~/.cache/agentrl/models/SmolLM2-...   # transformers serve
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from agentrl.envs.calculator import _wrong_guess, numeric_match
from agentrl.envs.safe_eval import format_number, safe_eval
from agentrl.envs.word_problems import word_problem_tasks
from agentrl.judge import JudgeScorer, JudgeSection
from agentrl.rollout.engine import Episode

_SWAP = {"+": "-", "-": "+", "*": "+", "/": "*"}


def trajectory(task: dict, kind: str, rng: random.Random) -> tuple[str, str]:
    """(the trajectory as text, its final answer) of one kind: right, guess, wrong_tool."""
    call = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
    if kind == "right":
        return f"{call.format(task['expression'])}\nTool: {task['answer']}\nThe answer is {task['answer']}.", task["answer"]
    if kind == "guess":
        guess = _wrong_guess(task["answer"], rng)
        return f"I think it is {guess}.", guess
    expr = task["expression"]
    for op, other in _SWAP.items():
        if f" {op} " in expr:
            expr = expr.replace(f" {op} ", f" {other} ", 1)
            break
    value = format_number(safe_eval(expr))
    return f"{call.format(expr)}\nTool: {value}\nThe answer is {value}.", value


def auc(scored: list[tuple[float, bool]]) -> float | None:
    """P(a right trajectory scores above a wrong one), ties half: how well the score ranks, whatever threshold."""
    pos = [s for s, t in scored if t]
    neg = [s for s, t in scored if not t]
    if not pos or not neg:
        return None
    return round(sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg)), 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--modes", nargs="+", default=["yes_no", "rating"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--base-url", default=None)
    p.add_argument("--reference", default="answer", help="task key of the reference ('' for none)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens of one verdict")
    p.add_argument("--out", default="runs/judge-agreement")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from agentrl.models.pretrained import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))  # the policy's, to write episodes
    rng = random.Random(0)
    tasks = word_problem_tasks(args.n, seed=7, split="eval")
    kinds = ["right", "right", "guess", "wrong_tool"]
    episodes, truth, kind_of = [], [], []
    for k, task in enumerate(tasks):
        kind = kinds[k % 4]
        text, answer = trajectory(task, kind, rng)
        episodes.append(Episode(task=task, prompt_ids=tokenizer(task["question"])["input_ids"],
                                token_ids=tokenizer(text)["input_ids"], turn_ends=[0], turn_rewards=[0.0]))
        truth.append(numeric_match(task, answer))
        kind_of.append(kind)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes:
        section = JudgeSection(mode=mode, model=args.model, base_url=args.base_url, reference_key=args.reference or None,
                               max_new_tokens=args.max_new_tokens, concurrency=2, timeout=300)
        where = "server" if args.base_url else "local"
        scorer = JudgeScorer(section, tokenizer, out / f"cache-{where}-{mode}-{args.reference or 'noref'}.jsonl")
        row_extra = {"max_new_tokens": args.max_new_tokens}
        eps = [Episode(**{**ep.__dict__, "info": {}, "turn_rewards": [0.0]}) for ep in episodes]
        started = time.time()
        scorer(eps)
        seconds = time.time() - started
        judged = [(ep.score >= 0.5, t, kd) for ep, t, kd in zip(eps, truth, kind_of) if not ep.infra_failure]
        agree = sum(j == t for j, t, _ in judged)
        by_kind = {kd: round(sum(j == t for j, t, k2 in judged if k2 == kd) / max(sum(k2 == kd for *_, k2 in judged), 1),
                             3) for kd in ("right", "guess", "wrong_tool")}
        row = {"backend": where, "mode": mode, "reference": bool(args.reference), "n": len(eps), **row_extra,
               "masked": sum(ep.infra_failure for ep in eps),
               "agreement": round(agree / max(len(judged), 1), 3),
               "says_right_rate": round(sum(j for j, *_ in judged) / max(len(judged), 1), 3),
               "agreement_by_kind": by_kind, "auc": auc([(ep.score, t) for ep, t in zip(eps, truth)
                                                          if not ep.infra_failure]), "seconds": round(seconds, 1), "judge": scorer.summary()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out / "agreement.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
