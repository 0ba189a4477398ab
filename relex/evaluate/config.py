"""The configuration of `relex eval`: one dataclass, loadable from YAML, with command-line flags on top.

    # configs/eval.yaml
    checkpoints: [runs/base, runs/grpo/trajectory@40, runs/extrapolated-500]
    task: {source: reasoning_gym, name: chain_sum, config: {min_terms: 2, max_terms: 2}}   # or "chain_sum"
    n: 200
    samples: 8
    temperature: 0.7

A task is a TaskSpec mapping, or a name: `chain_sum` / `reasoning_gym:chain_sum` (reasoning-gym),
`data/problems.jsonl` (a JSON-lines file), `hf:openai/gsm8k` (a Hugging Face dataset).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

from relex.errors import RelexError
from relex.evaluate.evaluation import EvalSettings
from relex.settings import load, read_yaml_mapping, setting
from relex.tasks import TaskSpec, as_task_spec


@dataclass(frozen=True)
class EvalConfig(EvalSettings):
    checkpoints: list[str] = setting(help="model folders, hub ids, aliases or STORE@STEP; compared with the first",
                                     factory=list)
    task: TaskSpec | dict | str | None = setting(None, "a TaskSpec mapping or a task name")
    task_config: dict | None = setting(None, "the task's config, replacing the spec's `config`")
    out: str | None = setting(None, "output folder, new or empty (default runs/eval/TASK-YYYYmmdd-HHMMSS)")
    overwrite: bool = setting(False, "replace a non-empty output folder")

    def validate(self) -> None:
        super().validate()
        if not self.checkpoints:
            raise RelexError("no checkpoint to evaluate: name one or more (folders, hub ids or STORE@STEP)")
        if self.task is None:
            raise RelexError("no task: pass --task NAME or --task-file FILE")
        self.task_spec()  # a bad task fails now, before any checkpoint is opened

    def task_spec(self) -> TaskSpec:
        """The task (`as_task_spec`), with `task_config` as its config when given."""
        spec = as_task_spec(self.task)
        return spec if self.task_config is None else dataclasses.replace(spec, config=dict(self.task_config))

    def out_dir(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        name = self.task_spec().name
        return Path("runs") / "eval" / f"{Path(name).stem}-{time.strftime('%Y%m%d-%H%M%S')}"

    def settings(self) -> dict:
        """The keyword arguments of `relex.evaluate.evaluate` that configure generation and statistics."""
        return {f.name: getattr(self, f.name) for f in fields(EvalSettings)}


def task_spec_from_file(path: str | Path) -> dict:
    """The `task:` mapping of a YAML file (e.g. the training config, so evaluation uses the same task)."""
    task = read_yaml_mapping(path).get("task")
    if not isinstance(task, dict):
        raise RelexError(f"{path}: no `task:` mapping (TaskSpec fields such as source, name, config)")
    return task


def parse_task_config(text: str) -> dict:
    """`--task-config`: inline JSON, or a JSON/YAML file holding the mapping."""
    if Path(text).is_file():
        return read_yaml_mapping(text)  # YAML is a superset of JSON
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise RelexError(f"--task-config {text!r}: neither a file nor JSON ({error})") from None
    if not isinstance(config, dict):
        raise RelexError(f"--task-config {text!r}: expected a JSON object such as {{\"min_terms\": 2}}")
    return config


def load_eval_config(
    config_file: str | None = None,
    *,
    task_file: str | None = None,
    task_config: str | None = None,
    **flags,
) -> EvalConfig:
    """The file's settings (if any) with every flag that was given (not None) on top, checked once together."""
    data = read_yaml_mapping(config_file) if config_file else {}
    overrides = {name: value for name, value in flags.items() if value not in (None, [])}
    if task_file is not None:
        if "task" in overrides:
            raise RelexError("give --task or --task-file, not both")
        overrides["task"] = task_spec_from_file(task_file)
    if task_config is not None:
        overrides["task_config"] = parse_task_config(task_config)
    return load(EvalConfig, {**data, **overrides}, "eval")
