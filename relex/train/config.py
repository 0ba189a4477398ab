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
set them instead. Every section is loaded by `relex.settings.load`, which refuses unknown keys naming the valid
ones, so a typo fails before training.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relex.errors import RelexError
from relex.io.dtypes import parse_dtype
from relex.models import make_tiny_llama
from relex.settings import check_keys, load, read_yaml_mapping, setting
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


# ---- sections that are mappings for other code to check ----------------------------------------------------------
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


# ---- relex's own sections ----------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """The policy: a model by name, or a random tiny Llama for tests. A config may give `model: NAME` for short."""

    name: str | None = setting(None, f"the embedded alias, a local folder or a hub id (default {DEFAULT_MODEL})")
    tiny: dict[str, Any] | None = setting(
        None, "make_tiny_llama options for a random tiny Llama written into OUT/model (tokenizer_from may name a "
        "model as `name` does)"
    )

    def __post_init__(self) -> None:
        if self.tiny is not None and self.name is not None:
            raise RelexError("model: give `name` or `tiny`, not both")
        if self.tiny is not None:
            if not isinstance(self.tiny, dict):
                raise RelexError(f"model.tiny: expected a mapping of make_tiny_llama options, got {self.tiny!r}")
            valid = [p for p in inspect.signature(make_tiny_llama).parameters if p != "out_dir"]
            check_keys(self.tiny, valid, "model.tiny")
        elif self.name is None:
            self.name = DEFAULT_MODEL


@dataclass
class RewardConfig:
    verifier: str | None = setting(None, "a verifier name (default: the task's)")
    format_weight: float = setting(0.0, "weight of the `format` reward (0: off)")


@dataclass
class RecordConfig:
    """See relex.train.grpo for how `relex train --resume` continues from the checkpoints `resumable` keeps."""

    every: int = setting(1, "record θ − θ₀ every N optimizer steps (and at the last)")
    delta_dtype: str | None = setting(None, "stored precision of the deltas (default float32)")
    resumable: bool = setting(False, "also save a full checkpoint (optimizer included) at every recorded step")
    keep_checkpoints: int = setting(1, "how many of those checkpoints to keep (the last ones)")
    background: bool = setting(
        True, "write each record while training goes on (one process; holds a float32 copy of the model in host "
        "memory while it writes); false: training waits for the file",
    )

    def __post_init__(self) -> None:
        for key in ("every", "keep_checkpoints"):
            if not is_positive_int(getattr(self, key)):
                raise RelexError(f"record.{key}: expected a positive integer, got {getattr(self, key)!r}")
        if self.delta_dtype is not None:
            parse_dtype(self.delta_dtype)
        if not isinstance(self.background, bool):
            raise RelexError(f"record.background: expected true or false, got {self.background!r}")


def model_shorthand(value: Any) -> Any:
    """`model: NAME` is short for `model: {name: NAME}`."""
    return {"name": value} if isinstance(value, str) else value


@dataclass
class TrainConfig:
    task: TaskSpec = setting(
        help="a TaskSpec mapping or a task name, e.g. {source: reasoning_gym, name: chain_sum}", parse=as_task_spec
    )
    model: ModelConfig = setting(help="the policy to train", factory=ModelConfig, parse=model_shorthand)
    reward: RewardConfig = setting(help="the reward functions", factory=RewardConfig)
    grpo: dict[str, Any] = setting(
        help="trl.GRPOConfig fields on top of relex's defaults", factory=dict, parse=grpo_mapping
    )
    record: RecordConfig = setting(help="what is recorded and kept", factory=RecordConfig)
    out: str | None = setting(None, "the run folder")
    accelerate: dict[str, Any] | None = setting(
        None, "`relex accelerate`'s section (relex.accelerate.config); train ignores it",
        parse=accelerate_mapping,
    )

    def __post_init__(self) -> None:
        self.task = as_task_spec(self.task)  # TrainConfig(task="chain_sum") works as the file's `task: chain_sum`
        if self.reward.verifier and not self.task.verifier:
            self.task.verifier = self.reward.verifier  # so that `relex eval --task-file` scores with the same verifier

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """A config from its mapping (a YAML file's): every section's keys checked, naming the valid ones."""
        return load(cls, data, "config")

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
    data = read_yaml_mapping(path) if path is not None else dict(base or {})
    if overrides.get("out") is not None:
        data["out"] = str(overrides["out"])
    if overrides.get("max_steps") is not None:
        data["grpo"] = {**(data.get("grpo") or {}), "max_steps": overrides["max_steps"]}
    if overrides.get("record_every") is not None:
        data["record"] = {**(data.get("record") or {}), "every": overrides["record_every"]}
    return TrainConfig.from_dict(data)
