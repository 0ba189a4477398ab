"""The `code` verifier against escapes: each program below passes its tests only if its escape works.

The table's programs define a correct `add` exactly when the thing the sandbox must prevent succeeded (a fork, a
connection, a write outside its tmpfs, a read of the caller's environment), so a verdict of 1.0 means an escape.
The isolation tests need bubblewrap; they skip, with the reason, only where it cannot create a sandbox.
"""

from __future__ import annotations

import socket

import pytest

from relex.errors import RelexError
from relex.verifiers import get_verifier, sandbox
from relex.verifiers.code_checks import plan_tests

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
CORRECT = "def add(a, b):\n    return a + b\n"

needs_sandbox = pytest.mark.skipif(
    sandbox.sandbox_problem() is not None, reason=f"no sandbox here: {sandbox.sandbox_problem()}"
)


def score(completion, tests=ADD_TESTS, timeout=5) -> float:
    (value,) = get_verifier("code")([completion], tests=[tests], timeout=timeout)
    return value


def if_escaped(condition: str, setup: str = "") -> str:
    """A program that defines a correct `add` only when `condition` holds after `setup` ran."""
    return f"{setup}\nif {condition}:\n    def add(a, b):\n        return a + b\n"


# ---------------------------------------------------------------------------------------------------- plan


def test_plan_keeps_expected_values_out_of_the_child():
    plan = plan_tests("import math\nassert add(2, 3) == 5\nassert 7 != add(1, 1)\nassert is_even(4)\nassert True")
    assert plan.steps == [["exec", "import math"], ["value", "add(2, 3)"], ["value", "add(1, 1)"], ["truth", "is_even(4)"]]
    assert "5" not in repr(plan.steps) and "7" not in repr(plan.steps)
    assert plan.constants == [True]


@pytest.mark.parametrize(
    ("lines", "passed"),
    [
        ([{"step": "program"}, {"step": 0, "value": "5"}], True),
        ([{"step": "program"}, {"step": 0, "value": "5.0"}], True),  # 5.0 == 5, as the assert would have it
        ([{"step": "program"}, {"step": 0, "value": "6"}], False),
        ([{"step": "program"}, {"step": 0, "value": "<object at 0x1>"}], False),  # not a literal
        ([{"step": "program"}, {"step": 0, "error": "TypeError"}], False),
        ([{"step": "program"}], False),  # left before the tests
        ([{"step": "program"}, {"step": 0, "value": "5"}, {"step": 0, "value": "5"}], False),  # a forged extra line
        ([], False),
    ],
)
def test_plan_judges_the_report(lines, passed):
    assert plan_tests("assert add(2, 3) == 5").judge(lines) is passed


def test_constant_failing_assert_fails_without_running():
    assert not plan_tests("assert False").parent_checks_pass()


def test_tests_that_are_not_python_are_a_configuration_error():
    with pytest.raises(RelexError, match="the tests are not valid Python"):
        score(CORRECT, tests="assert add(2, 3) ==")


def test_missing_sandbox_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.sandbox_problem.cache_clear()
    try:
        with pytest.raises(RelexError, match=r"^code verifier: bubblewrap \(bwrap\) is not installed; [^\n]*$"):
            score(CORRECT)
    finally:
        sandbox.sandbox_problem.cache_clear()


def test_the_seccomp_pipe_closes_each_descriptor_once(monkeypatch):
    """A descriptor closed twice may be another thread's by the second close (jobs run in parallel threads): that
    closed a job's report file under it, seen as EBADF in CI."""
    import os

    closed, original = [], os.close
    monkeypatch.setattr(sandbox.os, "close", lambda fd: closed.append(fd) or original(fd))
    with sandbox._seccomp_fd() as fd:
        assert os.read(fd, 8)
    assert sorted(closed) == sorted(set(closed)) and len(closed) == 2, closed


def test_seccomp_program_shape():
    program = sandbox.seccomp_program("x86_64")
    assert len(program) % 8 == 0 and len(program) // 8 == 11


# ---------------------------------------------------------------------------------------------------- verdicts


@needs_sandbox
@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (CORRECT, 1.0),
        ("Sure!\n```python\n" + CORRECT + "```\nThis adds.", 1.0),
        ("def add(a, b):\n    return a - b", 0.0),
        ("def add(a, b)\n    return a + b", 0.0),  # syntax error
        ("import sys\nsys.exit(0)", 0.0),  # leaving before the tests run
        ("import os\nos._exit(0)", 0.0),
        ("while True:\n    pass", 0.0),  # killed at the timeout
        ("x = bytearray(10**10)\n" + CORRECT, 0.0),  # address-space limit
        ("x = bytearray(2**26)\n" + CORRECT, 1.0),  # 64 MiB is allowed
        ("x = bytearray(2**30)\n" + CORRECT, 0.0),  # 1 GiB, over the 512 MiB limit but not the machine's
        ("open('small', 'wb').write(b'x' * 2**20)\n" + CORRECT, 1.0),  # the working folder is writable
        (if_escaped("n == 20", "n = 0\ntry:\n    with open('big', 'wb') as f:\n        for n in range(1, 21):\n"
                    "            f.write(b'x' * 2**20)\nexcept OSError:\n    pass"), 0.0),  # a 20 MiB file: over 16
        ("def add(a, b):\n    return float(a + b)", 1.0),  # 5.0 == 5
        ("class Five:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Five()", 0.0),
    ],
)
def test_code_table(completion, expected):
    assert score(completion, timeout=3) == expected


@needs_sandbox
def test_tests_as_a_list_of_asserts_with_setup():
    completions = [CORRECT, "def add(a, b):\n    return 5"]
    tests = [["import math", "x = 1", "assert add(2, 3) == 5", "assert add(x, 1) == 2"]] * 2
    assert get_verifier("code")(completions, tests=tests, timeout=3) == [1.0, 0.0]


@needs_sandbox
def test_truth_asserts_and_nested_asserts_run_in_the_child():
    tests = "assert add(1, 1) > 1\nfor i in range(3):\n    assert add(i, 0) == i"
    assert score(CORRECT, tests=tests) == 1.0
    assert score("def add(a, b):\n    return 0", tests=tests) == 0.0


@needs_sandbox
def test_stdin_is_empty():
    assert score("x = input()", tests="") == 0.0  # EOFError instead of waiting for input


# ---------------------------------------------------------------------------------------------------- escapes


FORGE_REPORT = """
import json, os, sys
frame = sys._getframe(1)
seen = {name: repr(value)[:200] for name, value in frame.f_locals.items()}
report = int(sys.argv[1])
steps = frame.f_locals.get("steps", [])
os.write(report, (json.dumps({"step": "program"}) + "\\n").encode())
for i, step in enumerate(steps):  # claim that every call returned what the test expects, if it can be found
    os.write(report, (json.dumps({"step": i, "value": "True"}) + "\\n").encode())
os._exit(0)
"""


@needs_sandbox
@pytest.mark.parametrize("tests", ["assert False", "assert add(2, 3) == 6", "assert 1 == 2"])
def test_a_forged_report_does_not_pass_failing_tests(tests):
    assert score(FORGE_REPORT, tests=tests) == 0.0


@needs_sandbox
def test_the_child_holds_no_expected_value():
    program = if_escaped("'6' in repr(sys._getframe(1).f_locals)", "import sys")
    assert score(program, tests="assert add(2, 3) == 6") == 0.0


@needs_sandbox
@pytest.mark.parametrize(
    "program",
    [
        if_escaped("pid is not None", "import posix\ntry:\n    pid = posix.fork()\nexcept OSError:\n    pid = None\n"
                   "if pid == 0:\n    posix._exit(0)"),
        if_escaped("started", "import _thread\ntry:\n    _thread.start_new_thread(print, ())\n    started = True\n"
                   "except RuntimeError:\n    started = False"),
        if_escaped("pid > 0", "import ctypes\npid = ctypes.CDLL(None).fork()\nif pid == 0:\n    ctypes.CDLL(None)._exit(0)"),
        if_escaped("ok", "import os\ntry:\n    os.setsid()\n    os.posix_spawn('/usr/bin/true', ['true'], {})\n    ok = True\n"
                   "except OSError:\n    ok = False"),
        if_escaped("ok", "import subprocess\ntry:\n    subprocess.run(['true'])\n    ok = True\nexcept OSError:\n    ok = False"),
        if_escaped("ok", "import ctypes\nok = ctypes.CDLL(None).unshare(0x10000000) == 0"),  # CLONE_NEWUSER
    ],
    ids=["posix.fork", "_thread", "ctypes-fork", "setsid-spawn", "subprocess", "new-user-namespace"],
)
def test_no_new_processes_or_threads(program):
    assert score(program) == 0.0


@needs_sandbox
def test_seccomp_alone_refuses_fork_and_threads(tmp_path):
    probe = (
        "import os, sys, _thread\nresults = []\n"
        "for start in (os.fork, lambda: _thread.start_new_thread(print, ())):\n"
        "    try:\n        start()\n        results.append('started')\n"
        "    except (OSError, RuntimeError):\n        results.append('refused')\n"
        "os.write(int(sys.argv[1]), ' '.join(results).encode())\n"
    )
    (tmp_path / "probe.py").write_text(probe)
    limits = sandbox.SandboxLimits(processes=10_000)  # RLIMIT_NPROC out of the way: only the filter refuses
    outcome = sandbox.run_sandboxed(tmp_path, "probe.py", limits, report=tmp_path / "report")
    assert outcome.returncode == 0
    assert (tmp_path / "report").read_text() == "refused refused"


@needs_sandbox
def test_no_network_to_the_host():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        program = if_escaped(
            "ok",
            f"import _socket\ns = _socket.socket()\ntry:\n    s.connect(('127.0.0.1', {port}))\n    ok = True\n"
            "except OSError:\n    ok = False",
        )
        assert score(program) == 0.0
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing is waiting to be accepted
            listener.accept()


@needs_sandbox
def test_no_view_of_the_callers_environment_or_files(monkeypatch, tmp_path):
    monkeypatch.setenv("RELEX_TEST_SECRET", "s3cr3t-value")
    secret_file = tmp_path / "expected.txt"
    secret_file.write_text("5")
    environ = if_escaped(
        "found",
        "import glob, os\nfound = 's3cr3t-value' in repr(os.environ)\n"
        "for path in glob.glob('/proc/*/environ'):\n    try:\n"
        "        found = found or b's3cr3t-value' in open(path, 'rb').read()\n    except OSError:\n        pass",
    )
    files = if_escaped("ok", f"import os\nok = os.path.exists({str(secret_file)!r}) or os.path.exists('/work')")
    assert score(environ) == 0.0
    assert score(files) == 0.0


@needs_sandbox
def test_read_only_filesystem_and_bounded_disk():
    outside = if_escaped(
        "written",
        "written = False\nfor path in ('/job/x', '/usr/x', '/x'):\n    try:\n        open(path, 'w').write('x')\n"
        "        written = True\n    except OSError:\n        pass",
    )
    disk = if_escaped(
        "total >= 100 * 2**20",
        "total = 0\nchunk = b'x' * 2**20\nfor i in range(10):\n    try:\n        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(15):\n                f.write(chunk)\n                total += len(chunk)\n"
        "    except OSError:\n        pass",
    )
    assert score(outside) == 0.0
    assert score(disk) == 0.0


@needs_sandbox
def test_parallel_jobs_keep_their_files():
    """Many rounds of four jobs in parallel threads: each job's report file stays its own (before each descriptor
    was closed once, 19 of 300 such rounds here failed with EBADF on a report file)."""
    completions = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return 5"] * 2
    for _ in range(40):
        assert get_verifier("code")(completions, tests=[["assert add(1, 1) == 2"]] * 4, timeout=3) == [1.0, 0.0, 1.0, 0.0]
