"""`trl.core` of TRL 0.11, under `agentrl.core`: the helpers PPO scripts import, with TRL's semantics.

Scripts written as `from trl.core import LengthSampler, respond_to_batch` run with `agentrl.core`.
These functions keep TRL's exact behaviour (e.g. `masked_mean` of an empty mask is NaN and `masked_var`
raises), which is not always what agentrl's own maths in `agentrl.algos` does (there an empty mask gives 0).
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

WANDB_PADDING = -1  # fills ragged per-mini-batch stats in `stack_dicts`


def top_k_top_p_filtering(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                          filter_value: float = -float("inf"), min_tokens_to_keep: int = 1) -> torch.Tensor:
    """logits (B, V) -> logits with everything outside the top-k / nucleus set to `filter_value`."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    if top_k > 0:
        logits = TopKLogitsWarper(top_k=top_k, filter_value=filter_value, min_tokens_to_keep=min_tokens_to_keep)(
            None, logits)
    if 0 <= top_p <= 1.0:
        logits = TopPLogitsWarper(top_p=top_p, filter_value=filter_value, min_tokens_to_keep=min_tokens_to_keep)(
            None, logits)
    return logits


def flatten_dict(nested: dict, sep: str = "/") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}. A key that contains `sep` is an error."""
    flat: dict = {}

    def walk(node: Mapping, prefix: str) -> None:
        for key, value in node.items():
            if sep in key:
                raise ValueError(f"separator '{sep}' not allowed to be in key '{key}'")
            if isinstance(value, Mapping):
                walk(value, prefix + key + sep)
            else:
                flat[prefix + key] = value

    walk(nested, "")
    return flat


def convert_to_scalar(stats: dict) -> dict:
    """One-element tensors and arrays become Python numbers (trackers such as TensorBoard want scalars)."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and (value.ndim == 0 or value.shape == (1,)):
            value = value.item()
        out[key] = value
    return out


def stack_dicts(stats_dicts: list[dict]) -> dict:
    """Stack each key's (flattened) tensors into (N, L), right-padded with WANDB_PADDING."""
    from torch.nn.utils.rnn import pad_sequence

    return {key: pad_sequence([torch.flatten(d[key]) for d in stats_dicts], batch_first=True,
                              padding_value=WANDB_PADDING) for key in stats_dicts[0]}


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor | None, gather: bool = True) -> torch.Tensor:
    """logits (B, T, V), labels (B, T) -> logprobs (B, T) of the labels; `gather=False`: all (B, T, V)."""
    logp = F.log_softmax(logits, dim=2)
    if not gather:
        return logp
    return torch.gather(logp, 2, labels.unsqueeze(2)).squeeze(-1)


def whiten(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Unit variance (unbiased) over all entries; with `shift_mean`, also mean 0."""
    mean, var = torch.mean(values), torch.var(values)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean over mask-1 entries (NaN for an empty mask, as in TRL)."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over mask-1 entries, Bessel-corrected when `unbiased`; an empty mask is an error."""
    variance = masked_mean((values - masked_mean(values, mask)) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("The sum of the mask is zero, which can happen when `mini_batch_size=1`; "
                             "try increase the `mini_batch_size` or `gradient_accumulation_steps`")
        variance = variance * n / (n - 1)  # n == 1 divides by zero, as in TRL
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten with the masked mean and variance. Masked-out entries are transformed too, not zeroed."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def clip_by_value(x: torch.Tensor, tensor_min, tensor_max) -> torch.Tensor:
    """Element-wise clamp to [tensor_min, tensor_max] where the bounds may be tensors."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> entropy (...) of softmax(logits)."""
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def stats_to_np(stats_dict: dict) -> dict:
    """Tensors -> numpy arrays (bf16 upcast first); numpy scalars -> float."""
    out = {}
    for key, value in stats_dict.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        out[key] = float(value) if np.isscalar(value) else value
    return out


def respond_to_batch(model: torch.nn.Module, queries: torch.Tensor, txt_len: int = 20, top_k: int = 0,
                     top_p: float = 1.0) -> torch.Tensor:
    """Sample `txt_len` tokens after `queries` (B, T) without a KV cache; returns the new ids (B, txt_len).

    `model(ids)[0]` must be the logits, as for a value-head model or a plain LM's output.
    """
    input_ids = queries
    for _ in range(txt_len):
        next_logits = top_k_top_p_filtering(model(input_ids)[0][:, -1, :], top_k=top_k, top_p=top_p)
        next_token = torch.multinomial(F.softmax(next_logits, dim=-1), num_samples=1)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids[:, -txt_len:]


def set_seed(seed: int) -> None:
    """Seed `random`, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class LengthSampler:
    """Draws an int uniformly from [min_value, max_value) with numpy's global RNG (as TRL does)."""

    def __init__(self, min_value: int, max_value: int):
        self.values = list(range(min_value, max_value))

    def __call__(self) -> int:
        return np.random.choice(self.values)


class PPODecorators:
    """`empty_device_cache()`: frees the accelerator cache after a block when `optimize_device_cache` is on."""

    optimize_device_cache = False

    @classmethod
    @contextlib.contextmanager
    def empty_device_cache(cls):
        yield
        if cls.optimize_device_cache and torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
            gc.collect()


def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None) -> torch.Tensor:
    """Standard-normal tensor of `shape`; a list of generators seeds each batch row separately."""
    device = torch.device(device or "cpu")
    layout = layout or torch.strided
    if isinstance(generator, list) and len(generator) == 1:
        generator = generator[0]
    if isinstance(generator, list):
        rows = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype, layout=layout)
                for g in generator]
        return torch.cat(rows).to(device)
    rand_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=rand_device, dtype=dtype, layout=layout).to(device)
