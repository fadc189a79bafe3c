"""A small safe evaluator for the arithmetic expressions of mechanism files (never ``eval``).

Grammar (recursive descent; ``^`` binds tighter than unary minus, so ``-2^2 == -4``)::

    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/") unary)*
    unary   := ("-" | "+") unary | power
    power   := atom ("^" unary)?               # right-associative: 2^3^2 == 2^9
    atom    := NUMBER | NAME | FUNC "(" sum ("," sum)* ")" | "(" sum ")"

Numbers: ``2``, ``1.5``, ``.5``, ``1e-3``.  Names come from an environment mapping (parameters,
point coordinates, ...) or are the constant ``pi``.  Functions: ``sin cos tan`` (rad), ``sqrt``,
``deg2rad``, ``abs``, ``atan2(y, x)`` (rad).  Every result must be a finite real number.  Errors
raise :class:`ExprError` (a ``ValueError``) quoting the expression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

FUNCTIONS: dict[str, tuple[int, Callable[..., float]]] = {
    "sin": (1, math.sin),
    "cos": (1, math.cos),
    "tan": (1, math.tan),
    "sqrt": (1, math.sqrt),
    "deg2rad": (1, math.radians),
    "abs": (1, abs),
    "atan2": (2, math.atan2),
}
CONSTANTS: dict[str, float] = {"pi": math.pi}
#: deepest nesting of parentheses, function calls and signs (ExprError beyond it, never a RecursionError)
MAX_DEPTH = 100
#: names an environment cannot redefine
RESERVED = frozenset(FUNCTIONS) | frozenset(CONSTANTS)

_TOKEN = re.compile(
    r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>[-+*/^(),])|(?P<space>\s+)"
)


class ExprError(ValueError):
    """A malformed expression, an undefined name or a non-real result; the message quotes the expression."""


class _Token(NamedTuple):
    kind: str  # "num" | "name" | "op" | "end"
    text: str
    col: int  # 1-based column in the expression


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ExprError(f"unexpected character {text[pos]!r} at column {pos + 1} in {text!r}")
        kind = m.lastgroup or ""
        if kind != "space":
            tokens.append(_Token(kind, m.group(), pos + 1))
        pos = m.end()
    tokens.append(_Token("end", "", len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str, env: Mapping[str, float]) -> None:
        self.text, self.env = text, env
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0  #: current nesting of sum() and unary() (see MAX_DEPTH)

    def error(self, problem: str) -> ExprError:
        shown = self.text if len(self.text) <= 200 else self.text[:200] + "..."
        return ExprError(f"{problem} in {shown!r}")

    def unexpected(self, tok: _Token) -> ExprError:
        if tok.kind == "end":
            return self.error("unexpected end of expression")
        return self.error(f"unexpected {tok.text!r} at column {tok.col}")

    def peek(self) -> _Token:
        return self.tokens[self.i]

    def at_op(self, *ops: str) -> bool:
        tok = self.tokens[self.i]
        return tok.kind == "op" and tok.text in ops

    def take(self) -> _Token:
        tok = self.tokens[self.i]
        if tok.kind == "end":
            raise self.unexpected(tok)
        self.i += 1
        return tok

    def expect(self, op: str) -> None:
        if not self.at_op(op):
            tok = self.peek()
            got = "end of expression" if tok.kind == "end" else f"{tok.text!r} at column {tok.col}"
            raise self.error(f"expected {op!r}, got {got}")
        self.i += 1

    def real(self, value: float | complex, what: str) -> float:
        """``value`` as a float, or an error if it is complex, infinite or NaN."""
        if isinstance(value, complex) or not math.isfinite(value):
            raise self.error(f"{what} is not a finite real number")
        return float(value)

    def parse(self) -> float:
        if self.peek().kind == "end":
            raise self.error("empty expression")
        value = self.sum()
        if self.peek().kind != "end":
            raise self.unexpected(self.peek())
        return value

    def nest(self) -> None:
        """Enter one nesting level; ExprError beyond MAX_DEPTH (the caller leaves with ``depth -= 1``)."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nested more than {MAX_DEPTH} levels deep")

    def sum(self) -> float:
        self.nest()
        value = self.product()
        while self.at_op("+", "-"):
            op = self.take().text
            rhs = self.product()
            value = self.real(value + rhs if op == "+" else value - rhs, f"{value:g} {op} {rhs:g}")
        self.depth -= 1
        return value

    def product(self) -> float:
        value = self.unary()
        while self.at_op("*", "/"):
            op = self.take().text
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise self.error("division by zero")
            value = self.real(value * rhs if op == "*" else value / rhs, f"{value:g} {op} {rhs:g}")
        return value

    def unary(self) -> float:
        if self.at_op("-", "+"):
            sign = -1.0 if self.take().text == "-" else 1.0
            self.nest()
            value = sign * self.unary()
            self.depth -= 1
            return value
        return self.power()

    def power(self) -> float:
        base = self.atom()
        if not self.at_op("^"):
            return base
        self.take()
        self.nest()
        exponent = self.unary()
        self.depth -= 1
        try:
            value: float | complex = base**exponent
        except (OverflowError, ZeroDivisionError):
            value = math.inf
        return self.real(value, f"{base:g}^{exponent:g}")

    def atom(self) -> float:
        tok = self.take()
        if tok.kind == "num":
            return self.real(float(tok.text), tok.text)
        if tok.kind == "op" and tok.text == "(":
            value = self.sum()
            self.expect(")")
            return value
        if tok.kind != "name":
            raise self.unexpected(tok)
        if tok.text in FUNCTIONS:
            return self.call(tok.text)
        if tok.text in CONSTANTS:
            return CONSTANTS[tok.text]
        if tok.text in self.env:
            return float(self.env[tok.text])
        raise self.error(f"undefined name {tok.text!r}")

    def call(self, name: str) -> float:
        nargs, fn = FUNCTIONS[name]
        self.expect("(")
        args = [self.sum()]
        while self.at_op(","):
            self.take()
            args.append(self.sum())
        self.expect(")")
        if len(args) != nargs:
            raise self.error(f"{name}() takes {nargs} argument(s), got {len(args)}")
        shown = f"{name}({', '.join(f'{a:g}' for a in args)})"
        try:
            value = fn(*args)
        except ValueError as exc:
            raise self.error(f"{shown}: {exc}") from None
        return self.real(value, shown)


def evaluate(expr: str | int | float, env: Mapping[str, float] | None = None) -> float:
    """Value of ``expr`` (a number, or an expression string) with names from ``env``.

    Raises :class:`ExprError` on a syntax error, an undefined name, a wrong number of function
    arguments, division by zero or a result that is not a finite real number.
    """
    if isinstance(expr, bool) or not isinstance(expr, (int, float, str)):
        raise ExprError(f"expected a number or an expression, got {expr!r}")
    if isinstance(expr, str):
        return _Parser(expr, env or {}).parse()
    if not math.isfinite(expr):
        raise ExprError(f"{expr!r} is not a finite real number")
    return float(expr)
