"""What both sides of a peer benchmark share: the settings of each task, the workload, the reward, the timing.

Imported by agentrl_side.py (agentrl's venv) and trl_side.py (a peer's venv: TRL 0.11.4 on transformers 4.46,
or TRL 1.16 on agentrl's stack), so it needs only the standard library and torch, never agentrl or trl.
The workload (prompts as text and as token ids, preference pairs) is written once by run.py with agentrl's
tokenizer and read by both sides, so both train on the same ids.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

# One task's settings, identical on both sides (each side maps them onto its own config names).
TASKS = {
    "ppo": {"batch_size": 64, "query_tokens": 14, "response_tokens": 32, "mini_batch_size": 16, "ppo_epochs": 4,
            "learning_rate": 1.41e-5},
    # Responses end at EOS or after 32 tokens (the 26 M random model almost never samples EOS; both sides report
    # their mean length). Forcing 32 with min_new_tokens would sample from a distribution with EOS masked, which
    # the trainers' recomputed logprobs do not see (agentrl's logprob-mismatch check rejects that, rightly).
    "grpo": {"prompts": 8, "num_generations": 8, "completion_tokens": 32, "mini_batch_size": 64, "beta": 0.0,
             "num_iterations": 1, "learning_rate": 1e-5, "max_grad_norm": 1.0},
    "dpo": {"batch_size": 16, "beta": 0.1, "learning_rate": 5e-5, "max_grad_norm": 1.0},
}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
# At SmolLM2-135M (run.py --models smollm2-135m) the batches of configs/real.yaml: 16 episodes a step, answers of
# at most 48 tokens, chat-template prompts of the word-problem task (the workload file carries these).
REAL_MODEL_TASKS = {
    "ppo": {"batch_size": 16, "response_tokens": 48, "mini_batch_size": 8, "ppo_epochs": 2},
    "grpo": {"prompts": 2, "num_generations": 8, "completion_tokens": 48, "mini_batch_size": 16},
    "dpo": {"batch_size": 8},
}
PEER = {"ppo": "TRL 0.11.4", "grpo": "TRL 1.16.0", "dpo": "TRL 1.16.0"}
PEER_VENV = {"ppo": "trl011", "grpo": "trl116", "dpo": "trl116"}


def one_thread() -> None:
    """One intra-op thread: on a shared 2-core machine a 2-thread OpenMP process slows erratically."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def load_workload(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def task_settings(task: str, work: dict) -> dict:
    """TASKS[task] with the workload's overrides for its model (the real model's smaller batches)."""
    return {**TASKS[task], **work.get("settings", {}).get(task, {})}


def digit_reward(text: str) -> float:
    """The score both sides give a completion: its share of digit characters. Cheap, and it varies even
    for a random model's text, so GRPO's group advantages are not all zero and both sides really update."""
    return sum(c.isdigit() for c in text) / max(1, len(text))


def trainable_snapshot(model) -> dict:
    """name -> a copy of every trainable LoRA matrix, to show afterwards that they moved (a value head, which
    only PPO has, is left out so that both sides compare the same tensors)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}


def moved(before: dict, model) -> dict:
    """How far the trainable parameters moved: the largest |change| and how many tensors changed at all.
    Names are matched by their LoRA suffix, since wrappers (value head, DDP) prefix them differently."""
    def key(name: str) -> str:
        i = name.find("layers.")
        return name[i:] if i >= 0 else name

    after = {key(n): p.detach() for n, p in model.named_parameters()}
    deltas = [float((after[key(n)].float() - p.float()).abs().max()) for n, p in before.items() if key(n) in after]
    return {"tensors": len(before), "compared": len(deltas), "changed": sum(d > 0 for d in deltas),
            "max_abs_change": max(deltas, default=0.0)}


def model_facts(model) -> dict:
    """What a reader compares across the two sides; `logits_checksum` (the summed logits of a fixed input) shows
    that both loaded the same weights (LoRA's B starts at zero, so the adapter changes nothing yet)."""
    import torch

    cfg = model.config
    with torch.no_grad():
        checksum = float(model(input_ids=torch.arange(1, 11)[None]).logits.double().sum())
    return {"logits_checksum": round(checksum, 3), "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
            "vocab": cfg.vocab_size, "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


# run.py's lockstep mode: the two sides' processes run at the same time and take turns, one step each, passing a
# byte over a socket pair (this variable names the inherited socket's fd; 1 after it: this side goes first).
LOCKSTEP_ENV = "AGENTRL_PEERS_LOCKSTEP"


class Baton:
    """Whose turn it is, between the two processes of a lockstep pair: `take()` blocks until the other process
    has finished its step; `give()` ends this one's. When the other process has exited (its end of the socket is
    closed: it finished or failed), `take()` returns at once and this process goes on alone."""

    def __init__(self, fd: int, first: bool):
        import socket

        self.sock = socket.socket(fileno=fd)
        self.held, self.partner_gone = first, False

    _process: "Baton | None" = None

    @classmethod
    def from_env(cls) -> "Baton | None":
        """This process's baton (one per process: every StepClock shares it), or None outside lockstep."""
        value = os.environ.get(LOCKSTEP_ENV)
        if not value:
            return None
        if cls._process is None:
            fd, first = value.split(",")
            cls._process = cls(int(fd), first == "1")
        return cls._process

    def take(self) -> None:
        if self.held or self.partner_gone:
            return
        self.partner_gone = self.sock.recv(1) == b""
        self.held = True

    def give(self) -> None:
        if self.held and not self.partner_gone:
            try:
                self.sock.sendall(b".")
            except OSError:  # the other process is gone
                self.partner_gone = True
        self.held = False


class StepClock:
    """Seconds of each step, from consecutive calls of tick() (the first tick starts the clock): wall-clock
    (`steps`) and this process's CPU time (`cpu_steps`). With one thread on a quiet machine the two agree; on a
    shared one the wall clock also counts the time other processes held the core, the CPU time does not.

    Under run.py's lockstep each tick also hands the turn to the other side's process and waits for it to come
    back (`Baton`), so consecutive steps of the two libraries run back to back, never at the same time, and
    the wait is not counted in either clock."""

    def __init__(self):
        self.last, self.steps, self.last_cpu, self.cpu_steps = None, [], None, []
        self.baton = Baton.from_env()

    def tick(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.last is not None:
            self.steps.append(now - self.last)
            self.cpu_steps.append(cpu - self.last_cpu)
        if self.baton is not None:
            if self.last is not None:
                self.baton.give()
            self.baton.take()
            now, cpu = time.perf_counter(), time.process_time()
        self.last, self.last_cpu = now, cpu


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def emit(result: dict) -> None:
    """The worker's answer: one JSON line, prefixed so run.py finds it among the libraries' own prints."""
    result.update(peak_rss_mb=round(peak_rss_mb(), 1), pid=os.getpid(), python=sys.version.split()[0])
    print("PEER-RESULT " + json.dumps(result), flush=True)


def step_loop(args, one_step, clock: StepClock) -> float | None:
    """Run one_step(i) for the warm-up and timed steps, ticking the clock after each. With --count-flops, one
    extra step after the warm-up runs under torch's FlopCounterMode (its time is not kept): FLOPs it returns."""
    flops = None
    clock.tick()
    for i in range(args.warmup + args.steps + bool(args.count_flops)):
        if args.count_flops and i == args.warmup:
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                one_step(i)
            flops = counter.get_total_flops()
            clock.last, clock.last_cpu = time.perf_counter(), time.process_time()
            continue
        one_step(i)
        clock.tick()
    return flops
