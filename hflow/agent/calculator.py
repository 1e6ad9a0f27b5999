"""Exact arithmetic on a model-written expression, without eval.

`evaluate("37 * 86")` returns ``"3182"``. The expression is parsed with ``ast.parse(mode="eval")`` and
only these nodes are evaluated; anything else raises ValueError with a message meant for the model:

* numbers: integers, and decimals or scientific notation (``0.1``, ``1e-3``) read exactly from their
  text (``0.1`` is 1/10, not the nearest binary float); no complex numbers;
* ``+ - * / // % **``, unary ``+``/``-``, parentheses. ``%`` is the remainder (not "percent"), ``//``
  floors, ``/`` divides exactly;
* the ways models write them: ``x``, ``X`` and ``×`` between operands multiply (so ``0x10`` reads as
  0 × 10: there are no hexadecimal literals), ``÷`` divides, ``^`` is the power (models mean 2^10 as
  1024, never as a bitwise xor), ``−`` (the Unicode minus) subtracts, and a trailing ``=`` is ignored.

Every value is a `fractions.Fraction`, so ``1/3 * 3`` is ``1`` and ``0.1 + 0.2`` is ``0.3``.

Guards keep every call fast (well under 0.1 s): an expression has at most `MAX_EXPRESSION_CHARS`
characters, every value (and so the result) at most about `MAX_DIGITS` digits in its numerator and
denominator, and a power is refused before it is computed when its result would be larger; so
``9**9**9`` is refused at once. A fractional power is computed only when its value is rational
(``16 ** 0.5`` is 4, ``2 ** 0.5`` is refused).

The result is written by one rule: an integer as its digits (``"3182"``, ``"-7"``); another number as
a decimal when its decimal expansion ends within `MAX_DECIMALS` digits after the point (``"0.3"``,
``"-2.125"``), else as the reduced fraction ``"a/b"`` (``"1/3"``, ``"-22/7"``).
"""

from __future__ import annotations

import ast
import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = ["MAX_DECIMALS", "MAX_DIGITS", "MAX_EXPRESSION_CHARS", "evaluate"]

MAX_EXPRESSION_CHARS = 2000
MAX_DIGITS = 1000
MAX_DECIMALS = 12

# An integer of at most _MAX_BITS bits has at most MAX_DIGITS digits; one a few bits longer may too.
_MAX_BITS = math.floor(MAX_DIGITS * math.log2(10))
_ALLOWED = "numbers, + - * / // % ** (or ^), and parentheses"

# x between operands: after a digit, a point, a closing parenthesis or a space; before a digit, a
# point, an opening parenthesis, a sign or a space. Not inside names (`exp`, `max` stay names, refused).
_TIMES_X = re.compile(r"(?<=[0-9.)\s])[xX](?=[\s0-9.(+\-])")
_SPELLINGS = (("×", "*"), ("÷", "/"), ("−", "-"), ("^", "**"))


def evaluate(expression: str) -> str:
    """The exact value of `expression` as text (see the module's rules); ValueError names what is wrong."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is too long ({len(expression)} characters, at most {MAX_EXPRESSION_CHARS})")
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise ValueError("the expression is empty")
    for spelling, operator in _SPELLINGS:
        text = text.replace(spelling, operator)
    text = _TIMES_X.sub("*", text)
    try:
        tree = ast.parse(text, mode="eval")
        value = _Evaluator(text).visit(tree.body)
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}; the calculator takes {_ALLOWED}") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return format_value(value)


def format_value(value: Fraction) -> str:
    """`value` as text: digits for an integer, a decimal that ends within MAX_DECIMALS places, else a/b."""
    if value.denominator == 1:
        return str(value.numerator)
    places = _decimal_places(value.denominator)
    if places is None or places > MAX_DECIMALS:
        return f"{value.numerator}/{value.denominator}"
    sign = "-" if value < 0 else ""
    scaled = abs(value.numerator) * 10**places // value.denominator  # exact: 10**places is a multiple
    whole, frac = divmod(scaled, 10**places)
    return f"{sign}{whole}.{str(frac).rjust(places, '0').rstrip('0')}"


def _show(value: Fraction) -> str:
    """`value` for an error message: long ones shortened."""
    text = format_value(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def _decimal_places(denominator: int) -> int | None:
    """How many decimal places 1/denominator needs to end, or None when its expansion never ends."""
    twos = fives = 0
    while denominator % 2 == 0:
        denominator //= 2
        twos += 1
    while denominator % 5 == 0:
        denominator //= 5
        fives += 1
    return max(twos, fives) if denominator == 1 else None


def _check_size(value: Fraction) -> Fraction:
    for part in (abs(value.numerator), value.denominator):
        bits = part.bit_length()
        if bits > _MAX_BITS and (bits > _MAX_BITS + 4 or len(str(part)) > MAX_DIGITS):
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _integer_root(n: int, k: int) -> int | None:
    """The integer r >= 0 with r**k == n (n >= 0), or None when there is none."""
    if n < 2:
        return n
    if k >= n.bit_length():  # then 2**k > n, and no integer r >= 2 has r**k == n
        return None
    # Newton's method on integers, from an upper bound; it decreases to floor(n ** (1/k)).
    r = 1 << -(-n.bit_length() // k)
    while True:
        nxt = ((k - 1) * r + n // r ** (k - 1)) // k
        if nxt >= r:
            break
        r = nxt
    return r if r**k == n else None


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        root = exponent.denominator
        if base < 0:
            raise ValueError(f"({_show(base)}) ** ({_show(exponent)}) is not a real number")
        num, den = _integer_root(base.numerator, root), _integer_root(base.denominator, root)
        if num is None or den is None:
            raise ValueError(
                f"({_show(base)}) ** ({_show(exponent)}) has no exact rational value "
                "(the calculator does exact arithmetic only)")
        base, exponent = Fraction(num, den), Fraction(exponent.numerator)
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    # |result| grows to about bits(base) * |exponent| bits: refuse before computing when that is too big.
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if bits > 1 and (bits - 1) * abs(exponent.numerator) > _MAX_BITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    if bits <= 1:  # 0, 1 or -1 (any other value has 2 bits or more): exact at once, whatever the exponent
        if base == 0:
            return Fraction(0 if exponent > 0 else 1)
        return base ** (exponent.numerator % 2)
    return _check_size(base**exponent.numerator)


class _Evaluator(ast.NodeVisitor):
    """Evaluates the allowed nodes; every other node is refused with a message naming it."""

    _BINARY = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
        ast.FloorDiv: lambda a, b: Fraction(a // b),
        ast.Mod: lambda a, b: a % b,
        ast.Pow: _power,
    }
    _REFUSED = {
        ast.Name: "names are",
        ast.Call: "function calls are",
        ast.Attribute: "attribute access is",
        ast.Subscript: "indexing is",
        ast.Compare: "comparisons are",
        ast.BoolOp: "and/or are",
        ast.Lambda: "lambdas are",
        ast.Tuple: "commas are (write 1000, not 1,000)",
    }

    def __init__(self, source: str) -> None:
        self.source = source

    def visit_Constant(self, node: ast.Constant) -> Fraction:
        value = node.value
        if type(value) is int:
            return _check_size(Fraction(value))
        if type(value) is float:
            return self._decimal(ast.get_source_segment(self.source, node) or repr(value))
        raise ValueError(f"{value!r} is not a number; the calculator takes {_ALLOWED}")

    def _decimal(self, literal: str) -> Fraction:
        try:
            number = Decimal(literal)
        except InvalidOperation:
            raise ValueError(f"cannot read the number {literal!r}") from None
        # Fraction(Decimal) computes 10 ** exponent: refuse an exponent too large before that.
        if abs(number.adjusted()) > MAX_DIGITS or len(number.as_tuple().digits) > MAX_DIGITS:
            raise ValueError(f"the number {literal!r} has more than {MAX_DIGITS} digits")
        return _check_size(Fraction(number))

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Fraction:
        if isinstance(node.op, ast.USub):
            return -self.visit(node.operand)
        if isinstance(node.op, ast.UAdd):
            return self.visit(node.operand)
        raise ValueError(f"the operator {type(node.op).__name__} is not allowed; the calculator takes {_ALLOWED}")

    def visit_BinOp(self, node: ast.BinOp) -> Fraction:
        operation = self._BINARY.get(type(node.op))
        if operation is None:
            raise ValueError(f"the operator {type(node.op).__name__} is not allowed; the calculator takes {_ALLOWED}")
        # Both operands are within the size limit, so + - * / // % cost microseconds; ** guards itself.
        return _check_size(operation(self.visit(node.left), self.visit(node.right)))

    def generic_visit(self, node: ast.AST) -> Fraction:
        what = self._REFUSED.get(type(node), f"{type(node).__name__} is")
        found = f" ({ast.get_source_segment(self.source, node)!r})" if isinstance(node, ast.expr) else ""
        raise ValueError(f"{what} not allowed{found}; the calculator takes {_ALLOWED}")
