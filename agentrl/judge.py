"""An LLM judge as the reward (RLAIF): a rubric, an optional reference answer and the trajectory go into a prompt;
the judge's verdict becomes the episode's score.

    reward.judge: {mode: rating, model: smollm2-135m, rubric: "..."}            # a local causal LM
    reward.judge: {mode: rating, model: Qwen/Qwen2.5-72B-Instruct,
                   base_url: http://localhost:8000/v1, api_key_env: OPENAI_API_KEY}  # an OpenAI-compatible server

Modes (one score in [0, 1] per episode):
    rating   "Score: N" with 0 <= N <= max_rating, divided by max_rating
    yes_no   P(yes) / (P(yes) + P(no)) read from the next-token distribution (local judge, or a server that returns
             top logprobs); a server without logprobs answers in words, scored 1 or 0
    ranking  one call per group (GRPO's generations, iterative DPO's samples of one task): "Ranking: 2 > 1 > 3",
             best first; rank k of n scores (n - 1 - k) / (n - 1). A group of one is rated instead.

A malformed verdict is asked again (`retries` times, sampling at retry_temperature), then the episode is marked
info["infra_failure"] and info["judge_failure"]: the trainers leave it out of the loss and of the group baselines
(agentrl/envs/base.py), exactly as a dead tool server; a 0 the policy did not earn would teach it. Every verdict is
appended to out_dir/judge-cache.jsonl keyed by the sha256 of the judge's whole input, so a resumed run asks nothing
twice.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import re
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from agentrl.envs.base import INFRA_FAILURE
from agentrl.errors import UserError

DEFAULT_RUBRIC = ("The response solves the user's task. Its final answer is correct; when a reference answer is "
                  "given, the final answer must equal it. Tool calls are well formed and used where they help.")


class JudgeError(UserError):
    """A judge setting that cannot work (names the reward.judge key)."""


@dataclass
class JudgeSection:
    mode: Literal["off", "rating", "yes_no", "ranking"] = "off"  # how the verdict is read; off: the env scores
    model: str | None = None  # local: a model dir or preset (smollm2-135m); with base_url: the served model's name
    base_url: str | None = None  # an OpenAI-compatible endpoint (http://localhost:8000/v1); None: a local model
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key ("EMPTY" when unset)
    rubric: str = DEFAULT_RUBRIC  # the principles the judge grades against
    reference_key: str | None = "answer"  # task key of the reference answer shown to the judge; None: no reference
    max_rating: int = 10  # rating mode: the top of the scale
    retries: int = 2  # malformed verdicts asked again before the episode is masked out
    retry_temperature: float = 0.7  # sampling temperature of the retries (the first ask is greedy)
    max_new_tokens: int = 32  # tokens of one verdict
    timeout: float = 60.0  # seconds per server request
    concurrency: int = 4  # server requests in flight at once
    weight: float = 1.0  # weight of the judge's score
    env_weight: float = 0.0  # weight of the environment's score (0: the judge replaces it)
    cache: bool = True  # keep verdicts in out_dir/judge-cache.jsonl


def check_judge(section: JudgeSection, where: str = "reward.judge") -> None:
    """One-line errors naming the key, before any model loads."""
    if section.mode == "off":
        return
    if not section.model:
        raise JudgeError(f"{where}.model: needed with {where}.mode={section.mode} (a model dir, a preset such as "
                         f"smollm2-135m, or the served model's name with {where}.base_url)")
    if section.max_rating < 1:
        raise JudgeError(f"{where}.max_rating: must be >= 1, got {section.max_rating}")
    for key in ("retries", "max_new_tokens", "concurrency"):
        if getattr(section, key) < (0 if key == "retries" else 1):
            raise JudgeError(f"{where}.{key}: must be >= {0 if key == 'retries' else 1}, got {getattr(section, key)}")
    if not section.timeout > 0 or not section.retry_temperature > 0:
        raise JudgeError(f"{where}.timeout and {where}.retry_temperature: must be > 0")


# --- the prompt ---------------------------------------------------------------------------------------------------

_ASK = {
    "rating": "Grade the response against the principles from 0 (fails) to {top} (fully meets them). "
              "Reply with one line: Score: N",
    "yes_no": "Does the response meet the principles? Answer with one word: yes or no.",
    "ranking": "Rank the responses from best to worst against the principles. Reply with one line, best first, "
               "for example: Ranking: {example}",
}


def judge_messages(section: JudgeSection, question: str, responses: list[str], reference: str | None) -> list[dict]:
    """The judge's chat messages: principles, the task, the reference answer when given, the response(s), the ask."""
    parts = [f"Principles:\n{section.rubric}", f"Task:\n{question}"]
    if reference is not None:
        parts.append(f"Reference answer:\n{reference}")
    if section.mode == "ranking":
        parts += [f"Response {i + 1}:\n{r}" for i, r in enumerate(responses)]
        example = " > ".join(str(i) for i in sorted(range(1, len(responses) + 1), key=lambda k: (k % 2, -k)))
    else:
        parts.append(f"Response:\n{responses[0]}")
        example = ""
    parts.append(_ASK[section.mode].format(top=section.max_rating, example=example))
    return [{"role": "system", "content": "You are a careful, strict judge of an AI assistant's work."},
            {"role": "user", "content": "\n\n".join(parts)}]


# --- reading verdicts: None is malformed ------------------------------------------------------------------------

def parse_rating(text: str, top: int) -> float | None:
    """'Score: 7' (or a bare number) -> 0.7 for top 10; None outside [0, top] or without a number."""
    m = re.search(r"score\s*[:=]?\s*\**\s*(\d+(?:\.\d+)?)", text, re.I) or re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*\.?\s*",
                                                                                        text)
    if not m or not 0 <= float(m.group(1)) <= top:
        return None
    return float(m.group(1)) / top


def parse_ranking(text: str, n: int) -> list[float] | None:
    """'Ranking: 2 > 1 > 3' -> scores per response in order ([0.5, 1.0, 0.0]); None unless a permutation of 1..n."""
    m = re.search(r"ranking\s*[:=]?\s*([\d\s>,]+)", text, re.I)
    order = [int(k) for k in re.findall(r"\d+", m.group(1))] if m else []
    if sorted(order) != list(range(1, n + 1)):
        return None
    scores = [0.0] * n
    for rank, k in enumerate(order):
        scores[k - 1] = (n - 1 - rank) / (n - 1)
    return scores


def parse_yes_no(text: str) -> float | None:
    """A worded verdict: 'Yes.' -> 1.0, 'no' -> 0.0; None when it says neither (or both)."""
    words = set(re.findall(r"[a-z]+", text.lower()))
    if ("yes" in words) == ("no" in words):
        return None
    return 1.0 if "yes" in words else 0.0


def yes_probability(top: dict[str, float], min_mass: float = 0.05) -> float | None:
    """P(yes) / (P(yes) + P(no)) from next-token {token text: probability}; tokens ' Yes', 'yes', 'YES' all count.
    None when the two together hold less than min_mass: the judge meant to say something else."""
    yes = sum(p for t, p in top.items() if t.strip().lower() == "yes")
    no = sum(p for t, p in top.items() if t.strip().lower() == "no")
    return yes / (yes + no) if yes + no >= min_mass else None


# --- back ends: messages -> text, or messages -> {next token: probability} -------------------------------------

class LocalJudge:
    """A causal LM on this machine (any model dir or preset), greedy first, sampled on retries."""

    def __init__(self, model: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from agentrl.models.pretrained import resolve_model_dir

        self.path = resolve_model_dir(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.name = f"local:{model}"

    def _ids(self, messages: list[dict]):
        import torch

        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # a base model without a template: plain text, the verdict follows
            text = "\n\n".join(m["content"] for m in messages) + "\n\nVerdict: "
        return torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])

    def complete(self, messages: list[dict], temperature: float, max_new_tokens: int, seed: int = 0) -> str:
        import torch

        ids = self._ids(messages)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                      temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def next_token(self, messages: list[dict], k: int = 20) -> dict[str, float]:
        import torch

        with torch.no_grad():
            probs = torch.softmax(self.model(self._ids(messages)).logits[0, -1].float(), -1)
        top = torch.topk(probs, k)
        return {self.tokenizer.decode([int(i)]): float(p) for p, i in zip(top.values, top.indices)}


class ServerJudge:
    """Any OpenAI-compatible chat endpoint (vLLM, llama.cpp, transformers serve, a hosted API) via `openai`."""

    def __init__(self, section: JudgeSection):
        try:
            import openai
        except ImportError:
            raise JudgeError("reward.judge.base_url needs the openai client: pip install 'agentrl[judge]'") from None
        self.client = openai.OpenAI(base_url=section.base_url, api_key=os.environ.get(section.api_key_env) or "EMPTY",
                                    timeout=section.timeout, max_retries=2)
        self.model, self.name = section.model, f"server:{section.base_url}:{section.model}"

    def complete(self, messages: list[dict], temperature: float, max_new_tokens: int, seed: int = 0) -> str:
        reply = self.client.chat.completions.create(model=self.model, messages=messages, temperature=temperature,
                                                    max_tokens=max_new_tokens, seed=seed)
        return reply.choices[0].message.content or ""

    def next_token(self, messages: list[dict], k: int = 20) -> dict[str, float] | str:
        """Top-k next-token probabilities when the server returns logprobs; else the worded answer (a str)."""
        reply = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0, max_tokens=1,
                                                    logprobs=True, top_logprobs=k)
        content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
        if not content:
            return reply.choices[0].message.content or ""
        return {t.token: math.exp(t.logprob) for t in content[0].top_logprobs}


# --- the cache: append-only JSONL, one line per verdict ----------------------------------------------------------

class VerdictCache:
    """{sha256 of the judge's input: its raw output}; a torn last line (a killed run) is skipped on reading."""

    def __init__(self, path: Path | None):
        self.path, self.entries, self.lock = path, {}, threading.Lock()
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self.entries[row["key"]] = row["output"]
                except (ValueError, KeyError, TypeError):
                    continue

    def get(self, key: str):
        return self.entries.get(key)

    def put(self, key: str, output) -> None:
        with self.lock:
            self.entries[key] = output
            if self.path is not None:
                with open(self.path, "a") as f:  # one write per line: a crash tears at most the last one
                    f.write(json.dumps({"key": key, "output": output}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())


def input_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# --- the score hook -----------------------------------------------------------------------------------------------

class JudgeScorer:
    """A score hook (episodes -> None, as RewardModelScorer): score = env_weight * env score + weight * judge score,
    on the final turn; episodes the judge could not score are marked infra_failure and judge_failure."""

    def __init__(self, section: JudgeSection, policy_tokenizer, cache_path: Path | str | None = None, backend=None):
        check_judge(section)
        self.section, self.policy_tokenizer = section, policy_tokenizer
        self.backend = backend or (ServerJudge(section) if section.base_url else LocalJudge(section.model))
        self.cache = VerdictCache(Path(cache_path) if section.cache and cache_path else None)
        self.stats = {"episodes": 0, "asked": 0, "cached": 0, "retried": 0, "failed": 0}
        self.last_error: str | None = None

    # one verdict: retried while malformed; None after the last retry
    def _verdict(self, messages: list[dict], read):
        s = self.section
        for attempt in range(s.retries + 1):
            temperature = 0.0 if attempt == 0 else s.retry_temperature
            if s.mode == "yes_no":
                kind, run = "next_token", lambda: self.backend.next_token(messages)
            else:
                kind, run = "complete", lambda: self.backend.complete(messages, temperature, s.max_new_tokens, attempt)
            key = input_key(self.backend.name, kind, messages, temperature, s.max_new_tokens, attempt)
            output = self.cache.get(key)
            if output is None:
                try:
                    output = run()
                except Exception as e:  # noqa: BLE001 - a timeout or a server error is a failed verdict, not a crash
                    body = getattr(e, "body", None)  # a server's 400 says why in its body (a prompt over the context)
                    output = {"error": f"{type(e).__name__}: {e}{f' {body}' if body else ''}"[:300]}
                    self.last_error = output["error"]  # shown in summary(): why verdicts failed
                else:
                    self.cache.put(key, output)
                self.stats["asked"] += 1
            else:
                self.stats["cached"] += 1
            verdict = None if isinstance(output, dict) and "error" in output else read(output)
            if verdict is not None:
                return verdict
            if s.mode == "yes_no" and isinstance(output, dict):  # logprobs are deterministic: asking again won't help
                return None
            self.stats["retried"] += attempt < s.retries
        return None

    def _read(self, mode: str, n: int):
        """Output -> the group's scores in order, or None when malformed."""
        s = self.section
        if mode == "ranking":
            return lambda text: parse_ranking(text, n)
        if mode == "yes_no":
            return lambda out: [p] if (p := yes_probability(out) if isinstance(out, dict) else parse_yes_no(out)) \
                is not None else None
        return lambda text: [p] if (p := parse_rating(text, s.max_rating)) is not None else None

    def _texts(self, ep) -> tuple[str, str, str | None]:
        """(question, the trajectory after the prompt as text, the reference answer)."""
        tok = self.policy_tokenizer
        question = str(ep.task.get("question") or tok.decode(ep.prompt_ids, skip_special_tokens=True))
        ref_key = self.section.reference_key
        reference = str(ep.task[ref_key]) if ref_key and ep.task.get(ref_key) is not None else None
        return question, tok.decode(ep.token_ids, skip_special_tokens=True).strip(), reference

    def __call__(self, episodes) -> None:
        s = self.section
        # Groups: consecutive episodes of one prompt (GRPO's generations, a DPO round's samples); rating and yes_no
        # ask once per episode.
        groups, start = [], 0
        for i in range(1, len(episodes) + 1):
            if i == len(episodes) or s.mode != "ranking" or episodes[i].prompt_ids != episodes[start].prompt_ids:
                groups.append(episodes[start:i])
                start = i
        jobs = []
        for group in groups:
            texts = [self._texts(ep) for ep in group]
            mode = "rating" if s.mode == "ranking" and len(group) == 1 else s.mode  # nothing to rank: rated
            messages = judge_messages(replace(s, mode=mode), texts[0][0], [t[1] for t in texts], texts[0][2])
            jobs.append((group, messages, self._read(mode, len(group))))
        workers = s.concurrency if s.base_url else 1  # a local model runs one verdict at a time
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            verdicts = list(pool.map(lambda job: self._verdict(job[1], job[2]), jobs))
        for (group, _, _), verdict in zip(jobs, verdicts):
            for k, ep in enumerate(group):
                self.stats["episodes"] += 1
                if verdict is None:
                    self.stats["failed"] += 1
                    ep.info = {**ep.info, INFRA_FAILURE: True, "judge_failure": True}
                    continue
                ep.info = {**ep.info, "env_score": ep.score, "judge_score": verdict[k]}
                ep.turn_rewards = [s.env_weight * r for r in ep.turn_rewards]
                ep.turn_rewards[-1] += s.weight * verdict[k]

    def summary(self) -> dict:
        """Counts for the run's summary: episodes judged, verdicts asked / read from the cache, retries, failures."""
        return {**self.stats, "failure_rate": round(self.stats["failed"] / max(self.stats["episodes"], 1), 4),
                "backend": self.backend.name, **({"last_error": self.last_error} if self.last_error else {})}


def judge_hook(section: JudgeSection, policy_tokenizer, out_dir: Path | str | None) -> JudgeScorer | None:
    """reward.judge as a score hook, its cache in out_dir/judge-cache.jsonl; None when mode is off."""
    if section.mode == "off":
        return None
    cache = Path(out_dir) / "judge-cache.jsonl" if out_dir is not None else None
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    return JudgeScorer(section, policy_tokenizer, cache)
