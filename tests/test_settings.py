"""relex.settings: one loader for every settings class (unknown keys, nested sections, types), help text on every
field, flags derived from the fields, and the one function that turns a task into a TaskSpec (offline, fast)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from relex.accelerate.config import AccelerateConfig, WarningConfig
from relex.errors import RelexError
from relex.evaluate.config import EvalConfig
from relex.evaluate.evaluation import EvalSettings
from relex.extrapolate import ExtrapolateConfig
from relex.fit import FitConfig
from relex.settings import add_arguments, help_text, load, overrides, setting
from relex.sweep import SweepConfig
from relex.tasks import TaskSpec, as_task_spec
from relex.train.config import ModelConfig, RecordConfig, RewardConfig, TrainConfig

SETTINGS_CLASSES = [TaskSpec, ModelConfig, RewardConfig, RecordConfig, TrainConfig, WarningConfig, AccelerateConfig,
                    EvalSettings, EvalConfig, SweepConfig, FitConfig, ExtrapolateConfig]
TASK = {"source": "reasoning_gym", "name": "chain_sum"}


@dataclass
class Inner:
    depth: int = setting(1, "how deep")


@dataclass
class Outer:
    name: str = setting(help="required: what it is called")
    ratio: float = setting(0.5, "a number")
    limit: int | None = setting(None, "an optional integer")
    quiet: bool = setting(False, "say less; 100% quiet")
    tags: list[str] = setting(help="labels", factory=list)
    inner: Inner = setting(help="a nested section", factory=Inner)


# ------------------------------------------------------------------------------------------------ the one loader


def test_a_mapping_loads_with_defaults_and_nested_sections():
    assert load(Outer, {"name": "x", "inner": {"depth": 3}}, "outer") == Outer(name="x", inner=Inner(depth=3))
    assert load(Outer, {"name": "x", "inner": None}, "outer").inner == Inner()
    assert load(Inner, None, "inner") == Inner()


@pytest.mark.parametrize(
    "cls, data, where, message",
    [
        (Outer, {"name": "x", "nmae": 1}, "outer",
         "outer: unknown key 'nmae'; valid keys: name, ratio, limit, quiet, tags, inner"),
        (Outer, {"name": "x", "inner": {"dpth": 2}}, "outer", "outer.inner: unknown key 'dpth'; valid keys: depth"),
        (RecordConfig, {"evry": 2}, "record",
         "record: unknown key 'evry'; valid keys: every, delta_dtype, resumable, keep_checkpoints"),
        (AccelerateConfig, {"warning": {"min_r": 0.1}}, "accelerate",
         "accelerate.warning: unknown key 'min_r'; valid keys: enabled, reward_window"),
        (TrainConfig, {"task": TASK, "record": {"evry": 2}}, "config", "config.record: unknown key 'evry'"),
        (TrainConfig, {"task": {**TASK, "train_n": 3}}, "config",
         "task: unknown key 'train_n'; valid keys: source, name, config"),
        (EvalConfig, {"checkpoint": ["a"]}, "eval", "eval: unknown key 'checkpoint'; valid keys: n, samples"),
    ],
)
def test_unknown_keys_fail_naming_the_valid_ones(cls, data, where, message):
    with pytest.raises(RelexError) as error:
        load(cls, data, where)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_missing_required_key_is_named_with_its_help():
    with pytest.raises(RelexError, match=r"^outer: missing key 'name' \(required: what it is called\)$"):
        load(Outer, {}, "outer")
    with pytest.raises(RelexError, match=r"^config: missing key 'task' \(a TaskSpec mapping or a task name"):
        TrainConfig.from_dict({"out": "runs/x"})


@pytest.mark.parametrize(
    "cls, data, where, message",
    [
        (Outer, {"name": 3}, "outer", "outer.name: expected a string, got 3"),
        (Outer, {"name": "x", "ratio": "half"}, "outer", "outer.ratio: expected a number, got 'half'"),
        (Outer, {"name": "x", "limit": True}, "outer", "outer.limit: expected an integer or null, got True"),
        (Outer, {"name": "x", "quiet": "no"}, "outer", "outer.quiet: expected true or false, got 'no'"),
        (Outer, {"name": "x", "inner": 5}, "outer", "outer.inner: expected a mapping of depth, got 5"),
        (Outer, ["name"], "outer", "outer: expected a mapping of name, ratio"),
        (EvalConfig, {"n": "ten"}, "eval", "eval.n: expected an integer or null, got 'ten'"),
        (RecordConfig, {"every": True}, "record", "record.every: expected an integer, got True"),
        (TrainConfig, {"task": TASK, "record": 5}, "config", "config.record: expected a mapping of every"),
        (TrainConfig, {"task": TASK, "grpo": [1]}, "config", "grpo: expected a mapping of GRPOConfig fields"),
        (TrainConfig, {"task": 7}, "config", "task: expected a mapping of TaskSpec fields or a task name, got 7"),
        (AccelerateConfig, {"warning": {"reward_window": "8"}}, "accelerate",
         "accelerate.warning.reward_window: expected an integer"),
    ],
)
def test_wrong_types_fail_in_one_line(cls, data, where, message):
    with pytest.raises(RelexError) as error:
        load(cls, data, where)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_cross_field_rules_run_when_a_class_is_made_by_hand_or_loaded():
    with pytest.raises(RelexError, match="--samples 4 needs --temperature"):
        EvalSettings(samples=4)
    with pytest.raises(RelexError, match="--samples 4 needs --temperature"):
        load(EvalConfig, {"checkpoints": ["a"], "task": "chain_sum", "samples": 4}, "eval")
    with pytest.raises(RelexError, match="no checkpoint to evaluate"):
        load(EvalConfig, {"task": "chain_sum"}, "eval")
    with pytest.raises(RelexError, match="each α must be > 1"):
        AccelerateConfig.from_dict({"alphas": [1.0]})


def test_a_plain_dataclass_loads_as_a_nested_section():
    sweep = load(SweepConfig, {"targets": [20, 40], "task": "chain_sum", "fit": {"rank": 2}}, "sweep")
    assert sweep.fit.rank == 2 and sweep.task == TaskSpec(source="reasoning_gym", name="chain_sum")
    with pytest.raises(RelexError, match="^sweep.fit: unknown key 'rnak'; valid keys: rank, temporal"):
        load(SweepConfig, {"targets": [20], "task": "chain_sum", "fit": {"rnak": 2}}, "sweep")


def test_shorthands_of_sections():
    config = TrainConfig.from_dict({"task": "chain_sum", "model": "my-model", "reward": {"verifier": "math"}})
    assert config.model == ModelConfig(name="my-model") and config.task.verifier == "math"
    assert TrainConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()  # what a run saves loads again
    assert AccelerateConfig.from_dict({"warning": False}).warning == WarningConfig(enabled=False)


# ---------------------------------------------------------------------------------------------------- help text


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda cls: cls.__name__)
def test_every_field_has_help(cls):
    missing = [f.name for f in dataclasses.fields(cls) if not help_text(cls, f.name)]
    assert not missing, f"{cls.__name__}: fields without help: {missing}"


# --------------------------------------------------------------------------------------------------------- flags


def parser_for(cls, only=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relex test", exit_on_error=False)
    add_arguments(parser, cls, only=only)
    return parser


def test_flags_are_derived_from_the_fields_and_read_back_as_overrides():
    parser = parser_for(Outer, only=["ratio", "limit", "quiet", "tags"])
    args = parser.parse_args(["--ratio", "0.25", "--quiet", "--tags", "a, b,"])
    assert overrides(args, Outer, only=["ratio", "limit", "quiet", "tags"]) == {"ratio": 0.25, "quiet": True, "tags": ["a", "b"]}
    assert overrides(parser.parse_args([]), Outer) == {}  # nothing given: the file or the defaults decide
    assert overrides(parser.parse_args(["--no-quiet"]), Outer) == {"quiet": False}
    usage = " ".join(parser.format_help().split())
    assert "--limit LIMIT an optional integer" in usage and "say less; 100% quiet (default False)" in usage


@pytest.mark.parametrize(
    "config",
    [
        RecordConfig(every=3, delta_dtype="bfloat16", resumable=True, keep_checkpoints=2),
        EvalSettings(n=20, samples=4, temperature=0.7, seed=3, batch_size=8, max_new_tokens=64),
        AccelerateConfig(segment_steps=6, alphas=[2.0, 4.0], methods=["relex"], keep=["*norm.weight"], jump=False,
                         max_new_tokens=32),
    ],
    ids=lambda config: type(config).__name__,
)
def test_flags_round_trip(config):
    cls = type(config)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "warning"]  # a nested section has no flag
    argv = []
    for name in names:
        value = getattr(config, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    args = parser_for(cls, only=names).parse_args(argv)
    assert load(cls, overrides(args, cls, only=names), "flags") == config


def test_a_bad_flag_value_and_a_field_without_a_flag():
    with pytest.raises(argparse.ArgumentError, match="--alphas: expected comma-separated float values, e.g. 1,2; got '2,x'"):
        parser_for(AccelerateConfig, only=["alphas"]).parse_args(["--alphas", "2,x"])
    with pytest.raises(TypeError, match="field 'inner'.*has no command-line flag"):
        parser_for(Outer, only=["inner"])
    with pytest.raises(RelexError, match="flags of Outer: unknown key 'nope'"):
        parser_for(Outer, only=["nope"])


def test_a_file_with_flags_on_top_is_checked_once_together():
    data = {"every": 2, "resumable": True}
    args = parser_for(RecordConfig).parse_args(["--every", "5"])
    assert load(RecordConfig, {**data, **overrides(args, RecordConfig)}, "record") == RecordConfig(every=5, resumable=True)


# ------------------------------------------------------------------------------------------ the one task function


def test_one_function_turns_a_name_or_a_mapping_into_a_task_spec():
    spec = as_task_spec("chain_sum")
    assert spec == TaskSpec(source="reasoning_gym", name="chain_sum")
    assert as_task_spec({**TASK, "eval_size": 40}) == TaskSpec(source="reasoning_gym", name="chain_sum", eval_size=40)
    assert as_task_spec("data/problems.jsonl") == TaskSpec(source="jsonl", name="data/problems.jsonl")
    assert as_task_spec(spec) is spec
    # every command goes through it
    assert TrainConfig.from_dict({"task": "chain_sum"}).task == TrainConfig(task="chain_sum").task == spec
    assert SweepConfig(targets=[20], task=TASK).task == spec
    assert EvalConfig(checkpoints=["a"], task="chain_sum", task_config={"min_terms": 2}).task_spec() == \
        TaskSpec(source="reasoning_gym", name="chain_sum", config={"min_terms": 2})


@pytest.mark.parametrize(
    "task, message",
    [
        (["chain_sum"], "task: expected a mapping of TaskSpec fields or a task name, got ['chain_sum']"),
        ({"source": "reasoning_gym"}, "task: missing key 'name'"),
        ({**TASK, "size": 3}, "task: unknown key 'size'; valid keys: source, name, config, verifier"),
        ({**TASK, "train_seed": "zero"}, "task.train_seed: expected an integer, got 'zero'"),
        ("hf:", "task 'hf:': write NAME or reasoning_gym:NAME"),
    ],
)
def test_a_bad_task_fails_in_one_line(task, message):
    with pytest.raises(RelexError) as error:
        as_task_spec(task)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
