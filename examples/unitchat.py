"""An environment agentrl never saw, written as a user would: unit conversion questions in words, answered
through a `convert` tool in the model's chat format. Half the demonstrations call the tool, half guess."""
import hashlib
import random
import re

from agentrl.envs.tools import ToolEnv, tool_schema

UNITS = {  # spoken name: (code, quantity, factor to the base unit)
    "millimeters": ("mm", "length", 0.001), "centimeters": ("cm", "length", 0.01), "meters": ("m", "length", 1.0),
    "kilometers": ("km", "length", 1000.0), "inches": ("in", "length", 0.0254), "feet": ("ft", "length", 0.3048),
    "miles": ("mi", "length", 1609.344), "grams": ("g", "mass", 0.001), "kilograms": ("kg", "mass", 1.0),
    "pounds": ("lb", "mass", 0.45359237), "ounces": ("oz", "mass", 0.028349523125),
    "seconds": ("s", "time", 1.0), "minutes": ("min", "time", 60.0), "hours": ("h", "time", 3600.0),
    "days": ("d", "time", 86400.0)}
CODES = {code: (q, f) for code, q, f in UNITS.values()}
PHRASES = ["How many {to} are in {v} {frm}?", "Convert {v} {frm} to {to}.", "What is {v} {frm} in {to}?",
           "A reading says {v} {frm}. How much is that in {to}?", "{v} {frm} is how many {to}?"]


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a quantity from one unit to another.

    Args:
        value: the number to convert
        from_unit: the code of the unit it is in: mm, cm, m, km, in, ft, mi, g, kg, lb, oz, s, min, h, d
        to_unit: the code of the unit to convert to (same list)
    """
    if from_unit not in CODES or to_unit not in CODES:
        raise ValueError(f"unknown unit code; use one of {', '.join(CODES)}")
    if CODES[from_unit][0] != CODES[to_unit][0]:
        raise ValueError("the two units measure different things")
    return f"{float(value) * CODES[from_unit][1] / CODES[to_unit][1]:.6g}"


def close(task, answer):
    """The last number in the answer, within 0.1% of the converted value."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", str(answer).replace(",", ""))
    return bool(numbers) and abs(float(numbers[-1]) - task["value_out"]) <= 1e-3 * max(1.0, abs(task["value_out"]))


class UnitChatEnv(ToolEnv):
    def __init__(self, format: str = "chat", max_turns: int = 3):
        super().__init__([convert], check=close, format=format, max_turns=max_turns)


def unit_tasks(n, seed=0, split="train"):
    rng, tasks, names, seen = random.Random(f"unit-chat-{seed}-{split}"), [], list(UNITS), set()
    while len(tasks) < n:
        frm = rng.choice(names)
        to = rng.choice([u for u in names if UNITS[u][1] == UNITS[frm][1] and u != frm])
        v = rng.choice([rng.randint(2, 999), round(rng.uniform(1, 99), 1)])
        q = rng.choice(PHRASES).format(v=v, frm=frm, to=to)
        if q in seen or (int(hashlib.sha256(q.encode()).hexdigest(), 16) % 4 == 0) != (split == "eval"):
            continue
        seen.add(q)
        out = convert(v, UNITS[frm][0], UNITS[to][0])
        tasks.append({"question": q, "answer": out, "value_out": float(out), "value": v,
                      "from": UNITS[frm][0], "to": UNITS[to][0]})
    return tasks


def unit_demonstration(task, rng):
    messages = [{"role": "user", "content": task["question"]}]
    if rng.random() < 0.5:
        args = {"value": task["value"], "from_unit": task["from"], "to_unit": task["to"]}
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": "convert", "arguments": args}}]},
                     {"role": "tool", "name": "convert", "content": task["answer"]},
                     {"role": "assistant", "content": f"The answer is {task['answer']}."}]
    else:
        guess = f"{task['value_out'] * rng.choice([0.1, 0.5, 2, 3, 10]):.4g}"
        messages.append({"role": "assistant", "content": f"I believe it is {guess}."})
    return {"messages": messages, "tools": [tool_schema(convert)]}
