"""Read the dataset columns that TRL passes to a reward function.

TRL calls a reward function as `fn(prompts=..., completions=..., completion_ids=..., **columns)` where every
dataset column is a list with one value per completion. A value that is not a list (a keyword given by hand,
such as `tolerance=1e-3`) applies to every row. A missing required column is a configuration error and raises
`RelexError` naming it; it is never scored as a wrong answer.
"""

from __future__ import annotations

from typing import Any

from relex.errors import RelexError


def required_column(columns: dict[str, Any], name: str, n: int, verifier: str) -> list:
    """The `name` column as one value per completion; raises when it, or a row of it, is missing."""
    if columns.get(name) is None:
        present = ", ".join(sorted(k for k in columns if k not in _TRL_KEYWORDS)) or "none"
        raise RelexError(f"verifier {verifier!r} needs the dataset column {name!r}; columns given: {present}")
    values = _per_row(columns[name], name, n)
    missing = [i for i, value in enumerate(values) if value is None]
    if missing:
        raise RelexError(f"verifier {verifier!r}: column {name!r} is None in rows {missing[:10]}")
    return values


def optional_column(columns: dict[str, Any], name: str, n: int, default: Any) -> list:
    """The `name` column as one value per completion, with `default` where it or a row of it is missing."""
    values = _per_row(columns.get(name), name, n)
    return [default if value is None else value for value in values]


def _per_row(values: Any, name: str, n: int) -> list:
    if not isinstance(values, (list, tuple)):
        return [values] * n
    if len(values) != n:
        raise RelexError(f"column {name!r} has {len(values)} values for {n} completions")
    return list(values)


_TRL_KEYWORDS = {"prompts", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
