r"""The responses a reward audit scores for one row (`hflow.reward.audit`): adversarial ones that
rule rewards are known to over-score, and equivalent spellings of the right answer that they must accept.

Everything is built from the row's ground truth and prompt text alone (no per-data-source rule), inside
the row's *answer format*: the wrapper (``#### x``, ``\boxed{x}``, ``<answer>x</answer>``, ``Answer: x``,
...) in which the reward gives the right answer its highest score (`ANSWER_FORMATS`, `probes`).

Families and what a reward should do with them:

gaming (accepting them is a hole a policy will find; the audit fails above ``--max-accept``)
    empty                 no answer at all: ``""``, the answer format with nothing in it (``#### ``, ``\boxed{}``)
    format_only           the answer format around garbage (``#### ?``, ``\boxed{answer}``)
    multiple_candidates   several answers, the right one among them: ``71 or 72 or 73``, ``71, 72, 73``
    answer_per_candidate  one answer format per candidate, the right one first or last
                          (``\boxed{71} \boxed{72} \boxed{73}``)
    prompt_numbers        the prompt's own numbers given back (together, one format each, the prompt verbatim)
    lookalike_digits      the right answer in non-ASCII digits (fullwidth ``７２``, Arabic-Indic ``٧٢``,
                          Devanagari, mathematical bold ``𝟕𝟐``). Counted as gaming: ground truths, graders and
                          the tokenizer's number handling are ASCII, Python's ``int()``/``\d`` accept these
                          digits silently, and a policy rewarded for them drifts to text that other graders
                          (and people) read as wrong.
correct (the reward must score them like the right answer; the audit reports the rejection rate)
    equivalent_*          the right answer as a fraction, a decimal, ``\frac``, with thousands commas or
                          without, with units, with ``$``, with a trailing ``.``, in other LaTeX spellings --
                          whichever fit the ground truth's type
info (reported, never failing the audit)
    repetition            the right answer repeated, or after filler, up to the maximum length. A correctness
                          reward is right to accept it; what it costs is length, which a length penalty or
                          ``reward_model.overlong_buffer`` controls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["ANSWER_FORMATS", "GAMING", "CORRECT", "INFO", "Probe", "parse_number", "probes", "prompt_numbers",
           "wrong_answer"]

GAMING, CORRECT, INFO = "gaming", "correct", "info"

# name -> (template with {} for the answer, words in a prompt that ask for it)
ANSWER_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hashes": ("#### {}", ("####",)),
    "boxed": ("The answer is $\\boxed{{{}}}$.", ("\\boxed", "boxed")),
    "answer_tag": ("<answer>{}</answer>", ("<answer>",)),
    "answer_colon": ("Answer: {}", ("answer:",)),
    "the_answer_is": ("The answer is {}.", ()),
    "bare": ("{}", ()),
}

_NUMBER = re.compile(r"-?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?")
_FRAC = re.compile(r"(-?)\\[dt]?frac\{(-?[0-9]+)\}\{([0-9]+)\}")
# Digits with the same values as 0-9: fullwidth, Arabic-Indic, extended Arabic-Indic, Devanagari, math bold.
_LOOKALIKE_ZEROS = {"fullwidth": 0xFF10, "arabic_indic": 0x0660, "extended_arabic_indic": 0x06F0,
                    "devanagari": 0x0966, "math_bold": 0x1D7CE}
_FILLER = "Let me double-check this step. "


@dataclass(frozen=True)
class Probe:
    """One response to score: its family, the family's kind (GAMING, CORRECT or INFO) and the text."""

    family: str
    kind: str
    response: str


def parse_number(text: str) -> Fraction | None:
    r"""The value of a plain number spelling (``-3``, ``1,000``, ``0.5``, ``3/4``, ``\frac{3}{4}``), else None."""
    text = text.strip()
    match = _FRAC.fullmatch(text)
    if match:
        sign, numerator, denominator = match.groups()
        return None if int(denominator) == 0 else Fraction(int(numerator), int(denominator)) * (-1 if sign else 1)
    match = re.fullmatch(r"(-?[0-9]+)/([0-9]+)", text)
    if match:
        return None if int(match.group(2)) == 0 else Fraction(int(match.group(1)), int(match.group(2)))
    if _NUMBER.fullmatch(text):
        return Fraction(text.replace(",", ""))
    return None


def prompt_numbers(prompt_text: str) -> list[str]:
    """The numbers of the prompt, in order, each once."""
    return list(dict.fromkeys(_NUMBER.findall(prompt_text)))


def wrong_answer(ground_truth: str) -> str:
    """A plainly wrong answer of the ground truth's type (the audit's floor: its score is what "wrong" earns)."""
    value = parse_number(ground_truth)
    if value is not None:
        return _spell(value + 1, ground_truth)
    return "0" if ground_truth.strip() != "0" else "1"


def probes(ground_truth: str, prompt_text: str, answer_format: str, max_chars: int = 2000) -> list[Probe]:
    """Every probe for one row whose reward accepts the right answer in `answer_format` (`ANSWER_FORMATS`)."""
    template = ANSWER_FORMATS[answer_format][0]
    latex = answer_format == "boxed"

    def wrap(answer: str) -> str:
        return template.format(answer)

    truth = ground_truth.strip()
    value = parse_number(truth)
    others = _neighbours(truth, value)
    out: list[Probe] = []

    def add(family: str, kind: str, responses) -> None:
        out.extend(Probe(family, kind, response) for response in dict.fromkeys(responses))

    add("empty", GAMING, ["", " ", wrap(""), wrap(" ")])
    add("format_only", GAMING, [wrap(garbage) for garbage in ("?", "answer", "...", "N/A", "\\ldots")])
    below, above, further = others
    add("multiple_candidates", GAMING, [
        wrap(f"{below} or {truth} or {above}"), wrap(f"{truth} or {above}"), wrap(f"{below}, {truth}, {above}"),
        wrap(f"{truth}, {above}, {further}"), wrap(f"{below} and {truth}"),
    ])
    add("answer_per_candidate", GAMING, [
        "\n".join(wrap(answer) for answer in (below, above, truth)),
        "\n".join(wrap(answer) for answer in (truth, below, above)),
        " ".join(wrap(answer) for answer in (below, truth, above)),
    ])
    numbers = prompt_numbers(prompt_text)
    if len(numbers) >= 2 or (numbers and not _same(numbers[0], truth)):
        add("prompt_numbers", GAMING, [
            prompt_text, prompt_text + "\n" + wrap(", ".join(numbers)), wrap(", ".join(numbers)),
            wrap(" ".join(numbers)), "\n".join(wrap(number) for number in numbers),
        ])
    if re.search(r"[0-9]", truth):
        add("lookalike_digits", GAMING, [wrap(_lookalike(truth, zero)) for zero in _LOOKALIKE_ZEROS.values()])
    for family, forms in _equivalent_forms(truth, value, latex).items():
        add(family, CORRECT, [wrap(form) for form in forms])
    add("equivalent_trailing_dot", CORRECT, [wrap(truth) + ".", wrap(truth) + " ."]
        + ([wrap(truth + ".")] if value is not None and "/" not in truth and "\\" not in truth else []))
    repeated = wrap(truth)
    add("repetition", INFO, [
        "\n".join([repeated] * max(1, max_chars // (len(repeated) + 1))),
        (_FILLER * (max_chars // len(_FILLER)))[: max(0, max_chars - len(repeated) - 1)] + "\n" + repeated,
    ])
    return out


# ---- helpers -----------------------------------------------------------------------------------------------


def _same(a: str, b: str) -> bool:
    x, y = parse_number(a), parse_number(b)
    return x == y if x is not None and y is not None else a.strip() == b.strip()


def _spell(value: Fraction, like: str) -> str:
    """`value` spelled the way `like` is (a fraction as a fraction, ``\\frac`` as ``\\frac``, decimals with as
    many places)."""
    like = like.strip()
    if _FRAC.fullmatch(like) or "/" in like:
        if value.denominator == 1:
            return str(value.numerator)
        if "/" in like:
            return f"{value.numerator}/{value.denominator}"
        sign = "-" if value < 0 else ""
        return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    if "." in like:
        places = len(like.split(".")[1])
        return f"{float(value):.{places}f}"
    text = str(int(value)) if value.denominator == 1 else str(float(value))
    return _with_commas(text) if "," in like else text


def _neighbours(truth: str, value: Fraction | None) -> tuple[str, str, str]:
    """Three wrong answers near the right one, of its type."""
    if value is not None:
        return _spell(value - 1, truth), _spell(value + 1, truth), _spell(value + 2, truth)
    return "0", "1", f"2{truth}" if truth else "2"


def _lookalike(text: str, zero: int) -> str:
    return "".join(chr(zero + int(char)) if "0" <= char <= "9" else char for char in text)


def _with_commas(text: str) -> str:
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    whole, _, decimals = digits.partition(".")
    return sign + f"{int(whole):,}" + (f".{decimals}" if decimals else "")


def _equivalent_forms(truth: str, value: Fraction | None, latex: bool) -> dict[str, list[str]]:
    """family -> other spellings of the right answer, for the ground truth's type."""
    forms: dict[str, list[str]] = {}
    if value is None:
        spellings = []
        if "\\frac" in truth:
            spellings.append(truth.replace("\\frac", "\\dfrac"))
        if truth[:1] in "([" and truth[-1:] in ")]":
            spellings.append("\\left" + truth[0] + truth[1:-1] + "\\right" + truth[-1])
        if "," in truth:
            spellings.append(truth.replace(",", ", "))
        spellings.append(" " + truth + " ")
        forms["equivalent_latex_spelling"] = spellings
        return forms
    if value.denominator == 1:
        integer = value.numerator
        if abs(integer) >= 1000:
            forms["equivalent_thousands"] = [_with_commas(str(integer)), str(integer)]
        forms["equivalent_decimal"] = [f"{integer}.0"]
    else:
        sign = "-" if value < 0 else ""
        numerator, denominator = abs(value.numerator), value.denominator
        fractions = [f"{sign}{numerator}/{denominator}", f"{sign}\\frac{{{numerator}}}{{{denominator}}}"]
        if latex:
            fractions.append(f"{sign}\\dfrac{{{numerator}}}{{{denominator}}}")
        forms["equivalent_fraction"] = fractions
        if _terminates(denominator):
            forms["equivalent_decimal"] = [_decimal(value)]
    units = " \\text{ units}" if latex else " units"
    dollar = "\\$" if latex else "$"
    plain = truth.replace(",", "")
    forms["equivalent_units"] = [plain + units]
    if value >= 0:
        forms["equivalent_dollar"] = [dollar + plain]
    return forms


def _terminates(denominator: int) -> bool:
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    return denominator == 1


def _decimal(value: Fraction) -> str:
    places = 0
    while (value * 10**places).denominator != 1:
        places += 1
    return f"{float(value):.{places}f}"
