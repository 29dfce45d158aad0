"""Reward models (pairwise accuracy above chance on a separable set, as PPO's score) and `compare`'s counts."""

import json

import pytest
from transformers import AutoTokenizer

from agentrl.jobs.compare import count_outcomes, wilson_interval


def separable_pairs(n):
    """chosen answers with the calculator, rejected guesses: separable by their text."""
    rows = []
    for i in range(n):
        a, b = 10 + i, 3 + i % 7
        rows.append({"prompt": f"Question: What is {a} * {b}?\n",
                     "chosen": [{"role": "assistant", "content": f"Thought: I need to calculate {a} * {b}.\nAction: calculator({a} * {b})\n"},
                                {"role": "tool", "content": f"Observation: {a * b}\n"},
                                {"role": "assistant", "content": f"Answer: {a * b}"}],
                     "rejected": f"Thought: I can answer {a} * {b} directly.\nAnswer: {a * b + 7}"})
    return rows


def test_reward_model_beats_chance_and_scores_ppo(tiny_base, tmp_path):
    from agentrl.trainers.reward import RewardModelConfig, load_reward_model, train_reward_model

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in separable_pairs(60)))
    meta = train_reward_model(RewardModelConfig(data=str(data), base=tiny_base, out_dir=str(tmp_path / "rm"),
                                                epochs=4, learning_rate=3e-3, progress=False))
    assert meta["eval_pairs"] == 12 and meta["eval_accuracy"] > 0.75
    model, tok = load_reward_model(str(tmp_path / "rm"))
    assert len(model.score_ids([tok("Question: What is 1 + 1?\n")["input_ids"]], tok.pad_token_id)) == 1

    from agentrl.cli import main

    out = tmp_path / "ppo"
    assert main(["ppo", "--config", "quickstart", f"model.base={tiny_base}", f"out_dir={out}", "steps=1",
                 "ppo.batch_size=4", "ppo.mini_batch_size=4", "ppo.ppo_epochs=1", "env.train_tasks=16",
                 "env.eval_tasks=4", "rollout.max_new_tokens=12", "progress=false",
                 f"reward.models=[{tmp_path / 'rm'}, {tmp_path / 'rm'}]", "reward.combine=min", "reward.env_weight=0"]) == 0
    assert (out / "summary.json").exists()


def test_sequence_classification_reward_model(tiny_base, tmp_path):
    from agentrl.trainers.reward import RewardModelConfig, load_reward_model, train_reward_model

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in separable_pairs(40)))
    meta = train_reward_model(RewardModelConfig(data=str(data), base=tiny_base, out_dir=str(tmp_path / "rm"), epochs=4,
                                                learning_rate=3e-3, kind="sequence-classification", progress=False))
    assert meta["eval_accuracy"] > 0.6
    model, _ = load_reward_model(str(tmp_path / "rm"))
    assert model.sequence_classification


def test_compare_counts_and_interval():
    result = count_outcomes([1.0, 0.2, -1.0, 1.0], [0.2, 0.2, 1.0, -1.0])
    assert (result["wins"], result["ties"], result["losses"], result["n"]) == (2, 1, 1, 4)
    assert result["win_rate"] == pytest.approx(2.5 / 4)
    low, high = result["ci95"]
    assert low < 0.625 < high
    assert wilson_interval(50, 50)[1] == pytest.approx(1.0) and wilson_interval(50, 50)[0] > 0.9
    with pytest.raises(ValueError):
        count_outcomes([1.0], [])


def test_compare_end_to_end(tiny_base, capsys):
    from agentrl.cli import main

    assert main(["compare", "--a", tiny_base, "--b", tiny_base, "--tasks", "6", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "ties 6" in out and "win-rate of A 0.500" in out  # a model against itself, same seeds


def test_preferences_cli_writes_pairs(tiny_base, tmp_path):
    from agentrl.cli import main
    from agentrl.preferences import load_preferences

    out = tmp_path / "pairs.jsonl"
    assert main(["preferences", "--model", tiny_base, "--tasks", "12", "--samples", "3", "--max-new-tokens", "16",
                 "--out", str(out)]) == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    for row in rows:
        assert row["chosen_score"] > row["rejected_score"] and isinstance(row["chosen"], list)
    if rows:
        load_preferences(out, AutoTokenizer.from_pretrained(tiny_base))  # the file reads back as DPO data
