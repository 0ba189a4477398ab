"""`TaskSpec`: what to train and evaluate on, as one dataclass that a YAML `task:` section maps onto.

    TaskSpec(source="reasoning_gym", name="chain_sum",
             config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    TaskSpec(source="jsonl", name="data/gsm8k.jsonl", eval_size=200)
    TaskSpec.from_dict(yaml.safe_load(...)["task"])   # unknown keys fail, naming the valid ones
    as_task_spec("chain_sum")                          # a name, a mapping or a TaskSpec: what every command takes
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relex.errors import RelexError
from relex.util import is_int

DEFAULT_INSTRUCTION = "Put the final answer within \\boxed{}."


@dataclass
class TaskSpec:
    """A task source plus how to turn its items into prompts and how many to use.

    source: task source registry name (`reasoning_gym`, `jsonl`, `hf`).
    name: reasoning-gym dataset name, JSON-lines path, or hub dataset id.
    config: reasoning-gym dataset options, or the source's options (split names, subset).
    verifier: verifier registry name; None picks the source's default (`reasoning_gym` or `math`).
    instruction: appended to each question on a new line; "" appends nothing.
    train_size, eval_size: rows per split; None means the source's default (reasoning-gym: 1000 and 200;
        files: every row, and no held-out split unless the file has split labels or eval_size is set).
    train_seed, eval_seed: reasoning-gym generation seeds; eval_seed also shuffles the held-out pick of an
        unlabelled file. reasoning-gym item i of a dataset comes from seed + i, so the default seeds are far apart.
    question_field, answer_field: record fields of file sources; an answer in GSM8K style ("... #### 42")
        keeps what follows the last "####".
    """

    source: str
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    verifier: str | None = None
    instruction: str = DEFAULT_INSTRUCTION
    system_prompt: str | None = None
    train_size: int | None = None
    eval_size: int | None = None
    train_seed: int = 0
    eval_seed: int = 1_000_000
    question_field: str = "question"
    answer_field: str = "answer"

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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskSpec:
        """A spec from a mapping (e.g. a YAML section); unknown or missing keys fail with the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in valid:
                raise RelexError(f"task: unknown key {key!r}; valid keys: {', '.join(valid)}")
        for key in ("source", "name"):
            if key not in data:
                raise RelexError(f"task: missing key {key!r} (e.g. source: reasoning_gym, name: chain_sum)")
        return cls(**data)


def as_task_spec(task: TaskSpec | Mapping[str, Any] | str) -> TaskSpec:
    """The TaskSpec itself, one from its mapping, or one from a name as `--task` reads it (task_spec_from_name)."""
    if isinstance(task, TaskSpec):
        return task
    if isinstance(task, str):
        return TaskSpec.from_dict(task_spec_from_name(task))
    if not isinstance(task, Mapping):
        raise RelexError(f"task: expected a mapping of TaskSpec fields or a task name, got {task!r}")
    return TaskSpec.from_dict(dict(task))


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
