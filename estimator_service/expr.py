"""A small safe evaluator for the arithmetic expressions of mechanism files (never ``eval``).

Grammar: numbers (``2``, ``1.5e-3``), names from an environment, ``+ - * / ^`` (``^`` is power and
right-associative), unary minus, parentheses, the constant ``pi`` and the functions ``sin cos tan
sqrt deg2rad abs atan2``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

_TOKEN = re.compile(r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>[-+*/^(),]))")

FUNCTIONS: dict[str, tuple[int, Callable[..., float]]] = {
    "sin": (1, math.sin),
    "cos": (1, math.cos),
    "tan": (1, math.tan),
    "sqrt": (1, math.sqrt),
    "deg2rad": (1, math.radians),
    "abs": (1, abs),
    "atan2": (2, math.atan2),
}
CONSTANTS = {"pi": math.pi}


class ExprError(ValueError):
    """A malformed expression or an undefined name; the message quotes the expression."""


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.replace("∗", "*")
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise ExprError(f"unexpected character {text[pos:].strip()[0]!r} in {text!r}")
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, text: str, env: Mapping[str, float]) -> None:
        self.text, self.env = text, env
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, op: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ExprError(f"unexpected end of expression {self.text!r}")
        if op is not None and tok != ("op", op):
            raise ExprError(f"expected {op!r}, got {tok[1]!r} in {self.text!r}")
        self.i += 1
        return tok

    def parse(self) -> float:
        value = self.sum()
        if self.peek() is not None:
            raise ExprError(f"unexpected {self.peek()[1]!r} in {self.text!r}")  # type: ignore[index]
        return value

    def sum(self) -> float:
        value = self.product()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            rhs = self.product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def product(self) -> float:
        value = self.unary()
        while self.peek() in (("op", "*"), ("op", "/")):
            op = self.take()[1]
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise ExprError(f"division by zero in {self.text!r}")
            value = value * rhs if op == "*" else value / rhs
        return value

    def unary(self) -> float:
        if self.peek() == ("op", "-"):
            self.take()
            return -self.unary()
        if self.peek() == ("op", "+"):
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> float:
        base = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            return float(base ** self.unary())
        return base

    def atom(self) -> float:
        kind, text = self.take()
        if kind == "num":
            return float(text)
        if kind == "op" and text == "(":
            value = self.sum()
            self.take(")")
            return value
        if kind == "name":
            if text in FUNCTIONS:
                nargs, fn = FUNCTIONS[text]
                self.take("(")
                args = [self.sum()]
                while self.peek() == ("op", ","):
                    self.take()
                    args.append(self.sum())
                self.take(")")
                if len(args) != nargs:
                    raise ExprError(f"{text}() takes {nargs} argument(s), got {len(args)} in {self.text!r}")
                try:
                    return float(fn(*args))
                except ValueError as exc:
                    raise ExprError(f"{text}{tuple(args)}: {exc} in {self.text!r}") from None
            if text in self.env:
                return float(self.env[text])
            if text in CONSTANTS:
                return CONSTANTS[text]
            raise ExprError(f"undefined name {text!r} in {self.text!r}")
        raise ExprError(f"unexpected {text!r} in {self.text!r}")


def evaluate(expr: str | int | float, env: Mapping[str, float] | None = None) -> float:
    """Value of ``expr`` (a number or an expression string) with names from ``env``."""
    if isinstance(expr, bool):
        raise ExprError(f"expected a number or an expression, got {expr!r}")
    if isinstance(expr, (int, float)):
        return float(expr)
    if not isinstance(expr, str):
        raise ExprError(f"expected a number or an expression, got {expr!r}")
    return _Parser(expr, env or {}).parse()
