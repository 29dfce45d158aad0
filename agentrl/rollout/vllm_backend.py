"""The vLLM rollout backend (`rollout.backend: vllm`): a vLLM engine in the training process samples the turns,
the rollout engine (engine.py) keeps running the episodes, so the Episode contract is the hf backend's.

Token-in-token-out: each turn's context goes to vLLM as token ids and the sampled ids come back as ids, with
the logprob of each under the tempered distribution (vLLM's `processed_logprobs`; with top_k/top_p, the
truncated one that was really sampled from). Nothing is detokenized and re-encoded.

Stopping is the hf sampler's, exactly: vLLM stops only on the tokenizer's EOS (`ignore_eos` + `stop_token_ids`,
so a model's extra generation-config EOS ids do not end a turn the hf backend would continue), and the
environment's stop patterns (regexes, which vLLM's literal stop strings cannot express) are applied afterwards:
a turn is cut after the first token whose decoded prefix matches. Each token was sampled given only the tokens
before it, so the kept tokens have exactly the distribution of a sampler that stopped there; the cost is the
tokens vLLM wrote past the match.

Weights: before each rollout the policy's *merged* weights (LoRA folded in, W + scale * B A, with the trained
norm gains) replace vLLM's in place (its worker's `reload_weights`, in this process: no serialization). Why merged
weights and not vLLM's LoRA support: add_lora also trains the normalisation gains (peft modules_to_save), which
a vLLM LoRA adapter cannot carry; full fine-tuning takes the same path; and a merged model samples at vLLM's full
speed, with no adapter kernels. The cost is one pass over the weights per step (`time/weight_sync`). The prefix cache is reset
after each sync: cached keys and values of the old weights must not serve the new ones.

vLLM is never a hard dependency: `pip install agentrl[vllm]` (on a CPU machine, a venv of its own:
benchmarks/vllm_cpu_setup.sh). It is imported only when this backend is built.
"""

from __future__ import annotations

import os
import re
import time
from typing import Iterator

import torch

from agentrl.errors import UserError
from agentrl.rollout.sampling import Sample, SamplingParams


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"rollout.backend=vllm needs vLLM ({e}): pip install 'agentrl[vllm]' on a GPU machine, or "
                        "run in the venv that benchmarks/vllm_cpu_setup.sh builds on a CPU machine") from None
    return vllm


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the policy as a plain transformers model would name them, LoRA merged in.

    model: a causal LM or a PeftModel with LoRA (and modules_to_save copies). Nothing is modified: each LoRA
    weight is W + delta computed on the fly (no merge/unmerge round trip drifting the base weights)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
        return
    base, adapter = model.get_base_model(), model.active_adapter
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".original_module." in name:  # adapter factors; frozen originals of trained copies
            continue
        if ".base_layer." in name:
            path, _, leaf = name.partition(".base_layer.")
            module = base.get_submodule(path)
            if leaf == "weight" and isinstance(module, LoraLayer) and adapter in module.lora_A and not module.merged:
                tensor = tensor + module.get_delta_weight(adapter).to(tensor.dtype)
            name = f"{path}.{leaf}"
        yield name.replace(f".modules_to_save.{adapter}.", "."), tensor.detach()


class VLLMRollout:
    """A colocated vLLM engine: `sync_weights(policy)` after each update, `sample` in place of sample_batch.

    model_dir: the base model directory the policy was loaded from (vLLM builds its network from it; the
    weights are replaced at the first sync). dtype "auto": the policy's dtype at the first sync is not known
    yet, so pass the model's (jobs do: model.dtype)."""

    def __init__(self, model_dir: str, dtype: str = "float32", gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, seed: int = 0, enforce_eager: bool = False):
        vllm = import_vllm()
        # The engine in this process (no engine-core subprocess): weights are handed to it as tensors, not
        # serialized, and it lives and dies with the trainer.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        started = time.time()
        self._vllm = vllm
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs",
                            enable_prefix_caching=True, skip_tokenizer_init=True, enforce_eager=enforce_eager)
        self.startup_seconds = time.time() - started

    def sync_weights(self, policy: torch.nn.Module) -> float:
        """Push the policy's merged weights into vLLM; returns the seconds it took."""
        started = time.time()
        # vLLM's own in-place reload: it undoes and redoes the kernel-format processing (CPU repacking, fused
        # qkv) around the model's load_weights, which alone fails on processed parameters.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": merged_weights(policy)})
        self.llm.reset_prefix_cache()
        return time.time() - started

    def sample(self, contexts: list[list[int]], params: SamplingParams, eos_token_id: int,
               pad_token_id: int | None = None, tokenizer=None, stop_patterns: tuple[str, ...] = (),
               generator: torch.Generator | None = None, room: list[int] | None = None) -> list[Sample]:
        """sample_batch's contract through vLLM: one Sample per context (ids, tempered logprobs, finish).

        room: per context, the most tokens it may sample before the episode's context budget is full (the
        rollout engine's rule, as for the hf sampler): vLLM writes no more, and such a turn ends "context"."""
        if not contexts:
            return []
        compiled = [re.compile(p) for p in stop_patterns]
        if compiled and tokenizer is None:
            raise ValueError("stop_patterns need a tokenizer to decode the turn text")
        # One seed per request from torch's RNG: the same run for the same seed, as with the hf sampler.
        seeds = torch.randint(0, 2**31 - 1, (len(contexts),), generator=generator if generator is not None and
                              generator.device.type == "cpu" else None).tolist()
        limits = turn_limits(params.max_new_tokens, len(contexts), room)
        requests = [self._vllm.SamplingParams(
            max_tokens=limit, temperature=params.temperature if params.do_sample else 0.0,
            top_k=max(int(params.top_k), 0), top_p=params.top_p, min_tokens=min(params.min_new_tokens, limit),
            logprobs=0, ignore_eos=True, stop_token_ids=[eos_token_id], seed=seed, detokenize=False)
            for seed, limit in zip(seeds, limits)]
        outputs = self.llm.generate([{"prompt_token_ids": list(c)} for c in contexts], requests, use_tqdm=False)
        samples = []
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [float(position[token].logprob) for token, position in zip(ids, completion.logprobs)]
            samples.append(_cut(ids, logprobs, eos_token_id, compiled, tokenizer, None if room is None else room[i]))
        return samples


def turn_limits(max_new_tokens: int, n: int, room: list[int] | None = None) -> list[int]:
    """Each request's max_tokens: max_new_tokens, or fewer where the episode's context has less room left."""
    return [max_new_tokens] * n if room is None else [max(1, min(max_new_tokens, r)) for r in room]


def _cut(ids: list[int], logprobs: list[float], eos_token_id: int, compiled: list[re.Pattern], tokenizer,
         room: int | None = None) -> Sample:
    """The sample the hf sampler would have returned: up to the first EOS, stop-pattern match or full context
    (`room` tokens), in its order of checks (sampling._finish: EOS, then the decoded turn text, then the room)."""
    for k, token in enumerate(ids, start=1):
        if token == eos_token_id:
            return Sample(ids[:k], logprobs[:k], "eos")
        if compiled and any(p.search(tokenizer.decode(ids[:k])) for p in compiled):
            return Sample(ids[:k], logprobs[:k], "stop")
        if room is not None and k >= room:
            return Sample(ids[:k], logprobs[:k], "context")
    return Sample(ids, logprobs, "length")
