"""The `math` verifier: is the completion's final answer mathematically equal to the gold answer?

    math_reward(["... so the answer is \\boxed{\\frac{1}{2}}"], answer=["0.5"])  # [1.0]

Only the extracted final answer (`extract_final_answer`) goes to math-verify, never the whole completion:
`parse("To find the answer to 62 - 24, we")` returns the restated expression `62 - 24`, which verifies as
correct, and SmolLM2 learned to game exactly that under GRPO.

math-verify's own timeouts use `signal.alarm`, which raises outside the main thread (TRL and evaluation may
score from worker threads) and cannot interrupt a long integer power inside C anyway, so they are turned off
and the work is bounded up front instead: over-long answers and answers whose exact value is astronomically
large (power towers, factorials of big numbers) score 0.0 without being checked. math-verify logs once that
its timeout is disabled; that is expected.
"""

from __future__ import annotations

import functools
import logging
import re

from relex.errors import RelexError
from relex.verifiers.answers import completion_text, extract_final_answer, find_closing_brace
from relex.verifiers.columns import required_column
from relex.verifiers.failures import guarded_call

LOG = logging.getLogger(__name__)

NAME = "math"
MAX_ANSWER_CHARS = 200
_GROWTH = re.compile(r"\^|\*\*|!|\\[dt]?binom|\\choose")
_LONG_INTEGER = re.compile(r"\d{6,}")


def math_reward(completions, **columns) -> list[float]:
    """1.0 where the final answer equals the `answer` column according to math-verify, else 0.0."""
    golds = required_column(columns, "answer", len(completions), NAME)
    return [score_math(completion_text(c), str(gold)) for c, gold in zip(completions, golds, strict=True)]


def score_math(text: str, gold: str) -> float:
    answer = extract_final_answer(text)
    if answer is None:
        return 0.0
    if too_costly_to_check(answer):
        LOG.debug("verifier math: answer %.60r is too costly to check; scoring 0.0", answer)
        return 0.0
    from math_verify import parse, verify

    expected = parsed_gold(gold)
    ok, parsed = guarded_call(NAME, parse, as_latex(answer), parsing_timeout=None, raise_on_error=True)
    if not ok or not parsed:
        return 0.0
    ok, equal = guarded_call(NAME, verify, expected, parsed, timeout_seconds=None, raise_on_error=True)
    return 1.0 if ok and equal else 0.0


@functools.lru_cache(maxsize=4096)
def parsed_gold(gold: str) -> list:
    from math_verify import parse

    parsed = parse(as_latex(gold), parsing_timeout=None)
    if not parsed:
        raise RelexError(f"math verifier: gold answer {gold!r} could not be parsed by math-verify")
    return parsed


def as_latex(answer: str) -> str:
    """An answer as inline math, so that a bare "-7" or "\\frac{1}{2}" parses as a value."""
    return f"${answer.strip().strip('$').strip()}$"


def too_costly_to_check(answer: str) -> bool:
    """True for answers whose exact value sympy could spend minutes computing, e.g. `9^{9^{9}}`, `10^{7}!`.

    Factorials, binomials and `**` may only appear alone, an exponent may not hold another power or factorial,
    and no integer next to such an operator may have six or more digits.
    """
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
