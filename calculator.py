"""The Calculator tool of GTA and of the built-in world: arithmetic by walking a whitelist of AST
nodes - never eval.

    calculate("(3*2.50+1.20)*0.92")  ->  "8.004"     (a result, or "Error: ...": it never raises)

Numbers, + - * / // % **, unary signs, parentheses, and math functions and constants by name
(`sqrt(2)` or `math.sqrt(2)`). An expression is text a policy wrote, so every operation is sized
before it runs: no integer past MAX_INT_BITS, no factorial past MAX_FACTORIAL, no rounding to
more than MAX_NDIGITS digits, and nothing longer than MAX_EXPRESSION_CHARS is parsed.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 1000


MAX_INT_BITS = 4000          # ~1200 digits: bounds the work of *, ** and str() on integers


MAX_FACTORIAL = 1000


MAX_NDIGITS = 1000           # round(x, n) builds 10 ** |n|: n = -10**8 would run for minutes


class CalculatorError(ValueError):
    pass


def _int_arg(x, fn):
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if not isinstance(x, int):
        raise CalculatorError(f"{fn}() needs an integer")
    if abs(x) > MAX_FACTORIAL:
        raise CalculatorError(f"{fn}() argument too large (limit {MAX_FACTORIAL})")
    return x


def _power(a, b):
    # Refuse integer powers whose result would exceed MAX_INT_BITS before computing them.
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        if b * math.log2(abs(a)) > MAX_INT_BITS:
            raise CalculatorError("result too large")
    return a ** b


# Every operation is sized before it runs: each operand is already <= MAX_INT_BITS (checked
# when it was computed), and the functions below refuse arguments whose result, or the work to
# get it, would be larger. Checking the result afterwards is not enough: the work is done by then.

def _multiply(a, b):
    if isinstance(a, int) and isinstance(b, int) and \
            a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalculatorError("result too large")
    return a * b


def _round(x, ndigits=None):
    if ndigits is None:
        return round(x)
    if isinstance(ndigits, float) and ndigits.is_integer():
        ndigits = int(ndigits)
    if not isinstance(ndigits, int):
        raise CalculatorError("round() needs an integer number of digits")
    if abs(ndigits) > MAX_NDIGITS:
        raise CalculatorError(f"round() digits out of range (limit {MAX_NDIGITS})")
    return round(x, ndigits)


def _lcm(*xs):
    if sum(x.bit_length() for x in xs if isinstance(x, int)) > MAX_INT_BITS + len(xs):
        raise CalculatorError("result too large")
    return math.lcm(*xs)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _multiply,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: _power}


_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


_FUNCTIONS = {
    "abs": abs, "round": _round, "min": min, "max": max, "int": int, "float": float,
    "pow": _power, "sqrt": math.sqrt, "cbrt": math.cbrt, "exp": math.exp, "log": math.log,
    "log10": math.log10, "log2": math.log2, "log1p": math.log1p, "sin": math.sin,
    "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan,
    "atan2": math.atan2, "sinh": math.sinh, "cosh": math.cosh, "tanh": math.tanh,
    "degrees": math.degrees, "radians": math.radians, "floor": math.floor, "ceil": math.ceil,
    "trunc": math.trunc, "fabs": math.fabs, "hypot": math.hypot, "gcd": math.gcd,
    "lcm": _lcm, "isqrt": math.isqrt, "fsum": lambda *xs: math.fsum(xs),
    "factorial": lambda n: math.factorial(_int_arg(n, "factorial")),
    "comb": lambda n, k: math.comb(_int_arg(n, "comb"), _int_arg(k, "comb")),
    "perm": lambda n, k: math.perm(_int_arg(n, "perm"), _int_arg(k, "perm")),
}


_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):
            return node.value
        raise CalculatorError(f"unsupported literal {node.value!r}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, (ast.Name, ast.Attribute)):
        name = _qualified_name(node)
        if name not in _CONSTANTS:
            raise CalculatorError(f"unknown name '{name}'")
        return _CONSTANTS[name]
    elif isinstance(node, ast.Call):
        name = _qualified_name(node.func)
        if name not in _FUNCTIONS:
            raise CalculatorError(f"unknown function '{name}'")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError(f"{name}() takes plain positional arguments only")
        value = _FUNCTIONS[name](*[_evaluate(a) for a in node.args])
    else:
        raise CalculatorError(f"unsupported syntax ({type(node).__name__})")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    return value


def _qualified_name(node) -> str:
    # `sqrt` and `math.sqrt` both name the whitelisted function; no other attribute exists.
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "math":
        return node.attr
    raise CalculatorError("attribute access is not allowed")


def calculate(expression: str) -> str:
    """Evaluate one arithmetic expression; the result as Python prints it, or 'Error: ...'.

    Numbers, + - * / // % **, unary signs, parentheses, and math functions/constants by name
    (`sqrt(2)` or `math.sqrt(2)`). Never raises.
    """
    try:
        if not isinstance(expression, str):
            raise CalculatorError("the expression must be a string")
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
        tree = ast.parse(expression.strip(), mode="eval")
        if isinstance(tree.body, ast.Tuple):
            raise CalculatorError("a comma separates values: write numbers without thousands "
                                  "separators")
        return str(_evaluate(tree))
    except CalculatorError as e:
        return f"Error: {e}"
    except SyntaxError as e:
        return f"Error: invalid expression ({e.msg})"
    except RecursionError:
        return "Error: expression nested too deeply"
    except Exception as e:  # ZeroDivisionError, math domain errors, overflow, bad arity ...
        return f"Error: {e}"


