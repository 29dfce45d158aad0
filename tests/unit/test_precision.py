"""`mixed_precision: auto`: bf16 only where the hardware runs it natively (agentrl/precision.py)."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Casts(TorchDispatchMode):
    """Counts the float32 -> bf16 copies of whole weight matrices (autocast's casts of parameters)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                and tuple(args[0].shape) in self.shapes):
            self.count += 1
        return func(*args, **kwargs)


def test_frozen_casts_cached_casts_each_frozen_weight_once_with_the_same_results(tiny_base):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agentrl.precision import frozen_casts_cached

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"])).eval()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    weights = {tuple(p.shape) for p in frozen if p.dim() == 2}
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))

    def two_forwards(cached: bool):
        casts = _Casts(weights)
        with torch.autocast("cpu", dtype=torch.bfloat16), casts:
            if cached:
                with frozen_casts_cached(model):
                    assert not torch.is_grad_enabled()
                    logits = [model(input_ids=ids).logits for _ in range(2)]
            else:
                with torch.no_grad():
                    logits = [model(input_ids=ids).logits for _ in range(2)]
        return logits, casts.count

    plain, per_call = two_forwards(False)
    cached, once = two_forwards(True)
    assert per_call > 0 and once * 2 == per_call  # the second forward re-cast nothing
    assert all(torch.equal(a, b) for a, b in zip(plain, cached))  # the same casts, so the same numbers
    assert all(not p.requires_grad for p in frozen)  # frozen again afterwards
    assert any(p.requires_grad for p in model.parameters())  # the adapter was never touched
    with pytest.raises(RuntimeError, match="inside"), torch.autocast("cpu", dtype=torch.bfloat16):
        with frozen_casts_cached(model):
            raise RuntimeError("inside")
    assert all(not p.requires_grad for p in frozen)  # and after an error too
    with frozen_casts_cached(None):  # a rollout sampled by another engine passes no model of ours
        assert not torch.is_grad_enabled()
