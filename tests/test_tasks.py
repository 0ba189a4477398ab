"""relex.tasks: reasoning-gym and JSON-lines sources, their splits, rows and errors (offline, fast)."""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from relex.errors import RelexError
from relex.tasks import (
    DEFAULT_INSTRUCTION,
    TASK_SOURCES,
    TaskSpec,
    decode_entry,
    encode_entry,
    load_task,
)

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def chain_sum(**overrides):
    spec = {"source": "reasoning_gym", "name": "chain_sum", "config": CHAIN_SUM, "train_size": 200, "eval_size": 50}
    return load_task({**spec, **overrides})


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ------------------------------------------------------------------------------------------------ reasoning-gym


@pytest.fixture(scope="module")
def task():
    return chain_sum()


def test_chain_sum_splits_are_disjoint_and_sized(task):
    assert task.name == "reasoning_gym:chain_sum" and task.verifier == "reasoning_gym"
    assert task.splits == ("train", "eval")
    train, held_out = task.rows("train"), task.rows("eval")
    assert len(train) == 200 and len(held_out) == 50
    held_out_questions = [row["question"] for row in held_out]
    assert not set(held_out_questions) & {row["question"] for row in train}
    assert len(set(held_out_questions)) == len(held_out_questions)
    assert len({row["id"] for row in train + held_out}) == 250


def test_chain_sum_is_deterministic_in_its_seeds(task):
    assert chain_sum().rows("train") == task.rows("train") and chain_sum().rows("eval") == task.rows("eval")
    assert chain_sum(train_seed=7).rows("train") != task.rows("train")


def test_nearby_seeds_still_give_disjoint_splits(caplog):
    # item i comes from seed + i, so seeds 0 and 1 share all but one item: every overlap must be skipped
    with caplog.at_level(logging.WARNING, logger="relex.tasks"):
        task = chain_sum(train_seed=0, eval_seed=1)
    assert not {r["question"] for r in task.rows("eval")} & {r["question"] for r in task.rows("train")}
    assert len(task.rows("eval")) == 50
    assert "skipped" in caplog.text


def test_too_small_problem_space_fails():
    one_digit = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 10 * 10 * 2 questions
    with pytest.raises(RelexError, match="eval_size=150 is more than this problem space allows"):
        chain_sum(config=one_digit, train_size=100, eval_size=150)


def test_rows_are_conversational_with_verifiable_gold(task):
    for row in task.rows("train", n=20) + task.rows("eval", n=20):
        assert row["prompt"] == [{"role": "user", "content": f"{row['question']}\n{DEFAULT_INSTRUCTION}"}]
        entry = decode_entry(row["entry"])
        assert entry["question"] == row["question"] and entry["answer"] == row["answer"]
        expression = entry["metadata"]["expression"]
        assert row["answer"] == str(eval(expression))  # planted truth: the sum itself


def test_gold_scores_one_with_reasoning_gym_itself(task):
    import reasoning_gym

    scorer = reasoning_gym.get_score_answer_fn("chain_sum")
    assert all(scorer(row["answer"], decode_entry(row["entry"])) == 1.0 for row in task.rows("eval"))


@pytest.mark.parametrize(
    "name",
    # complex_arithmetic and advanced_geometry compare metadata tuples: entries must decode with decode_entry
    ["chain_sum", "basic_arithmetic", "complex_arithmetic", "advanced_geometry"],
)
def test_gold_scores_one_with_the_reasoning_gym_verifier(name):
    from relex.verifiers import get_verifier

    task = load_task({"source": "reasoning_gym", "name": name, "train_size": 10, "eval_size": 10})
    rows = task.dataset("eval").to_list()  # as TRL hands them over: one list per column
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    completions = [[{"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"}] for row in rows]
    scores = get_verifier(task.verifier)(completions=completions, **columns)
    assert scores == [1.0] * len(rows)


def test_system_prompt_and_empty_instruction():
    task = chain_sum(system_prompt="Be brief.", instruction="", train_size=3, eval_size=0)
    assert task.splits == ("train",)
    row = task.rows("train")[0]
    assert row["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["question"]}]


def test_rows_survive_a_datasets_round_trip(task):
    rows = task.rows("eval")
    dataset = task.dataset("eval")
    assert isinstance(dataset, datasets.Dataset) and dataset.to_list() == rows
    assert decode_entry(dataset[0]["entry"]) == decode_entry(rows[0]["entry"])


def test_entry_codec_keeps_tuples():
    entry = {"question": "q", "answer": None, "metadata": {"output": ((1, 2), (3, 4)), "pairs": [(1, "a")], "k": {}}}
    assert decode_entry(encode_entry(entry)) == entry
    assert decode_entry(entry) is entry


def test_unknown_dataset_suggests_close_names():
    with pytest.raises(RelexError, match="no dataset 'chain_sums'; close names: chain_sum"):
        chain_sum(name="chain_sums")


def test_unknown_dataset_config_key_lists_valid_ones():
    with pytest.raises(RelexError, match="chain_sum config: unknown key 'terms'; valid keys: min_terms, max_terms"):
        chain_sum(config={"terms": 3})
    with pytest.raises(RelexError, match="train_seed/eval_seed"):
        chain_sum(config={"seed": 3})
    with pytest.raises(RelexError, match="invalid config"):
        chain_sum(config={"min_terms": 3, "max_terms": 2})


# ---------------------------------------------------------------------------------------------- spec and errors


def test_unknown_source_lists_valid_ones():
    with pytest.raises(RelexError, match="unknown task source 'csv'; valid: hf, jsonl, reasoning_gym"):
        load_task({"source": "csv", "name": "x"})
    assert list(TASK_SOURCES) == ["hf", "jsonl", "reasoning_gym"]


def test_unknown_spec_key_names_the_valid_keys():
    with pytest.raises(RelexError, match=r"unknown key 'train_n'; valid keys: source, name, config, .*answer_field"):
        load_task({"source": "reasoning_gym", "name": "chain_sum", "train_n": 10})
    with pytest.raises(RelexError, match="missing key 'name'"):
        load_task({"source": "reasoning_gym"})
    with pytest.raises(RelexError, match="train_size must be a non-negative integer"):
        TaskSpec(source="reasoning_gym", name="chain_sum", train_size=-1)


def test_n_larger_than_the_split_names_both_numbers(task):
    with pytest.raises(RelexError, match="asked for 51 rows of split 'eval', which has 50"):
        task.rows("eval", n=51)
    assert len(task.rows("eval", n=50)) == 50


# ------------------------------------------------------------------------------------------------------- jsonl


def test_jsonl_labelled_splits(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "What is 3 + 4?", "answer": 7, "split": "train", "id": "a"},
            "",
            {"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = 24.\n#### 72", "split": "train"},
            {"question": "What is 10 - 4?", "answer": "6", "split": "eval", "difficulty": "easy"},
        ],
    )
    task = load_task({"source": "jsonl", "name": str(path)})
    assert task.verifier == "math" and task.splits == ("train", "eval")
    first, gsm8k = task.rows("train")
    assert first["id"] == "a" and first["answer"] == "7" and "split" not in first
    assert gsm8k["answer"] == "72" and gsm8k["id"] == "qa.jsonl:3"
    (held_out,) = task.rows("eval")
    assert held_out["difficulty"] == "easy" and held_out["prompt"][-1]["content"].endswith(DEFAULT_INSTRUCTION)
    assert task.dataset("eval").to_list() == [held_out]


def test_jsonl_unlabelled_holds_out_eval_size_by_seed(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(20)])
    task = load_task({"source": "jsonl", "name": str(path), "eval_size": 5})
    again = load_task({"source": "jsonl", "name": str(path), "eval_size": 5})
    other = load_task({"source": "jsonl", "name": str(path), "eval_size": 5, "eval_seed": 3})
    assert len(task.rows("train")) == 15 and len(task.rows("eval")) == 5
    assert task.rows("eval") == again.rows("eval") != other.rows("eval")
    assert not {r["question"] for r in task.rows("eval")} & {r["question"] for r in task.rows("train")}


def test_jsonl_without_eval_has_no_held_out_split(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "1"}])
    task = load_task({"source": "jsonl", "name": str(path)})
    with pytest.raises(RelexError, match=r"has no held-out split 'eval'; it has: train$"):
        task.rows("eval")


def test_jsonl_sizes_larger_than_the_file(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": "1"} for i in range(4)])
    with pytest.raises(RelexError, match="train_size=10, but the train split has 3 rows"):
        load_task({"source": "jsonl", "name": str(path), "eval_size": 1, "train_size": 10})
    with pytest.raises(RelexError, match="eval_size=4 leaves no train rows; the file has 4"):
        load_task({"source": "jsonl", "name": str(path), "eval_size": 4})


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_jsonl_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(RelexError, match=f"{path}: empty"):
        load_task({"source": "jsonl", "name": str(path)})


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "1"}, "", '{"question": "q", "answer":'])
    with pytest.raises(RelexError, match=f"{path}:3: not valid JSON"):
        load_task({"source": "jsonl", "name": str(path)})
    write_jsonl(path, ['["a list"]'])
    with pytest.raises(RelexError, match=f"{path}:1: expected a JSON object, got list"):
        load_task({"source": "jsonl", "name": str(path)})


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "1"}, {"problem": "q2", "answer": "2"}])
    with pytest.raises(RelexError, match=f"{path}:2: field 'question' is missing; fields present: problem, answer"):
        load_task({"source": "jsonl", "name": str(path)})


def test_jsonl_renamed_fields(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"problem": "q", "solution": "x #### 3", "part": "test"}])
    task = load_task(
        {
            "source": "jsonl",
            "name": str(path),
            "question_field": "problem",
            "answer_field": "solution",
            "config": {"split_field": "part", "eval_split": "test"},
        }
    )
    assert task.splits == ("eval",) and task.rows("eval")[0]["answer"] == "3"


def test_jsonl_split_label_errors(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "1", "split": "dev"}])
    with pytest.raises(RelexError, match=f"{path}:1: split='dev'; expected 'train' or 'eval'"):
        load_task({"source": "jsonl", "name": str(path)})
    write_jsonl(path, [{"question": "q", "answer": "1", "split": "train"}, {"question": "r", "answer": "2"}])
    with pytest.raises(RelexError, match=f"{path}:2: split field 'split' on some lines but not others"):
        load_task({"source": "jsonl", "name": str(path)})
    with pytest.raises(RelexError, match="config: unknown key 'splits'; valid keys: split_field, train_split, eval_split"):
        load_task({"source": "jsonl", "name": str(path), "config": {"splits": 1}})


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(RelexError, match="no such JSON-lines file"):
        load_task({"source": "jsonl", "name": str(tmp_path / "nope.jsonl")})


# ------------------------------------------------------------------------------------------ hf (hub faked locally)


def test_hf_source_with_a_local_stand_in_for_the_hub(monkeypatch):
    hub = {
        "train": [{"question": f"q{i}", "answer": f"work #### {i}"} for i in range(6)],
        "test": [{"question": "t0", "answer": "#### 1,000"}],
    }
    calls = []

    def fake_load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(hub[split])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = load_task({"source": "hf", "name": "openai/gsm8k", "config": {"subset": "main"}, "train_size": 4})
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert task.name == "hf:openai/gsm8k" and task.verifier == "math"
    assert [r["answer"] for r in task.rows("train")] == ["0", "1", "2", "3"]
    assert task.rows("eval")[0]["answer"] == "1,000" and task.rows("eval")[0]["id"] == "openai/gsm8k[test]:0"
    with pytest.raises(RelexError, match="asked for 9 rows of 'train', which has 6"):
        load_task({"source": "hf", "name": "openai/gsm8k", "train_size": 9})


def test_a_task_is_given_by_name_mapping_or_spec():
    from relex.errors import RelexError
    from relex.tasks import TaskSpec, as_task_spec

    spec = TaskSpec(source="reasoning_gym", name="chain_sum")
    assert as_task_spec(spec) is spec
    assert as_task_spec("chain_sum") == as_task_spec({"source": "reasoning_gym", "name": "chain_sum"}) == spec
    assert as_task_spec("hf:openai/gsm8k") == TaskSpec(source="hf", name="openai/gsm8k")
    with pytest.raises(RelexError, match="expected a mapping of TaskSpec fields or a task name"):
        as_task_spec(["chain_sum"])
