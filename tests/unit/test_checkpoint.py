"""Checkpoint files: round trip without pickle, atomic writes, corruption detected and skipped, no NaN written;
the fail-loud batch checks."""

import json
import random

import numpy as np
import pytest
import torch

from agentrl.checkpoint import (Checkpointer, CheckpointError, NonFiniteError, latest_valid, read_checkpoint,
                                rng_state, set_rng_state, verify, write_checkpoint)
from agentrl.rollout.engine import Episode
from agentrl.trainers.common import TaskCycler, check_batch, episodes_to_batch, logprob_mismatch


def _state(x: float = 1.0) -> dict:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    return {"model": {"w": torch.full((2, 2), x)}, "optimizer": opt.state_dict(), "tuple": (1, (2.5, None)),
            "int_keys": {0: "a", 7: [1, 2]}, "rng": rng_state(), "floats": [0.1, 1e-300, float("nan")]}


def test_round_trip_keeps_tensors_tuples_int_keys_and_rng(tmp_path):
    state = _state()
    write_checkpoint(tmp_path / "step-000001", state, 1)
    back = read_checkpoint(tmp_path / "step-000001")
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["tuple"] == (1, (2.5, None)) and back["int_keys"] == {0: "a", 7: [1, 2]}
    assert back["optimizer"]["param_groups"][0]["betas"] == state["optimizer"]["param_groups"][0]["betas"]
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    torch.optim.Adam([torch.nn.Parameter(torch.ones(3))]).load_state_dict(back["optimizer"])
    assert back["floats"][:2] == [0.1, 1e-300]
    # every RNG continues exactly where it was saved
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(back["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_truncated_or_partial_checkpoint_is_skipped_with_a_message(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        write_checkpoint(root / f"step-{step:06d}", _state(step), step)
    tensors = root / "step-000006" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])  # truncated by hand
    (root / "step-000004" / "manifest.json").unlink()  # a write that never finished
    assert "bytes" in verify(root / "step-000006")
    assert latest_valid(root) == root / "step-000002"
    err = capsys.readouterr().err
    assert "step-000006 is incomplete or corrupted" in err and "using the previous one" in err
    assert "step-000004" in err
    with pytest.raises(CheckpointError, match="unusable"):
        read_checkpoint(root / "step-000006")
    flipped = root / "step-000002" / "state.json"
    flipped.write_text(flipped.read_text().replace("0.1", "0.2"))  # same size, other bytes
    assert "sha256" in verify(root / "step-000002") and latest_valid(root) is None


def test_non_finite_weights_never_reach_a_checkpoint(tmp_path):
    write_checkpoint(tmp_path / "step-000001", {"trainer": _state()}, 1)
    bad = _state(float("nan"))
    with pytest.raises(NonFiniteError, match="non-finite"):
        write_checkpoint(tmp_path / "step-000002", {"trainer": bad}, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]  # nothing half-written, the last good kept


def test_checkpointer_keeps_the_newest_and_stops_on_a_nonfinite_streak(tmp_path):
    class Fake:
        def state_dict(self):
            return {"model": {"w": torch.ones(1)}}

    ck = Checkpointer(tmp_path, every=2, keep=2, max_nonfinite_steps=2)
    for step in range(1, 8):
        ck.after_step(Fake(), step, {}, last=step == 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000007"]
    ck.after_step(Fake(), 8, {"train/skipped_nonfinite": 1.0}, last=False)
    with pytest.raises(NonFiniteError, match=r"step 9: .* 2 steps in a row.*step-000008"):
        ck.after_step(Fake(), 9, {"train/skipped_nonfinite": 2.0}, last=False)


def test_task_cycler_resumes_its_order():
    a = TaskCycler([{"i": i} for i in range(7)], seed=3)
    a.draw(5)
    b = TaskCycler([{"i": i} for i in range(7)], seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())) | {"rng": a.state_dict()["rng"]})
    assert a.draw(20) == b.draw(20)


def _episode() -> Episode:
    return Episode(task={}, prompt_ids=[1, 5, 6], token_ids=[7, 8, 9, 10, 11], loss_mask=[1, 1, 0, 0, 1],
                   logprobs=[-0.5, -1.0, 0.0, 0.0, -2.0], turn_ends=[1, 4], turn_rewards=[0.0, 1.0])


def test_batch_checks_catch_trained_ids_and_masks_that_differ_from_the_rollout():
    episodes = [_episode(), _episode()]
    episodes[1].token_ids = episodes[1].token_ids[:3]
    episodes[1].loss_mask, episodes[1].logprobs, episodes[1].turn_ends = [1, 1, 0], [-0.5, -1.0, 0.0], [1]
    batch = episodes_to_batch(episodes, pad_id=0)
    check_batch(episodes, batch)
    assert batch.logprobs[0].tolist() == [0.0, 0.0, -0.5, -1.0, 0.0, 0.0, -2.0]
    bad = episodes_to_batch(episodes, pad_id=0)
    bad.input_ids[1, 4] = 3
    with pytest.raises(RuntimeError, match="episode 1: the batch trains token id 3 at position 4"):
        check_batch(episodes, bad)
    bad = episodes_to_batch(episodes, pad_id=0)
    bad.loss_mask[0, 4] = 1.0  # an observation token trained
    with pytest.raises(RuntimeError, match="episode 0: loss_mask is 1.0 at position 4"):
        check_batch(episodes, bad)
    bad = episodes_to_batch(episodes, pad_id=0)
    bad.loss_mask[1, 5] = 1.0  # padding trained
    with pytest.raises(RuntimeError, match="episode 1: loss_mask"):
        check_batch(episodes, bad)


def test_logprob_mismatch_is_measured_and_an_error_above_the_threshold():
    sampled = torch.tensor([[-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    stats = logprob_mismatch(sampled + torch.tensor([[1e-6, -3e-6, 5.0]]), sampled, mask, 0.05)
    assert stats["rollout/logprob_mismatch_max"] == pytest.approx(3e-6, rel=0.1)
    assert stats["rollout/logprob_mismatch_mean"] == pytest.approx(2e-6, rel=0.1)
    with pytest.raises(RuntimeError, match="logprob_mismatch_threshold=0.05"):
        logprob_mismatch(sampled * 1.2, sampled, mask, 0.05)  # e.g. logprobs at another temperature


def test_settings_that_cannot_take_effect_are_named_at_start():
    import warnings

    from agentrl.jobs.common import warn_ineffective
    from agentrl.jobs.ppo import load_job

    config = load_job("grpo", ["rollout.top_p=0.9", "grpo.mini_batch_size=128", "model.lora_dropout=0.1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_ineffective(config, "grpo")
    text = "\n".join(str(w.message) for w in caught)
    for key in ("rollout.top_p", "grpo.mini_batch_size", "model.lora_dropout"):
        assert f"config {key}" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_ineffective(load_job("quickstart"), "ppo")  # the shipped configs warn about nothing
    assert not caught


def test_cached_eval_stores_reuses_and_recomputes_for_another_config(tmp_path):
    from agentrl.jobs.run import cached_eval

    calls = []

    def compute():
        calls.append(1)
        return {"greedy": {"accuracy": 0.5 + len(calls)}}

    first = cached_eval(tmp_path, "before", {"seed": 0}, compute)
    assert cached_eval(tmp_path, "before", {"seed": 0}, compute) == first and len(calls) == 1  # stored, reused
    assert cached_eval(tmp_path, "before", {"seed": 1}, compute) != first and len(calls) == 2  # another config
    (tmp_path / "checkpoints" / "eval-before.json").write_text('{"config": ')  # a torn write: computed again
    cached_eval(tmp_path, "before", {"seed": 1}, compute)
    assert len(calls) == 3
