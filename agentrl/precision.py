"""Which mixed precision the hardware runs natively: `mixed_precision: auto`.

bf16 autocast pays only where the matrix units take bf16: CUDA GPUs from Ampere on, and CPUs with AVX512-BF16 or
AMX (oneDNN's bf16 kernels). Elsewhere PyTorch emulates it: on an AVX2-only CPU a bf16 matmul runs at about 1/80
of the float32 rate (docs/real-model.md), so a recipe written for one machine would crawl on another. "auto"
takes bf16 where it is native and float32 ("no") where it is not; an explicit "bf16" is kept, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch


@functools.cache
def native_bf16(device_type: str) -> bool:
    """True where bf16 matrix products run on the hardware's own bf16 units."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return torch.cpu._is_avx512_bf16_supported()
    return False


def resolve_mixed_precision(value: str | None, device_type: str | None = None) -> str:
    """"auto" -> "bf16" where native on `device_type` (default: CUDA when available, else the CPU), else "no".
    Any other value is returned as it is; "bf16" where it is emulated warns once."""
    value = value or "no"
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if value == "auto":
        return "bf16" if native_bf16(device_type) else "no"
    if value == "bf16" and not native_bf16(device_type):
        _warn_emulated(device_type)
    return value


@functools.cache
def _warn_emulated(device_type: str) -> None:
    warnings.warn(f"mixed_precision bf16: this {device_type.upper()} has no native bf16 (no AVX512-BF16 or AMX on "
                  f"a CPU), so PyTorch emulates it, many times slower than float32; set mixed_precision: auto (bf16 "
                  f"only where native) or no", stacklevel=3)


@contextlib.contextmanager
def frozen_casts_cached(model: torch.nn.Module | None):
    """Inside an autocast region of the model's device: a no-grad block in which the lower-precision cast of each
    frozen float32 parameter is made once and reused, instead of once per call.

    Autocast keeps the casts it makes only for parameters that require grad (torch's heuristic: those are the
    ones being trained). Under LoRA the backbone is frozen, so a rollout that decodes token by token re-cast the
    whole backbone's weights at every step: reading 4 bytes and writing 2 per parameter each time, a large share
    of a small-batch decoding step on a CPU. Marking the frozen parameters as requiring grad for the duration of
    a block with no autograd lets autocast cache their casts until its context ends. The values are the same
    casts, so the results are identical. Parameters sharded or managed by FSDP / DeepSpeed are left alone.
    Outside autocast (or without a model: a rollout whose sampler is another engine's) this only enters no_grad."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    frozen = []
    if params and torch.is_autocast_enabled(params[0].device.type) and torch.is_autocast_cache_enabled():
        frozen = [p for p in params if not p.requires_grad and p.dtype == torch.float32
                  and type(p) is torch.nn.Parameter and not hasattr(p, "ds_id")]
    with torch.no_grad():
        try:
            for p in frozen:
                p.requires_grad_(True)
            yield
        finally:
            for p in frozen:
                p.requires_grad_(False)
