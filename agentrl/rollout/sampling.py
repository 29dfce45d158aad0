"""Batched sampling with the KV cache that keeps the exact sampled ids and their logprobs.

Written by hand rather than through `model.generate` because the rollout needs, per row, its own stop
pattern (a regex on the text of this turn), the logprob of each sampled token under the *tempered full*
distribution (what PPO recomputes later), and nothing re-tokenized. top-k / top-p only shape sampling.
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from agentrl.checkpoint import NonFiniteError


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    min_new_tokens: int = 0  # EOS is suppressed before this many tokens
    # Context budgets of a rollout (rollout/engine.py): tokens an episode may hold, prompt included (None: the
    # model's max_position_embeddings), and tokens one observation may add (None: what the context has left).
    max_context: int | None = None
    max_observation_tokens: int | None = None
    # Later turns run only their new tokens on the KV cache of the earlier ones (sample_batch(kv=...)) instead of
    # re-prefilling prompt and history; False re-prefills (the same numbers up to float rounding; a benchmark's
    # switch, benchmarks/levers.py --no-kv-reuse).
    reuse_kv: bool = True
    # The tokens every first-turn context begins with (a system message, tool schemas) are prefilled once and their
    # KV cache copied to each row, as vLLM's prefix caching does. The same numbers up to float rounding, which is
    # enough to change what a seeded run samples, so it is off unless asked for (rollout.share_prefix).
    share_prefix: bool = False
    # Rows whose turn has ended leave the decoding batch (once a quarter of it has), instead of being fed padding
    # until the longest row of the batch is done: an agent's batch of short answers and a few long tool calls pays
    # for the long ones alone. The random draws stay those of the full batch (sample_rows), but the smaller batch's
    # products round differently, so seeded runs sample differently with it on (rollout.compact).
    compact: bool = False


@dataclass
class Sample:
    ids: list[int]  # sampled token ids, EOS included when sampled
    logprobs: list[float]  # log pi(id | prefix) under logits / temperature
    finish: str  # "eos", "stop" (a stop pattern matched), "length" (max_new_tokens) or "context" (room, below)
    values: list[float] | None = None  # value_head's value at the position predicting each id (PPO), if asked


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache`; older models and releases keep the old name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (logits of the last positions only)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


_INDEX_KEEP_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def index_logits_to_keep(model: torch.nn.Module, device) -> bool:
    """Whether the causal LM takes `logits_to_keep` as a 1-D tensor of positions (transformers' own models do;
    remote-code ones may take only an int), checked once per model on a one-token forward.

    Why it matters: `logits_to_keep=1` runs the head on `hidden[:, -1:]`, a non-contiguous slice, which torch
    multiplies by a frozen (V, H) weight as a batched matmul that reads the whole weight once per row. At
    V = 151,936 (Qwen) one such call on 16 rows took 570 ms against 103 ms for the same rows indexed out
    contiguously (one thread); a DPO step of 16 pairs spent 3.3 of its 13 s there. An empty index gives no
    logits at all (the trainers' fast paths read hidden states: trainers/common._no_logits)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base not in _INDEX_KEEP_OK:  # the signature too is read once per model: this runs on every fast forward
        ok = keeps_logits(model)
        if ok:
            one = torch.zeros((1, 2), dtype=torch.long, device=device)
            with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
                try:
                    out = base(input_ids=one, attention_mask=torch.ones_like(one),
                               logits_to_keep=torch.tensor([1], dtype=torch.long, device=device))
                    ok = tuple(out.logits.shape[:2]) == (1, 1)
                except Exception:  # noqa: BLE001 - any failure means: use the int form
                    ok = False
        _INDEX_KEEP_OK[base] = ok
    return _INDEX_KEEP_OK[base]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, identical for left padding (sampling) and right padding."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _left_pad(contexts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c):] = 1
    return ids.to(device), mask.to(device)


@dataclass
class KVState:
    """The KV cache a multi-turn rollout carries from one turn to the next (`sample_batch(kv=...)`): each row's
    tokens so far, except its last sampled token (never fed), with holes (mask 0) where a row waited."""

    cache: DynamicCache | None = None
    attention_mask: torch.Tensor | None = None  # (B, L) 1 on the real tokens in the cache

    def select(self, rows: list[int]) -> None:
        """Keep rows `rows` (the episodes still running), in that order."""
        index = torch.tensor(rows, device=self.attention_mask.device)
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]


def _forward_kwargs(model, hidden_states: bool) -> dict:
    """The sampler's forward kwargs. Logits of the last position only: the others are never read (a (B, T, V)
    block saved). Kept as logits_to_keep=1, not a position index (index_logits_to_keep), although at a 152 K
    vocabulary that costs a batched matmul over the whole head per row: the index gives logits that differ by
    float rounding (up to 3e-6), enough to change which tokens a seeded run samples (docs/throughput.md)."""
    extra = {"logits_to_keep": 1} if keeps_logits(model) else {}
    if hidden_states:  # the value head reads the last hidden state
        extra["output_hidden_states"] = True
    return extra


# The shortest common prefix worth a forward of its own (share_prefix): below it the extra call costs more.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(contexts: list[list[int]]) -> int:
    """The tokens every context begins with, leaving each at least one token of its own (whose logits start it)."""
    first, n = contexts[0], max(0, min(len(c) for c in contexts) - 1)
    for c in contexts[1:]:
        n = next((k for k in range(n) if c[k] != first[k]), n)
    return n


def _prefill(model, contexts: list[list[int]], pad_token_id: int, kv: KVState | None, extra: dict,
             share_prefix: bool = False):
    """The first forward of sample_batch: the contexts left-padded (or, with a cache in `kv`, only each row's new
    tokens on top of it). Identical contexts (GRPO's num_generations copies of a prompt) are prefilled once; their
    KV cache is then copied to every row that shares it. share_prefix: the tokens all distinct contexts begin
    with (a system message and tool schemas) are prefilled once too, as a cache the rest of each row runs on.
    Returns (cache, attention_mask, positions, last_logits, last_hidden or None), each per row."""
    if kv is not None and kv.cache is not None:
        return _forward_on(model, contexts, pad_token_id, kv.cache, kv.attention_mask, extra)
    distinct: dict[tuple, int] = {}
    row_of = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]
    unique, cache, cache_mask = [list(c) for c in distinct], DynamicCache(), None
    shared = shared_prefix_length(unique) if share_prefix and len(unique) > 1 else 0
    if shared >= MIN_SHARED_PREFIX:
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([unique[0][:shared]], device=device), use_cache=True,
              **{cache_kwarg(model): cache}, **{k: v for k, v in extra.items() if k != "output_hidden_states"})
        shared = shared if cache.get_seq_length() == shared else 0  # a model that keeps no cache: prefill it all
    if shared >= MIN_SHARED_PREFIX:
        cache.batch_repeat_interleave(len(unique))
        cache_mask = torch.ones((len(unique), shared), dtype=torch.long, device=device)
        unique = [c[shared:] for c in unique]
    cache, attention_mask, positions, last_logits, last_hidden = _forward_on(model, unique, pad_token_id, cache,
                                                                             cache_mask, extra)
    if len(unique) < len(contexts):
        rows = torch.tensor(row_of, device=attention_mask.device)
        cache.batch_select_indices(rows)
        attention_mask, positions, last_logits = attention_mask[rows], positions[rows], last_logits[rows]
        last_hidden = last_hidden[rows] if last_hidden is not None else None
    return cache, attention_mask, positions, last_logits, last_hidden


def _forward_on(model, contexts: list[list[int]], pad_token_id: int, cache, cache_mask: torch.Tensor | None,
                extra: dict):
    """The contexts left-padded, run on `cache` (empty, or holding each row's earlier tokens under cache_mask):
    the new tokens continue each row's positions, and the mask covers the cache, then them."""
    input_ids, attention_mask = _left_pad(contexts, pad_token_id, next(model.parameters()).device)
    positions = position_ids(attention_mask)
    if cache_mask is not None:
        positions = positions + cache_mask.sum(-1, keepdim=True)
        attention_mask = torch.cat([cache_mask, attention_mask], dim=1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                use_cache=True, **{cache_kwarg(model): cache}, **extra)
    last_hidden = out.hidden_states[-1][:, -1] if "output_hidden_states" in extra else None
    return cache, attention_mask, positions, out.logits[:, -1], last_hidden


def _finish(ids: list[int], eos_token_id: int, compiled: list, tokenizer, room: int | None) -> str | None:
    """Why a row's turn ends after its newest token ("eos", "stop": a stop pattern in its text, "context": its
    positions are used up), or None while it goes on."""
    if ids[-1] == eos_token_id:
        return "eos"
    if compiled and any(p.search(tokenizer.decode(ids)) for p in compiled):
        return "stop"
    if room is not None and len(ids) >= room:
        return "context"
    return None


@torch.no_grad()  # sampling builds no graph: with LoRA weights that require grad, every step's activations and
# KV tensors would be kept for a backward that never comes (18 GB at SmolLM2-135M, 16 episodes)
def sample_batch(
    model: torch.nn.Module,
    contexts: list[list[int]],
    params: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    tokenizer=None,
    stop_patterns: tuple[str, ...] = (),
    generator: torch.Generator | None = None,
    value_head: torch.nn.Module | None = None,
    kv: KVState | None = None,
    room: list[int] | None = None,
) -> list[Sample]:
    """Continue each context until EOS, a stop pattern in this turn's text, or `max_new_tokens`.

    contexts: B lists of token ids (left-padded here). Stop patterns need `tokenizer` to decode.
    value_head: PPO's value head, read on the last hidden state that predicts each sampled token, so the
    trainer needs no separate forward for the values of the rollout (`Sample.values`).
    kv: with a cache in it, `contexts` are only each row's new tokens (its last sampled token, then what the
    environment appended), run on top of that cache instead of re-prefilling the whole context; either way
    the cache of this call is left in it for the next turn.
    room: per row, the most tokens it may sample before its context is full (finish "context"), if fewer
    than max_new_tokens.
    """
    if not contexts:
        return []
    device = next(model.parameters()).device
    compiled = [re.compile(p) for p in stop_patterns]
    if compiled and tokenizer is None:
        raise ValueError("stop_patterns need a tokenizer to decode the turn text")
    warpers = [TopKLogitsWarper(int(params.top_k))] if params.top_k and params.top_k > 0 else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
    extra = _forward_kwargs(model, value_head is not None)
    cache, attention_mask, positions, last_logits, last_hidden = _prefill(model, contexts, pad_token_id, kv, extra,
                                                                          params.share_prefix)
    samples = [Sample([], [], "length", [] if value_head is not None else None) for _ in contexts]
    rows = list(range(len(contexts)))  # the context of each row of the decoding batch (all, unless params.compact)
    active = torch.ones(len(contexts), dtype=torch.bool, device=device)  # per row of the batch: still sampling
    parked: dict[int, tuple] = {}  # context -> its KV and mask, for rows that left the batch (params.compact)
    cache_kw = cache_kwarg(model)
    next_pos = positions[:, -1:] + 1
    for n_new in range(params.max_new_tokens):
        if not torch.isfinite(last_logits).all():  # else a NaN from multinomial, or argmax picking garbage
            raise NonFiniteError("sampling: the model's logits hold NaN or inf, so its weights have diverged (a "
                                 "learning rate too large?); lower it, or resume from an earlier checkpoint")
        logits = last_logits.float() / params.temperature  # (B, V)
        if n_new < params.min_new_tokens:
            logits[:, eos_token_id] = float("-inf")
        logprobs_all = torch.log_softmax(logits, dim=-1)  # before top-k / top-p shape the draw
        tokens = _draw(logits, params, warpers, rows, len(contexts), generator)
        token_logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
        # One device-to-host copy per step, not one per row.
        token_list, logprob_list = tokens.tolist(), token_logprobs.tolist()
        value_list = None
        if value_head is not None:  # (B,) values of the positions that predict these tokens
            value_list = value_head(last_hidden.to(value_head.summary.weight.device)).float().tolist()
        for j in torch.nonzero(active).flatten().tolist():
            i = rows[j]
            _append(samples[i], token_list[j], logprob_list[j], None if value_list is None else value_list[j])
            finish = _finish(samples[i].ids, eos_token_id, compiled, tokenizer, None if room is None else room[i])
            active[j] = finish is None
            samples[i].finish = finish or "length"
        if not active.any() or n_new == params.max_new_tokens - 1:  # the last tokens are not fed: nothing reads it
            break
        if params.compact and int(active.sum()) <= COMPACT_BELOW * len(rows):
            rows, (attention_mask, next_pos, tokens, active, last_hidden) = _shed(
                cache, rows, active, (attention_mask, next_pos, tokens, active, last_hidden),
                parked if kv is not None else None)
        tokens = torch.where(active, tokens, torch.full_like(tokens, pad_token_id))
        attention_mask = torch.cat([attention_mask, active.long()[:, None]], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_pos,
                    use_cache=True, **{cache_kw: cache}, **extra)
        last_logits, last_hidden = out.logits[:, -1], out.hidden_states[-1][:, -1] if value_head is not None else None
        next_pos = next_pos + 1
    if kv is not None:  # a model that keeps no cache in it (a scripted test policy) re-prefills every turn
        filled = cache.get_seq_length() == attention_mask.shape[1]
        if filled and parked:
            cache, attention_mask = _unpark(cache, attention_mask, rows, parked)
        kv.cache, kv.attention_mask = (cache, attention_mask) if filled else (None, None)
    return samples


def _draw(logits: torch.Tensor, params: SamplingParams, warpers: list, rows: list[int], n: int,
          generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row from its tempered logits (B, V): sampled after top-k / top-p (params.compact:
    with each context's own draws, sample_rows), or the argmax when not sampling."""
    if not params.do_sample:
        return logits.argmax(-1)
    for w in warpers:
        logits = w(None, logits)
    probs = torch.softmax(logits, -1)
    if params.compact:
        return sample_rows(probs, rows, n, generator)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _append(sample: Sample, token: int, logprob: float, value: float | None) -> None:
    sample.ids.append(token)
    sample.logprobs.append(logprob)
    if value is not None:
        sample.values.append(value)


def _shed(cache: DynamicCache, rows: list[int], active: torch.Tensor, tensors: tuple, parked: dict | None):
    """Drop the finished rows from the decoding batch (params.compact): from `cache` in place, and from `tensors`
    (per-row tensors, the attention mask first; None passes through). With `parked`, the next turn runs on every
    row's cache, so each leaver's KV and mask are kept there by context. Returns (rows, tensors) of those left."""
    keep = torch.nonzero(active).flatten()
    if parked is not None:
        for j in torch.nonzero(~active).flatten().tolist():
            parked[rows[j]] = ([(layer.keys[j], layer.values[j]) for layer in cache.layers], tensors[0][j])
    cache.batch_select_indices(keep)
    return [rows[j] for j in keep.tolist()], tuple(None if t is None else t[keep] for t in tensors)


# params.compact: the decoding batch sheds its finished rows once this share of them or fewer still sample (each
# shedding copies the KV cache, so not at every finished row).
COMPACT_BELOW = 0.75


def sample_rows(probs: torch.Tensor, rows: list[int], n: int, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` (R, V), for contexts `rows` of a batch of `n`: argmax(probs / E) with E
    exponential noise drawn for all n contexts and read at `rows`, so each context gets the random numbers it gets
    in the full batch, whichever rows have left it (torch.multinomial draws one token per row the same way)."""
    noise = torch.empty((n, probs.shape[-1]), dtype=probs.dtype, device=probs.device).exponential_(generator=generator)
    return (probs / noise[torch.tensor(rows, device=probs.device)]).argmax(-1)


def _unpark(cache: DynamicCache, attention_mask: torch.Tensor, rows: list[int], parked: dict[int, tuple]):
    """The decoding batch's cache and mask with the rows that left it put back, in context order: a row that
    left early is padded on the right with zeros under mask 0, as the rows that wait are while others sample."""
    n, width = len(rows) + len(parked), attention_mask.shape[1]
    order = rows + sorted(parked)
    layers = []
    for li, layer in enumerate(cache.layers):
        keys, values = [layer.keys], [layer.values]
        for i in sorted(parked):
            k, v = parked[i][0][li]
            pad = (0, 0, 0, width - k.shape[-2])  # (heads, length, dim): zeros after its last position
            keys.append(torch.nn.functional.pad(k, pad)[None])
            values.append(torch.nn.functional.pad(v, pad)[None])
        layers.append((torch.cat(keys), torch.cat(values)))
    masks = [attention_mask] + [torch.nn.functional.pad(parked[i][1], (0, width - parked[i][1].shape[0]))[None]
                                for i in sorted(parked)]
    back = torch.tensor(sorted(range(n), key=lambda r: order[r]), device=attention_mask.device)  # context order
    full = DynamicCache(ddp_cache_data=[(k[back], v[back]) for k, v in layers])
    return full, torch.cat(masks)[back]
