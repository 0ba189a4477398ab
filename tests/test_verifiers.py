"""Verifier tests: tables of real and hand-written completions with the verdict each must get.

The real table is 544 SmolLM2-135M completions from a GRPO run on chain_sum whose naive verifier (math-verify
on the whole completion) was gamed by restating the question. Verdicts come from an independent oracle here,
never from the recorded `naive_reward`.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from relex.errors import RelexError
from relex.tasks import encode_entry
from relex.verifiers import (
    VERIFIERS,
    completion_text,
    extract_final_answer,
    format_reward,
    get_verifier,
    reset_verifier_failures,
    verifier_failures,
)
from relex.verifiers.math_answer import too_costly_to_check

SMOLLM2_ROWS = Path(__file__).parent / "data" / "smollm2-grpo-completions.jsonl"


@pytest.fixture(autouse=True)
def clean_failure_counts():
    reset_verifier_failures()
    yield
    reset_verifier_failures()


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
        ("None", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_completion_text_accepts_plain_and_conversational():
    assert completion_text("hi") == "hi"
    assert completion_text([{"role": "assistant", "content": "\\boxed{3}"}]) == "\\boxed{3}"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "7"}]}]) == "7"


# ---------------------------------------------------------------------------------------------------- math


def oracle_correct(text: str, gold: str) -> bool:
    """Independent of relex: last `\\boxed{}` without nested braces, else last integer, equal to gold."""
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", text)
    candidate = boxes[-1].strip() if boxes else (re.findall(r"-?\d+", text) or [""])[-1]
    return re.fullmatch(r"-?\d+", candidate) is not None and int(candidate) == int(gold)


@pytest.fixture(scope="module")
def smollm2_rows() -> list[dict]:
    rows = [json.loads(line) for line in SMOLLM2_ROWS.read_text().splitlines()]
    math = get_verifier("math")
    for row, value in zip(rows, math([r["completion"] for r in rows], answer=[r["gold"] for r in rows]), strict=True):
        row["math"] = value
    return rows


def test_math_agrees_with_oracle_on_every_real_completion(smollm2_rows):
    assert len(smollm2_rows) == 544
    disagreements = [r for r in smollm2_rows if r["math"] != float(oracle_correct(r["completion"], r["gold"]))]
    assert disagreements == []


def test_math_scores_restated_questions_zero(smollm2_rows):
    naive_right = [r for r in smollm2_rows if r["naive_reward"] == 1.0]
    gamed = [r for r in naive_right if r["math"] == 0.0]
    restated = [r for r in gamed if r["completion"].startswith("To find the answer to ")]
    print(f"naive 1.0: {len(naive_right)}; of those math 0.0: {len(gamed)}, restating the question: {len(restated)}")
    assert (len(naive_right), len(gamed), len(restated)) == (248, 193, 181)
    assert not any(oracle_correct(r["completion"], r["gold"]) for r in gamed)
    example = next(r for r in gamed if r["completion"].startswith("To find the answer to 62 - 24, we"))
    assert example["gold"] == "38"


def test_math_counts_on_real_completions(smollm2_rows):
    assert sum(r["math"] for r in smollm2_rows) == 57
    assert verifier_failures() == {}


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("62 - 24 = \\boxed{38}", "38", 1.0),
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("\\boxed{-7}", "-7", 1.0),
        ("11 - 18 = -7", "-7", 1.0),
        ("11 - 18 = 7", "-7", 0.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
        ("\\boxed{2^{10}}", "1024", 1.0),
        ("I think \\boxed{5} no wait \\boxed{6}", "5", 0.0),
        ("The answer is 38. Check: 62 - 24", "38", 0.0),
        ("To find the answer to 62 - 24, we need to subtract.", "38", 0.0),
        ("To find the answer to 9 + 6, we", "15", 0.0),
        ("I cannot answer that.", "38", 0.0),
        ("The answer is \\boxed{}.", "38", 0.0),
        ("\\boxed{9^{9^{9}}}", "5", 0.0),  # too costly to check; exact evaluation would never finish
        ("\\boxed{" + "1+" * 200 + "1}", "201", 0.0),  # over-long answer
        ([{"role": "assistant", "content": "\\boxed{14}"}], "14", 1.0),
    ],
)
def test_math_table(completion, gold, expected):
    assert score("math", completion, answer=gold) == expected


@pytest.mark.parametrize(
    ("answer", "too_costly"),
    [
        ("2^{10}", False),
        ("x^2 + y^{2}", False),
        ("99999^{99999}", False),
        ("5!", False),
        ("9^{9^{9}}", True),
        ("9^\\left(9^9\\right)", True),
        ("10^{1000000}", True),
        ("1000000!", True),
        ("9^{99}!", True),
        ("\\binom{10^{5}}{3}", True),
    ],
)
def test_answers_too_costly_to_check(answer, too_costly):
    assert too_costly_to_check(answer) == too_costly


def test_math_works_outside_the_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.append(score("math", "\\boxed{\\frac{1}{2}}", answer="0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]
    assert verifier_failures() == {}


def test_math_library_crash_scores_zero_and_is_counted(monkeypatch):
    import math_verify

    def crash(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(math_verify, "verify", crash)
    assert get_verifier("math")(["\\boxed{1}", "\\boxed{2}", "no answer"], answer=["1", "1", "1"]) == [0.0, 0.0, 0.0]
    assert verifier_failures() == {"math": 2}


def test_unparsable_gold_is_an_error():
    with pytest.raises(RelexError, match="gold answer"):
        score("math", "\\boxed{1}", answer="")


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


def test_reasoning_gym_scorer_crash_scores_zero_and_is_counted(chain_sum_entries):
    broken = {k: v for k, v in chain_sum_entries[0].items() if k != "answer"}  # score_answer reads entry["answer"]
    assert score("reasoning_gym", "\\boxed{3}", entry=broken) == 0.0
    assert verifier_failures() == {"reasoning_gym": 1}


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


# ---------------------------------------------------------------------------------------------------- code

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("def add(a, b):\n    return a + b", 1.0),
        ("Sure!\n```python\ndef add(a, b):\n    return a + b\n```\nThis adds.", 1.0),
        ("```python\ndef add(a, b):\n    return a - b\n```\n```python\ndef add(a, b):\n    return a + b\n```", 1.0),
        ("```python\ndef add(a, b):\n    return a + b\n```\n```python\ndef add(a, b):\n    return a - b\n```", 0.0),
        ("from __future__ import annotations\ndef add(a: int, b: int) -> int:\n    return a + b", 1.0),
        ("def add(a, b):\n    return a - b", 0.0),
        ("def add(a, b)\n    return a + b", 0.0),  # syntax error
        ("import sys\nsys.exit(0)", 0.0),  # leaving before the tests run
        ("import os\nos._exit(0)", 0.0),
        ("while True:\n    pass", 0.0),  # hangs: killed at the timeout
        ("import os\nwhile True:\n    os.fork()", 0.0),  # fork bomb
        ("import subprocess\nsubprocess.run(['true'])\ndef add(a, b):\n    return a + b", 0.0),
        ("import threading\nthreading.Thread(target=print).start()\ndef add(a, b):\n    return a + b", 0.0),
        ("x = bytearray(10**10)\ndef add(a, b):\n    return a + b", 0.0),  # memory hog
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))\ndef add(a, b):\n    return a + b", 0.0),
        ("import ctypes\ndef add(a, b):\n    return a + b", 0.0),
        ("open('big', 'wb').write(b'x' * 10**8)\ndef add(a, b):\n    return a + b", 0.0),  # file size limit
    ],
)
def test_code_table(completion, expected):
    assert score("code", completion, tests=ADD_TESTS, timeout=3) == expected


def test_code_tests_as_a_list_of_asserts():
    completions = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return 5"]
    tests = [["assert add(2, 3) == 5", "assert add(1, 1) == 2"]] * 2
    assert get_verifier("code")(completions, tests=tests, timeout=3) == [1.0, 0.0]


def test_code_gets_empty_stdin():
    assert score("code", "x = input()", tests="", timeout=3) == 0.0  # EOFError instead of waiting for input
