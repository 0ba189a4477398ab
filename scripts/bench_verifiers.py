"""Benchmarks of the verifiers: agreement of `math` with Math-Verify's own tests, and scoring speed.

`agreement`: how often relex's `math` verifier gives the verdict that Math-Verify's own test suite expects. The
cases are the (gold, prediction, expected) rows of huggingface/Math-Verify's `tests/`, kept with their source
and licence in `tests/data/verifiers/` (README.md there). Each row also records the options its test passed to
Math-Verify (extraction targets, float precision, strict, set-relation comparison). relex always grades with one
fixed configuration (LaTeX and expression targets, precision 6, strict, no set relations), so the script also
counts the rows whose `verify` options are those defaults, and the rows whose extraction targets are too.

`speed`: completions scored per second by `math` (the real SmolLM2 completions) and by `code` (sandboxed, in
TRL-style batches), and how the time to score a completion of unclosed `\\boxed{` grows with its length.

    python scripts/bench_verifiers.py agreement [--show]         # agreement, false accepts and rejects
    python scripts/bench_verifiers.py agreement --from-tests DIR # rebuild the cases from Math-Verify's tests/
    python scripts/bench_verifiers.py speed [--batch 32]
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
CASES = DATA / "verifiers" / "math_verify_cases.jsonl"
SMOLLM2_ROWS = DATA / "smollm2-grpo-completions.jsonl"
DEFAULT_OPTIONS = {"match_types": ["latex", "expr"], "precision": 6, "strict": True, "allow_set_relation_comp": False}


def cases_from_tests(folder: Path) -> list[dict]:
    """Every call of `compare_strings(gold, pred, ...)` or `verify(parse(gold), parse(pred))` in the test files,
    one row per parametrized case, with the options that call passes."""
    rows = []
    for path in sorted(folder.glob("test_*.py")):
        for function in ast.parse(path.read_text()).body:
            if isinstance(function, ast.FunctionDef):
                rows += _function_cases(path, function)
    return rows


def _function_cases(path: Path, function: ast.FunctionDef) -> list[dict]:
    call = _comparison_call(function)
    if call is None:
        return []
    rows = []
    for params in _parameter_sets(path, function):
        options = dict(DEFAULT_OPTIONS)
        for keyword in call.keywords:
            options[keyword.arg] = _value(keyword.value, params, path)
        gold, pred = (_value(arg, params, path) for arg in call.args[:2])
        expected = params.get("expected", params.get("result", 1))
        rows.append({"source": f"{path.name}::{function.name}", "gold": gold, "pred": pred,
                     "expected": int(bool(expected)), "options": options})
    return rows


def _comparison_call(function: ast.FunctionDef) -> ast.Call | None:
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    compare = [c for c in calls if c.func.id == "compare_strings"]
    if len(compare) == 1:
        return compare[0]
    verify = [c for c in calls if c.func.id == "verify" and not c.keywords]
    if len(verify) == 1 and all(isinstance(a, ast.Call) and getattr(a.func, "id", "") == "parse" for a in verify[0].args):
        return ast.Call(func=verify[0].func, args=[a.args[0] for a in verify[0].args], keywords=[])
    return None


def _parameter_sets(path: Path, function: ast.FunctionDef) -> list[dict]:
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
            names = [n.strip() for n in ast.literal_eval(decorator.args[0]).split(",")]
            values = _evaluate(decorator.args[1], path)
            return [dict(zip(names, row, strict=True)) for row in values]
    return [{}]  # a test that calls with literal arguments


def _value(node: ast.expr, params: dict, path: Path):
    return params[node.id] if isinstance(node, ast.Name) else _evaluate(node, path)


def _evaluate(node: ast.expr, path: Path):
    # test tables hold literals and a few f-strings of `math` values (test_float_precision)
    return eval(compile(ast.Expression(node), str(path), "eval"), {"math": math})  # noqa: S307


def relex_verdicts(rows: list[dict]) -> list[int]:
    from relex.verifiers import get_verifier

    scores = get_verifier("math")([r["pred"] for r in rows], answer=[r["gold"] for r in rows])
    return [int(s == 1.0) for s in scores]


def report(rows: list[dict], verdicts: list[int], label: str) -> None:
    agree = sum(v == r["expected"] for r, v in zip(rows, verdicts))
    false_accepts = sum(v and not r["expected"] for r, v in zip(rows, verdicts))
    false_rejects = sum(r["expected"] and not v for r, v in zip(rows, verdicts))
    print(f"{label}: {agree}/{len(rows)} agree ({agree / len(rows):.1%}), "
          f"{false_rejects} false rejects, {false_accepts} false accepts")


def agreement(show: bool) -> None:
    rows = [json.loads(line) for line in CASES.read_text().splitlines()]
    verdicts = relex_verdicts(rows)
    verify_keys = ("precision", "strict", "allow_set_relation_comp")
    same_verify = [i for i, r in enumerate(rows) if all(r["options"][k] == DEFAULT_OPTIONS[k] for k in verify_keys)]
    defaults = [i for i, r in enumerate(rows) if r["options"] == DEFAULT_OPTIONS]
    report(rows, verdicts, "all cases")
    report([rows[i] for i in same_verify], [verdicts[i] for i in same_verify], "default verify options")
    report([rows[i] for i in defaults], [verdicts[i] for i in defaults], "default extraction and verify options")
    if show:
        for r, v in zip(rows, verdicts):
            if v != r["expected"]:
                print(f"  {r['source']}: expected {r['expected']}, relex {v}: gold {r['gold']!r} pred {r['pred']!r}")


def speed(batch: int) -> None:
    from relex.verifiers import get_verifier

    rows = [json.loads(line) for line in SMOLLM2_ROWS.read_text().splitlines()]
    math_verifier = get_verifier("math")
    seconds = _timed(math_verifier, [r["completion"] for r in rows], answer=[r["gold"] for r in rows])
    print(f"math: {len(rows)} SmolLM2 completions in {seconds:.2f} s, {len(rows) / seconds:.0f} per second")
    short, long = (_timed(math_verifier, ["\\boxed{" * n + "1"], answer=["1"]) for n in (6_000, 60_000))
    print(f"math: 6,000 unclosed boxes {short:.3f} s, 60,000 {long:.3f} s (ratio {long / short:.1f} for 10x the text)")
    code = get_verifier("code")
    programs = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"] * (batch // 2)
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    code(programs[:2], tests=tests)  # warm the sandbox check and the page cache
    seconds = _timed(code, programs, tests=tests)
    print(f"code: a batch of {len(programs)} in {seconds:.2f} s, {len(programs) / seconds:.1f} per second (sandboxed)")


def _timed(verifier, completions, **columns) -> float:
    start = time.perf_counter()
    verifier(completions, **columns)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    agree = commands.add_parser("agreement", help="math against Math-Verify's test cases")
    agree.add_argument("--from-tests", type=Path, help="a Math-Verify checkout's tests/ folder to rebuild the cases from")
    agree.add_argument("--show", action="store_true", help="print every disagreement")
    fast = commands.add_parser("speed", help="completions scored per second")
    fast.add_argument("--batch", type=int, default=32, help="completions per call of the code verifier")
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if args.command == "speed":
        speed(args.batch)
    elif args.from_tests:
        rows = cases_from_tests(args.from_tests)
        CASES.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"wrote {len(rows)} cases to {CASES}")
    else:
        agreement(args.show)


if __name__ == "__main__":
    main()
