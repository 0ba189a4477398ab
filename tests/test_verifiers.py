"""Verifier tests: tables of real and hand-written completions with the verdict each must get.

The `math` verifier's tables (real SmolLM2 completions, Math-Verify's own cases, hack attempts) are in
test_verifier_math.py and the `code` verifier's escapes in test_verifier_code.py.
"""

from __future__ import annotations

import json

import pytest

from relex.errors import RelexError
from relex.tasks import encode_entry
from relex.verifiers import (
    VERIFIERS,
    completion_text,
    count_failures,
    extract_final_answer,
    format_reward,
    get_verifier,
)


@pytest.fixture(autouse=True)
def failures():
    """The verifier failures counted during the test."""
    with count_failures() as counted:
        yield counted


def score(name: str, completion, **columns) -> float:
    (value,) = get_verifier(name)([completion], **{k: [v] for k, v in columns.items()})
    return value


# ---------------------------------------------------------------------------------------------------- registry


def test_registry_names():
    assert VERIFIERS.names() == ["code", "format", "json_schema", "math", "numeric", "reasoning_gym"]


def test_unknown_verifier_lists_valid_names():
    with pytest.raises(RelexError, match=r"unknown verifier 'maths'; valid: code, format, json_schema, math"):
        get_verifier("maths")


@pytest.mark.parametrize("name", ["math", "numeric"])
def test_missing_column_is_a_configuration_error(name):
    with pytest.raises(RelexError, match="needs the dataset column 'answer'"):
        get_verifier(name)(["\\boxed{1}"], prompts=["p"], trainer_state=None)


def test_column_length_must_match_completions():
    with pytest.raises(RelexError, match="column 'answer' has 1 values for 2 completions"):
        get_verifier("math")(["1", "2"], answer=["1"])


def test_none_row_in_required_column_is_an_error():
    with pytest.raises(RelexError, match=r"column 'answer' is None in rows \[1\]"):
        get_verifier("math")(["1", "2"], answer=["1", None])


def test_relex_errors_inside_a_verifier_are_not_swallowed():
    with pytest.raises(RelexError, match="got int"):
        get_verifier("math")([42], answer=["42"])


# ---------------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{38}.", "38"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed {7}", "7"),
        ("The answer is \\boxed{}.", None),
        ("7\n\nThe answer is \\boxed{}.", None),  # the box declares no answer; 7 is not taken instead
        ("\\boxed{12", "12"),  # an unclosed box is no box
        ("62 - 24 = 38", "38"),
        ("To find the answer to 62 - 24, we", "24"),
        ("11-18", "18"),
        ("11 - 18 = -7", "-7"),
        ("x = \u22127", "-7"),
        ("That is 1,234 apples.", "1234"),
        ("about 3.25.", "3.25"),
        ("a half is 1/2", "1/2"),
        ("3,4", "4"),
        ("5th place, 10x faster", None),
        ("x = \uff13\uff18", "38"),  # full-width digits
        ("\u0663\u0668", "38"),  # Arabic-Indic digits
        ("None", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_completion_text_accepts_plain_and_conversational():
    assert completion_text("hi") == "hi"
    assert completion_text([{"role": "assistant", "content": "\\boxed{3}"}]) == "\\boxed{3}"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "7"}]}]) == "7"


# ---------------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so \\boxed{42}", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("42", 0.0),
        ("The answer is \\boxed{}.", 0.0),
        ("\\boxed{ }", 0.0),
        ("\\boxed{4", 0.0),
        ("\\boxed{" * 20_000 + "x", 0.0),  # unclosed boxes: one pass, not one scan per box
        ("\\boxed{" * 20_000 + "x}", 1.0),
        ([{"role": "assistant", "content": "\\boxed{x}"}], 1.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]
    assert get_verifier("format") is format_reward


# ---------------------------------------------------------------------------------------------------- reasoning_gym


@pytest.fixture(scope="module")
def chain_sum_entries() -> list[dict]:
    import reasoning_gym

    return list(reasoning_gym.create_dataset("chain_sum", size=5, seed=1, min_terms=2, max_terms=2))


def test_reasoning_gym_scores_right_and_wrong_answers(chain_sum_entries):
    for entry in chain_sum_entries:
        right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
        completions = [f"\\boxed{{{right}}}", f"So the result is {right}.", f"\\boxed{{{wrong}}}", f"It is {wrong}"]
        scores = get_verifier("reasoning_gym")(completions, entry=[entry] * 4)
        assert scores == [1.0, 1.0, 0.0, 0.0], entry["question"]


@pytest.mark.parametrize("encode", [json.dumps, encode_entry])
def test_reasoning_gym_accepts_json_entries_and_a_task_column(chain_sum_entries, encode):
    entry = chain_sum_entries[2]
    assert score("reasoning_gym", f"\\boxed{{{entry['answer']}}}", entry=encode(entry), task="chain_sum") == 1.0


def test_reasoning_gym_needs_a_dataset_name():
    with pytest.raises(RelexError, match="add a 'task' column"):
        score("reasoning_gym", "\\boxed{3}", entry={"question": "q", "answer": "3", "metadata": {}})


def test_reasoning_gym_unknown_dataset_is_an_error(chain_sum_entries):
    with pytest.raises(RelexError, match="not registered"):
        score("reasoning_gym", "\\boxed{3}", entry=chain_sum_entries[0], task="no_such_dataset")


def test_reasoning_gym_scorer_crash_scores_zero_and_is_counted(chain_sum_entries, failures):
    broken = {k: v for k, v in chain_sum_entries[0].items() if k != "answer"}  # score_answer reads entry["answer"]
    assert score("reasoning_gym", "\\boxed{3}", entry=broken) == 0.0
    assert failures == {"reasoning_gym": 1}


def test_failure_counts_belong_to_the_block_that_counts_them(chain_sum_entries, failures):
    """An evaluation during training counts its own failures without resetting the training log's count."""
    broken = {k: v for k, v in chain_sum_entries[0].items() if k != "answer"}
    with count_failures() as evaluation:
        score("reasoning_gym", "\\boxed{3}", entry=broken)
    score("reasoning_gym", "\\boxed{3}", entry=broken)
    assert evaluation == {"reasoning_gym": 1} and failures == {"reasoning_gym": 2}


# ---------------------------------------------------------------------------------------------------- numeric


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("\\boxed{3.14159}", "3.14159", 1.0),
        ("pi is 3.1415926", "3.14159265", 1.0),  # within the default relative 1e-6
        ("pi is 3.14", "3.14159265", 0.0),
        ("\\boxed{\\frac{1}{4}}", "0.25", 1.0),
        ("it is 1/4", "0.25", 1.0),
        ("a total of 1,234,567 people", "1234567", 1.0),
        ("\\boxed{-2.5}", "-5/2", 1.0),
        ("\\boxed{0}", "0", 1.0),
        ("\\boxed{1e-12}", "0", 1.0),  # the absolute floor
        ("\\boxed{two}", "2", 0.0),
        ("\\boxed{1/0}", "2", 0.0),
        ("no number here", "2", 0.0),
    ],
)
def test_numeric_table(completion, gold, expected):
    assert score("numeric", completion, answer=gold) == expected


def test_numeric_tolerance_column_and_keyword():
    assert score("numeric", "\\boxed{3.14}", answer="3.14159", tolerance=1e-3) == 1.0
    numeric = get_verifier("numeric")
    assert numeric(["\\boxed{3.14}", "\\boxed{3.2}"], answer=["3.14159"] * 2, tolerance=1e-3) == [1.0, 0.0]


def test_numeric_gold_must_be_a_number():
    with pytest.raises(RelexError, match="gold answer 'seven' is not a number"):
        score("numeric", "\\boxed{7}", answer="seven")


# ---------------------------------------------------------------------------------------------------- json_schema

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ('{"name": "Ada", "age": 36}', 1.0),
        ('  {"name": "Ada", "age": 36}\n', 1.0),
        ('Here you go:\n```json\n{"name": "Ada", "age": 36}\n```\nDone.', 1.0),
        ('```json\n{"name": 1}\n```\n```json\n{"name": "Ada", "age": 36}\n```', 1.0),
        ('```\n{"name": "Ada", "age": 36}\n```', 1.0),
        ('Here you go: {"name": "Ada", "age": 36}', 0.0),  # prose around unfenced JSON
        ('{"name": "Ada", "age": -1}', 0.0),
        ('{"name": "Ada"}', 0.0),
        ('{"name": "Ada", "age": 36, "extra": true}', 0.0),
        ('{"name": "Ada", "age": 36', 0.0),
        ("[" * 100_000 + "]" * 100_000, 0.0),
        ("", 0.0),
    ],
)
def test_json_schema_table(completion, expected):
    assert score("json_schema", completion, schema=PERSON) == expected


def test_json_schema_accepts_schema_as_json_text():
    assert score("json_schema", '{"name": "Ada", "age": 36}', schema=json.dumps(PERSON)) == 1.0


def test_invalid_schema_is_an_error():
    with pytest.raises(RelexError, match="invalid JSON Schema"):
        score("json_schema", "{}", schema={"type": "no-such-type"})
