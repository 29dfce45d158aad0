"""`mixed_precision: auto`: bf16 only where the hardware runs it natively (agentrl/precision.py)."""

import warnings

import pytest

from agentrl.precision import native_bf16, resolve_mixed_precision


def test_auto_is_bf16_exactly_where_it_is_native():
    assert resolve_mixed_precision("auto", "cpu") == ("bf16" if native_bf16("cpu") else "no")
    assert resolve_mixed_precision("no", "cpu") == "no" and resolve_mixed_precision(None, "cpu") == "no"


@pytest.mark.skipif(native_bf16("cpu"), reason="this CPU runs bf16 natively: nothing to warn about")
def test_explicit_bf16_on_a_cpu_that_emulates_it_is_kept_with_a_warning():
    from agentrl.precision import _warn_emulated

    _warn_emulated.cache_clear()
    with pytest.warns(UserWarning, match="no native bf16.*mixed_precision: auto"):
        assert resolve_mixed_precision("bf16", "cpu") == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        resolve_mixed_precision("bf16", "cpu")


def test_the_real_model_config_resolves_auto_for_every_trainer_section():
    from agentrl.jobs.ppo import load_job

    job = load_job("real", [])
    expected = "bf16" if native_bf16("cpu") else "no"
    assert job.ppo.mixed_precision == job.grpo.mixed_precision == job.sft.mixed_precision == expected
    assert load_job("real", ["ppo.mixed_precision=no"]).ppo.mixed_precision == "no"


def test_a_trainer_accelerator_resolves_auto():
    from accelerate.state import AcceleratorState

    from agentrl.distributed import make_accelerator

    # accelerate keeps one state a process: an earlier test's fp32 accelerator would refuse bf16 on a bf16 CPU
    AcceleratorState._reset_state(True)
    try:
        precision = make_accelerator(mixed_precision="auto").mixed_precision
    finally:
        AcceleratorState._reset_state(True)
    assert precision == ("bf16" if native_bf16("cpu") else "no")


def test_the_ppo_and_grpo_commands_resolve_auto_too():
    """`agentrl ppo/grpo --config real` load through the CLI: their `before` is looked up by the resolved precision,
    under which the SFT job stored its evaluation (with "auto" left in, the lookup missed and the 200 held-out
    tasks were evaluated again)."""
    from types import SimpleNamespace

    from agentrl.cli import _training_job
    from agentrl.jobs.ppo import JobConfig, resolve_precisions

    expected = "bf16" if native_bf16("cpu") else "no"
    for algo in ("ppo", "grpo"):
        job = _training_job(SimpleNamespace(config="real", overrides=[]), algo)
        assert job.algo == algo and getattr(job, algo).mixed_precision == expected
    by_hand = JobConfig()
    by_hand.ppo.mixed_precision = "auto"  # a config built in code, handed to run_job: resolved there
    assert resolve_precisions(by_hand).ppo.mixed_precision == expected
