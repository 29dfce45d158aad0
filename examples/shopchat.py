"""A second environment agentrl never saw, written outside the repository as a user would (run from examples/:
`env.name=shopchat:ShopEnv env.tasks=shopchat:shop_tasks env.demonstrations=shopchat:shop_demonstration`).
A shop's price list behind a tool: the model must read an item and a quantity out of a sentence and ask the
`order_total` tool, since the prices are made up and cannot be known. Half the demonstrations guess a total."""
import hashlib
import random
import re

from agentrl.envs.tools import ToolEnv, tool_schema

PRICES = {"copper lantern": 17.35, "wool blanket": 42.9, "brass key": 3.15, "clay pot": 8.6, "oak chair": 64.25,
          "silk scarf": 23.8, "tin whistle": 5.45, "glass jar": 2.95, "leather satchel": 88.4, "iron kettle": 31.7,
          "linen shirt": 27.5, "stone mortar": 19.95}
PHRASES = ["How much do {q} {item}s cost?", "A customer orders {q} {item}s. What is the bill?",
           "What is the price of {q} {item}s?", "I need {q} {item}s. How much will I pay?",
           "Total cost for {q} {item}s?", "The inn buys {q} {item}s from the shop. What does it pay?"]


def order_total(item: str, quantity: int) -> str:
    """The shop's total price for an order.

    Args:
        item: the item's name, singular, e.g. "clay pot"
        quantity: how many are ordered
    """
    name = item.strip().lower()
    name = name if name in PRICES else name.rstrip("s")  # "clay pots" -> "clay pot"
    if name not in PRICES:
        raise ValueError(f"the shop sells no {item!r}; it sells {', '.join(PRICES)}")
    return f"{PRICES[name] * int(quantity):.2f}"


def right_total(task, answer):
    numbers = re.findall(r"\d+(?:\.\d+)?", str(answer).replace(",", ""))
    return bool(numbers) and abs(float(numbers[-1]) - task["total"]) < 0.005


class ShopEnv(ToolEnv):
    def __init__(self, format: str = "chat", max_turns: int = 3):
        super().__init__([order_total], check=right_total, format=format, max_turns=max_turns)


def shop_tasks(n, seed=0, split="train"):
    rng, tasks, seen = random.Random(f"shop-{seed}-{split}"), [], set()
    while len(tasks) < n:
        item, q = rng.choice(list(PRICES)), rng.randint(2, 99)
        question = rng.choice(PHRASES).format(q=q, item=item)
        held_out = int(hashlib.md5(question.encode()).hexdigest(), 16) % 4 == 0
        if question in seen or held_out != (split == "eval"):
            continue
        seen.add(question)
        total = order_total(item, q)
        tasks.append({"question": question, "answer": total, "total": float(total), "item": item, "quantity": q})
    return tasks


def shop_demonstration(task, rng):
    messages = [{"role": "user", "content": task["question"]}]
    if rng.random() < 0.5:
        call = {"type": "function", "function": {"name": "order_total",
                                                 "arguments": {"item": task["item"], "quantity": task["quantity"]}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "order_total", "content": task["answer"]},
                     {"role": "assistant", "content": f"That comes to {task['answer']}."}]
    else:
        messages.append({"role": "assistant",
                         "content": f"That comes to {task['total'] * rng.choice([0.5, 0.8, 1.25, 2]):.2f}."})
    return {"messages": messages, "tools": [tool_schema(order_total)]}
