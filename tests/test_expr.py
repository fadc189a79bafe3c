"""The safe expression evaluator of mechanism files: values, precedence, functions and errors."""

from __future__ import annotations

import math
import re

import pytest

from estimator_service.expr import ExprError, evaluate


@pytest.mark.parametrize("expr, env, expected", [
    ("2", {}, 2.0),
    ("1e-3", {}, 1e-3),
    ("1.5E+2", {}, 150.0),
    (".5 + 1.", {}, 1.5),
    (7, {}, 7.0),
    (-0.25, {}, -0.25),
    ("1 + 2*3", {}, 7.0),
    ("(1 + 2)*3", {}, 9.0),
    ("8/4/2", {}, 1.0),  # left-associative
    ("7 - 2 - 1", {}, 4.0),
    ("2^3^2", {}, 512.0),  # power is right-associative
    ("-2^2", {}, -4.0),  # power binds tighter than unary minus
    ("2^-2", {}, 0.25),
    ("3--2", {}, 5.0),
    ("+3", {}, 3.0),
    ("2*pi", {}, 2 * math.pi),
    ("(1/3)*mass*length^2", {"mass": 3.0, "length": 2.0}, 4.0),
    ("x1+5*cos(45*pi/180)", {"x1": 7.0}, 7.0 + 5 / math.sqrt(2)),
    ("sin(pi/6) + tan(pi/4)", {}, 1.5),
    ("sqrt(16) + deg2rad(180)", {}, 4.0 + math.pi),
    ("abs(-3) * atan2(1, 1)", {}, 3 * math.pi / 4),
    ("atan2(0 - 1, -1)", {}, -3 * math.pi / 4),
    ("  L12 ^ 2\t/ 12 ", {"L12": 0.54}, 0.54**2 / 12),
])
def test_values(expr: str | float, env: dict[str, float], expected: float) -> None:
    assert evaluate(expr, env) == pytest.approx(expected, rel=1e-15, abs=1e-15)


@pytest.mark.parametrize("expr, message", [
    ("L2*2", "undefined name 'L2' in 'L2*2'"),
    ("exp(1)", "undefined name 'exp' in 'exp(1)'"),
    ("2 +", "unexpected end of expression in '2 +'"),
    ("(1", "expected ')', got end of expression in '(1'"),
    ("()", "unexpected ')' at column 2 in '()'"),
    ("1 2", "unexpected '2' at column 3 in '1 2'"),
    ("1 $ 2", "unexpected character '$' at column 3 in '1 $ 2'"),
    ("__import__('os')", "unexpected character \"'\" at column 12"),
    ("L.real", "unexpected character '.' at column 2"),
    ("1e", "unexpected 'e' at column 2 in '1e'"),
    ("sin 1", "expected '(', got '1' at column 5 in 'sin 1'"),
    ("pi(1)", "unexpected '(' at column 3 in 'pi(1)'"),
    ("sin(1, 2)", "sin() takes 1 argument(s), got 2"),
    ("atan2(1)", "atan2() takes 2 argument(s), got 1"),
    ("1/(L-1)", "division by zero in '1/(L-1)'"),
    ("sqrt(-1)", "sqrt(-1): math domain error"),
    ("(-8)^(1/3)", "-8^0.333333 is not a finite real number"),
    ("10^1000", "10^1000 is not a finite real number"),
    ("0^-1", "0^-1 is not a finite real number"),
    ("1e400", "1e400 is not a finite real number"),
    ("", "empty expression in ''"),
    ("   ", "empty expression"),
])
def test_errors_are_precise(expr: str, message: str) -> None:
    with pytest.raises(ExprError, match=re.escape(message)):
        evaluate(expr, {"L": 1.0})


@pytest.mark.parametrize("value", [True, None, [1, 2], {"a": 1}, float("nan"), float("inf")])
def test_non_expression_values_are_rejected(value: object) -> None:
    with pytest.raises(ExprError, match="expected a number or an expression|not a finite real number"):
        evaluate(value)  # type: ignore[arg-type]


def test_expr_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        evaluate("nope")
