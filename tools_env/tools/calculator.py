"""`calculator`: safe arithmetic by walking a Python ``ast`` — nothing is ever ``eval``-ed.

Numbers, ``+ - * / // % **``, parentheses, unary minus/plus, the constants ``pi``, ``e``, ``tau``
and a few functions (``sqrt log log2 log10 exp sin cos tan asin acos atan abs round floor ceil
min max``). Size guards keep a policy from asking for ``9**9**9``: integers are capped at
``MAX_INT_BITS`` bits, exponents at ``MAX_EXPONENT``, expressions at ``MAX_CHARS`` characters
(which also bounds the syntax tree). Cost 0; latency is the measured evaluation time.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from typing import Any, Callable

from tools_env.tools.base import EpisodeContext, Tool, ToolResult, register_tool

MAX_CHARS = 1000
MAX_INT_BITS = 4096
MAX_EXPONENT = 10_000

Number = int | float


class CalcError(ValueError):
    pass


_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "min": min,
    "max": max,
}


def _check_int(x: Number) -> Number:
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise CalcError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalcError("result is not a finite number")
    return x


def _pow(a: Number, b: Number) -> Number:
    if abs(b) > MAX_EXPONENT:
        raise CalcError(f"exponent too large (|exponent| > {MAX_EXPONENT})")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and a not in (-1, 0, 1):
        if (abs(a).bit_length() - 1) * b > MAX_INT_BITS:
            raise CalcError(f"result too large (more than {MAX_INT_BITS} bits)")
    if a == 0 and b < 0:
        raise CalcError("division by zero")
    result = a**b
    if isinstance(result, complex):
        raise CalcError("result is a complex number")
    return result


def _mul(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalcError(f"result too large (more than {MAX_INT_BITS} bits)")
    return a * b


_BINOPS: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: _mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _pow,
}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalcError(f"unsupported literal {node.value!r}")
        return _check_int(node.value)
    if isinstance(node, ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
            raise CalcError(f"unsupported operator {type(node.op).__name__}{hint}")
        left, right = _eval(node.left), _eval(node.right)
        try:
            return _check_int(op(left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("result too large") from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name):
        if node.id not in _CONSTANTS:
            raise CalcError(f"unknown name {node.id!r}")
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in _FUNCTIONS or node.keywords:
            raise CalcError(
                f"unsupported function {name or ast.unparse(node.func)!r}; available: {', '.join(_FUNCTIONS)}"
            )
        args = [_eval(a) for a in node.args]
        try:
            return _check_int(_FUNCTIONS[name](*args))
        except (ValueError, TypeError, OverflowError) as e:
            raise CalcError(f"{name}: {e}") from None
    raise CalcError(f"unsupported syntax {type(node).__name__}")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``; ``CalcError`` says what is wrong with it."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError(f"cannot parse expression: {getattr(e, 'msg', e)}") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise CalcError("expression nested too deeply") from None


def format_number(x: Number) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


@register_tool
class Calculator(Tool):
    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses, "
        "constants pi e tau, functions sqrt log log2 log10 exp sin cos tan asin acos atan abs round "
        "floor ceil min max. Free and instant."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 10 / 7"}},
        "required": ["expression"],
    }

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        t0 = time.perf_counter()
        try:
            observation, error = format_number(evaluate(arguments["expression"])), None
        except CalcError as e:
            observation, error = f"calculator error: {e}", str(e)
        meta = {"stated": observation} if error is None else {}  # one value, computed
        return ToolResult(observation=observation, latency_s=time.perf_counter() - t0, error=error, meta=meta)
