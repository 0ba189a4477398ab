"""`TaskSpec`: what to train and evaluate on, as one dataclass that a YAML `task:` section maps onto.

    TaskSpec(source="reasoning_gym", name="chain_sum",
             config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    TaskSpec(source="jsonl", name="data/gsm8k.jsonl", eval_size=200)
    as_task_spec(yaml.safe_load(...)["task"])    # unknown keys fail, naming the valid ones
    as_task_spec("chain_sum")                    # a name, a mapping or a TaskSpec: what every command takes
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relex.errors import RelexError
from relex.settings import load, setting
from relex.util import is_int

DEFAULT_INSTRUCTION = "Put the final answer within \\boxed{}."


@dataclass
class TaskSpec:
    """A task source plus how to turn its items into prompts and how many to use.

    reasoning-gym item i of a dataset comes from seed + i, so the default seeds are far apart. An answer in
    GSM8K style ("... #### 42") keeps what follows the last "####".
    """

    source: str = setting(help="task source: reasoning_gym, jsonl or hf")
    name: str = setting(help="reasoning-gym dataset name, JSON-lines path, or hub dataset id")
    config: dict[str, Any] = setting(
        help="reasoning-gym dataset options, or the source's options (split names, subset)", factory=dict
    )
    verifier: str | None = setting(None, "verifier name; null picks the source's default (reasoning_gym or math)")
    instruction: str = setting(DEFAULT_INSTRUCTION, 'appended to each question on a new line; "" appends nothing')
    system_prompt: str | None = setting(None, "a system message before each question")
    train_size: int | None = setting(
        None, "train rows; null: the source's default (reasoning-gym 1000, a file every row)"
    )
    eval_size: int | None = setting(
        None, "held-out rows; null: the source's default (reasoning-gym 200, a file: only its own split labels)"
    )
    train_seed: int = setting(0, "reasoning-gym generation seed of the train split")
    eval_seed: int = setting(1_000_000, "reasoning-gym seed of the held-out split; also shuffles a file's pick")
    question_field: str = setting("question", "record field holding the question (file sources)")
    answer_field: str = setting("answer", "record field holding the answer (file sources)")

    def __post_init__(self) -> None:
        if not isinstance(self.config, dict):
            raise RelexError(f"task {self.name}: config must be a mapping, got {type(self.config).__name__}")
        for key in ("train_size", "eval_size"):
            value = getattr(self, key)
            if value is not None and (not is_int(value) or value < 0):
                raise RelexError(f"task {self.name}: {key} must be a non-negative integer or null, got {value!r}")
        for key in ("train_seed", "eval_seed"):
            if not is_int(getattr(self, key)):
                raise RelexError(f"task {self.name}: {key} must be an integer, got {getattr(self, key)!r}")


def as_task_spec(task: TaskSpec | Mapping[str, Any] | str) -> TaskSpec:
    """The one way to a TaskSpec: the spec itself, one from a mapping of its fields (a YAML `task:` section), or
    one from a name as `--task` reads it (`task_spec_from_name`). Unknown or missing keys fail with the valid ones."""
    if isinstance(task, TaskSpec):
        return task
    if isinstance(task, str):
        task = task_spec_from_name(task)
    if not isinstance(task, Mapping):
        raise RelexError(f"task: expected a mapping of TaskSpec fields or a task name, got {task!r}")
    return load(TaskSpec, task, "task")


def task_spec_from_name(name: str) -> dict:
    """`chain_sum`, `reasoning_gym:chain_sum`, `problems.jsonl` or `hf:ID` as a TaskSpec mapping."""
    if name.endswith(".jsonl"):
        return {"source": "jsonl", "name": name}
    source, colon, rest = name.partition(":")
    if not colon:
        return {"source": "reasoning_gym", "name": name}
    if not source or not rest:
        raise RelexError(f"task {name!r}: write NAME or reasoning_gym:NAME, hf:DATASET_ID, or a path ending in .jsonl")
    return {"source": source, "name": rest}  # load_task names the valid sources if this one is unknown
