"""Verifiers: reward functions that score a completion against a dataset row, for GRPO and for evaluation.

Every verifier has TRL's reward signature, `fn(completions, **columns) -> list[float | None]`, so the function
that scores rollouts during training also scores checkpoints afterwards:

    from relex.verifiers import get_verifier
    math = get_verifier("math")
    math(["62 - 24 = \\boxed{38}"], answer=["38"])  # [1.0]
    GRPOTrainer(..., reward_funcs=[math, get_verifier("format")], ...)

Registered names: `math` (math-verify on the answer the completion commits to), `reasoning_gym` (the dataset's
own `score_answer`), `numeric` (a number within tolerance), `json_schema` (JSON valid under a schema), `code`
(Python that passes tests in a bubblewrap sandbox) and `format` (a non-empty `\\boxed{}`). A missing column raises
`RelexError`; a completion that crashes a checking library scores 0.0 and is counted by `count_failures()`.
"""

from relex.registry import Registry
from relex.verifiers.answers import completion_text, extract_final_answer
from relex.verifiers.code_exec import code_reward
from relex.verifiers.failures import count_failures
from relex.verifiers.format import format_reward
from relex.verifiers.math_answer import math_reward
from relex.verifiers.numeric import numeric_reward
from relex.verifiers.procedural import reasoning_gym_reward
from relex.verifiers.structured import json_schema_reward

VERIFIERS = Registry("verifier")
VERIFIERS.register("math")(math_reward)
VERIFIERS.register("reasoning_gym")(reasoning_gym_reward)
VERIFIERS.register("numeric")(numeric_reward)
VERIFIERS.register("json_schema")(json_schema_reward)
VERIFIERS.register("code")(code_reward)
VERIFIERS.register("format")(format_reward)


def get_verifier(name: str):
    """The verifier registered as `name`; an unknown name raises `RelexError` listing the valid ones.

    Args:
        name: one of `math`, `reasoning_gym`, `numeric`, `json_schema`, `code`, `format`.

    Returns:
        A reward function with TRL's signature, `fn(completions, **columns) -> list[float]`: the columns it
        reads are named in its docstring (`answer` for `math` and `numeric`).

    Example:
        get_verifier("math")(["62 - 24 = \\boxed{38}"], answer=["38"])  # [1.0]
    """
    return VERIFIERS.get(name)


__all__ = [
    "VERIFIERS",
    "completion_text",
    "count_failures",
    "extract_final_answer",
    "format_reward",
    "get_verifier",
]
