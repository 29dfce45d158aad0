"""Fixed PPO and GRPO updates, run once on one process (by test_distributed.py) and once split over two.

    torchrun --nproc_per_node 2 tests/integration/dist_worker.py OUT_DIR
    accelerate launch --config_file configs/accelerate/fsdp.yaml tests/integration/dist_worker.py OUT_DIR

Each rank takes its half of the same 64 (query, response, score) rows, and of the same 8 groups of 4 episodes,
makes one update (one epoch, one mini-batch over the global batch) and rank 0 writes the updated weights to
OUT_DIR/ppo.safetensors and OUT_DIR/grpo.safetensors, for the test to compare with the one-process update.
"""

from __future__ import annotations

import random
import sys

import torch

ROWS, GROUPS, GROUP_SIZE = 64, 8, 4
TEXTS = ["Question: What is 12 * 3?\nThought: use the tool\nAction: calculator(12 * 3)\nAnswer: 36"] * 4


def tokenizer():
    from agentrl.models.tiny import build_tokenizer

    return build_tokenizer(TEXTS, 64)


def tiny_model(tok):
    from agentrl.models.tiny import BaseModelConfig, tiny_llama

    torch.manual_seed(0)
    return tiny_llama(BaseModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok).eval()


def ppo_rows(tok) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """64 (query, response, score) rows of varied lengths (so ranks hold different token counts)."""
    rng = random.Random(0)
    ids = range(3, len(tok))
    return [(torch.tensor([tok.bos_token_id] + rng.choices(ids, k=rng.randint(2, 6))),
             torch.tensor(rng.choices(ids, k=rng.randint(1, 9))), rng.uniform(-1, 1)) for _ in range(ROWS)]


def ppo_update(rows, lr: float = 0.05) -> dict[str, torch.Tensor]:
    """One classic `step()` on these rows (this process's share) with SGD, so weights move by lr * gradient."""
    from agentrl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    tok = tokenizer()
    model = AutoModelForCausalLMWithValueHead(tiny_model(tok), v_head_init_std=0.1)
    config = PPOConfig(batch_size=len(rows), mini_batch_size=len(rows), ppo_epochs=1, learning_rate=lr,
                       init_kl_coef=0.1, exp_name="dist")
    trainer = PPOTrainer(config, model, None, tok, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    stats = trainer.step([q for q, _, _ in rows], [r for _, r, _ in rows], [s for _, _, s in rows])
    weights = whole_weights(trainer)
    weights["stats.objective/kl"] = torch.tensor(stats["objective/kl"])
    weights["stats.ppo/mean_scores"] = torch.tensor(stats["ppo/mean_scores"])
    return weights


def whole_weights(trainer) -> dict[str, torch.Tensor]:
    """The updated parameters by name: gathered under FSDP (on the main process), else this process's copy."""
    from agentrl.distributed import gathered_state_dict

    full = gathered_state_dict(trainer.accelerator, trainer.model)
    if full is not None:
        return full
    return {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}


def grpo_episodes(tok):
    """8 groups of 4 fixed two-turn episodes (an observation in the middle), scores varied within groups."""
    from agentrl.rollout.engine import Episode

    rng, episodes = random.Random(1), []
    ids = range(3, len(tok))
    for g in range(GROUPS):
        prompt = [tok.bos_token_id] + rng.choices(ids, k=3 + g % 3)
        for _ in range(GROUP_SIZE):
            a, obs, b = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 6)
            tokens = rng.choices(ids, k=a + obs + b)
            mask = [1] * a + [0] * obs + [1] * b
            episodes.append(Episode(task={"g": g}, prompt_ids=prompt, token_ids=tokens, loss_mask=mask,
                                    logprobs=[0.0] * len(tokens), turn_ends=[a - 1, a + obs + b - 1],
                                    turn_rewards=[0.0, rng.choice([-1.0, 0.2, 1.0])]))
    return episodes


def grpo_update(episodes, lr: float = 0.05) -> dict[str, torch.Tensor]:
    from agentrl.trainers.grpo import GRPOConfig, GRPOTrainer

    tok = tokenizer()
    model = tiny_model(tok)
    config = GRPOConfig(tasks_per_step=len(episodes) // GROUP_SIZE, num_generations=GROUP_SIZE,
                        mini_batch_size=len(episodes), learning_rate=lr, beta=0.0, max_grad_norm=None,
                        logprob_mismatch_threshold=None)
    trainer = GRPOTrainer(config, model, tok, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    stats = trainer._update(episodes)
    weights = whole_weights(trainer)
    weights["stats.grpo/mean_scores"] = torch.tensor(stats["grpo/mean_scores"])
    return weights


def main(out: str) -> None:
    from accelerate import PartialState
    from safetensors.torch import save_file

    from agentrl.distributed import partial_state

    state: PartialState = partial_state()
    assert state.num_processes == 2, f"expected 2 processes, got {state.num_processes} ({state.distributed_type})"
    tok = tokenizer()
    with state.split_between_processes(ppo_rows(tok)) as mine:
        ppo = ppo_update(mine)
    episodes = grpo_episodes(tok)  # 4 whole groups per rank
    with state.split_between_processes(episodes) as mine:
        grpo = grpo_update(mine)
    print(f"dist_worker: trained under {state.distributed_type.value}", flush=True)  # FSDP once an Accelerator is
    if state.is_main_process:
        save_file({k: v.contiguous() for k, v in ppo.items()}, f"{out}/ppo.safetensors")
        save_file({k: v.contiguous() for k, v in grpo.items()}, f"{out}/grpo.safetensors")
    state.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
