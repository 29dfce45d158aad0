import time

import pytest

from agentrl.envs import CalculatorEnv, CalculatorError, MultiStepCalculatorEnv, calculator_tasks, safe_eval
from agentrl.envs.calculator import numeric_match

HOSTILE = [
    "__import__('os').system('touch /tmp/agentrl_pwned')",
    "9**9**9**9",
    "(1<<10**9)",
    "1" * 10_000,
    "١٢٣ + 1",  # Arabic-Indic digits
    "lambda: 1",
    "(1).__class__",
    "().__class__.__bases__",
    "open('/etc/passwd')",
    "10**10**10",
    "2**-99999",
    "1e308 * 1e308",
    "",
]


@pytest.mark.parametrize("expression", HOSTILE)
def test_safe_eval_rejects_hostile_input_fast(expression, tmp_path):
    started = time.time()
    with pytest.raises(CalculatorError):
        safe_eval(expression)
    assert time.time() - started < 0.1


def test_hostile_input_becomes_an_observation_and_runs_nothing():
    import os

    env = CalculatorEnv()
    env.reset({"question": "What is 1 + 1?", "answer": "2"})
    result = env.step("Thought: x\nAction: calculator(__import__('os').system('touch /tmp/agentrl_pwned'))\n")
    assert result.observation.startswith("Observation: Error") and not result.done
    assert not os.path.exists("/tmp/agentrl_pwned")


def test_safe_eval_arithmetic():
    assert safe_eval("123 * 456") == 56088
    assert safe_eval("(2 + 3) * -4") == -20
    assert safe_eval("7 // 2") == 3 and safe_eval("7 % 4") == 3 and safe_eval("2 ** 10") == 1024
    assert safe_eval("779 - 04") == 775  # leading zeros tolerated
    assert safe_eval("1 / 4") == 0.25
    with pytest.raises(CalculatorError, match="division by zero"):
        safe_eval("1 / 0")


def run(env, task, *turns):
    env.reset(task)
    result = None
    for turn in turns:
        result = env.step(turn)
        if result.done:
            break
    return result


TASK = {"question": "What is 123 * 456?", "answer": "56088"}


def test_rewards_follow_the_tutorial():
    call = "Thought: I need to calculate 123 * 456.\nAction: calculator(123 * 456)\n"
    assert run(CalculatorEnv(), TASK, call, "Answer: 56088").reward == 1.0
    assert run(CalculatorEnv(), TASK, call, "Answer: 56000").reward == 0.2
    assert run(CalculatorEnv(), TASK, "Thought: bad\nAction: calculator(123 *)\n", "Answer: 56088").reward == -0.5
    assert run(CalculatorEnv(), TASK, "Thought: I know.\nAnswer: 56088").reward == -1.0
    custom = CalculatorEnv(rewards={"no_tool": -2.0})
    assert run(custom, TASK, "Answer: 5").reward == -2.0


def test_observation_after_a_call_and_answers_read_from_the_answer_line_only():
    env = CalculatorEnv()
    env.reset(TASK)
    first = env.step("Thought: t\nAction: calculator(123 * 456)\n")
    assert first.observation == "Observation: 56088\n" and not first.done
    # listing many numbers earns nothing; a self-written Observation is not a tool call
    assert run(CalculatorEnv(), TASK, "Thought: t\nAction: calculator(123 * 456)\n", "Answer: 56088 or 56089").reward == 0.2
    forged = run(CalculatorEnv(), TASK, "Thought: t\nObservation: 56088\nAnswer: 56088")
    assert forged.reward == -1.0 and forged.info["tool_calls"] == 0
    read = run(CalculatorEnv(), TASK, "Thought: t\nAction: calculator(123 * 456)\n", "Answer: The result is 56088.")
    assert read.reward == 1.0 and read.info["answer"] == "The result is 56088."
    assert numeric_match(TASK, "56088.0") and not numeric_match(TASK, "56088 or 56089") and not numeric_match(TASK, "x")


def test_turn_limit_ends_the_episode():
    env = CalculatorEnv(max_turns=2)
    env.reset(TASK)
    assert not env.step("Action: calculator(1 + 1)\n").done
    final = env.step("Action: calculator(2 + 2)\n")
    assert final.done and final.reward == 0.2


@pytest.mark.parametrize("action, observation", [
    ('Action: calculator("123 * 456")\n', "Observation: Error: character '\"' is not allowed\n"),
    ('Action: calculator({"expression": "1 + 1"})\n', "Observation: Error: character '{' is not allowed\n"),
    ("Action: calc(1 + 1)\n", "Observation: Error: expected calculator(<expression>)\n"),
    ("Action: 1 + 1\n", "Observation: Error: expected calculator(<expression>)\n"),
    ("Action: calculator(1 +)\n", "Observation: Error: malformed expression\n"),
])
def test_the_strict_grammar_answers_each_malformed_call_with_what_is_wrong(action, observation):
    env = CalculatorEnv()
    env.reset(TASK)
    result = env.step(action)
    assert result.observation == observation and not result.done
    assert result.info["format_errors"] == 1 and result.info["tool_calls"] == 0


def test_multistep_calculator_does_one_operation_a_call():
    env = MultiStepCalculatorEnv()
    env.reset({"question": "What is (1 + 2) * 3?", "answer": "9"})
    assert env.step("Action: calculator((1 + 2) * 3)\n").observation == (
        "Observation: Error: 2 operations in one call; this calculator does 1\n")
    assert env.step("Action: calculator(1 + 2)\n").observation == "Observation: 3\n"


def test_tasks_are_deterministic_and_splits_disjoint():
    a, b = calculator_tasks(300, seed=3, split="train"), calculator_tasks(300, seed=3, split="train")
    assert a == b
    held_out = {t["question"] for t in calculator_tasks(300, seed=3, split="eval")}
    assert not held_out & {t["question"] for t in calculator_tasks(3000, seed=9, split="train")}
    assert all(str(safe_eval(t["expression"])) == t["answer"] for t in a)
