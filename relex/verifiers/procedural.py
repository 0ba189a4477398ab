"""The `reasoning_gym` verifier: score with the generating dataset's own `score_answer`.

Each row carries the reasoning-gym entry (`entry` column: the dict with question, answer and metadata, or that
dict as JSON text from `relex.tasks.encode_entry`) and names its dataset in a `task` column or in
`entry["metadata"]["source_dataset"]`:

    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=1)[0]
    reasoning_gym_reward(["\\boxed{3}"], entry=[entry])  # [1.0]

The answer handed to `score_answer` is the extracted final answer (last box, else last number), or the
stripped completion when it has neither. Entries are best stored as `encode_entry` text: in a `datasets.Dataset`
Arrow merges the metadata of different items into one struct, and plain JSON turns the tuples that some scorers
compare against into lists.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from relex.errors import RelexError
from relex.tasks.entry import decode_entry
from relex.verifiers.answers import completion_text, extract_final_answer
from relex.verifiers.columns import optional_column, required_column
from relex.verifiers.failures import guarded_call

NAME = "reasoning_gym"


def reasoning_gym_reward(completions, **columns) -> list[float]:
    """The reasoning-gym score (0.0 to 1.0) of each completion's answer for its `entry`.

    Args:
        completions: strings or chat completions.
        entry: the dataset column with reasoning-gym's entry per row (its question, answer and metadata);
            `task` (optional column): the reasoning-gym dataset that scores it (default: the entry's own).

    Returns:
        One score per completion, from the dataset's own `score_answer`.

    Example:
        rows = load_task({"source": "reasoning_gym", "name": "basic_arithmetic"}).rows("eval", 2)
        reasoning_gym_reward(["\\boxed{38}", "\\boxed{7}"], entry=[r["entry"] for r in rows])
    """
    n = len(completions)
    entries = [as_entry(e) for e in required_column(columns, "entry", n, NAME)]
    tasks = optional_column(columns, "task", n, None)
    return [
        score_entry(completion_text(c), entry, task or dataset_name(entry))
        for c, entry, task in zip(completions, entries, tasks, strict=True)
    ]


def score_entry(text: str, entry: dict[str, Any], dataset: str) -> float:
    answer = extract_final_answer(text) or text.strip()
    ok, score = guarded_call(NAME, score_answer_fn(dataset), answer=answer, entry=entry)
    return float(score) if ok else 0.0


def as_entry(entry: Any) -> dict[str, Any]:
    """A reasoning-gym entry from a dict or its JSON text (`relex.tasks.encode_entry`, which keeps tuples)."""
    if isinstance(entry, str):
        try:
            entry = decode_entry(entry)
        except json.JSONDecodeError as e:
            raise RelexError(f"reasoning_gym verifier: column 'entry' holds a string that is not JSON: {e}") from e
    if not isinstance(entry, dict):
        raise RelexError(f"reasoning_gym verifier: column 'entry' must hold dicts, got {type(entry).__name__}")
    return entry


def dataset_name(entry: dict[str, Any]) -> str:
    name = (entry.get("metadata") or {}).get("source_dataset")
    if not name:
        raise RelexError(
            "reasoning_gym verifier: add a 'task' column or entry['metadata']['source_dataset'] naming the dataset"
        )
    return name


@functools.cache
def score_answer_fn(dataset: str) -> Callable[..., float]:
    """`score_answer` of a reasoning-gym dataset, built once per name (building one instantiates the dataset)."""
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(dataset)
    except ValueError as e:
        raise RelexError(f"reasoning_gym verifier: {e}") from e
