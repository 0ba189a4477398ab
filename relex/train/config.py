"""The configuration of `relex train`: a `TrainConfig` dataclass tree loaded from YAML, flags on top.

    # configs/smollm2-arithmetic.yaml
    model: smollm2-135m-instruct         # an alias, a local folder, a hub id, or {tiny: {hidden_size: 64, ...}}
    task: {source: reasoning_gym, name: chain_sum, config: {min_terms: 2, max_terms: 2}}
    reward: {format_weight: 0.1}         # the task's verifier, plus the `format` reward at this weight
    grpo: {num_generations: 8, per_device_train_batch_size: 16, learning_rate: 1.0e-5, max_steps: 40}
    record: {every: 2}
    out: runs/smollm2-arithmetic

`grpo` is passed to TRL's `GRPOConfig` on top of relex's CPU-friendly defaults (`GRPO_DEFAULTS`); its keys are
checked against `GRPOConfig`'s fields, and the keys relex sets itself (`RESERVED_GRPO`) are refused with where to
set them instead. Every section refuses unknown keys, naming the valid ones, so a typo fails before training.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relex.errors import RelexError
from relex.tasks import TaskSpec, as_task_spec
from relex.util import is_positive_int

DEFAULT_MODEL = "smollm2-135m-instruct"

# relex's defaults for TRL's GRPOConfig: CPU-friendly and quiet; a config's `grpo` mapping overrides them.
GRPO_DEFAULTS: dict[str, Any] = {
    "bf16": False,  # GRPOConfig turns bf16 on by default; CPUs run float32
    "gradient_checkpointing": False,  # GRPOConfig turns it on by default; small models do not need it
    "report_to": "none",
    "log_completions": False,
    "dataloader_pin_memory": False,  # the loader yields text prompts; pinning only warns on CPU
    "seed": 0,
}
# GRPOConfig keys that relex derives from other settings, and where to set them instead
RESERVED_GRPO = {
    "output_dir": "set `out` (checkpoints go to OUT/checkpoints)",
    "save_strategy": "set record.resumable (a checkpoint at every recorded step)",
    "save_steps": "set record.every and record.resumable (a checkpoint at every recorded step)",
    "save_only_model": "set record.resumable",
    "reward_weights": "set reward.format_weight",
    "logging_steps": "relex logs every optimizer step to OUT/log.jsonl",
    "logging_strategy": "relex logs every optimizer step to OUT/log.jsonl",
    "disable_tqdm": "relex shows its own progress bar",
}


@dataclass
class ModelConfig:
    """name: the embedded alias, a local folder or a hub id; tiny: `make_tiny_llama` options for a random tiny
    Llama written into OUT/model (for tests; `tokenizer_from` may name a model like `name` does)."""

    name: str | None = None
    tiny: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.tiny is not None and self.name is not None:
            raise RelexError("model: give `name` or `tiny`, not both")
        if self.tiny is not None:
            if not isinstance(self.tiny, dict):
                raise RelexError(f"model.tiny: expected a mapping of make_tiny_llama options, got {self.tiny!r}")
            from relex.models import make_tiny_llama

            valid = [p for p in inspect.signature(make_tiny_llama).parameters if p != "out_dir"]
            check_keys(self.tiny, valid, "model.tiny")
        elif self.name is None:
            self.name = DEFAULT_MODEL


@dataclass
class RewardConfig:
    """verifier: a verifier name (default: the task's); format_weight: weight of the `format` reward (0: off)."""

    verifier: str | None = None
    format_weight: float = 0.0


@dataclass
class RecordConfig:
    """every: record θ − θ₀ every N optimizer steps (and at the last); delta_dtype: stored precision (float32);
    resumable: also save a full checkpoint (optimizer included) at every recorded step, keeping the last
    `keep_checkpoints`, so that `relex train --resume` can continue the run (see relex.train.grpo)."""

    every: int = 1
    delta_dtype: str | None = None
    resumable: bool = False
    keep_checkpoints: int = 1

    def __post_init__(self) -> None:
        for key in ("every", "keep_checkpoints"):
            if not is_positive_int(getattr(self, key)):
                raise RelexError(f"record.{key}: expected a positive integer, got {getattr(self, key)!r}")
        if self.delta_dtype is not None:
            from relex.io.dtypes import parse_dtype

            parse_dtype(self.delta_dtype)


@dataclass
class TrainConfig:
    task: TaskSpec
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: dict[str, Any] = field(default_factory=dict)
    record: RecordConfig = field(default_factory=RecordConfig)
    out: str | None = None
    accelerate: dict[str, Any] | None = None  # `relex accelerate`'s section (relex.accelerate.config); train ignores it

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        check_keys(data, [f.name for f in dataclasses.fields(cls)], "config")
        if "task" not in data:
            raise RelexError("config: missing `task` (e.g. task: {source: reasoning_gym, name: chain_sum})")
        model = data.get("model")
        reward = section(RewardConfig, data.get("reward"), "reward")
        task = as_task_spec(data["task"])
        if reward.verifier and not task.verifier:
            task.verifier = reward.verifier  # so that `relex eval --task-file` scores with the same verifier
        return cls(
            task=task,
            model=ModelConfig(name=model) if isinstance(model, str) else section(ModelConfig, model, "model"),
            reward=reward,
            grpo=grpo_mapping(data.get("grpo")),
            record=section(RecordConfig, data.get("record"), "record"),
            out=data.get("out"),
            accelerate=accelerate_mapping(data.get("accelerate")),
        )

    def verifier_name(self, task_verifier: str) -> str:
        """The reward's verifier: `reward.verifier`, else the task's (they must agree when both are set)."""
        if self.reward.verifier and self.task.verifier and self.reward.verifier != self.task.verifier:
            raise RelexError(
                f"reward.verifier is {self.reward.verifier!r} but task.verifier is {self.task.verifier!r}; set one of them"
            )
        return self.reward.verifier or task_verifier

    def grpo_options(self) -> dict[str, Any]:
        """relex's GRPO defaults with the config's `grpo` mapping on top."""
        return {**GRPO_DEFAULTS, **self.grpo}

    def to_dict(self) -> dict[str, Any]:
        """The resolved config (defaults filled in), loadable again with `TrainConfig.from_dict`."""
        data = dataclasses.asdict(self)
        data["grpo"] = self.grpo_options()
        data["model"] = {k: v for k, v in data["model"].items() if v is not None}
        if data["accelerate"] is None:
            del data["accelerate"]
        return data


def load_config(path: str | Path | None = None, *, base: dict[str, Any] | None = None, **overrides) -> TrainConfig:
    """The YAML file's config (or `base`), with `out`, `max_steps` and `record_every` overrides when not None."""
    from relex.evaluate.config import read_yaml_mapping

    data = read_yaml_mapping(path) if path is not None else dict(base or {})
    if overrides.get("out") is not None:
        data["out"] = str(overrides["out"])
    if overrides.get("max_steps") is not None:
        data["grpo"] = {**(data.get("grpo") or {}), "max_steps": overrides["max_steps"]}
    if overrides.get("record_every") is not None:
        data["record"] = {**(data.get("record") or {}), "every": overrides["record_every"]}
    return TrainConfig.from_dict(data)


# ---- sections -----------------------------------------------------------------------------------------------------
def check_keys(data: dict[str, Any], valid: list[str], where: str) -> None:
    for key in data:
        if key not in valid:
            raise RelexError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")


def section(cls, data: dict[str, Any] | None, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise RelexError(f"{where}: expected a mapping, got {data!r}")
    check_keys(data, [f.name for f in dataclasses.fields(cls)], where)
    return cls(**data)


def accelerate_mapping(data: Any) -> dict[str, Any] | None:
    """The `accelerate` section as given; relex.accelerate.config checks its keys when `relex accelerate` reads it."""
    if data is not None and not isinstance(data, dict):
        raise RelexError(f"accelerate: expected a mapping of relex accelerate settings, got {data!r}")
    return None if data is None else dict(data)


def grpo_mapping(data: dict[str, Any] | None) -> dict[str, Any]:
    """The `grpo` section, its keys checked against TRL's `GRPOConfig` and relex's reserved keys."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RelexError(f"grpo: expected a mapping of GRPOConfig fields, got {data!r}")
    from trl import GRPOConfig

    valid = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    for key in data:
        if key in RESERVED_GRPO:
            raise RelexError(f"grpo: {key!r} is set by relex; {RESERVED_GRPO[key]}")
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=5, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise RelexError(
                f"grpo: unknown key {key!r}; {hint}valid keys are the fields of trl.GRPOConfig, e.g. "
                "num_generations, per_device_train_batch_size, gradient_accumulation_steps, learning_rate, "
                "max_completion_length, temperature, beta, max_steps, seed"
            )
    return dict(data)
