"""Model-written arithmetic never yields a complex number or a traceback: a CalculatorError (an observation)."""

import pytest

from agentrl.envs.calculator import CalculatorEnv
from agentrl.envs.safe_eval import CalculatorError, safe_eval


@pytest.mark.parametrize("expression", ["(-8)**(1/3)", "0**((-1)**0.5)", "(-1)**0.5", "(-1)**0.5 * 0", "2**((-4)**0.5)",
                                        "1 + (-2)**1.5"])
def test_complex_results_are_calculator_errors(expression):
    with pytest.raises(CalculatorError, match="not a real number"):
        safe_eval(expression)


def test_real_powers_still_work():
    assert safe_eval("8**(1/3)") == pytest.approx(2.0)
    assert safe_eval("(-8)**3") == -512 and safe_eval("(-2)**-2") == 0.25


def test_the_env_answers_with_an_observation():
    env = CalculatorEnv()
    env.reset({"question": "What is 1 + 1?", "answer": 2, "expression": "1 + 1"})
    result = env.step("Action: calculator(0**((-1)**0.5))\n")
    assert result.observation is not None and "not a real number" in result.observation and not result.done
