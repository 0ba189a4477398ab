"""The `reasoning_gym` task source: procedurally generated problems from reasoning-gym.

    TaskSpec(source="reasoning_gym", name="chain_sum",
             config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})

The train split is `create_dataset(name, size=train_size, seed=train_seed, **config)`; the held-out split comes
from `eval_seed`. Different seeds do not make disjoint sets: item i is generated from seed + i (so seeds 0 and 1
share all but one item), and small problem spaces repeat questions by chance (2-term sums of 1-2 digit numbers:
about 45% of 200 held-out questions also occur among 1000 train ones). So held-out questions that occur in train,
or earlier in the held-out split, are skipped, and more are drawn until eval_size remain; the held-out split is
then "questions never seen in training", which leans toward the rarer ones. Rows carry the reasoning-gym entry,
encoded by `relex.tasks.entry.encode_entry`, in column `entry` for the `reasoning_gym` verifier.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Any

from relex.errors import RelexError
from relex.settings import check_keys
from relex.tasks.entry import encode_entry
from relex.tasks.task import EVAL, TASK_SOURCES, TRAIN, TaskSource, make_row

LOG = logging.getLogger(__name__)

DEFAULT_TRAIN_SIZE = 1000
DEFAULT_EVAL_SIZE = 200
MAX_DRAW_FACTOR = 16  # draw at most this many times eval_size candidates for the held-out split


@TASK_SOURCES.register("reasoning_gym")
class ReasoningGymSource(TaskSource):
    default_verifier = "reasoning_gym"

    def load(self) -> dict[str, list[dict[str, Any]]]:
        spec = self.spec
        config = dataset_config(spec.name, spec.config)
        train_size = DEFAULT_TRAIN_SIZE if spec.train_size is None else spec.train_size
        eval_size = DEFAULT_EVAL_SIZE if spec.eval_size is None else spec.eval_size
        train = list(enumerate(generate(spec.name, config, train_size, spec.train_seed)))
        held_out = self._held_out(config, eval_size, {entry["question"] for _, entry in train})
        return {
            TRAIN: [self._row(TRAIN, spec.train_seed, index, entry) for index, entry in train],
            EVAL: [self._row(EVAL, spec.eval_seed, index, entry) for index, entry in held_out],
        }

    def _held_out(self, config: dict[str, Any], size: int, seen: set[str]) -> list[tuple[int, dict]]:
        """`size` (index, entry) pairs from eval_seed whose questions are new, drawing more while some repeat."""
        drawn = size
        while True:
            candidates = generate(self.spec.name, config, drawn, self.spec.eval_seed)
            kept, skipped = first_new(candidates, seen, size)
            if len(kept) == size or drawn >= MAX_DRAW_FACTOR * size:
                break
            drawn *= 2
        if len(kept) < size:
            raise RelexError(
                f"task {self.task_name}: only {len(kept)} of {drawn} held-out questions are new (not in the "
                f"{len(seen)} distinct train questions, not repeated); eval_size={size} is more than this problem "
                "space allows: lower train_size or eval_size, or widen the config"
            )
        if skipped:
            LOG.warning(
                "task %s: skipped %d held-out questions already in train or repeated, keeping the first %d new ones",
                self.task_name, skipped, size,
            )
        return kept

    def _row(self, split: str, seed: int, index: int, entry: dict[str, Any]) -> dict[str, Any]:
        answer = entry.get("answer")
        row_id = f"{self.task_name}:seed{seed}:{index}"
        try:
            encoded = encode_entry(entry)
        except TypeError as error:
            raise RelexError(f"task {self.task_name}: {split} item {index} is not JSON-storable ({error})") from None
        return make_row(row_id, entry["question"], None if answer is None else str(answer), self.spec, entry=encoded)


def generate(name: str, config: dict[str, Any], size: int, seed: int) -> list[dict[str, Any]]:
    """The first `size` entries of reasoning-gym dataset `name` with `seed`."""
    import reasoning_gym

    if size == 0:
        return []
    try:
        return list(reasoning_gym.create_dataset(name, size=size, seed=seed, **config))
    except (AssertionError, ValueError) as error:  # reasoning-gym validates configs with asserts
        raise RelexError(f"reasoning-gym {name}: invalid config {config} ({error})") from None


def first_new(candidates: list[dict[str, Any]], seen: set[str], size: int) -> tuple[list[tuple[int, dict]], int]:
    """Up to `size` (index, entry) pairs whose questions are not in `seen` nor repeated; and how many were skipped."""
    questions = set(seen)
    kept, skipped = [], 0
    for index, entry in enumerate(candidates):
        if len(kept) == size:
            break
        if entry["question"] in questions:
            skipped += 1
            continue
        questions.add(entry["question"])
        kept.append((index, entry))
    return kept, skipped


def dataset_config(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """`config` checked against the options of reasoning-gym dataset `name`."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
        some = ", ".join(sorted(DATASETS)[:8])
        hint = f"close names: {', '.join(close)}" if close else f"it has {len(DATASETS)} datasets, e.g. {some}"
        raise RelexError(f"reasoning-gym has no dataset {name!r}; {hint}")
    for key in ("seed", "size"):
        if key in config:
            raise RelexError(f"reasoning-gym {name}: set train_{key}/eval_{key} on the task, not config[{key!r}]")
    options = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]
    check_keys(config, options, f"reasoning-gym {name} config")
    return dict(config)
