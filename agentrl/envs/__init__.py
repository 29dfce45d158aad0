"""Environments: the protocol, the calculator of the tutorials, and helpers to load a user's own."""

from agentrl.envs.base import Environment, StepResult, load_object, make_env
from agentrl.envs.calculator import (CalculatorEnv, CalculatorToolEnv, calculator, MultiStepCalculatorEnv, calculator_demonstration, calculator_tasks,
                                     multistep_demonstration, multistep_tasks)
from agentrl.envs.safe_eval import CalculatorError, safe_eval
from agentrl.envs.search import SearchEnv, search_tasks
from agentrl.envs.tools import (TOOL_PARSERS, ToolEnv, detect_tool_parser, parse_hermes_tool_calls,
                                parse_llama3_json_tool_calls, parse_mistral_tool_calls, tool_schema)

__all__ = [
    "CalculatorEnv",
    "CalculatorError",
    "CalculatorToolEnv",
    "Environment",
    "MultiStepCalculatorEnv",
    "SearchEnv",
    "TOOL_PARSERS",
    "StepResult",
    "ToolEnv",
    "calculator",
    "calculator_demonstration",
    "calculator_tasks",
    "detect_tool_parser",
    "load_object",
    "make_env",
    "multistep_demonstration",
    "multistep_tasks",
    "parse_hermes_tool_calls",
    "parse_llama3_json_tool_calls",
    "parse_mistral_tool_calls",
    "safe_eval",
    "search_tasks",
    "tool_schema",
]
