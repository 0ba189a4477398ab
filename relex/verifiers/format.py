"""The `format` reward: did the completion give its final answer in a non-empty `\\boxed{}`?

A shaping reward to add next to a correctness verifier (weights go in TRL's `reward_weights`):

    format_reward(["\\boxed{42}", "42", "\\boxed{}"])  # [1.0, 0.0, 0.0]
"""

from __future__ import annotations

from relex.verifiers.answers import boxed_contents, completion_text


def format_reward(completions, **columns) -> list[float]:
    """1.0 where the last `\\boxed{}` of the completion has content, else 0.0.

    Args:
        completions: strings or chat completions; no dataset column is read.

    Returns:
        One score per completion.

    Example:
        format_reward(["\\boxed{}", "x \\boxed{2}"])  # [0.0, 1.0]
    """
    return [1.0 if has_boxed_answer(completion_text(c)) else 0.0 for c in completions]


def has_boxed_answer(text: str) -> bool:
    boxes = boxed_contents(text)
    return bool(boxes and boxes[-1].strip())
