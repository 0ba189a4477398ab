"""The `numeric` verifier: is the final answer a number within tolerance of the gold number?

    numeric_reward(["pi is about \\boxed{3.14159}"], answer=["3.14159265"], tolerance=1e-5)  # [1.0]

`tolerance` (a column or keyword) is relative, 1e-6 by default, with an absolute floor of 1e-9 so that a gold
answer of 0 can be matched. Answers may be integers, decimals, "1,234", "a/b" or `\\frac{a}{b}`.
"""

from __future__ import annotations

import math
import re

from relex.errors import RelexError
from relex.verifiers.answers import completion_text, extract_final_answer
from relex.verifiers.columns import optional_column, required_column

NAME = "numeric"
DEFAULT_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-9
_LATEX_FRACTION = re.compile(r"^\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}$")


def numeric_reward(completions, **columns) -> list[float]:
    """1.0 where the final answer is within `tolerance` of the `answer` column, else 0.0.

    Args:
        completions: strings or chat completions.
        answer: the gold numbers; `tolerance` (optional column): the allowed difference per row.

    Returns:
        One score per completion.

    Example:
        numeric_reward(["about \\boxed{3.14}"], answer=["3.1416"], tolerance=[0.01])  # [1.0]
    """
    n = len(completions)
    golds = required_column(columns, "answer", n, NAME)
    tolerances = optional_column(columns, "tolerance", n, DEFAULT_TOLERANCE)
    return [
        score_numeric(completion_text(c), gold_number(gold), float(tol))
        for c, gold, tol in zip(completions, golds, tolerances, strict=True)
    ]


def score_numeric(text: str, gold: float, tolerance: float) -> float:
    answer = extract_final_answer(text)
    value = to_number(answer) if answer is not None else None
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, gold, rel_tol=tolerance, abs_tol=ABSOLUTE_TOLERANCE) else 0.0


def gold_number(gold) -> float:
    value = to_number(str(gold))
    if value is None:
        raise RelexError(f"numeric verifier: gold answer {gold!r} is not a number")
    return value


def to_number(text: str) -> float | None:
    """The value of "-1,234.5", "3/4" or "\\frac{3}{4}" (optionally in $...$); None when it is not a number."""
    text = text.strip().strip("$").strip().replace(",", "").replace("\u2212", "-")
    fraction = _LATEX_FRACTION.match(text)
    numerator, slash, denominator = text.partition("/")
    if fraction:
        numerator, slash, denominator = fraction.group(1), "/", fraction.group(2)
    try:
        value = float(numerator) / float(denominator) if slash else float(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value
