"""The `math` verifier: is the answer the completion commits to mathematically equal to the gold answer?

    math_reward(["... so the answer is \\boxed{\\frac{1}{2}}"], answer=["0.5"])        # [1.0]
    math_reward(["\\boxed{62 - 24}"], answer=["38"])                                   # [0.0]: not an answer
    math_reward(["\\boxed{2^{10}}"], answer=["1024"], answer_form=["expression"])     # [1.0]

Grading follows Math-Verify's authors: the answer is extracted with math-verify's own extraction targets
(LaTeX with boxes first, then plain expressions) and compared with its `verify`. Two things are added, both to
keep a policy from being paid for something that is not an answer:

- math-verify only sees the region the completion commits to (`committed_region`: the final box or run of boxes,
  the text after "final answer", or the end of the completion), never the whole text: given the whole text it
  finds whatever expression the model restated ("To find the answer to 62 - 24, we") and grades that.
- an answer form. `answer_form` (a column or keyword) is `number`, `expression` or `auto` (the default). A
  `number` answer must be a number (an integer, decimal, fraction or percentage, possibly as `x = 38`), not an
  unevaluated expression: `62 - 24`, `17 \\times 23` or `2^{10}` restate an arithmetic question instead of
  answering it. `expression` accepts anything math-verify finds equal. `auto` asks for a number when the gold
  answer is a number and for an expression otherwise.

math-verify's own timeouts use `signal.alarm`, which raises outside the main thread (TRL and evaluation may
score from worker threads) and cannot interrupt a long integer power inside C anyway, so they are turned off
and the work is bounded up front instead: the region is at most a few thousand characters, and over-long
answers and answers whose exact value is astronomically large (power towers, factorials of big numbers) score
0.0 without being checked. math-verify logs once that its timeout is disabled; that is expected.
"""

from __future__ import annotations

import functools
import logging
import re

from relex.errors import RelexError
from relex.verifiers.answers import (
    REGION_CHARS,
    ascii_digits,
    committed_region,
    completion_text,
    find_closing_brace,
)
from relex.verifiers.columns import optional_column, required_column
from relex.verifiers.failures import guarded_call

LOG = logging.getLogger(__name__)

NAME = "math"
ANSWER_FORMS = ("auto", "number", "expression")
MAX_ANSWER_CHARS = 200
MAX_REGION_CHARS = 2 * REGION_CHARS  # a run of boxes longer than this is not an answer
_GROWTH = re.compile(r"\^|\*\*|(?<!\\)!|\\[dt]?binom|\\choose")
_LONG_INTEGER = re.compile(r"\d{6,}")
_DELIMITED = re.compile(r"\$|\\boxed|\\\[|\\\(")
_PLAIN_NUMBER = re.compile(r"\s*-?[\d.,\s]*\d\s*%?\s*")


def math_reward(completions, **columns) -> list[float]:
    """1.0 where the committed answer equals the `answer` column according to math-verify, else 0.0.

    Args:
        completions: strings, or chat completions (lists of messages; the last one's content is scored).
        answer: the dataset column with the gold answers; `answer_form` (optional): how to read them.

    Returns:
        One score per completion.

    Example:
        math_reward(["62 - 24 = \\boxed{38}", "so \\boxed{40}"], answer=["38", "38"])  # [1.0, 0.0]
    """
    n = len(completions)
    golds = required_column(columns, "answer", n, NAME)
    forms = [answer_form(f) for f in optional_column(columns, "answer_form", n, "auto")]
    return [
        score_math(completion_text(c), str(gold), form)
        for c, gold, form in zip(completions, golds, forms, strict=True)
    ]


def answer_form(form: str) -> str:
    if form not in ANSWER_FORMS:
        raise RelexError(f"math verifier: answer_form {form!r} is not one of {', '.join(ANSWER_FORMS)}")
    return form


def score_math(text: str, gold: str, form: str = "auto") -> float:
    expected = parsed_gold(gold)
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    value, answer_text = answer
    if form == "number" or (form == "auto" and is_number(expected[0])):
        if not is_number(value, answer_text, after_working=True):
            LOG.debug("verifier math: %.60r is not a number; scoring 0.0", answer_text)
            return 0.0
    if too_costly_to_check(answer_text):
        LOG.debug("verifier math: answer %.60r is too costly to check; scoring 0.0", answer_text)
        return 0.0
    from math_verify import verify

    # math-verify compares every pair of gold and answer forms (value, then text) and counts a pair whose
    # comparison raises (`12:00` parses to zoo) as unequal; with raise_on_error it would abort the others
    ok, equal = guarded_call(NAME, verify, expected, [value, answer_text], timeout_seconds=None)
    return 1.0 if ok and equal else 0.0


def extract_answer(text: str) -> tuple[object, str] | None:
    """math-verify's parse of the committed region: `(value, the answer's text)`, or None when there is none."""
    region = committed_region(text)
    if len(region) > MAX_REGION_CHARS or _risky_binomial(region):
        return None
    ok, parsed = guarded_call(NAME, _parse, region)
    if not ok or len(parsed) < 2 or isinstance(parsed[0], str):
        return None  # nothing found, or a string math-verify could not turn into a value
    return parsed[0], parsed[1]


@functools.lru_cache(maxsize=4096)
def parsed_gold(gold: str) -> list:
    """The gold answer as math-verify parses it: a solution with `$`/`\\boxed` as it is, a bare answer as LaTeX."""
    gold = ascii_digits(gold)
    if _DELIMITED.search(gold) or _PLAIN_NUMBER.fullmatch(gold):
        parsed = _parse(gold)  # "1,22" and "1 000" are numbers to math-verify's expression target
    else:
        parsed = _parse(as_latex(gold)) or _parse(gold)
    if not parsed:
        raise RelexError(f"math verifier: gold answer {gold!r} could not be parsed by math-verify")
    return parsed


def _parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(text, targets, parsing_timeout=None, raise_on_error=True)


def as_latex(answer: str) -> str:
    """An answer as inline math, so that a bare "-7" or "\\frac{1}{2}" parses as a value."""
    return f"${answer.strip().strip('$').strip()}$"


def is_number(value, text: str = "", after_working: bool = False) -> bool:
    """True for an integer, decimal, fraction or percentage, also as the right side of `x = 38`; with
    `after_working`, of any equation (`62 - 24 = 38`: math-verify compares its right side with a gold value)."""
    import sympy

    if isinstance(value, sympy.Eq) and (after_working or isinstance(value.lhs, sympy.Symbol)):
        value = value.rhs
    if isinstance(value, sympy.Number) or _is_fraction(value):
        return True
    # math-verify leaves 50\% as the unevaluated product 50 * (1/100)
    percent = isinstance(value, sympy.Mul) and sympy.Rational(1, 100) in value.args and text.rstrip().endswith("%")
    return percent and all(isinstance(arg, sympy.Number) for arg in value.args)


def _is_fraction(value) -> bool:
    """`2/3` as math-verify's expression target leaves it: 2 * 3**-1, unevaluated."""
    import sympy

    if not isinstance(value, sympy.Mul) or len(value.args) != 2:
        return False
    number, reciprocal = sorted(value.args, key=lambda arg: isinstance(arg, sympy.Pow))
    return (
        isinstance(number, sympy.Number)
        and isinstance(reciprocal, sympy.Pow)
        and isinstance(reciprocal.base, sympy.Number)
        and reciprocal.exp == -1
    )


def too_costly_to_check(answer: str) -> bool:
    """True for answers whose exact value sympy could spend minutes computing, e.g. `9^{9^{9}}`, `10^{7}!`.

    Factorials, binomials and `**` may only appear alone, an exponent may not hold another power or factorial,
    and no integer next to such an operator may have six or more digits. `\\!` is a thin space, not a factorial.
    """
    answer = answer.replace("\\!", "")
    if len(answer) > MAX_ANSWER_CHARS:
        return True
    growth = _GROWTH.findall(answer)
    if not growth:
        return False
    if _LONG_INTEGER.search(answer):
        return True
    if len(growth) > 1 and any(op != "^" for op in growth):
        return True
    return any(_GROWTH.search(exponent) for exponent in _exponents(answer))


def _risky_binomial(region: str) -> bool:
    """A binomial that math-verify's parser would evaluate while parsing (`\\binom{10^{9}}{10^{8}}`)."""
    return ("binom" in region or "choose" in region) and too_costly_to_check(region[:MAX_ANSWER_CHARS])


def _exponents(answer: str) -> list[str]:
    """The text of every exponent: a `^{...}` group, the letter or digit after `^`, or else the rest."""
    exponents = []
    for match in re.finditer(r"\^\s*", answer):
        start = match.end()
        if answer.startswith("{", start):
            end = find_closing_brace(answer, start + 1)
            exponents.append(answer[start + 1 : end] if end is not None else answer[start + 1 :])
        else:  # a digit or letter is the whole exponent; after `\left(` or `(` the rest of the answer may be
            token = answer[start : start + 1]
            exponents.append(token if token.isalnum() else answer[start:])
    return exponents
