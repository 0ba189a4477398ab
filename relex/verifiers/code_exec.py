"""The `code` verifier: does the completion's Python code pass the row's tests?

    code_reward(["```python\\ndef add(a, b):\\n    return a + b\\n```"], tests=["assert add(2, 3) == 5"])

The code is the last ```python (or untagged) fenced block, else the whole completion. `tests` is Python source
with asserts, or a list of assert lines. Code and tests run together in a fresh `python -I` in an empty
temporary folder, in a new session whose whole process group is killed on timeout (`timeout` column or keyword,
seconds). The child is limited in address space, CPU time, file size and process count (0: no new processes or
threads), and a prelude disables process and thread creation (fork, exec, subprocess, threading, ctypes) and
sockets. Success needs exit status 0 and a secret written after the tests, so `sys.exit(0)` before the tests
does not pass.

This is a best-effort sandbox against accidents and reward hacks, not a security boundary: the code runs as the
calling user, can read and write that user's files, and a determined program can undo the prelude. As root,
RLIMIT_NPROC is not enforced and only the prelude blocks forks. Run untrusted code in a container.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from relex.verifiers.answers import completion_text, last_fenced_block
from relex.verifiers.columns import optional_column, required_column

LOG = logging.getLogger(__name__)

NAME = "code"
DEFAULT_TIMEOUT = 5.0
MAX_PARALLEL = 8


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = DEFAULT_TIMEOUT  # wall-clock seconds; CPU time is capped one second above it
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 16 * 2**20


def code_reward(completions, **columns) -> list[float]:
    """1.0 where the extracted code passes the `tests` column in the sandbox, else 0.0 (never raises for bad code)."""
    n = len(completions)
    tests = required_column(columns, "tests", n, NAME)
    timeouts = optional_column(columns, "timeout", n, DEFAULT_TIMEOUT)
    jobs = [
        (extract_code(completion_text(c)), test_source(t), SandboxLimits(timeout=float(s)))
        for c, t, s in zip(completions, tests, timeouts, strict=True)
    ]
    with ThreadPoolExecutor(max_workers=max(1, min(n, MAX_PARALLEL, os.cpu_count() or 1))) as pool:
        return [1.0 if passed else 0.0 for passed in pool.map(lambda job: passes_tests(*job), jobs)]


def extract_code(text: str) -> str:
    block = last_fenced_block(text, ("python", "py", "python3", ""))
    return block if block is not None else text


def test_source(tests: str | list[str]) -> str:
    return tests if isinstance(tests, str) else "\n".join(tests)


def passes_tests(code: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> bool:
    """Run `code` then `tests` in the sandbox; True only when the tests ran to the end without an error."""
    secret = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="relex-code-", ignore_cleanup_errors=True) as tmp:
        folder = Path(tmp)
        (folder / "sandbox.py").write_text(SANDBOX)
        (folder / "program.py").write_text(f"{code}\n{tests}\n")
        returncode = _run_sandbox(folder, secret, limits)
        passed = returncode == 0 and _tail(folder / "stdout", len(secret)) == secret.encode()
        if not passed:
            LOG.debug("verifier code: exit %s; stderr ends %r", returncode, _tail(folder / "stderr", 500))
    return passed


def _run_sandbox(folder: Path, secret: str, limits: SandboxLimits) -> int:
    """Exit status of the sandboxed child (negative: killed by that signal, e.g. on timeout)."""
    cpu_seconds = math.ceil(limits.timeout) + 1
    argv = [sys.executable, "-I", "sandbox.py", *map(str, (limits.memory_bytes, cpu_seconds, limits.file_bytes))]
    with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
        child = subprocess.Popen(
            argv,
            cwd=folder,
            env=_child_env(folder),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            child.communicate(f"{secret}\n".encode(), timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            LOG.debug("verifier code: timed out after %.1f s", limits.timeout)
        finally:
            _kill_group(child.pid)  # also whatever the program started that outlived it
            child.wait()
    return child.returncode


def _child_env(folder: Path) -> dict[str, str]:
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": os.defpath, "HOME": str(folder), "LANG": "C.UTF-8", **threads}


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


def _tail(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - size))
        return f.read()


# Runs in the child as `python -I sandbox.py MEMORY CPU_SECONDS FILE_BYTES`, with the secret on stdin.
SANDBOX = """
import os, posix, resource, socket, sys, threading, _posixsubprocess, _socket, _thread


def blocked(*args, **kwargs):
    raise PermissionError("disabled by the relex code verifier sandbox")


def confine(memory, cpu_seconds, file_bytes):
    for kind, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu_seconds),
                        (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NPROC, 0)):
        resource.setrlimit(kind, (value, value))
    for module in (os, posix):  # RLIMIT_NPROC does not bind root, so take the calls away as well
        for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve",
                     "kill", "killpg"):
            if hasattr(module, name):
                setattr(module, name, blocked)
    _posixsubprocess.fork_exec = blocked
    for module, names in ((_thread, ("start_new_thread", "start_new", "start_joinable_thread")),
                          (threading, ("_start_new_thread", "_start_joinable_thread"))):
        for name in names:  # RLIMIT_NPROC counts threads too; the same verdict as root or not
            if hasattr(module, name):
                setattr(module, name, blocked)
    for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server"):
        setattr(socket, name, blocked)
    _socket.socket = blocked
    sys.modules["ctypes"] = None


def main():
    secret = sys.stdin.readline().strip()  # a local, so the program cannot read it from __main__
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    report = os.dup(1)  # the program may close or redirect stdout
    confine(*map(int, sys.argv[1:4]))
    with open("program.py") as f:
        program = compile(f.read(), "program.py", "exec")
    exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
    os.write(report, secret.encode())
    os._exit(0)


main()
"""
