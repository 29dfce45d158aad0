"""Environments: the protocol, the calculator of the tutorials, and helpers to load a user's own."""

from agentrl.envs.base import Environment, StepResult, load_object, make_env
from agentrl.envs.calculator import CalculatorEnv, calculator_demonstration, calculator_tasks
from agentrl.envs.safe_eval import CalculatorError, safe_eval

__all__ = [
    "CalculatorEnv",
    "CalculatorError",
    "Environment",
    "StepResult",
    "calculator_demonstration",
    "calculator_tasks",
    "load_object",
    "make_env",
    "safe_eval",
]
