"""Several processes through accelerate (DDP, FSDP, DeepSpeed; `torchrun` or `accelerate launch`).

The process group, the main-process test and the pieces that make a step's statistics and normalisers global.
Imports only torch and accelerate, so the checkpoint module and the trainers can both use it.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from contextlib import contextmanager, nullcontext

import torch


def partial_state():
    """accelerate's shared process state, told to use the CPU (gloo) under `torchrun` on a machine without a GPU.

    accelerate only takes its MULTI_CPU path when asked for the CPU; otherwise, on a CPU-only machine, each
    process `torchrun` starts silently becomes a separate single-process run. The state is a singleton: the
    first call decides, so jobs call this before anything else asks accelerate.
    """
    from accelerate import PartialState

    return PartialState(cpu=_wants_cpu())


def _wants_cpu() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()


def is_main_process() -> bool:
    """True in a single process, and in the main process of several."""
    return partial_state().is_main_process


def wait_for_everyone() -> None:
    """A barrier across processes (nothing with one)."""
    partial_state().wait_for_everyone()


# Each rank trains on its own share of a step's episodes (`batch_size` per process, TRL 0.11's meaning); the
# helpers below make the statistics and normalisers of a step global. With one process they are never called,
# so single-process numbers stay exactly what they were.

def finish_trackers(accelerator) -> None:
    """Flush and close the trackers' files: the first half of accelerator.end_training(), whose second half
    destroys the process group that the job's saving, evaluation and next rounds still need."""
    for tracker in accelerator.trackers:
        tracker.finish()


def end_processes() -> None:
    """The end of a job: every process waits for the main one (still writing), then the group is closed."""
    global _COLLECT_AT_EXIT
    if partial_state().num_processes == 1:
        # No group of agentrl's: one destroyed here would be another library's (a vLLM engine in this process
        # starts a world of one and closes it itself at exit, with "Invalid process group" if it is gone).
        return
    wait_for_everyone()
    # Hand the GIL to gloo's worker thread before anything can free the group. Once the barrier completes, that
    # thread still drops its reference to the barrier's work. That work holds earlier broadcasts whose tensors are
    # Python objects, so dropping it needs the GIL. The group's last owner is DDP's reducer, which frees the group
    # when the job's objects are freed. ~ProcessGroupGloo joins the worker threads while holding the GIL. If the
    # thread has not finished by then, each waits for the other forever: a finished 2-process job hung at exit,
    # about 1 run in 3 under CPU load (py-spy: MainThread in ~ProcessGroupGloo -> thread::join, the gloo thread in
    # ~AsyncBarrierWork -> decref_pyobject -> gil_scoped_acquire). Sleeping releases the GIL; torch exposes no
    # completion to wait on.
    time.sleep(END_GRACE_SECONDS)
    partial_state().destroy_process_group()
    # destroy_process_group drops torch's own references to the group, not those of the objects using it (an FSDP
    # unit keeps its process_group). Freed during the interpreter's finalization, gloo's work objects can abort
    # the process (SIGABRT after a finished job: seen once in the FSDP job test; pytorch/pytorch#179291 describes
    # the mechanism), so what is left is collected at exit, while the interpreter is still whole.
    if not _COLLECT_AT_EXIT:
        atexit.register(gc.collect)
        _COLLECT_AT_EXIT = True


_COLLECT_AT_EXIT = False
END_GRACE_SECONDS = 0.5  # see end_processes: time for gloo's thread to drop its last work


def make_accelerator(**kwargs):
    """An Accelerator on the process group of partial_state() (the CPU under torchrun without a GPU)."""
    from accelerate import Accelerator

    from agentrl.errors import UserError
    from agentrl.precision import resolve_mixed_precision

    if "mixed_precision" in kwargs:
        kwargs["mixed_precision"] = resolve_mixed_precision(kwargs["mixed_precision"])
    if kwargs.get("mixed_precision") == "fp16" and not torch.cuda.is_available():
        raise UserError("mixed_precision: fp16 needs a CUDA GPU and this machine has none; use bf16 (CPUs with "
                        "AVX512-BF16 run it natively) or no")
    if _wants_cpu():
        kwargs.setdefault("cpu", True)
        if _sharding_on_cpu() == "FSDP":
            return _fsdp_on_cpu(Accelerator, kwargs)
        if _sharding_on_cpu() == "DEEPSPEED":
            # accelerate takes its DeepSpeed path only when not told to use the CPU; the process group stays
            # the CPU (gloo) one, and DeepSpeed finds no GPU and runs on the CPU.
            kwargs["cpu"] = False
    return _micro_batch_for_deepspeed(Accelerator(**kwargs))


def _micro_batch_for_deepspeed(accelerator):
    """DeepSpeed's engine wants train_micro_batch_size_per_gpu, which accelerate takes from a dataloader handed
    to prepare(); agentrl's trainers build their own batches and hand none, so prepare() would refuse ("auto")."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    return accelerator


def _sharding_on_cpu() -> str | None:
    """"FSDP" or "DEEPSPEED" when `accelerate launch` asked for it on a machine without a GPU, else None."""
    if not _wants_cpu():
        return None
    for kind in ("FSDP", "DEEPSPEED"):
        if os.environ.get(f"ACCELERATE_USE_{kind}", "false").lower() == "true":
            return kind
    return None


def _fsdp_on_cpu(accelerator_class, kwargs: dict):
    """An FSDP Accelerator on the CPU (gloo) group: what `accelerate launch --config_file fsdp.yaml` asks for.

    torch's FSDP runs on CPU with gloo, but accelerate 1.16 only turns a MULTI_GPU (or other accelerator) state
    into FSDP (AcceleratorState.__init__), and a CPU group is MULTI_CPU, so the job would silently run as DDP.
    The shared state is presented as MULTI_GPU while the Accelerator is built (the device stays the CPU), so
    accelerate takes its FSDP path; without a GPU only, and used by the 2-process FSDP tests.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = partial_state()
    if not AcceleratorState._shared_state and state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        # FSDP's compute device on CPU is "cpu"; accelerate's "cpu:0" (rank % 1) fails its device_id check.
        PartialState._shared_state["device"] = torch.device("cpu")
        try:
            accelerator = accelerator_class(**kwargs)
        finally:
            if PartialState._shared_state.get("distributed_type") == DistributedType.MULTI_GPU:
                PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
        return accelerator
    return accelerator_class(**kwargs)


def broadcast_from_main(obj):
    """The main process's `obj` on every process (one broadcast of a pickled object); `obj` with one process."""
    if partial_state().num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj], from_process=0)[0]


def gather_in_order(items: list) -> list:
    """Every process's list, concatenated in process order, on every process; `items` with one process.

    With contiguous shares (split_between_processes), that is the original order."""
    if partial_state().num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(items)


def world_banner(state=None) -> str:
    """E.g. "world size 2 (MULTI_CPU)": every job prints it at start, so a silent fall-back to one process shows."""
    state = state or partial_state()
    kind = _sharding_on_cpu() or state.distributed_type.value  # see make_accelerator
    return f"world size {state.num_processes} ({kind})"


def sum_over_processes(accelerator, x: torch.Tensor) -> torch.Tensor:
    """x summed over every process (all-reduce); x itself with one process."""
    if accelerator.num_processes == 1:
        return x
    return accelerator.reduce(x.detach().float().to(accelerator.device).clone(), "sum")


def global_masked_moments(accelerator, x: torch.Tensor, mask: torch.Tensor,
                          unbiased: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of x over the mask-1 positions of every process's batch (B, T) -> two scalars.

    Two all-reduces (the mean first, then squared deviations from it), as a single process would compute
    them over the concatenated batches: whitening over the global batch, not an average of per-rank whitenings.
    """
    count = sum_over_processes(accelerator, mask.sum())
    mean = sum_over_processes(accelerator, (x * mask).sum()) / count.clamp(min=1.0)
    var = sum_over_processes(accelerator, ((x - mean) ** 2 * mask).sum()) / count.clamp(min=1.0)
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return mean, var


def global_token_scale(accelerator, mask: torch.Tensor) -> float | None:
    """Factor turning a per-rank masked mean into its share of the global token mean, or None (one process).

    A loss masked_mean(l, mask) on each rank, times local_tokens * world / global_tokens, averaged over ranks by
    DDP's gradient all-reduce, equals sum(l over all ranks' tokens) / global_tokens: every token weighs the same,
    whatever rank it sits on (an average of per-rank means would weigh short-batch ranks' tokens more).
    """
    if accelerator.num_processes == 1:
        return None
    local = mask.sum().float()
    total = sum_over_processes(accelerator, local)
    return float(local * accelerator.num_processes / total.clamp(min=1.0))


def mean_over_processes(accelerator, stats: dict, keys=None) -> dict:
    """The float stats (all, or `keys`) averaged over processes in one all-reduce; the others kept as they are.

    Every rank rolls out the same number of episodes, so the mean of per-rank episode means is the global mean.
    """
    if accelerator.num_processes == 1:
        return stats
    keys = [k for k in (stats if keys is None else keys)
            if k in stats and isinstance(stats[k], (int, float)) and not isinstance(stats[k], bool)]
    if not keys:
        return stats
    values = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=accelerator.device)
    reduced = accelerator.reduce(values, "mean").tolist()
    return {**stats, **dict(zip(keys, reduced))}


def global_logprob_mismatch(accelerator, stats: dict[str, float]) -> dict[str, float]:
    """logprob_mismatch's max and mean over every process (the max of the maxes, the mean of the means)."""
    if accelerator.num_processes == 1 or not stats:
        return stats
    local = torch.tensor([stats["rollout/logprob_mismatch_max"], stats["rollout/logprob_mismatch_mean"]],
                         device=accelerator.device)
    every = accelerator.gather(local).view(-1, 2)
    return {"rollout/logprob_mismatch_max": every[:, 0].max().item(),
            "rollout/logprob_mismatch_mean": every[:, 1].mean().item()}


def sharded(accelerator) -> bool:
    """FSDP or DeepSpeed: no rank holds the whole model, so saving needs accelerator.get_state_dict."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def gathered_state_dict(accelerator, model) -> dict | None:
    """The whole weights of a sharded model on the main process ({} on the others; a collective: every rank
    calls it); None when the model is not sharded.

    FSDP and ZeRO-1/2: the parameters (inside summon_full_params under FSDP), named as the unwrapped model's
    state_dict names them (the value-head model's own state_dict, TRL's layout, leaves the LM out under PEFT,
    which FSDP's state-dict hooks and accelerator.get_state_dict rely on). ZeRO-3: accelerator.get_state_dict
    (it needs `stage3_gather_16bit_weights_on_model_save: true`, which the shipped zero3.yaml sets).
    """
    from accelerate.utils import DistributedType

    if not sharded(accelerator):
        return None
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel

        gathered = FullyShardedDataParallel.summon_full_params(model, writeback=False)
    elif accelerator.state.deepspeed_plugin.zero_stage == 3:
        return accelerator.get_state_dict(model)
    else:  # ZeRO-1/2 partition the optimizer state and gradients, not the weights
        gathered = nullcontext()
    with gathered:
        if not accelerator.is_main_process:
            return {}
        return {unwrapped_name(n): p.detach().clone()
                for n, p in accelerator.unwrap_model(model).named_parameters()}


def load_full_parameters(accelerator, model, weights: dict) -> None:
    """Under FSDP, whole tensors (names as gathered_state_dict gives them) copied into the sharded parameters
    (every rank calls it; each keeps its shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, writeback=True), torch.no_grad():
        for n, p in accelerator.unwrap_model(model).named_parameters():
            if unwrapped_name(n) in weights:
                p.copy_(weights[unwrapped_name(n)].to(p.device, p.dtype))


@contextmanager
def fsdp_free_names(model):
    """model.named_modules() without FSDP's `_fsdp_wrapped_module` components, while PEFT saves gathered weights.

    PEFT finds modules_to_save weights in the given state dict by module name and strips only a leading
    `_fsdp_wrapped_module.` (peft/utils/save_and_load.py); with one FSDP unit per layer the names carry it
    inside, and the saved adapter would lose the trained norm gains. Nothing changes without FSDP units.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not FullyShardedDataParallel.fsdp_modules(model):
        yield
        return
    original = model.named_modules

    def named_modules(*args, **kwargs):
        for name, module in original(*args, **kwargs):
            yield name.replace("._fsdp_wrapped_module", "").removeprefix("_fsdp_wrapped_module."), module

    model.named_modules = named_modules  # an instance attribute, deleted on the way out
    try:
        yield
    finally:
        del model.named_modules


def unwrapped_name(name: str) -> str:
    """A parameter's name without the wrappers' components FSDP and activation checkpointing insert."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


@contextmanager
def gathered_for_generation(accelerator, model):
    """Whole weights on every rank while it rolls out with the unwrapped model, under ZeRO-3 and FSDP.

    Ranks sample different numbers of tokens, so a sharded forward (one all-gather per layer and call) would
    leave ranks waiting on each other; the parameters are gathered once around the rollout instead, and the
    per-layer gathering switched off meanwhile. DDP, ZeRO-1/2 and a single process need nothing. FSDP (version
    1) runs in CI on CPU (gloo); ZeRO-3 ran on CPU too (DeepSpeed 0.19.8; its test needs deepspeed installed).
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        # DeepSpeed's own: the parameters gathered and its per-module fetch hooks removed meanwhile (each would
        # otherwise still all-gather per forward call).
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield
    elif kind == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True), \
                _fsdp_units_bypassed(model):
            yield
    else:
        yield


@contextmanager
def _fsdp_units_bypassed(model):
    """Every FSDP unit inside `model` calls its wrapped module directly, without FSDP's forward.

    Inside summon_full_params the original parameters hold the whole tensors, yet an FSDP unit's forward still
    all-gathers its shard (torch 2.13, FSDP1), so a rank that samples one more token than another would wait
    for it forever (measured on CPU with gloo). The rollout only reads the weights, so the units are skipped.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(model)
    for unit in units:
        # An instance attribute (deleted on the way out); the wrapped module's __call__, so that its hooks still
        # run (transformers captures hidden states with forward hooks on the decoder layers).
        unit.forward = unit._fsdp_wrapped_module.__call__
    try:
        yield
    finally:
        for unit in units:
            del unit.forward


def all_finite(accelerator, finite: bool) -> bool:
    """True when `finite` holds on every process (one all-reduce): a decision every rank takes alike."""
    if accelerator.num_processes == 1:
        return finite
    return not sum_over_processes(accelerator, torch.tensor(float(not finite))).item()


