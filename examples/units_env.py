"""A new tool-using environment: convert units with a typed tool function, with demonstrations for SFT.

    agentrl sft --config quickstart env.name=examples.units_env:UnitsEnv env.tasks=examples.units_env:units_tasks \
        env.demonstrations=examples.units_env:units_demonstrations out_dir=runs/units-sft
    agentrl ppo --config quickstart env.name=examples.units_env:UnitsEnv env.tasks=examples.units_env:units_tasks \
        model.base=runs/units-sft/model out_dir=runs/units-ppo
"""

import json
import random

from agentrl.envs import ToolEnv

FACTORS = {"km": 1000.0, "m": 1.0, "cm": 0.01}


def convert(value: float, unit: str) -> str:
    """Convert a length to metres.

    Args:
        value: the amount
        unit: one of km, m, cm
    """
    return f"{value * FACTORS[unit]:g}"


class UnitsEnv(ToolEnv):
    def __init__(self, format: str = "react"):
        super().__init__([convert], check=lambda task, answer: answer.strip() == task["answer"], format=format)


def units_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    rows = [(rng.randint(1, 999), rng.choice(list(FACTORS))) for _ in range(n)]
    return [{"question": f"How many metres is {v} {u}?", "value": v, "unit": u, "answer": convert(v, u)}
            for v, u in rows]


def units_demonstrations(task: dict, rng: random.Random) -> dict:
    """One SFT row, split where the rollout engine splits turns (prompt and observation not trainable).
    40% call the tool; the rest guess with the wrong factor, so RL has to teach *when* the tool pays."""
    prompt = f"Question: {task['question']}\n"
    if rng.random() >= 0.4:
        wrong = rng.choice([u for u in FACTORS if FACTORS[u] != FACTORS[task["unit"]]])
        return {"segments": [[prompt, False], [f"Thought: I know this.\nAnswer: {convert(task['value'], wrong)}", True]]}
    call = json.dumps({"value": task["value"], "unit": task["unit"]})
    return {"segments": [[prompt, False], [f"Thought: I need to convert.\nAction: convert({call})\n", True],
                         [f"Observation: {task['answer']}\n", False], [f"Answer: {task['answer']}", True]]}
