"""DPO (and IPO, hinge, conservative DPO) with an assistant-only mask, TRL-style API.

    DPOTrainer(model=model, ref_model=None, args=training_args, train_dataset=dataset, tokenizer=tokenizer,
               beta=0.1, max_length=512, max_prompt_length=256).train()

`args` may be a `transformers.TrainingArguments` or a `DPOConfig`. Under LoRA with `ref_model=None` the
reference is the adapter-disabled base (no second copy); `precompute_ref_log_probs` computes reference
logprobs once, before training, and keeps no reference model at all.
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

import torch
from accelerate.utils import set_seed

from agentrl.algos.dpo import dpo_loss
from agentrl.errors import UserError
from agentrl.preferences import PreferenceExample, load_preferences
from agentrl.trainers.common import (FAST, MetricsLog, build_batch, checkpoint_activations, default_pad_token,
                                     eval_mode, guarded_step, make_accelerator, masked_logprobs, mean_over_processes,
                                     norm_gain_parameters, optimizer_groups, progress_bar)
# checkpoints and resume
from agentrl.trainers.common import (load_trainer_checkpoint, load_trainer_state, resumed_metrics,
                                     save_trainer_checkpoint, save_weights, trainer_state, write_lm)


@dataclass
class DPOConfig:
    """The TrainingArguments fields DPO uses, plus DPO's own. Unknown TrainingArguments fields are ignored."""

    output_dir: str = "runs/dpo"  # where save_model() writes by default
    per_device_train_batch_size: int = 8  # preference pairs per forward
    gradient_accumulation_steps: int = 1  # forwards per optimizer step
    learning_rate: float = 5e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    adam_epsilon: float = 1e-8  # AdamW epsilon
    norm_learning_rate: float | None = None  # learning rate of trainable norm gains (None: learning_rate)
    num_train_epochs: float = 1.0  # passes over the pairs (ignored when max_steps > 0)
    max_steps: int = -1  # optimizer steps; > 0 overrides num_train_epochs
    warmup_steps: int = 0  # linear warm-up steps
    lr_scheduler_type: str = "linear"  # a transformers scheduler name
    max_grad_norm: float = 1.0  # gradient-norm clip
    logging_steps: int = 10  # log every this many optimizer steps
    save_steps: int = 0  # also checkpoint every this many steps (0: only save_model)
    seed: int = 42  # random seed
    fp16: bool = False  # fp16 mixed precision (needs a CUDA GPU)
    bf16: bool = False  # bf16 mixed precision
    gradient_checkpointing: bool = False  # activation checkpointing on the model
    report_to: str | list | None = None  # accelerate tracker(s); "none" or None: no tracker
    logging_dir: str | None = None  # where trackers write (None: output_dir)
    beta: float = 0.1  # strength of the implicit KL to the reference
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"  # which preference loss
    label_smoothing: float = 0.0  # conservative / robust DPO: assumed label-noise rate
    rpo_alpha: float | None = None  # weight of the chosen completions' per-token NLL added to the loss (RPO,
    # Pang et al. 2024, arXiv:2404.19733; TRL's rpo_alpha): keeps the chosen likelihood rising. None: off
    max_length: int = 512  # prompt + completion tokens (completions are truncated)
    max_prompt_length: int = 256  # longer prompts are a data error
    precompute_ref_log_probs: bool = False  # reference logprobs once up front; no reference model kept
    cache_ref_log_probs: bool = True  # keep each pair's reference logprobs the first time they are computed and
    # reuse them in later epochs (the reference is frozen), instead of a reference forward every time
    reference_with_adapter: bool = False  # with precompute under LoRA: reference = the policy as it is now
    # (adapter on: iterative DPO against the previous round) instead of the adapter-disabled base
    skip_bad_rows: bool = False  # skip (and count) malformed rows instead of raising
    progress: bool = True  # progress bar

    def __post_init__(self):
        # A comparison with NaN is False, so NaN fails too. A negative beta trains the preferences in reverse; zero
        # divides (ipo).
        if not 0 < self.beta < math.inf:
            raise UserError(f"beta: must be a finite number > 0, got {self.beta!r}")
        if not 0 < self.learning_rate < math.inf:
            raise UserError(f"learning_rate: must be a finite number > 0, got {self.learning_rate!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"label_smoothing: must be in [0, 0.5), got {self.label_smoothing!r}")

    @classmethod
    def from_args(cls, args) -> "DPOConfig":
        if args is None:
            return cls()
        if isinstance(args, cls):
            return copy.copy(args)
        names = {f.name for f in fields(cls)}
        values = {n: getattr(args, n) for n in names if hasattr(args, n)}
        if isinstance(values.get("report_to"), list) and values["report_to"] in ([], ["none"]):
            values["report_to"] = None
        return cls(**values)


class DPOTrainer:
    def __init__(self, model=None, ref_model=None, args=None, train_dataset=None, eval_dataset=None, tokenizer=None,
                 processing_class=None, peft_config=None, **overrides):
        tokenizer = tokenizer or processing_class
        if model is None or tokenizer is None or train_dataset is None:
            raise ValueError("DPOTrainer needs model, tokenizer and train_dataset")
        if eval_dataset is not None:
            warnings.warn("eval_dataset is not evaluated during DPO training yet; use `agentrl compare` or "
                          "agentrl.jobs.evaluate after training", stacklevel=2)
        config = DPOConfig.from_args(args)
        unknown = set(overrides) - {f.name for f in fields(DPOConfig)}
        if unknown:
            raise TypeError(f"DPOTrainer got unexpected arguments {sorted(unknown)}")
        # replace(), not setattr: DPOTrainer(beta=-1) is checked by __post_init__ as DPOConfig(beta=-1) is.
        config = replace(config, **{key: value for key, value in overrides.items() if value is not None})
        self.config = config
        self.logprob_paths = FAST  # the exact logprob shortcuts (trainers/common.LogprobPaths)
        if config.fp16 and not torch.cuda.is_available():
            raise UserError("dpo.fp16: fp16 needs a CUDA GPU and none is available; set fp16=False (or bf16=True)")
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            if not torch.cuda.is_available():
                raise ValueError("4-/8-bit quantized models need a CUDA GPU; load the model without load_in_4bit")
        from agentrl.distributed import partial_state

        set_seed(config.seed + partial_state().process_index)  # each rank its own stream; rank 0 = one process
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self.is_peft_model = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        if config.gradient_checkpointing:
            checkpoint_activations(model, self.is_peft_model)
        self.tokenizer = tokenizer
        default_pad_token(tokenizer)
        if isinstance(train_dataset, list) and train_dataset and isinstance(train_dataset[0], PreferenceExample):
            self.examples, self.skipped_rows = list(train_dataset), 0
        else:
            self.examples, self.skipped_rows = load_preferences(train_dataset, tokenizer, config.max_length,
                                                                config.max_prompt_length, config.skip_bad_rows)
        report = config.report_to if config.report_to not in ("none", [], None) else None
        mixed = "fp16" if config.fp16 else "bf16" if config.bf16 else "no"
        self.accelerator = make_accelerator(gradient_accumulation_steps=config.gradient_accumulation_steps,
                                       mixed_precision=mixed, log_with=report,
                                       project_dir=config.logging_dir or config.output_dir)
        if report:
            self.accelerator.init_trackers("agentrl-dpo", config={k: v for k, v in asdict(config).items()
                                                                  if isinstance(v, (int, float, str, bool))})
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = ref_model.eval().requires_grad_(False)
        elif not self.is_peft_model and not config.precompute_ref_log_probs:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        params = optimizer_groups(params, config.learning_rate, [(norm_gain_parameters(model), config.norm_learning_rate)])
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                                           eps=config.adam_epsilon)
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        if config.precompute_ref_log_probs:
            self._precompute_reference()
        self.metrics_log = MetricsLog(None, self.accelerator)
        self.history: list[dict] = []
        self.current_step, self.lr_scheduler, self.resumed = 0, None, None
        self.ref_cache: dict[int, tuple[float, float]] = {}  # id(example) -> reference logprobs (cache_ref_log_probs)

    # --- sequence logprobs ------------------------------------------------------------------------------

    def _batch(self, examples: list[PreferenceExample]):
        """One right-padded batch: chosen rows first, then rejected rows. loss_mask = assistant tokens only."""
        rows = []
        for side in ("chosen", "rejected"):
            for ex in examples:
                ids, mask = getattr(ex, f"{side}_ids"), getattr(ex, f"{side}_mask")
                rows.append((ex.prompt_ids + ids, [0] * len(ex.prompt_ids) + list(mask), []))
        batch = build_batch(rows, self.tokenizer.pad_token_id)
        return type(batch)(*(x.to(self.accelerator.device) for x in (batch.input_ids, batch.attention_mask,
                                                                      batch.loss_mask, batch.scores)))

    def sequence_logps(self, model, examples: list[PreferenceExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed logprobs of assistant tokens: (chosen (B,), rejected (B,))."""
        batch = self._batch(examples)
        # Chosen and rejected share their prompt: it runs once per pair, and only assistant positions reach the
        # LM head (masked_logprobs).
        logps = masked_logprobs(model, batch, 1.0, paths=self.logprob_paths)[0].sum(-1)
        return logps[: len(examples)], logps[len(examples):]

    @torch.no_grad()
    def reference_logps(self, examples: list[PreferenceExample]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.accelerator.device
        if all(ex.ref_chosen_logp is not None for ex in examples):
            return (torch.tensor([ex.ref_chosen_logp for ex in examples], device=dev),
                    torch.tensor([ex.ref_rejected_logp for ex in examples], device=dev))
        cached = [self.ref_cache.get(id(ex)) for ex in examples]
        if all(c is not None for c in cached):
            return tuple(torch.tensor(x, device=dev) for x in zip(*cached))
        if self.ref_model is not None:
            out = self.sequence_logps(self.ref_model, examples)
        elif self.is_peft_model:
            with self.accelerator.unwrap_model(self.model).disable_adapter():
                out = self.sequence_logps(self.model, examples)
        else:
            raise RuntimeError("no reference: pass ref_model, use LoRA, or precompute_ref_log_probs")
        if self.config.cache_ref_log_probs:
            self.ref_cache.update({id(ex): (c, r) for ex, c, r in zip(examples, *(x.tolist() for x in out))})
        return out

    @torch.no_grad()
    def _precompute_reference(self) -> None:
        """Reference logprobs of every pair, computed once by the model as it is now (the adapter disabled
        under LoRA when no ref_model is given). Afterwards no reference model is needed."""
        self.model.eval()
        size = self.config.per_device_train_batch_size
        for start in range(0, len(self.examples), size):
            chunk = [ex for ex in self.examples[start:start + size] if ex.ref_chosen_logp is None]
            if not chunk:
                continue
            with self.accelerator.autocast():  # at the training forward's precision, as in train()
                if self.ref_model is not None:
                    c, r = self.sequence_logps(self.ref_model, chunk)
                elif self.is_peft_model and not self.config.reference_with_adapter:
                    with self.accelerator.unwrap_model(self.model).disable_adapter():
                        c, r = self.sequence_logps(self.model, chunk)
                else:
                    c, r = self.sequence_logps(self.model, chunk)
            for ex, lc, lr in zip(chunk, c.tolist(), r.tolist()):
                ex.ref_chosen_logp, ex.ref_rejected_logp = lc, lr

    # --- training ---------------------------------------------------------------------------------------

    def train(self, metrics_path: str | None = None, checkpointer=None) -> list[dict]:
        """Optimizer steps over shuffled pairs. After load_checkpoint, continues from the checkpoint's step.

        checkpointer: an agentrl.checkpoint.Checkpointer (periodic checkpoints, signals, non-finite streaks).
        """
        from transformers import get_scheduler

        cfg = self.config
        resumed = self.resumed or {}
        self.metrics_log = resumed_metrics(self, metrics_path)
        size, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
        world = self.accelerator.num_processes  # each rank trains on its own size pairs of every draw
        per_epoch = max(1, math.ceil(len(self.examples) / (size * world)) // accum)
        total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(per_epoch * cfg.num_train_epochs))
        self.lr_scheduler = scheduler = get_scheduler(cfg.lr_scheduler_type, self.optimizer, cfg.warmup_steps, total)
        self.total_steps = total
        self.rng = random.Random(cfg.seed)
        self.order, self.acc = [], defaultdict(list)  # pairs not yet drawn this epoch; stats since the last row
        if "loop" in resumed:
            loop = resumed.pop("loop")
            scheduler.load_state_dict(loop["lr_scheduler"])
            for group, lr in zip(self.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr  # creating the scheduler above reset it to the first step's
            self.rng.setstate(loop["rng"])
            self.order, self.acc = list(loop["order"]), defaultdict(list, loop["acc"])
            self.history = list(loop["history"])
        bar = progress_bar(total, "DPO", cfg.progress and self.accelerator.is_main_process)
        if bar is not None:
            bar.update(self.current_step)
        # Dropout off: the reference is the same network, and DPO's implicit reward compares the two.
        eval_mode(self.model)
        started, acc = time.time(), self.acc
        while self.current_step < total:
            skipped = 0
            for _ in range(accum):
                skipped += self._micro_step(self._draw(size * world), acc)
            acc["train/skipped_nonfinite"].append(float(skipped))
            scheduler.step()
            self.current_step += 1
            step = self.current_step
            if step % cfg.logging_steps == 0 or step == total:
                row = {k: sum(v) / len(v) for k, v in acc.items() if k != "train/skipped_nonfinite"}
                row = mean_over_processes(self.accelerator, row)  # every rank had as many pairs
                row["train/skipped_nonfinite"] = sum(acc["train/skipped_nonfinite"])  # updates skipped since the last row
                row.update({"step": step, "learning_rate": scheduler.get_last_lr()[0],
                            "skipped_rows": self.skipped_rows, "elapsed": time.time() - started})
                self.history.append(row)
                self.metrics_log.write(row, step)
                acc.clear()
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['rewards/accuracies']:.2f}")
            if cfg.save_steps and step % cfg.save_steps == 0:
                self.save_model(f"{cfg.output_dir}/checkpoint-{step}")
            if checkpointer is not None:
                checkpointer.after_step(self, step, {"train/skipped_nonfinite": skipped}, last=step == total)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return self.history

    def _draw(self, count: int) -> list:
        """This rank's slice of the next `count` pairs of the shuffled order (a new epoch's shuffle appended when
        too few are left). Every rank holds every pair and the same order (same seed)."""
        if len(self.order) < count:
            fresh = list(range(len(self.examples)))
            self.rng.shuffle(fresh)
            self.order += fresh
        with self.accelerator.split_between_processes(self.order[:count]) as mine:
            batch = [self.examples[i] for i in mine]
        del self.order[:count]
        return batch

    def _micro_step(self, batch: list, acc: dict) -> int:
        """The DPO loss of one micro-batch, its backward (and the optimizer step where accumulation ends), its
        statistics appended to `acc`. Returns the non-finite events guarded_step met (0-2)."""
        cfg = self.config
        with self.accelerator.accumulate(self.model):
            # The reference at the policy's precision (bf16: half the cost, and the two agree exactly where the
            # weights do, so the implicit rewards start at 0).
            with self.accelerator.autocast():
                ref_c, ref_r = self.reference_logps(batch)
                pol_c, pol_r = self.sequence_logps(self.model, batch)
            losses, rc, rr = dpo_loss(pol_c, pol_r, ref_c, ref_r, cfg.beta, cfg.loss_type, cfg.label_smoothing)
            loss = losses.mean()
            if cfg.rpo_alpha:
                # Per-token NLL of the chosen completions (their summed logprob over their token count).
                counts = torch.tensor([max(1, sum(ex.chosen_mask)) for ex in batch], device=pol_c.device)
                nll = (-pol_c / counts).mean()
                loss = loss + cfg.rpo_alpha * nll
                acc["nll/chosen"].append(nll.item())
            skipped = guarded_step(self.accelerator, self.model, self.optimizer, loss, cfg.max_grad_norm or None)
            self.optimizer.zero_grad(set_to_none=True)
        acc["loss"].append(loss.item())
        acc["rewards/chosen"].append(rc.mean().item())
        acc["rewards/rejected"].append(rr.mean().item())
        acc["rewards/accuracies"].append((rc > rr).float().mean().item())
        acc["rewards/margins"].append((rc - rr).mean().item())
        acc["logps/chosen"].append(pol_c.detach().mean().item())
        acc["logps/rejected"].append(pol_r.detach().mean().item())
        return skipped

    # --- checkpoints (agentrl.checkpoint) ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Weights, optimizer, RNGs, the reference logprobs of every pair, and (inside train()) the step,
        pair order, scheduler and unlogged stats."""
        loop = None
        if self.lr_scheduler is not None:
            loop = {"lr_scheduler": self.lr_scheduler.state_dict(), "rng": self.rng.getstate(),
                    "order": list(self.order), "acc": dict(self.acc), "history": list(self.history)}
        refs = [[ex.ref_chosen_logp, ex.ref_rejected_logp] for ex in self.examples]
        cache = [self.ref_cache.get(id(ex)) for ex in self.examples]
        return trainer_state(self, loop=loop, ref_logps=refs if self.config.precompute_ref_log_probs else None,
                             ref_cache=[list(c) if c else None for c in cache] if self.ref_cache else None)

    def load_state_dict(self, state: dict) -> None:
        load_trainer_state(self, state)
        if state["ref_logps"] is not None:
            if len(state["ref_logps"]) != len(self.examples):
                from agentrl.checkpoint import CheckpointError

                raise CheckpointError(f"the checkpoint has reference logprobs of {len(state['ref_logps'])} pairs, "
                                      f"this trainer has {len(self.examples)}")
            for ex, (c, r) in zip(self.examples, state["ref_logps"]):
                ex.ref_chosen_logp, ex.ref_rejected_logp = c, r
        if state.get("ref_cache") is not None and len(state["ref_cache"]) == len(self.examples):
            self.ref_cache = {id(ex): tuple(c) for ex, c in zip(self.examples, state["ref_cache"]) if c is not None}
        if state["loop"] is not None:
            self.resumed["loop"] = state["loop"]

    def save_checkpoint(self, directory: str) -> None:
        save_trainer_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        load_trainer_checkpoint(self, directory)

    def save_model(self, output_dir: str | None = None) -> None:
        """Adapter (under LoRA) or model + tokenizer, written atomically; refuses non-finite weights."""
        save_weights(self.accelerator, self.model, output_dir or self.config.output_dir, lambda tmp, full: write_lm(
            self.accelerator.unwrap_model(self.model), tmp, full, self.tokenizer))
