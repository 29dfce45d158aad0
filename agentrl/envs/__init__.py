"""Environments: the protocol, the calculator of the tutorials, and helpers to load a user's own."""

from agentrl.envs.base import Corpus, Environment, StepResult, load_object, load_tasks, make_env
from agentrl.envs.calculator import (CALCULATOR_CORPUS, CHAT_CORPUS, MULTISTEP_CORPUS, CalculatorEnv, CalculatorToolEnv,
                                     MultiStepCalculatorEnv, calculator, calculator_demonstration, calculator_tasks,
                                     multistep_demonstration, multistep_tasks)
from agentrl.envs.safe_eval import CalculatorError, safe_eval
from agentrl.envs.search import SEARCH_CORPUS, SearchEnv, search_tasks
from agentrl.envs.word_problems import (WordProblemEnv, word_problem_demonstration, word_problem_tasks,
                                        word_problem_tool_demonstration)
from agentrl.envs.tools import (TOOL_PARSERS, ToolEnv, detect_tool_parser, parse_hermes_tool_calls,
                                parse_llama3_json_tool_calls, parse_mistral_tool_calls, tool_schema)

# The built-in corpora by name (BaseModelConfig.corpus), each defined beside its environment.
CORPORA: dict[str, Corpus] = {"calculator": CALCULATOR_CORPUS, "multistep": MULTISTEP_CORPUS, "chat": CHAT_CORPUS,
                              "search": SEARCH_CORPUS}

__all__ = [
    "CORPORA",
    "CalculatorEnv",
    "CalculatorError",
    "CalculatorToolEnv",
    "Corpus",
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
    "load_tasks",
    "make_env",
    "multistep_demonstration",
    "multistep_tasks",
    "parse_hermes_tool_calls",
    "parse_llama3_json_tool_calls",
    "parse_mistral_tool_calls",
    "safe_eval",
    "search_tasks",
    "tool_schema",
    "WordProblemEnv",
    "word_problem_demonstration",
    "word_problem_tasks",
    "word_problem_tool_demonstration",
]
