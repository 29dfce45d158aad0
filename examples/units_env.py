"""A new tool-using environment in under 30 lines: convert units with a typed tool function.

    agentrl ppo --config quickstart env.name=examples.units_env:UnitsEnv env.tasks=examples.units_env:units_tasks
"""

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
    return [{"question": f"How many metres is {v} {u}?", "answer": convert(v, u)} for v, u in rows]
