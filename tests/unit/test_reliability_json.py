"""summary.json and every JSONL a run writes are strict JSON: a non-finite number is written as null."""

import json
import math

from agentrl.checkpoint import strict_json, write_json, write_jsonl
from agentrl.rollout.engine import Episode
from agentrl.samples import SamplesLog
from agentrl.trainers.common import MetricsLog

NAN, INF = float("nan"), float("inf")


def strict_load(text: str):
    """What a strict parser does with NaN / Infinity: refuse them."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth(tmp_path):
    data = {"a": NAN, "b": [INF, 1.5, (-INF, 2)], "c": {"d": {"e": NAN}}, "f": "nan", "g": 3}
    write_json(tmp_path / "summary.json", data)
    assert strict_load((tmp_path / "summary.json").read_text()) == {
        "a": None, "b": [None, 1.5, [None, 2]], "c": {"d": {"e": None}}, "f": "nan", "g": 3}
    write_jsonl(tmp_path / "pairs.jsonl", [data, {"x": NAN}])
    rows = [strict_load(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert rows[1] == {"x": None} and rows[0]["a"] is None
    assert strict_json({"x": (NAN, 1.0)}) == '{"x": [null, 1.0]}'


def test_metrics_rows_are_strict(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"loss": NAN, "kl": INF, "nested": {"x": -INF}, "ok": 0.5}, step=1)
    assert strict_load((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "loss": None, "kl": None, "nested": {"x": None}, "ok": 0.5}


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_samples_of_a_nan_reward_episode_are_strict(tmp_path):
    ep = Episode(task={"question": "q"}, prompt_ids=[81], token_ids=[65, 66], loss_mask=[1, 1],
                 logprobs=[NAN, -0.5], turn_ends=[1], turn_rewards=[NAN], info={"answer": INF})
    SamplesLog(tmp_path / "samples.jsonl", CharTokenizer(), every=1, per_step=1).write(1, [ep])
    row = strict_load((tmp_path / "samples.jsonl").read_text())
    assert row["score"] is None and row["turn_rewards"] == [None] and row["info"] == {"answer": None}
    assert row["logprobs"] == [None, None, -0.5] and not math.isnan(row["logprobs"][2])
