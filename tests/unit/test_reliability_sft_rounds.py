"""The embedded builder trains on past sft.steps while the model reproduces fewer than sft.min_demo_exact_match of
its demonstrations, up to a bound, and then warns naming demo_exact_match and what to change; a model that reaches
it in sft.steps trains exactly as before (one call of sft.steps, nothing more)."""

import warnings

import pytest

from agentrl.jobs import base_model
from agentrl.trainers.sft import SFTConfig, SFTTrainer


class FakeTrainer:
    model, examples, steps_done = None, [], 0

    class tokenizer:
        pad_token_id = 0

    def __init__(self):
        self.calls = []

    def train(self, metrics_path=None, steps=None):
        self.calls.append(steps)
        self.steps_done += steps


def rounds_with(monkeypatch, matches, ceiling=1.0, **sft):
    """train_until_reproduced after sft.steps (already trained), with demo_exact_match reading `matches` in turn."""
    trainer, it = FakeTrainer(), iter(matches)
    trainer.steps_done = SFTConfig(**sft).steps
    monkeypatch.setattr(base_model, "demonstration_accuracy", lambda *a: next(it))
    monkeypatch.setattr(base_model, "reproducible_fraction", lambda *a: ceiling)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rounds = base_model.train_until_reproduced(trainer, SFTConfig(**sft), "demos")
    return trainer, rounds, [str(w.message) for w in caught]


def test_reproduced_at_the_configured_steps_trains_no_further(monkeypatch):
    trainer, rounds, warned = rounds_with(monkeypatch, [0.95], steps=600)
    assert trainer.calls == [] and rounds == {600: 0.95} and warned == []


def test_short_of_it_trains_more_rounds_until_reproduced(monkeypatch):
    trainer, rounds, warned = rounds_with(monkeypatch, [0.27, 0.6, 0.92], steps=600)
    assert trainer.calls == [600, 600] and rounds == {600: 0.27, 1200: 0.6, 1800: 0.92} and warned == []


def test_the_bound_stops_it_with_a_warning_that_says_what_to_change(monkeypatch):
    trainer, _, warned = rounds_with(monkeypatch, [0.1, 0.2, 0.3, 0.4, 0.5], steps=100, max_steps=250)
    assert trainer.calls == [100, 50] and trainer.steps_done == 250
    assert len(warned) == 1 and "demo_exact_match" in warned[0] and "sft.max_steps (now 250)" in warned[0]


def test_a_round_that_gains_nothing_stops_it(monkeypatch):
    # Demonstrations random by design (a scripted player's coin flips) plateau below any threshold.
    trainer, _, warned = rounds_with(monkeypatch, [0.4, 0.41], steps=100)
    assert trainer.calls == [100] and "gained less than" in warned[0]


def test_demonstrations_random_by_design_are_held_to_what_can_be_reproduced(monkeypatch):
    # A coin flip for calling the tool, a guessed number: no model reproduces those rows (README's units example).
    trainer, _, warned = rounds_with(monkeypatch, [0.1], ceiling=0.1, steps=100)
    assert trainer.calls == [] and warned == []
    trainer, _, warned = rounds_with(monkeypatch, [0.1, 0.5], ceiling=0.5, steps=100)
    assert trainer.calls == [100] and warned == []


def test_reproducible_fraction_by_hand():
    def row(prompt, *trained):
        return [*prompt, *trained], [-100] * len(prompt) + list(trained)

    # Prompt (7, 8) is always answered (1, 2); prompt (9, 9) by (1, 2) or (1, 3): its rows are a coin flip.
    examples = [row((7, 8), 1, 2), row((7, 8), 1, 2), row((9, 9), 1, 2), row((9, 9), 1, 3)]
    assert base_model.reproducible_fraction(examples, examples) == 2 / 4
    assert base_model.reproducible_fraction(examples, examples[:1]) == 1.0


def test_off(monkeypatch):
    trainer, _, warned = rounds_with(monkeypatch, [0.1], steps=100, min_demo_exact_match=0.0)
    assert trainer.calls == [] and warned == []


@pytest.mark.parametrize("field, value", [("min_demo_exact_match", 1.5), ("min_demo_exact_match", float("nan")),
                                          ("max_steps", 0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        SFTConfig(**{field: value})


def test_a_second_train_call_goes_on_where_the_first_stopped(tmp_path):
    from agentrl.models.tiny import BaseModelConfig, build_tokenizer, tiny_llama

    rows = [{"segments": [[f"Say {w}:\n", False], [w, True]]} for w in ("alpha", "beta", "gamma", "delta")]
    tok = build_tokenizer(["Say alpha:\nalpha Say beta:\nbeta gamma delta"] * 20, 300)
    model = tiny_llama(BaseModelConfig(hidden_size=16, intermediate_size=32), tok)
    trainer = SFTTrainer(model, SFTConfig(steps=3, batch_size=2, logging_steps=1, warmup_steps=1, progress=False),
                         rows, tok)
    metrics = tmp_path / "metrics.jsonl"
    trainer.train(str(metrics))
    trainer.train(steps=2)
    assert [row["step"] for row in trainer.history] == [1, 2, 3, 4, 5] and trainer.steps_done == 5
    assert len(metrics.read_text().splitlines()) == 5  # one file, rows numbered on
    assert trainer.history[3]["learning_rate"] > trainer.history[2]["learning_rate"]  # a warm restart
