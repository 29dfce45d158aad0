"""Environments: the protocol, the calculator of the tutorials, and helpers to load a user's own."""

from agentrl.envs.base import Environment, StepResult, load_object, make_env
from agentrl.envs.calculator import (CalculatorEnv, MultiStepCalculatorEnv, calculator_demonstration, calculator_tasks,
                                     multistep_demonstration, multistep_tasks)
from agentrl.envs.safe_eval import CalculatorError, safe_eval

__all__ = [
    "CalculatorEnv",
    "CalculatorError",
    "Environment",
    "MultiStepCalculatorEnv",
    "StepResult",
    "calculator_demonstration",
    "calculator_tasks",
    "load_object",
    "make_env",
    "multistep_demonstration",
    "multistep_tasks",
    "safe_eval",
]
