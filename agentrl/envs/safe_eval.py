"""A calculator that never runs model-written code: an AST whitelist, never `eval`.

Accepted: ASCII numbers, + - * / // % **, unary +/-, parentheses. Bounded input length, exponent and
magnitude, so hostile input (`9**9**9**9`, `1<<10**9`, `__import__(...)`) fails fast with a message.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_LENGTH = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/%(). ]*")  # fullmatch: `$` would also match before a final newline
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not a well-formed, bounded arithmetic expression."""


def _check(value: int | float) -> int | float:
    if not isinstance(value, (int, float)):  # (-8) ** (1/3) is complex in Python; a real calculator refuses it
        raise CalculatorError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (left == 0 and right < 0)):
            raise CalculatorError(f"exponent {right} out of range")
        try:
            return _check(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def safe_eval(expression: str, max_operations: int | None = None) -> int | float:
    """Evaluate a bounded arithmetic expression. Raises CalculatorError with a readable message.

    max_operations: refuse expressions with more binary operations (1 = one `a op b` per call).
    """
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    if not expression.strip():
        raise CalculatorError("empty expression")
    if not _ALLOWED_CHARS.fullmatch(expression):
        bad = next(c for c in expression if not _ALLOWED_CHARS.fullmatch(c))
        raise CalculatorError(f"character {bad!r} is not allowed")
    # Models sometimes write "779 - 04"; Python rejects leading zeros, a calculator need not.
    expression = _LEADING_ZEROS.sub("", expression)
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise CalculatorError("malformed expression") from None
    if max_operations is not None:
        n_ops = sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))
        if n_ops > max_operations:
            raise CalculatorError(f"{n_ops} operations in one call; this calculator does {max_operations}")
    return _eval(tree.body)


def format_number(value: int | float) -> str:
    """Integers print as integers (56088, not 56088.0); other floats to 6 significant decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}".rstrip("0").rstrip(".")
