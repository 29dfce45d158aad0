"""samples.jsonl: a few whole episodes per sampled step, token by token, for `agentrl report`.

One JSON object a line. `kind` says what it holds:
    episode   one training episode (PPO, GRPO): columns over every token of prompt + episode
    pair      iterative DPO: {"chosen": episode, "rejected": episode} of one task
    compare   `agentrl compare`: {"a": episode, "b": episode} on the same task and seed
An episode's columns all have one entry per token: `token_ids`, `pieces` (text, concatenating to `text`),
`roles` ("prompt", "policy" = sampled by the policy, "observation" = written by the environment or a tool),
`loss_mask`, and per-token numbers that are null where they do not apply: `logprobs` (the sampler's),
`trainer_logprobs` (the trainer's forward before the update), `ref_logprobs`, `advantages`, `values` (PPO).
Numbers are what the trainer already computed in that step; writing them costs no forward pass.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from agentrl.checkpoint import strict_json
from agentrl.data import parse_json_line
from agentrl.errors import UserError
from agentrl.rollout.engine import Episode

ROLES = ("prompt", "policy", "observation")


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """One text piece per token, concatenating exactly to `decode(ids)` (special tokens kept).

    Decoding tokens one by one breaks byte-level BPE (a multi-byte character spans tokens) and drops the
    spaces some decoders add between tokens, so each piece is what the token adds to the decoded prefix;
    a token that ends inside a character gets "" and the next one carries the character.
    """
    pieces, emitted = [], ""
    for j in range(len(ids)):
        text = tokenizer.decode(ids[: j + 1], skip_special_tokens=False)
        if text.startswith(emitted) and not text.endswith("\ufffd"):
            pieces.append(text[len(emitted):])
            emitted = text
        else:
            pieces.append("")
    full = tokenizer.decode(ids, skip_special_tokens=False)
    if full != emitted and pieces:  # whatever is still held back goes on the last token
        if full.startswith(emitted):
            pieces[-1] += full[len(emitted):]
        else:  # a decoder that rewrites earlier text: keep the text right, give up the alignment
            pieces = [""] * (len(pieces) - 1) + [full]
    return pieces


def _round(xs, nd: int = 4):
    return [None if x is None else round(float(x), nd) for x in xs]


def episode_record(ep: Episode, tokenizer, tensors: dict | None = None, row: int | None = None) -> dict:
    """An episode as columns over its tokens (see the module docstring).

    tensors: name -> (B, T-1) tensor aligned as a TokenBatch (position t predicts token t+1), or (B,) one
    number per episode (GRPO's advantage, given to every sampled token); `row` is this episode's row.
    Per-token numbers are kept on policy tokens only: elsewhere they are not used by any loss.
    """
    ids = list(ep.prompt_ids) + list(ep.token_ids)
    n = len(ep.prompt_ids)
    mask = [0] * n + list(ep.loss_mask)
    roles = ["prompt"] * n + ["policy" if m else "observation" for m in ep.loss_mask]
    pieces = token_pieces(tokenizer, ids)
    info = ep.info or {}
    rec = {
        "task": ep.task, "question": ep.task.get("question"), "answer": ep.task.get("answer"),
        "prediction": info.get("answer"), "correct": bool(info.get("correct")), "score": ep.score,
        "turn_rewards": list(ep.turn_rewards), "turn_ends": [n + e for e in ep.turn_ends],
        "truncated": bool(ep.truncated), "info": info, "text": "".join(pieces),
        "token_ids": ids, "pieces": pieces, "roles": roles, "loss_mask": mask,
        "logprobs": _round([lp if m else None for lp, m in zip([0.0] * n + list(ep.logprobs), mask)]),
    }
    for name, t in (tensors or {}).items():
        if t is None or row is None:
            continue
        t = t[row].detach().float().cpu()
        if t.dim() == 0:  # one number per episode
            values = [t.item()] * len(ids)
        else:  # token j is predicted at position j - 1; the first token never is
            values = [None] + t[: len(ids) - 1].tolist() + [None] * max(0, len(ids) - 1 - t.shape[0])
        rec[name] = _round([v if m else None for v, m in zip(values, mask)])
    return rec


def pick(episodes: list[Episode], k: int) -> list[int]:
    """Up to k episode indices, half from failed episodes and half from solved ones where both exist (so a
    sample late in training still shows failures), evenly spread within each, in batch order."""
    failed = [i for i, ep in enumerate(episodes) if not (ep.info or {}).get("correct")]
    solved = [i for i, ep in enumerate(episodes) if (ep.info or {}).get("correct")]
    n_failed = min(len(failed), max(k - len(solved), (k + 1) // 2))
    n_solved = min(len(solved), k - n_failed)

    def spread(xs, m):
        return [xs[int(j * len(xs) / m)] for j in range(m)] if m else []

    return sorted(spread(failed, n_failed) + spread(solved, n_solved))


class SamplesLog:
    """Appends sampled episodes to a `.jsonl` file every `every` steps (and at step 1), from the main process
    only. With `path=None` it writes nothing, so trainers can always call it."""

    def __init__(self, path: str | Path | None, tokenizer=None, every: int = 10, per_step: int = 4,
                 accelerator=None, source: str = "", resume_bytes: int | None = None):
        if every < 1 or per_step < 0:
            raise ValueError(f"sample_every must be >= 1 and samples_per_step >= 0, got {every}, {per_step}")
        self.path = Path(path) if path and per_step and (accelerator is None or accelerator.is_main_process) else None
        self.tokenizer, self.every, self.per_step, self.source = tokenizer, every, per_step, source
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_bytes is None:
                self.path.write_text("")
            else:  # resumed from a checkpoint: drop what was written after it (agentrl.checkpoint)
                from agentrl.checkpoint import truncate_to

                truncate_to(self.path, resume_bytes)

    def wants(self, step: int) -> bool:
        return self.path is not None and (step == 1 or step % self.every == 0)

    def _append(self, rows: list[dict]) -> None:
        with self.path.open("a") as f:
            for row in rows:
                f.write(strict_json(row, default=str) + "\n")

    @torch.no_grad()
    def write(self, step: int, episodes: list[Episode], tensors: dict | None = None) -> None:
        """Training episodes of one step; tensors as in `episode_record`, rows in `episodes` order."""
        if not self.wants(step):
            return
        self._append([{"kind": "episode", "step": step, "source": self.source, "index": i,
                       **episode_record(episodes[i], self.tokenizer, tensors, i)}
                      for i in pick(episodes, self.per_step)])

    def write_pairs(self, step: int, pairs: list[tuple[Episode, Episode]], kind: str = "pair",
                    names: tuple[str, str] = ("chosen", "rejected"), extra: list[dict] | None = None,
                    tokenizers: tuple | None = None) -> None:
        """(chosen, rejected) pairs (iterative DPO: step = round), or A/B episodes (compare: kind="compare",
        names ("a", "b"), each side decoded by its own tokenizer)."""
        if self.path is None or step % self.every:
            return
        tok_x, tok_y = tokenizers or (self.tokenizer, self.tokenizer)
        rows = []
        for i, (x, y) in enumerate(pairs[: self.per_step]):
            rows.append({"kind": kind, "step": step, "source": self.source, "index": i,
                         names[0]: episode_record(x, tok_x), names[1]: episode_record(y, tok_y),
                         **(extra[i] if extra else {})})
        self._append(rows)


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL run file (samples, metrics, pairs); a bad line is an error naming the file and line.

    A last line cut short (no newline: the job was killed while writing it, or is writing it now) is skipped
    with a warning: every row before it is whole, since rows are appended one whole line at a time."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); is it a JSONL file?") from None
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            row = parse_json_line(line, f"{path}:{n}")
            if isinstance(row, UserError):
                if n == len(lines) and not text.endswith("\n"):
                    warnings.warn(f"{path}:{n}: skipping a torn last line (the job stopped while writing it)",
                                  stacklevel=2)
                    break
                raise row
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows
