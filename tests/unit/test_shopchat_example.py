"""The second outside environment (examples/shopchat.py): a held-out split by content, demonstrations of which
about half call the tool, and guesses that the environment's check marks wrong."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import shopchat  # noqa: E402


def test_splits_share_no_question_and_demonstrations_teach_the_format_not_the_policy():
    train, held_out = shopchat.shop_tasks(2000), shopchat.shop_tasks(200, split="eval")
    assert not {t["question"] for t in train} & {t["question"] for t in held_out}
    rng = random.Random(0)
    rows = [shopchat.shop_demonstration(task, rng) for task in train[:400]]
    called = [any(m.get("tool_calls") for m in row["messages"]) for row in rows]
    assert 0.4 < sum(called) / len(rows) < 0.6
    for task, row, calls in zip(train, rows, called):
        answer = row["messages"][-1]["content"]
        assert shopchat.right_total(task, answer) == calls, answer


def test_the_tool_prices_an_order_and_names_what_the_shop_sells():
    assert shopchat.order_total("clay pots", 3) == "25.80"
    with pytest.raises(ValueError, match="sells"):
        shopchat.order_total("dragon", 1)
