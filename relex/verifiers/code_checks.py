"""Split a test file into what the sandboxed child evaluates and what only the verifier's process knows.

    plan = plan_tests("import math\\nassert add(2, 3) == 5\\nassert is_even(4)")
    plan.steps   # [["exec", "import math"], ["value", "add(2, 3)"], ["truth", "is_even(4)"]]
    plan.judge(report_lines)  # True when the child's values match: add(2, 3) == 5 and is_even(4) is truthy

Each top-level statement becomes one step, in order. An assert whose one side is a Python literal (`f(x) == 5`,
`5 != f(x)`) sends only the other side: the child reports its value and this process compares it with the
literal, so the child never sees the expected value. A constant assert (`assert False`, `assert 1 == 2`) is
decided here without the child. Any other assert sends its whole condition and expects True. Other statements
run as they are.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field

from relex.errors import RelexError

_COMPARISONS = {ast.Eq: operator.eq, ast.NotEq: operator.ne}
_LITERAL_COMPARISONS = {
    **_COMPARISONS, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_NOT_A_LITERAL = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


@dataclass
class CheckPlan:
    steps: list[list[str]] = field(default_factory=list)  # [kind, source]: kind is exec, value or truth
    checks: dict[int, tuple] = field(default_factory=dict)  # step -> (comparison, expected) for value steps
    constants: list[bool] = field(default_factory=list)  # the verdicts of constant asserts

    def parent_checks_pass(self) -> bool:
        return all(self.constants)

    def judge(self, lines: list[dict]) -> bool:
        """True when the report has the program's line and then exactly one passing line per step, in order."""
        expected_steps = ["program", *range(len(self.steps))]
        if [line.get("step") for line in lines] != expected_steps:
            return False
        return all("error" not in line for line in lines) and all(
            self._step_passes(i, line) for i, line in enumerate(lines[1:])
        )

    def _step_passes(self, i: int, line: dict) -> bool:
        kind = self.steps[i][0]
        if kind == "exec":
            return set(line) == {"step"}
        value = literal_value(line.get("value"))
        if value is None:
            return False
        if kind == "truth":
            return value == (True,)
        compare, expected = self.checks[i]
        return bool(compare(value[0], expected))


def plan_tests(source: str) -> CheckPlan:
    try:
        module = ast.parse(source)
    except SyntaxError as e:
        raise RelexError(f"code verifier: the tests are not valid Python (line {e.lineno}: {e.msg})") from e
    plan = CheckPlan()
    for statement in module.body:
        _add_statement(plan, statement)
    return plan


def _add_statement(plan: CheckPlan, statement: ast.stmt) -> None:
    if not isinstance(statement, ast.Assert):
        plan.steps.append(["exec", ast.unparse(statement)])
        return
    condition = statement.test
    constant = _literal(condition) or _literal_comparison_value(condition)
    if constant is not None:
        plan.constants.append(bool(constant[0]))
        return
    split = _literal_comparison(condition)
    if split is None:
        plan.steps.append(["truth", ast.unparse(condition)])
        return
    compare, evaluated, expected = split
    plan.checks[len(plan.steps)] = (compare, expected)
    plan.steps.append(["value", ast.unparse(evaluated)])


def _literal_comparison(condition: ast.expr) -> tuple | None:
    """`(comparison, the side to evaluate, the literal)` for `x == literal` or `literal != x`, else None."""
    if not (isinstance(condition, ast.Compare) and len(condition.ops) == 1):
        return None
    compare = _COMPARISONS.get(type(condition.ops[0]))
    left, right = condition.left, condition.comparators[0]
    if compare is None:
        return None
    for evaluated, other in ((left, right), (right, left)):
        literal = _literal(other)
        if literal is not None and _literal(evaluated) is None:
            return compare, evaluated, literal[0]
    return None


def _literal_comparison_value(condition: ast.expr) -> tuple | None:
    """`(verdict,)` of a comparison between two literals (`1 == 2`), decided here; None for anything else."""
    if not (isinstance(condition, ast.Compare) and len(condition.ops) == 1):
        return None
    compare = _LITERAL_COMPARISONS.get(type(condition.ops[0]))
    left, right = _literal(condition.left), _literal(condition.comparators[0])
    if compare is None or left is None or right is None:
        return None
    try:
        return (bool(compare(left[0], right[0])),)
    except TypeError:  # 1 < "a": the assert would raise, so it fails
        return (False,)


def _literal(node: ast.expr) -> tuple | None:
    """`(value,)` when the expression is a Python literal, else None."""
    try:
        return (ast.literal_eval(node),)
    except _NOT_A_LITERAL:
        return None


def literal_value(text) -> tuple | None:
    """`(value,)` of a `repr` the child reported, when it is a Python literal; None otherwise."""
    if not isinstance(text, str):
        return None
    try:
        return (ast.literal_eval(text),)
    except _NOT_A_LITERAL:
        return None
