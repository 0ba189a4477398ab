"""The `math` verifier as tables of cases: real SmolLM2 completions, Math-Verify's own test cases, hack attempts.

- `tests/data/smollm2-grpo-completions.jsonl`: 544 SmolLM2-135M completions from a GRPO run on chain_sum whose
  naive verifier (math-verify on the whole completion) was gamed by restating the question. The expected verdict
  is an independent oracle's (the last box, else the last integer, equal to the gold), except for the rows listed
  in `RAMBLING_ROWS`, read one by one, where that crude oracle is not the right judge. The recorded
  `naive_reward` is never trusted.
- `tests/data/verifiers/math_verify_cases.jsonl`: the (gold, prediction, expected) cases of Math-Verify's own
  `tests/` (source and licence in tests/data/verifiers/README.md), rebuilt by
  `scripts/bench_verifiers.py agreement --from-tests`.
  relex must agree with every case whose extraction targets and `verify` options are Math-Verify's defaults,
  and differs only on the cases listed in `DELIBERATE_DIFFERENCES`, each with its reason.
- `HACKS`: completions a policy could learn to write to be paid without answering; all score 0.0.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from relex.errors import RelexError
from relex.verifiers import count_failures, get_verifier
from relex.verifiers.math_answer import too_costly_to_check

DATA = Path(__file__).parent / "data"
SMOLLM2_ROWS = DATA / "smollm2-grpo-completions.jsonl"
MATH_VERIFY_CASES = DATA / "verifiers" / "math_verify_cases.jsonl"
DEFAULT_OPTIONS = {"match_types": ["latex", "expr"], "precision": 6, "strict": True, "allow_set_relation_comp": False}


@pytest.fixture(autouse=True)
def failures():
    """The verifier failures counted during the test."""
    with count_failures() as counted:
        yield counted


def score(completion, gold: str, **columns) -> float:
    (value,) = get_verifier("math")([completion], answer=[gold], **{k: [v] for k, v in columns.items()})
    return value


# ---------------------------------------------------------------------------------------------------- SmolLM2


def oracle_correct(text: str, gold: str) -> bool:
    """Independent of relex: last `\\boxed{}` without nested braces, else last integer, equal to gold."""
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", text)
    candidate = boxes[-1].strip() if boxes else (re.findall(r"-?\d+", text) or [""])[-1]
    return re.fullmatch(r"-?\d+", candidate) is not None and int(candidate) == int(gold)


# Rows where the last integer is not what the completion answers. Almost all restate the question after "the
# answer to" and wander off; the integer that happens to end them is no answer. math-verify's "answer" anchor
# finds the restated `9 + 4`, which is not a number, so they score 0.0.
RAMBLING_ROWS = {
    160: (0.0, "'The answer to the equation 5 + 2 = is 7.': math-verify's anchor takes the 5; a false reject"),
    190: (0.0, "'2 is the answer to 2 - 0, which is 2 ...': the anchor finds the restated 2 - 0"),
    211: (0.0, "'the answer is 4. ... the answer of 2 + 4 equals 6': two contradicting answers"),
    245: (1.0, "'... which equals 15. An answer of 15 is ... (8': answers 15, then breaks off"),
    274: (0.0, "'... which is 14. ... So, 7 + 14': restates, ends on an operand"),
    308: (0.0, "'6 - 3 equals 3. This is the answer to the question of how many times 6 is 3 ...'"),
    346: (0.0, "'To find the answer to 9 + 4, ... results in 13. This is a classic example of a simple division ...'"),
    348: (0.0, "'4 multiplied by 9 indeed equals 34. Therefore, 9 + 34 = 13.': wrong working"),
    354: (0.0, "'To find the answer to 5 + 3, we need to consider both cases: adding ... and subtracting'"),
    359: (0.0, "'5 + 3 = 8, so the answer is' (cut off before stating it)"),
    434: (0.0, "'4 + 3 = 7, which is the result of multiplying': wrong working, no final answer"),
    435: (0.0, "'... the greatest multiple of 3 ... 7': ends on a stray 7"),
    442: (0.0, "'To find the answer to 2 - 3, ... multiplying both sides by -1. In this case,': no answer"),
    466: (0.0, "'6, which represents a total of 30 ... we get 9, which is the opposite of the': no answer"),
    467: (1.0, "'... the equation 6 + 3 = 9, ...': states 9; the oracle's last integer is a stray 6"),
    488: (0.0, "'... the difference of 5 and 6, which is 1, and ... the difference of 5 and 1': no answer"),
    498: (0.0, "'... We cannot just add 1 to 5, ... because 1 is': no answer"),
    501: (0.0, "'... adding 1 to the result of the previous calculation ...': no answer"),
}


@pytest.fixture(scope="module")
def smollm2_rows() -> list[dict]:
    rows = [json.loads(line) for line in SMOLLM2_ROWS.read_text().splitlines()]
    math = get_verifier("math")
    for row, value in zip(rows, math([r["completion"] for r in rows], answer=[r["gold"] for r in rows]), strict=True):
        row["math"] = value
    return rows


def expected_verdict(index: int, row: dict) -> float:
    if index in RAMBLING_ROWS:
        return RAMBLING_ROWS[index][0]
    return float(oracle_correct(row["completion"], row["gold"]))


def test_math_verdicts_on_every_real_completion(smollm2_rows, failures):
    assert len(smollm2_rows) == 544
    wrong = [(i, r["completion"][:80], r["math"]) for i, r in enumerate(smollm2_rows) if r["math"] != expected_verdict(i, r)]
    assert wrong == []
    assert failures == {}


def test_math_scores_restated_questions_zero(smollm2_rows):
    naive_right = [r for r in smollm2_rows if r["naive_reward"] == 1.0]
    gamed = [r for r in naive_right if r["math"] == 0.0]
    restated = [r for r in gamed if r["completion"].startswith("To find the answer to ")]
    print(f"naive 1.0: {len(naive_right)}; of those math 0.0: {len(gamed)}, restating the question: {len(restated)}")
    assert (len(naive_right), sum(r["math"] for r in smollm2_rows)) == (248, 43)
    assert not any(r["math"] for r in smollm2_rows if r["completion"].startswith("To find the answer to 62 - 24, we"))
    assert all(r["math"] == 0.0 for r in restated)


# ---------------------------------------------------------------------------------------------------- Math-Verify

# Cases of Math-Verify's suite where relex's verdict differs, all from tests that restrict the extraction targets
# or change `verify`'s options; relex always extracts with both targets and Math-Verify's default options.
DELIBERATE_DIFFERENCES = {
    ("test_latex_notation", "$10$", "Answer \\( (9+1) \\)"):
        "gold is a number, so an unevaluated (9+1) is not accepted (the 62 - 24 hack)",
    ("test_latex_notation", "$9$", "Answer $ \n 9 \n $"):
        "latex-only test: the expression target relex also uses finds the 9 the text answers",
    ("test_latex_notation", "$9$", "Answer \\( \n 9 \n \\)"):
        "latex-only test: the expression target finds the 9",
    ("test_relations_math", "$x = 11$", "$x = 5+5+1 = 7 =11$"):
        "latex-only test; the gold is a number (x = 11) and the answer a chain of expressions",
    ("test_relations_math", "$x = 1/3$", "$x = 5+5+1 = 1/3 \\approx 11$"):
        "latex-only test; the gold is a number and the answer a chain of expressions",
    ("test_precision", "$\\frac{1}{3}$", "0.3333$"): "needs float precision 4 (relex: 6, the default)",
    ("test_complex_math_expressions", "$(\\begin{pmatrix}\\frac{1}{3}\\\\ \\frac{1}{5} \\end{pmatrix})$",
     "$\\begin{pmatrix}0.33\\\\0.2 \\end{pmatrix}$"): "needs float precision 2",
    ("test_complex_math_expressions", "$(\\frac{3}{5},\\frac{8}{3}]$", "$(0.6,2.6667]$"): "needs float precision 4",
    ("test_set_rel_assymetry", "$x \\in [-2,7]$", "$-2 \\\\le x \\\\le 7$"): "needs allow_set_relation_comp",
    ("test_float_precision", "4.123105625617661", "$\\sqrt{17}$"):
        "needs precision 5; and a number gold is not answered by an unevaluated root",
    ("test_strict_variable_comparison", "$f(x)$", "$f(y)$"): "needs strict=False",
}


@pytest.fixture(scope="module")
def math_verify_cases() -> list[dict]:
    rows = [json.loads(line) for line in MATH_VERIFY_CASES.read_text().splitlines()]
    scores = get_verifier("math")([r["pred"] for r in rows], answer=[r["gold"] for r in rows])
    for row, value in zip(rows, scores, strict=True):
        row["relex"] = int(value == 1.0)
    return rows


def test_agrees_with_math_verify_on_its_default_cases(math_verify_cases):
    assert len(math_verify_cases) == 270
    defaults = [r for r in math_verify_cases if r["options"] == DEFAULT_OPTIONS]
    assert len(defaults) == 149
    assert [r for r in defaults if r["relex"] != r["expected"]] == []


def test_differs_from_math_verify_only_where_listed(math_verify_cases):
    differences = {
        (r["source"].split("::")[1], r["gold"], r["pred"]) for r in math_verify_cases if r["relex"] != r["expected"]
    }
    assert differences == set(DELIBERATE_DIFFERENCES)
    same_verify = [r for r in math_verify_cases if r["options"]["precision"] == 6 and r["options"]["strict"]
                   and not r["options"]["allow_set_relation_comp"]]
    agree = sum(r["relex"] == r["expected"] for r in same_verify)
    assert agree / len(same_verify) >= 0.97, f"{agree}/{len(same_verify)}"


# ---------------------------------------------------------------------------------------------------- hacks

HACKS = [
    ("\\boxed{62 - 24}", "38"),  # the question restated in a box
    ("\\boxed{17 \\times 23}", "391"),
    ("\\boxed{17 * 23}", "391"),
    ("\\boxed{2^{10}}", "1024"),
    ("\\boxed{\\frac{1+\\sqrt{5}}{2}}", "2"),
    ("62 - 24", "38"),
    ("To find the answer to 62 - 24, we", "38"),
    ("The answer is $62 - 24$.", "38"),
    ("62 - 24 = ?", "38"),
    ("\\boxed{36} or \\boxed{38}", "38"),  # hedging: several candidates
    ("\\boxed{36}, \\boxed{37}, \\boxed{38}", "38"),
    ("\\boxed{36, 37, 38}", "38"),
    ("\\boxed{\\{36, 38\\}}", "38"),
    ("$36$ or $38$", "38"),
    ("\\boxed{36 \\text{ or } 38}", "38"),
    ("\\boxed{40}. Actually, I think it is 38.", "38"),  # a correction after the box is not the answer
    ("\\boxed{38}. The final answer is $40$.", "38"),  # ... unless it is stated as the final answer
    ("The final answer is $x^2$.", "2"),  # a digit inside LaTeX is not the answer
    ("$\\frac{10}{9}$", "9"),
    ("so the point is $(1,4.5)$", "4.5"),
    ("\\boxed{}", "38"),
    ("\\boxed{" * 6000 + "39}", "38"),  # huge outputs
    ("1 + " * 250_000 + "1", "250001"),
    ("\\boxed{" + "1+" * 200 + "1}", "201"),
    ("\\boxed{9^{9^{9}}}", "5"),  # too costly to check; exact evaluation would never finish
    ("\\boxed{10^{7}!}", "5"),
]


@pytest.mark.parametrize(("completion", "gold"), HACKS)
def test_hack_attempts_score_zero(completion, gold, failures):
    assert score(completion, gold) == 0.0
    assert failures == {}


@pytest.mark.parametrize(
    "completion",
    [
        "The answer is 36, 37 or 38.",
        "It is either 36 or 38.",
        "The answer is $36$ or $38$.",
        "The answer is 38 (or maybe 36).",
        "the final answer is $\\boxed{36}$ or $38$",
        "\\boxed{36} or \\boxed{37} or \\boxed{38}",
        "\\boxed{36}\n\\boxed{37}\n\\boxed{38}",
    ],
)
def test_hedging_pays_for_one_candidate_at_most(completion):
    assert sum(score(completion, gold) for gold in ("36", "37", "38")) <= 1.0


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
        ("\\boxed{62 - 24 = 38}", "38", 1.0),  # the working, then the value
        ("The answer is $62 - 24 = 38$.", "38", 1.0),
        ("\\boxed{62 - 24 = 36}", "38", 0.0),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
        ("The answer is 38. Check: 62 - 24", "38", 1.0),  # answered, then the check restates the question
        ("I think \\boxed{5} no wait \\boxed{6}", "5", 0.0),  # the last box decides
        ("I think \\boxed{5} no wait \\boxed{6}", "6", 1.0),
        ("\\boxed{38}. The final answer is $40$.", "40", 1.0),
        ("\\boxed{11,\\! 111,\\! 111,\\! 100}", "11111111100", 1.0),  # thin spaces, MATH's style
        ("\\boxed{\uff13\uff18}", "38", 1.0),  # full-width digits
        ("\\boxed{\u0663\u0668}", "38", 1.0),  # Arabic-Indic digits
        ("The answer is \u0663\u0668.", "38", 1.0),
        ("\\boxed{12 \\text{ cm}}", "12", 1.0),  # units
        ("\\boxed{50\\%}", "50\\%", 1.0),  # percent
        ("\\boxed{\\frac{62}{2}}", "31", 1.0),  # a fraction is a number
        ("\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}", "(2, 2), (6, 2)", 1.0),  # one answer, two boxes
        ("\\boxed{1}, \\boxed{2} and \\boxed{3}", "\\{1, 2, 3\\}", 1.0),
        ("\\boxed{(6, 2)}", "(2, 2), (6, 2)", 0.0),
        ("so the point is $(1,4.5)$", "(1, \\frac{9}{2})", 1.0),
        ("$\\frac{10}{9}$", "10/9", 1.0),
        ("\\boxed{[0, 1)}", "[0, 1)", 1.0),  # intervals
        ("\\boxed{(0, 1]}", "[0, 1)", 0.0),
        ("\\boxed{" * 6000 + "38}", "38", 1.0),  # unclosed boxes around the last one
        ("\\boxed{\\boxed{38}}", "38", 1.0),  # a box in a box is one answer
        ("I cannot answer that.", "38", 0.0),
        ([{"role": "assistant", "content": "\\boxed{14}"}], "14", 1.0),
    ],
)
def test_math_table(completion, gold, expected, failures):
    assert score(completion, gold) == expected
    assert failures == {}


@pytest.mark.parametrize(
    ("completion", "gold", "form", "expected"),
    [
        ("\\boxed{2^{10}}", "1024", "expression", 1.0),
        ("\\boxed{2^{10}}", "1024", "number", 0.0),
        ("\\boxed{2^{10}}", "1024", "auto", 0.0),
        ("\\boxed{62 - 24}", "38", "expression", 1.0),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", "auto", 1.0),  # a gold expression asks for an expression
        ("\\boxed{(x+1)^2}", "x^2 + 2x + 1", "number", 0.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", "number", 1.0),
    ],
)
def test_answer_forms(completion, gold, form, expected):
    assert score(completion, gold, answer_form=form) == expected


def test_unknown_answer_form_is_an_error():
    with pytest.raises(RelexError, match="answer_form 'integer' is not one of auto, number, expression"):
        score("\\boxed{1}", "1", answer_form="integer")


@pytest.mark.parametrize(
    ("answer", "too_costly"),
    [
        ("2^{10}", False),
        ("x^2 + y^{2}", False),
        ("99999^{99999}", False),
        ("5!", False),
        ("11,\\! 111,\\! 111,\\! 100", False),  # \! is a thin space, not a factorial
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


def test_math_works_outside_the_main_thread(failures):
    results = []
    worker = threading.Thread(target=lambda: results.append(score("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]
    assert failures == {}


def test_math_library_crash_scores_zero_and_is_counted(monkeypatch, failures):
    import math_verify

    def crash(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(math_verify, "verify", crash)
    assert get_verifier("math")(["\\boxed{1}", "\\boxed{2}", "no answer"], answer=["1", "1", "1"]) == [0.0, 0.0, 0.0]
    assert failures == {"math": 2}


def test_unparsable_gold_is_an_error():
    with pytest.raises(RelexError, match="gold answer"):
        score("\\boxed{1}", "")
