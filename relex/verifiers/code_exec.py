"""The `code` verifier: does the completion's Python code pass the row's tests?

    code_reward(["```python\\ndef add(a, b):\\n    return a + b\\n```"], tests=["assert add(2, 3) == 5"])

The code is the last ```python (or untagged) fenced block, else the whole completion. `tests` is Python source
with asserts, or a list of assert lines; `timeout` (a column or keyword) is the wall-clock limit in seconds.

The verdict is computed here, in the caller's process, never by the untrusted one (`relex.verifiers.code_checks`):
an assert `assert f(x) == 5` becomes a request to evaluate `f(x)`, and only this process knows the 5. The child
runs the program and then each request, in the order of the tests, inside an operating-system sandbox
(`relex.verifiers.sandbox`: bubblewrap namespaces, no network, a read-only view of `/usr` and Python only, a
size-limited tmpfs, no new processes or threads, rlimits, and a kill of the whole PID namespace on timeout). It
writes what each request evaluated to (its `repr`) to a report file; this process reads the values back as
Python literals and compares them with the expected ones. A program that forges the report, exits early or
reads its caller's frames learns nothing it could pass with: there is no secret in its process, and a missing
or extra report line fails. What it can forge is the value of an assert that holds no literal to compare with
(`assert is_prime(7)` expects True, which anyone can guess), and asserts nested inside loops or functions,
which run in the child as statements; write tests as `assert call(...) == expected` to close that gap.

The program sees only Python's standard library. bubblewrap is required: where it is missing or cannot run, the
verifier raises `RelexError` in one line.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from relex.verifiers.answers import completion_text, last_fenced_block
from relex.verifiers.code_checks import CheckPlan, plan_tests
from relex.verifiers.columns import optional_column, required_column
from relex.verifiers.sandbox import (
    DEFAULT_TIMEOUT,
    SandboxLimits,
    require_sandbox,
    run_sandboxed,
)

LOG = logging.getLogger(__name__)

NAME = "code"
MAX_PARALLEL = 8
MAX_REPORT_BYTES = 2**20


def code_reward(completions, **columns) -> list[float]:
    """1.0 where the extracted code passes the `tests` column in the sandbox, else 0.0 (never raises for bad code).

    Args:
        completions: strings or chat completions; the code is the last fenced Python block (or the whole text).
        tests: the dataset column with the tests per row; `timeout` (optional column): seconds per row.

    Returns:
        One score per completion. Raises `RelexError` before running anything when the sandbox (bubblewrap)
        is missing.

    Example:
        code_reward(["```python\\ndef add(a, b):\\n    return a + b\\n```"], tests=["assert add(1, 2) == 3"])  # [1.0]
    """
    n = len(completions)
    tests = required_column(columns, "tests", n, NAME)
    timeouts = optional_column(columns, "timeout", n, DEFAULT_TIMEOUT)
    jobs = [
        (extract_code(completion_text(c)), plan_tests(test_source(t)), SandboxLimits(timeout=float(s)))
        for c, t, s in zip(completions, tests, timeouts, strict=True)
    ]
    require_sandbox()  # one clear error before any job starts
    with ThreadPoolExecutor(max_workers=max(1, min(n, MAX_PARALLEL, os.cpu_count() or 1))) as pool:
        return [1.0 if passed else 0.0 for passed in pool.map(lambda job: passes_tests(*job), jobs)]


def extract_code(text: str) -> str:
    block = last_fenced_block(text, ("python", "py", "python3", ""))
    return block if block is not None else text


def test_source(tests: str | list[str]) -> str:
    return tests if isinstance(tests, str) else "\n".join(tests)


def passes_tests(code: str, plan: CheckPlan, limits: SandboxLimits = SandboxLimits()) -> bool:
    """Run `code`, then the plan's requests, in the sandbox; True when every check of the plan holds."""
    if not plan.parent_checks_pass():
        return False
    with tempfile.TemporaryDirectory(prefix="relex-code-", ignore_cleanup_errors=True) as tmp:
        job = Path(tmp)
        (job / "runner.py").write_text(RUNNER)
        (job / "program.py").write_text(code)
        (job / "steps.json").write_text(json.dumps(plan.steps))
        outcome = run_sandboxed(job, "runner.py", limits, report=job / "report")
        lines = read_report(job / "report")
        passed = not outcome.timed_out and plan.judge(lines)
        if not passed:
            LOG.debug("verifier code: exit %s, report %.300r, stderr ends %r",
                      outcome.returncode, lines, (job / "stderr").read_bytes()[-500:])
    return passed


def read_report(path: Path) -> list[dict]:
    """The report's JSON lines (at most `MAX_REPORT_BYTES`); a line that is not a JSON object ends the list."""
    with open(path, "rb") as f:
        data = f.read(MAX_REPORT_BYTES)
    lines = []
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            break
        if not isinstance(line, dict):
            break
        lines.append(line)
    return lines


# Runs in the sandbox as `/job/runner.py REPORT_FD`, under its limits. It holds no expected value: it runs the
# program, then each step, and writes one JSON line per step to the report descriptor, stopping at the first error.
RUNNER = """
import json, os, sys


def send(report, **line):
    os.write(report, (json.dumps(line) + "\\n").encode())


def main():
    report = int(sys.argv[1])
    with open("/job/steps.json") as f:
        steps = json.load(f)
    with open("/job/program.py") as f:
        source = f.read()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "program.py", "exec"), namespace)
    except BaseException as e:
        send(report, step="program", error=type(e).__name__)
        return
    send(report, step="program")
    for i, (kind, step) in enumerate(steps):
        try:
            if kind == "exec":
                exec(compile(step, f"test {i}", "exec"), namespace)
                send(report, step=i)
            else:
                value = eval(compile(step, f"test {i}", "eval"), namespace)
                send(report, step=i, value=repr(bool(value) if kind == "truth" else value))
        except BaseException as e:
            send(report, step=i, error=type(e).__name__)
            return


main()
"""
