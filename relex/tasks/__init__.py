"""Tasks: where training prompts and held-out evaluation items come from.

    from relex.tasks import load_task
    task = load_task({"source": "reasoning_gym", "name": "chain_sum",
                      "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}})
    task.dataset("train")       # a datasets.Dataset for TRL's GRPOTrainer
    task.rows("eval", n=100)    # held-out rows; score completions with relex.verifiers.get(task.verifier)

Sources (`TASK_SOURCES`): reasoning_gym (procedural), jsonl (a local file), hf (a hub dataset).
"""

from relex.tasks import hf_source, jsonl_source, reasoning_gym_source  # noqa: F401  (they register themselves)
from relex.tasks.entry import decode_entry, encode_entry
from relex.tasks.spec import DEFAULT_INSTRUCTION, TaskSpec, as_task_spec
from relex.tasks.task import EVAL, TASK_SOURCES, TRAIN, Task, TaskSource, load_task

__all__ = [
    "DEFAULT_INSTRUCTION",
    "EVAL",
    "TASK_SOURCES",
    "TRAIN",
    "Task",
    "TaskSource",
    "TaskSpec",
    "as_task_spec",
    "decode_entry",
    "encode_entry",
    "load_task",
]
