"""Several processes through accelerate (DDP, FSDP, DeepSpeed; `torchrun` or `accelerate launch`).

The process group, the main-process test and the pieces that make a step's statistics and normalisers global.
Imports only torch and accelerate, so the checkpoint module and the trainers can both use it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

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
    wait_for_everyone()
    partial_state().destroy_process_group()


def make_accelerator(**kwargs):
    """An Accelerator on the process group of partial_state() (the CPU under torchrun without a GPU)."""
    from accelerate import Accelerator

    if _wants_cpu():
        kwargs.setdefault("cpu", True)
    return Accelerator(**kwargs)


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
    return f"world size {state.num_processes} ({state.distributed_type.value})"


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
    """The full state dict of a sharded model, gathered by accelerate (a collective: every rank calls it; under
    ZeRO-3 it needs `stage3_gather_16bit_weights_on_model_save: true`); None when the model is not sharded."""
    return accelerator.get_state_dict(model) if sharded(accelerator) else None


@contextmanager
def gathered_for_generation(accelerator, model):
    """Whole weights on every rank while it rolls out with the unwrapped model, under ZeRO-3 and FSDP.

    Ranks sample different numbers of tokens, so a sharded forward (one all-gather per layer and call) would
    leave ranks waiting on each other; the parameters are gathered once around the rollout instead (what TRL's
    unwrap_model_for_generation does under ZeRO-3). DDP and a single process need nothing. Not exercised on
    this project's CPU-only CI (FSDP and DeepSpeed need GPUs here).
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    elif kind == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
            yield
    else:
        yield


def all_finite(accelerator, finite: bool) -> bool:
    """True when `finite` holds on every process (one all-reduce): a decision every rank takes alike."""
    if accelerator.num_processes == 1:
        return finite
    return not sum_over_processes(accelerator, torch.tensor(float(not finite))).item()


