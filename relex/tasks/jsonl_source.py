"""The `jsonl` task source: a JSON-lines file of question/answer records.

    {"question": "What is 3 + 4?", "answer": "7"}
    {"question": "...", "answer": "Natalia sold ... #### 72", "split": "eval"}

Lines may carry a split label (field `split`, values `train` / `eval`; config `split_field`, `train_split`,
`eval_split` rename them), all or none of them. Without labels, `eval_size` rows picked by `eval_seed` are held
out (none when eval_size is unset). Blank lines are skipped; errors name the file and line.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from relex.errors import RelexError
from relex.tasks.records import record_row
from relex.tasks.task import EVAL, TASK_SOURCES, TRAIN, TaskSource, count_leaked

LOG = logging.getLogger(__name__)


@TASK_SOURCES.register("jsonl")
class JsonlSource(TaskSource):
    default_verifier = "math"
    config_defaults = {"split_field": "split", "train_split": TRAIN, "eval_split": EVAL}

    def load(self) -> dict[str, list[dict[str, Any]]]:
        options = self.options()
        path = Path(self.spec.name).expanduser()
        records = read_jsonl(path)
        if _has_labels(records, path, options["split_field"]):
            splits = self._labelled_splits(records, path, options)
        else:
            splits = self._seeded_splits(records, path)
        leaked = count_leaked(splits[TRAIN], splits[EVAL])
        if leaked:
            LOG.warning("%s: %d held-out questions also appear in the train split", path, leaked)
        return {
            TRAIN: self._first(splits[TRAIN], self.spec.train_size, TRAIN),
            EVAL: self._first(splits[EVAL], self.spec.eval_size, EVAL),
        }

    def _row(self, line_no: int, record: dict[str, Any], path: Path) -> dict[str, Any]:
        split_field = self.options()["split_field"]
        return record_row(record, self.spec, f"{path}:{line_no}", f"{path.name}:{line_no}", skip=(split_field,))

    def _labelled_splits(self, records, path: Path, options: dict[str, Any]) -> dict[str, list[dict]]:
        names = {options["train_split"]: TRAIN, options["eval_split"]: EVAL}
        splits: dict[str, list[dict]] = {TRAIN: [], EVAL: []}
        for line_no, record in records:
            label = record[options["split_field"]]
            if label not in names:
                raise RelexError(
                    f"{path}:{line_no}: {options['split_field']}={label!r}; expected {' or '.join(map(repr, names))} "
                    "(config train_split / eval_split name the labels)"
                )
            splits[names[label]].append(self._row(line_no, record, path))
        return splits

    def _seeded_splits(self, records, path: Path) -> dict[str, list[dict]]:
        eval_size = self.spec.eval_size or 0
        if eval_size >= len(records):
            raise RelexError(f"{path}: eval_size={eval_size} leaves no train rows; the file has {len(records)}")
        order = list(range(len(records)))
        random.Random(self.spec.eval_seed).shuffle(order)
        held_out = set(order[:eval_size])
        splits: dict[str, list[dict]] = {TRAIN: [], EVAL: []}
        for position, (line_no, record) in enumerate(records):
            splits[EVAL if position in held_out else TRAIN].append(self._row(line_no, record, path))
        return splits

    def _first(self, rows: list[dict], size: int | None, split: str) -> list[dict]:
        if size is not None and size > len(rows):
            raise RelexError(f"task {self.task_name}: {split}_size={size}, but the {split} split has {len(rows)} rows")
        return rows if size is None else rows[:size]


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line; a bad line or an empty file fails naming the file."""
    if not path.is_file():
        raise RelexError(f"{path}: no such JSON-lines file")
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                records.append((line_no, _parse_line(line, path, line_no)))
    if not records:
        raise RelexError(f"{path}: empty; expected one JSON object per line")
    return records


def _parse_line(line: str, path: Path, line_no: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise RelexError(f"{path}:{line_no}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise RelexError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    return record


def _has_labels(records: list[tuple[int, dict[str, Any]]], path: Path, split_field: str) -> bool:
    """Whether the records carry split labels: all of them or none, else an error naming the first odd line."""
    labelled = [split_field in record for _, record in records]
    if all(labelled) or not any(labelled):
        return labelled[0]
    odd = next(line_no for (line_no, _), has in zip(records, labelled) if has != labelled[0])
    raise RelexError(f"{path}:{odd}: split field {split_field!r} on some lines but not others; label all or none")
