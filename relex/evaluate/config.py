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

import json
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from relex.errors import RelexError
from relex.evaluate.evaluation import EvalSettings
from relex.tasks.spec import task_spec_from_name


@dataclass(frozen=True)
class EvalConfig(EvalSettings):
    checkpoints: list[str] = field(default_factory=list)
    task: dict | str | None = None  # a TaskSpec mapping or a task name
    task_config: dict | None = None  # overrides the spec's `config`
    out: str | None = None  # None: runs/eval/TASK-YYYYmmdd-HHMMSS
    overwrite: bool = False

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EvalConfig":
        mapping = read_yaml_mapping(path)
        unknown = set(mapping) - {f.name for f in fields(cls)}
        if unknown:
            valid = ", ".join(f.name for f in fields(cls))
            raise RelexError(f"{path}: unknown eval setting(s) {', '.join(sorted(unknown))}; valid: {valid}")
        return cls(**mapping)

    def validate(self) -> None:
        super().validate()
        if not self.checkpoints:
            raise RelexError("no checkpoint to evaluate: name one or more (folders, hub ids or STORE@STEP)")
        if self.task is None:
            raise RelexError("no task: pass --task NAME or --task-file FILE")

    def task_spec(self) -> dict:
        spec = task_spec_from_name(self.task) if isinstance(self.task, str) else dict(self.task)
        if self.task_config is not None:
            spec["config"] = dict(self.task_config)
        return spec

    def out_dir(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        name = self.task_spec()["name"]
        return Path("runs") / "eval" / f"{Path(name).stem}-{time.strftime('%Y%m%d-%H%M%S')}"

    def settings(self) -> dict:
        """The keyword arguments of `relex.evaluate.evaluate` that configure generation and statistics."""
        return {f.name: getattr(self, f.name) for f in fields(EvalSettings)}


def read_yaml_mapping(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RelexError(f"{path}: no such file")
    try:
        mapping = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RelexError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(mapping, dict):
        raise RelexError(f"{path}: expected a mapping of settings at the top level")
    return mapping


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
    """The file's settings (if any) with every flag that was given (not None) on top."""
    config = EvalConfig.from_yaml(config_file) if config_file else EvalConfig()
    overrides = {name: value for name, value in flags.items() if value not in (None, [])}
    if task_file is not None:
        if "task" in overrides:
            raise RelexError("give --task or --task-file, not both")
        overrides["task"] = task_spec_from_file(task_file)
    if task_config is not None:
        overrides["task_config"] = parse_task_config(task_config)
    return replace(config, **overrides)
