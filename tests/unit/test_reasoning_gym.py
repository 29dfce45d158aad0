"""reasoning-gym families as environments: the split, extraction before scoring, partial scores, math-verify in
threads, one-line errors, and the environment through the rollout engine's protocol (offline, no trained model)."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("reasoning_gym")

from agentrl.config import ConfigError
from agentrl.envs.base import checked_reset, checked_step, make_env
from agentrl.envs.ecosystems import reasoning_gym as rgym
from agentrl.envs.ecosystems.reasoning_gym import (
    ReasoningGymEnv,
    extract_answer,
    family_score,
    math_verify_check,
    reasoning_gym_chat_demonstration,
    reasoning_gym_demonstration,
    reasoning_gym_tasks,
    task_entry,
)

LEGS = {"dataset": "leg_counting", "config": {"min_animals": 1, "max_animals": 2}}


def questions(tasks):
    return [t["question"] for t in tasks]


def test_split_is_disjoint_by_index_and_text_and_the_same_on_every_call():
    train = reasoning_gym_tasks(600, seed=0, split="train", **LEGS)
    held_out = reasoning_gym_tasks(200, seed=0, split="eval", **LEGS)
    assert questions(train) == questions(reasoning_gym_tasks(600, seed=0, split="train", **LEGS))
    assert held_out == reasoning_gym_tasks(200, seed=0, split="eval", **LEGS)
    assert len(set(questions(held_out))) == 200  # held-out questions are distinct
    assert {t["index"] % 2 for t in train} == {0} and {t["index"] % 2 for t in held_out} == {1}
    # other seeds of either split never meet the other split, by index or by text (reasoning-gym alone would
    # share 49 of 50 items between seeds 1 and 2)
    for train_seed, eval_seed in ((1, 0), (0, 1), (1, 2), (2, 1)):
        tr = reasoning_gym_tasks(300, seed=train_seed, split="train", **LEGS)
        ev = reasoning_gym_tasks(100, seed=eval_seed, split="eval", **LEGS)
        assert not {t["index"] for t in tr} & {t["index"] for t in ev}
        assert not set(questions(tr)) & set(questions(ev))
    # a family so small that indices alone would repeat held-out questions in training: text decides
    tiny = {"dataset": "leg_counting", "config": {"min_animals": 1, "max_animals": 1, "max_instances": 3}}
    tr = reasoning_gym_tasks(400, seed=3, split="train", **tiny)
    ev = reasoning_gym_tasks(40, seed=0, split="eval", **tiny)
    assert len(set(questions(tr))) < 400 and not set(questions(tr)) & set(questions(ev))
    # seeds draw different items
    assert set(questions(reasoning_gym_tasks(50, seed=1, split="train", **LEGS))) != set(questions(train[:50]))
    # the task is the family's own item
    entry = task_entry(held_out[0])
    assert entry["question"].strip() == held_out[0]["question"] and entry["answer"] == held_out[0]["answer"]


def test_extraction_before_scoring():
    task = reasoning_gym_tasks(1, seed=0, split="eval", **LEGS)[0]
    gold = task["answer"]
    # the family's scorer alone gives containment credit to a sentence that holds the answer
    assert 0 < family_score(task, f"The answer is {gold}") < 1
    assert extract_answer(f"Thought: count.\nAnswer: {gold}") == gold
    assert extract_answer(f"<answer> {gold} </answer>") == gold
    assert extract_answer(f"Answer: 3\nno, wait.\nAnswer: {gold}\n") == gold  # the last one
    assert extract_answer(f"The answer is {gold}") is None
    env = ReasoningGymEnv()
    env.reset(task)
    result = env.step(f"The answer is {gold}")  # no Answer: marker: nothing to score
    assert (result.reward, result.info["correct"], result.info["format_errors"]) == (0.0, False, 1)
    env.reset(task)
    assert env.step(f"Thought: I add them up.\nAnswer: {gold}").reward == 1.0
    env.reset(task)
    assert env.step(f"Answer: {int(gold) + 1}").reward == 0.0


def test_partial_scores_stay_the_reward_unless_turned_off():
    task = reasoning_gym_tasks(1, seed=0, split="eval", dataset="letter_jumble",
                               config={"min_words": 4, "max_words": 4})[0]
    words = task["answer"].split()
    half = " ".join(words[:2] + [w[::-1] + "x" for w in words[2:]])
    env = make_env(ReasoningGymEnv)
    env.reset(task)
    partial = env.step(f"Answer: {half}")
    assert 0 < partial.reward < 1 and not partial.info["correct"]
    assert partial.reward == pytest.approx(family_score(task, half))
    strict = ReasoningGymEnv(partial_credit=False)
    strict.reset(task)
    assert strict.step(f"Answer: {half}").reward == 0.0
    strict.reset(task)
    assert strict.step(f"Answer: {task['answer']}").reward == 1.0


def test_math_verify_check_is_safe_in_threads():
    from math_verify import parse

    cases = [({"answer": "1/2"}, "0.5", True), ({"answer": "\\frac{1}{2}"}, "1/2", True),
             ({"answer": "12"}, "12.0", True), ({"answer": "3"}, "4", False), ({"answer": "3"}, "", False),
             ({"answer": "\\sqrt{4}"}, "2", True), ({"answer": "10"}, "\\boxed{10}", True)] * 8
    with ThreadPoolExecutor(8) as pool:
        # what this guards against: math-verify's default signal.alarm timeout raises in a worker thread
        with pytest.raises(ValueError, match="threaded"):
            pool.submit(parse, "1/2").result()
        got = list(pool.map(lambda c: math_verify_check(c[0], c[1]), cases))
    assert got == [expected for _, _, expected in cases]
    env = ReasoningGymEnv(scorer="math_verify")
    env.reset({"question": "Half of one?", "answer": "1/2"})
    assert env.step("Answer: 0.5").reward == 1.0


def test_family_scores_from_threads():
    tasks = reasoning_gym_tasks(32, seed=0, split="eval", **LEGS)

    def episode(task):
        env = ReasoningGymEnv()
        env.reset(task)
        return env.step(f"Answer: {task['answer']}").reward

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(episode, tasks)) == [1.0] * 32


@pytest.mark.parametrize("kwargs, message", [
    ({}, "env.tasks_kwargs.dataset: name a reasoning-gym dataset"),
    ({"dataset": "leg_countin"},
     "env.tasks_kwargs.dataset: unknown reasoning-gym dataset 'leg_countin'; nearest: leg_counting"),
    ({"dataset": "leg_counting", "config": {"min_animal": 1}},
     ("env.tasks_kwargs.config.min_animal: not a field of leg_counting's config (LegCountingConfig); "
      "nearest: min_animals")),
    ({"dataset": "leg_counting", "config": {"min_animals": 0}}, "env.tasks_kwargs.config: leg_counting rejects"),
    ({"dataset": "leg_counting", "config": {"seed": 3}}, "env.tasks_kwargs.config.seed: set by agentrl"),
    ({"dataset": "leg_counting", "config": "min_animals=1"}, "env.tasks_kwargs.config: a mapping"),
    ({"dataset": "leg_counting", "config": {"min_animals": 1, "max_animals": 1, "max_instances": 2}},
     "distinct eval questions"),
])
def test_errors_are_one_line_and_name_the_key(kwargs, message):
    with pytest.raises(ConfigError) as e:
        reasoning_gym_tasks(200, seed=0, split="eval", **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_errors_through_the_job_config():
    from agentrl.jobs.common import EnvSection, tasks_of

    section = EnvSection(name="agentrl.envs.ecosystems.reasoning_gym:ReasoningGymEnv",
                         tasks="agentrl.envs.ecosystems.reasoning_gym:reasoning_gym_tasks",
                         tasks_kwargs={"dataset": "leg_countng"})
    with pytest.raises(ConfigError, match="nearest: leg_counting"):
        tasks_of(section, 5, 0, "eval")


def test_demonstrations_use_the_familys_answers_with_a_share_wrong():
    tasks = reasoning_gym_tasks(400, seed=0, split="train", wrong_fraction=0.3, **LEGS)
    rng = random.Random(0)
    rows = [reasoning_gym_demonstration(t, rng) for t in tasks]
    env = ReasoningGymEnv()
    scores = []
    for task, row in zip(tasks, rows):
        (prompt, p_trainable), (turn, trainable) = row["segments"]
        assert prompt == env.reset(task) and (p_trainable, trainable) == (False, True)
        scores.append(env.step(turn).reward)  # the row's answer, scored as a rollout's would be
    wrong = sum(s < 1.0 for s in scores) / len(scores)
    assert 0.22 < wrong < 0.38
    again = random.Random(0)
    assert rows == [reasoning_gym_demonstration(t, again) for t in tasks]  # reproducible from the rng
    chat = reasoning_gym_chat_demonstration(tasks[0], random.Random(0))
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][1]["content"].startswith("Answer: ")


def _tokenizer(chat: bool):
    from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE
    from agentrl.models.tiny import build_tokenizer

    tasks = reasoning_gym_tasks(50, seed=0, split="train", **LEGS)
    texts = [f"Question: {t['question']}\nAnswer: {t['answer']}" for t in tasks]
    markers = ("<|im_start|>", "<|im_end|>") if chat else ()
    return build_tokenizer(texts, 400, markers, CHATML_TOOLS_TEMPLATE if chat else None)


@pytest.mark.parametrize("format", ["react", "chat"])
def test_the_environment_through_the_engine_protocol(format):
    tok = _tokenizer(format == "chat")
    task = reasoning_gym_tasks(1, seed=0, split="eval", **LEGS)[0]
    env = make_env(ReasoningGymEnv, {"format": format})
    if format == "chat":
        env.bind_tokenizer(tok)
    prompt = checked_reset(env, task)
    assert task["question"] in prompt
    end = "<|im_end|>" if format == "chat" else ""
    if format == "chat":
        assert prompt.endswith("<|im_start|>assistant\n") and env.stop_patterns
    result = checked_step(env, f"Answer: {task['answer']}{end}")
    assert (result.reward, result.done, result.info["correct"]) == (1.0, True, True)
    checked_reset(env, task)
    assert checked_step(env, f"Answer: 1{task['answer']}{end}").reward < 1.0


@pytest.mark.parametrize("format", ["react", "chat"])
def test_a_random_tiny_model_rolls_out(format):
    """The real engine with a random tiny model: episodes end, masks cover only sampled tokens, scores are the
    environment's."""
    from agentrl.models.tiny import BaseModelConfig, tiny_llama
    from agentrl.rollout import SamplingParams, rollout

    tok = _tokenizer(format == "chat")
    torch.manual_seed(0)
    model = tiny_llama(BaseModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok).eval()
    tasks = reasoning_gym_tasks(4, seed=0, split="eval", **LEGS)
    episodes = rollout(model, tok, lambda: ReasoningGymEnv(format=format), tasks, SamplingParams(max_new_tokens=6),
                       generator=torch.Generator().manual_seed(0))
    for ep in episodes:
        assert ep.num_turns == 1 and len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
        assert all(m == 1 for m in ep.loss_mask)  # one turn: every response token was sampled
        assert ep.score == ep.info["score"] and 0.0 <= ep.score <= 1.0


def test_a_calculator_tool_in_react():
    env = ReasoningGymEnv(tools=["agentrl.envs:calculator"], max_turns=2)
    task = reasoning_gym_tasks(1, seed=0, split="eval", **LEGS)[0]
    checked_reset(env, task)
    first = checked_step(env, "Action: calculator(3 * 4)\n")
    assert first.observation == "Observation: 12\n" and not first.done
    last = checked_step(env, f"Answer: {task['answer']}")
    assert last.done and last.reward == 1.0 and last.info["tool_calls"] == 1


def test_seed_out_of_range_is_named():
    with pytest.raises(ConfigError, match="seed must be"):
        reasoning_gym_tasks(1, seed=rgym.MAX_SEED, split="train", **LEGS)


def test_the_split_is_the_same_in_another_process():
    """Nothing of the process (hash seed, time) enters the draw: a fresh interpreter with another hash seed draws
    the same tasks. (Five families themselves iterate over sets; see docs/ecosystems-reasoning-gym.md.)"""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from agentrl.envs.ecosystems.reasoning_gym import reasoning_gym_tasks as t; "
            f"print(json.dumps([t(20, 1, s, **{LEGS!r}) for s in ('train', 'eval')]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    here = [reasoning_gym_tasks(20, 1, split, **LEGS) for split in ("train", "eval")]
    assert json.loads(out.stdout) == json.loads(json.dumps(here))


def test_chat_demonstrations_start_from_the_prompt_the_environment_renders():
    tok = _tokenizer(chat=True)
    task = reasoning_gym_tasks(1, seed=0, split="train", **LEGS)[0]
    row = reasoning_gym_chat_demonstration(task, random.Random(0))
    env = ReasoningGymEnv(format="chat")
    env.bind_tokenizer(tok)
    assert tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False) == env.reset(task)


@pytest.mark.parametrize("dataset, config", [("spell_backward", {}), ("letter_jumble", {}), ("basic_arithmetic", {}),
                                             ("leg_counting", {})])
def test_wrong_answers_score_below_one_under_the_familys_scorer(dataset, config):
    rng = random.Random(0)
    for task in reasoning_gym_tasks(20, seed=0, split="train", dataset=dataset, config=config):
        wrong = rgym.wrong_answer(task, rng)
        assert wrong != task["answer"] and family_score(task, wrong) < 1.0 and family_score(task, task["answer"]) == 1.0


def test_a_calculator_tool_in_chat():
    import json

    tok = _tokenizer(chat=True)
    env = ReasoningGymEnv(format="chat", tools=["agentrl.envs:calculator"], max_turns=2)
    env.bind_tokenizer(tok)
    task = reasoning_gym_tasks(1, seed=0, split="eval", **LEGS)[0]
    assert "Tools: calculator(expression)" in checked_reset(env, task)
    call = json.dumps({"name": "calculator", "arguments": {"expression": "3 * 4"}})
    first = checked_step(env, f"<tool_call>{call}</tool_call><|im_end|>")
    assert not first.done and "<|im_start|>tool\n12<|im_end|>" in first.observation
    last = checked_step(env, f"Answer: {task['answer']}<|im_end|>")
    assert last.done and last.reward == 1.0 and last.info["tool_calls"] == 1


def test_families_that_follow_the_hash_seed_warn(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.warns(UserWarning, match="PYTHONHASHSEED"):
        reasoning_gym_tasks(2, seed=0, split="eval", dataset="ransom_note")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reasoning_gym_tasks(2, seed=0, split="eval", dataset="ransom_note")
