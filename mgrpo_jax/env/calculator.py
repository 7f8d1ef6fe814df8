"""The offline `reason` tool's engine: a small, safe evaluator for arithmetic, comparisons and dates.

Expressions are parsed with `ast` and walked against an allow-list; nothing is ever passed to `eval`.
Supported: integer/decimal literals, ISO dates (`1921-03-04`, written bare or quoted), `+ - * / // % **`,
unary minus, comparisons (chained too), `and`/`or`/`not`, parentheses, and the functions
`abs min max round sum` plus `days_between(a, b)` and `years_between(a, b)` (whole years elapsed from
a to b, negative if b is earlier). `date - date` gives days. Errors come back as `CalculatorError`
whose message the tool shows the agent.

`evaluate` is total on strings: whatever the agent writes (tuples in comparisons, huge rounding digits,
complex powers, mixed dates and numbers) is a `CalculatorError`, never another exception, and no input runs
for long (the expression's length, node count, exponents, magnitudes and rounding digits are bounded).
"""

from __future__ import annotations

import ast
import datetime
import math
import operator
import re
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
MAX_ROUND_DIGITS = 30  # round(x, d) with a huge |d| would build 10**|d|

_ISO_DATE = re.compile(r"(?<![\w\"'])(\d{4})-(\d{2})-(\d{2})(?![\w\"'])")
_QUOTED_DATE = re.compile(r"[\"'](\d{4}-\d{2}-\d{2})[\"']")


class CalculatorError(ValueError):
    """An expression the calculator rejects; the message is written for the agent."""


def _as_date(value: Any, what: str) -> datetime.date:
    if isinstance(value, datetime.date):
        return value
    raise CalculatorError(f"{what} expects dates (YYYY-MM-DD), got {_format(value)}")


def _years_between(start: Any, end: Any) -> int:
    start, end = _as_date(start, "years_between"), _as_date(end, "years_between")
    if end < start:
        return -_years_between(end, start)
    years = end.year - start.year
    if (end.month, end.day) < (start.month, start.day):
        years -= 1
    return years


def _days_between(start: Any, end: Any) -> int:
    return (_as_date(end, "days_between") - _as_date(start, "days_between")).days


def _numbers(values: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    if len(values) == 1 and isinstance(values[0], list | tuple):
        values = tuple(values[0])
    if not values:
        raise CalculatorError(f"{what} needs at least one value")
    return values


def _extreme(pick: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`min`/`max` over numbers, or over dates; never a mix (Python would raise a TypeError)."""

    def function(*values: Any) -> Any:
        values = _numbers(values, what)
        if all(isinstance(value, datetime.date) for value in values):
            return pick(values)
        return pick(_number(value, what) for value in values)

    return function


def _round(value: Any, digits: Any = 0) -> int | float:
    value, digits = _number(value, "round"), _number(digits, "round")
    if digits != int(digits) or abs(digits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round takes a whole number of digits between -{MAX_ROUND_DIGITS} and "
                              f"{MAX_ROUND_DIGITS}, got {_format(digits)}")
    return round(value, int(digits))


# name -> (function, fewest arguments, most arguments or None for any number)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int | None]] = {
    "abs": (lambda x: abs(_number(x, "abs")), 1, 1),
    "min": (_extreme(min, "min"), 1, None),
    "max": (_extreme(max, "max"), 1, None),
    "sum": (lambda *xs: sum(_number(x, "sum") for x in _numbers(xs, "sum")), 1, None),
    "round": (_round, 1, 2),
    "days_between": (_days_between, 2, 2),
    "years_between": (_years_between, 2, 2),
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_COMPARE = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}


def _number(value: Any, what: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"{what} expects numbers, got {_format(value)}")
    return value


def _check_magnitude(value: Any) -> Any:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("the result is too large")
    return value


def _binary(op: ast.operator, left: Any, right: Any) -> Any:
    if isinstance(op, ast.Sub) and isinstance(left, datetime.date) and isinstance(right, datetime.date):
        return (left - right).days
    symbol = type(op).__name__
    left, right = _number(left, symbol), _number(right, symbol)
    if isinstance(op, ast.Pow) and abs(right) > MAX_EXPONENT:
        raise CalculatorError(f"exponents above {MAX_EXPONENT} are not supported")
    try:
        return _check_magnitude(_BINARY[type(op)](left, right))
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or isinstance(node.value, int | float):
            return _check_magnitude(node.value)
        raise CalculatorError(f"unsupported literal {node.value!r}")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.keywords:
            raise CalculatorError("only plain calls of the listed functions are supported")
        if node.func.id == "date":
            return _date_literal(node)
        if node.func.id not in _FUNCTIONS:
            raise CalculatorError(f"unknown function {node.func.id!r}; use one of {sorted(_FUNCTIONS)}")
        function, fewest, most = _FUNCTIONS[node.func.id]
        if len(node.args) < fewest or (most is not None and len(node.args) > most):
            raise CalculatorError(f"wrong number of arguments for {node.func.id}")
        return _check_magnitude(function(*(_evaluate(argument) for argument in node.args)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _binary(node.op, _evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand)
        if isinstance(node.op, ast.Not):
            return not operand
        if isinstance(node.op, ast.USub):
            return -_number(operand, "negation")
        if isinstance(node.op, ast.UAdd):
            return _number(operand, "unary plus")
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            if type(op) not in _COMPARE:
                raise CalculatorError("unsupported comparison")
            right = _evaluate(right_node)
            for value in (left, right):
                if isinstance(value, tuple):  # e.g. (1, 2) < 3: Python would raise a TypeError
                    raise CalculatorError(f"comparisons need numbers or dates, got ({_format(value)})")
            if isinstance(left, datetime.date) != isinstance(right, datetime.date):
                raise CalculatorError("cannot compare a date with a number")
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(value) for value in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Tuple | ast.List):
        return tuple(_evaluate(element) for element in node.elts)
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _date_literal(node: ast.Call) -> datetime.date:
    (argument,) = node.args if len(node.args) == 1 else (None,)
    if not isinstance(argument, ast.Constant) or not isinstance(argument.value, str):
        raise CalculatorError("write dates as YYYY-MM-DD")
    try:
        return datetime.date.fromisoformat(node.args[0].value)
    except ValueError:
        raise CalculatorError(f"{node.args[0].value!r} is not a valid date") from None


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return format(value, ".10g")
    if isinstance(value, tuple):
        return ", ".join(_format(element) for element in value)
    return str(value)


def evaluate(expression: str) -> str:
    """Evaluate `expression` and return the result as text (`true`/`false` for comparisons, integral
    floats without `.0`, dates as YYYY-MM-DD); raises `CalculatorError` with a readable message."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the problem is empty; write an expression such as 3 * (4 + 5)")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    # Dates become date("...") calls before parsing, so 1921-03-04 is a date and not 1921 minus 3 minus 4.
    source = _QUOTED_DATE.sub(lambda match: f'date("{match.group(1)}")', expression.strip())
    source = _ISO_DATE.sub(lambda match: f'date("{match.group(0)}")', source)
    source = source.replace("×", "*").replace("÷", "/").replace("^", "**")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("could not parse the expression; use numbers, dates, operators and "
                              f"functions {sorted(_FUNCTIONS)}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    try:
        value = _evaluate(tree)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    if value == ():
        raise CalculatorError("the expression has no value; write one such as 3 * (4 + 5)")
    return _format(value)
