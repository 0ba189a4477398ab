"""`Task`: the rows of one task, per split, ready for TRL's GRPOTrainer and for held-out evaluation.

Each row is a dict:
    id        a stable identifier of the item
    prompt    conversational messages, [system?, user: question + "\\n" + instruction]; GRPOTrainer applies
              the model's chat template to them, evaluation calls `apply_chat_template(prompt,
              add_generation_prompt=True)`
    question  the raw question;  answer  the gold answer string (None where a dataset has no single one)
    ...       the verifier's columns, e.g. `entry` (a JSON string, see relex.tasks.entry) for reasoning_gym

Task sources (reasoning_gym, jsonl, hf) live in `TASK_SOURCES`; `load_task` picks one by `TaskSpec.source`.
"""

from __future__ import annotations

import logging
from typing import Any

from relex.errors import RelexError
from relex.registry import Registry
from relex.settings import check_keys
from relex.tasks.spec import TaskSpec, as_task_spec

LOG = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"


class TaskSource:
    """Turns a `TaskSpec` into rows per split; subclasses register themselves in `TASK_SOURCES`."""

    default_verifier = "math"
    config_defaults: dict[str, Any] = {}

    def __init__(self, spec: TaskSpec):
        self.spec = spec

    @property
    def task_name(self) -> str:
        return f"{self.spec.source}:{self.spec.name}"

    def options(self) -> dict[str, Any]:
        """`config_defaults` updated by the spec's config; an unknown key fails, naming the valid ones."""
        check_keys(self.spec.config, self.config_defaults, f"task {self.task_name} config")
        return {**self.config_defaults, **self.spec.config}

    def load(self) -> dict[str, list[dict[str, Any]]]:
        raise NotImplementedError


TASK_SOURCES: Registry[type[TaskSource]] = Registry("task source")


class Task:
    """Named splits of rows, plus the name of the verifier that scores completions against them."""

    def __init__(self, name: str, verifier: str, splits: dict[str, list[dict[str, Any]]]):
        self.name = name
        self.verifier = verifier
        self._rows = {split: rows for split, rows in splits.items() if rows}

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._rows)

    def rows(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """The first `n` rows (all when None) of `split`."""
        if split not in self._rows:
            held_out = "held-out " if split == EVAL else ""
            raise RelexError(
                f"task {self.name} has no {held_out}split {split!r}; it has: {', '.join(self.splits) or 'none'}"
            )
        rows = self._rows[split]
        if n is not None and not 0 <= n <= len(rows):
            raise RelexError(f"task {self.name}: asked for {n} rows of split {split!r}, which has {len(rows)}")
        return list(rows[:n] if n is not None else rows)

    def dataset(self, split: str, n: int | None = None):
        """The rows of `split` as a `datasets.Dataset`, the form GRPOTrainer takes."""
        import datasets
        import pyarrow

        try:
            return datasets.Dataset.from_list(self.rows(split, n))
        except (pyarrow.ArrowInvalid, pyarrow.ArrowTypeError) as error:
            raise RelexError(f"task {self.name}: split {split!r} has columns Arrow cannot hold ({error})") from None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{split}={len(rows)}" for split, rows in self._rows.items())
        return f"Task({self.name}, verifier={self.verifier}, {sizes})"


def load_task(spec: TaskSpec | dict[str, Any] | str) -> Task:
    """Build the task a spec (or a mapping of its fields, or a task name: `as_task_spec`) describes."""
    spec = as_task_spec(spec)
    source_cls = TASK_SOURCES.get(spec.source)
    source = source_cls(spec)
    task = Task(source.task_name, spec.verifier or source_cls.default_verifier, source.load())
    LOG.info("loaded %r", task)
    return task


def make_prompt(question: str, spec: TaskSpec) -> list[dict[str, str]]:
    """Conversational messages: the optional system prompt, then the question with the instruction appended."""
    content = f"{question}\n{spec.instruction}" if spec.instruction else question
    system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
    return system + [{"role": "user", "content": content}]


def make_row(row_id: str, question: str, answer: str | None, spec: TaskSpec, **columns: Any) -> dict[str, Any]:
    return {"id": row_id, "prompt": make_prompt(question, spec), "question": question, "answer": answer, **columns}


def count_leaked(train: list[dict[str, Any]], held_out: list[dict[str, Any]]) -> int:
    """How many held-out rows ask a question that also appears in the train rows."""
    seen = {row["question"] for row in train}
    return sum(row["question"] in seen for row in held_out)
