"""Run untrusted Python in an operating-system sandbox: bubblewrap namespaces, a seccomp filter and rlimits.

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)  # write runner.py and its inputs here; the sandbox sees the folder as /job
        outcome = run_sandboxed(job, "runner.py", SandboxLimits(timeout=5), report=job / "report")

The child sees a filesystem that holds only the system's `/usr` and the Python installation (read-only), the job
folder at `/job` (read-only) and a size-limited tmpfs at `/tmp` as its working folder: not the caller's home, repo
or datasets. It runs as `nobody` in its own user namespace (and may not make another), with its own PID, network
(loopback only, nothing listening), IPC and UTS namespaces, an empty environment and no capabilities. A seccomp
filter makes `fork`, `vfork`, `clone` and `clone3` fail, so it can start neither processes nor threads. The filter
is what holds: RLIMIT_NPROC is set to 0 as well, but on the development machine's kernel (6.18) a process in a
new user namespace could fork under it.
Address space, CPU time, file size and processes are limited with rlimits that a bootstrap sets before the
script starts. On timeout the parent kills bubblewrap's process group; bubblewrap is PID 1 of the sandbox's namespace,
and the kernel kills every process of a PID namespace when its first process dies, so nothing the program
started survives (`setsid()` does not help it).

bubblewrap comes from Debian's `bubblewrap` package (`scripts/setup.sh` installs it when run as root). Where it
is missing, or the kernel refuses it user namespaces, `require_sandbox()` raises `RelexError` in one line
saying so (`sandbox_problem()` returns that sentence, for callers that want to check first).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from relex.errors import RelexError

LOG = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
NOBODY = 65534
SANDBOX_ENV = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = DEFAULT_TIMEOUT  # wall-clock seconds; CPU time is capped a second or two above it
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 16 * 2**20
    disk_bytes: int = 32 * 2**20  # the tmpfs that is the program's working folder
    processes: int = 0  # RLIMIT_NPROC; the seccomp filter refuses new processes and threads whatever this is


@dataclass(frozen=True)
class SandboxOutcome:
    returncode: int  # negative: killed by that signal
    timed_out: bool


def run_sandboxed(job: Path, script: str, limits: SandboxLimits, report: Path) -> SandboxOutcome:
    """Run `/job/SCRIPT REPORT_FD` with Python in the sandbox, under `limits`; the file `report`, outside it, is
    open for writing at REPORT_FD. The job folder also receives the child's `stdout` and `stderr`."""
    bwrap = require_sandbox()
    job.chmod(0o755)  # the program runs as nobody and reads its inputs from here
    with contextlib.ExitStack() as stack:
        seccomp = stack.enter_context(_seccomp_fd())
        out = stack.enter_context(open(job / "stdout", "wb"))
        err = stack.enter_context(open(job / "stderr", "wb"))
        report_file = stack.enter_context(open(report, "wb"))
        report_fd = report_file.fileno()
        command = [bwrap, *bwrap_arguments(job, limits, seccomp), *python_command(script, [str(report_fd)], limits)]
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            pass_fds=(report_fd, seccomp),
            env=SANDBOX_ENV,  # bubblewrap stays the sandbox's PID 1, whose /proc/1/environ the program can read
        )
        timed_out = False
        try:
            child.wait(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            LOG.debug("sandbox: timed out after %.1f s", limits.timeout)
        finally:
            _kill_group(child.pid)
            child.wait()
    return SandboxOutcome(child.returncode, timed_out)


def bwrap_arguments(job: Path, limits: SandboxLimits, seccomp_fd: int | None = None) -> list[str]:
    prefix = sys.base_prefix
    arguments = [
        # as root, --unshare-all keeps the caller's user; --unshare-user with --uid maps the program to nobody
        "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns",
        "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
        *(item for name, value in SANDBOX_ENV.items() for item in ("--setenv", name, value)),
        "--ro-bind", "/usr", "/usr", "--ro-bind", prefix, prefix,
        "--proc", "/proc", "--ro-bind", str(job), "/job",
        "--size", str(limits.disk_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp",
    ]  # fmt: skip
    for name in ("lib", "lib64", "bin"):  # merged-/usr systems link these into /usr; others get /usr's copy
        if Path("/" + name).is_symlink():
            arguments += ["--symlink", os.readlink("/" + name), "/" + name]
        elif Path("/" + name).is_dir():
            arguments += ["--ro-bind", "/" + name, "/" + name]
    arguments += ["--remount-ro", "/"]  # the root bubblewrap builds is a tmpfs: writable and unbounded otherwise
    if seccomp_fd is not None:
        arguments += ["--seccomp", str(seccomp_fd)]
    return arguments


def python_command(script: str, arguments: list[str], limits: SandboxLimits) -> list[str]:
    # the base interpreter, not a virtual environment's: the sandbox sees only the installation under base_prefix
    interpreter = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    rlimits = [limits.memory_bytes, math.ceil(limits.timeout) + 1, limits.file_bytes, limits.processes]
    return [str(interpreter), "-I", "-S", "-c", _BOOTSTRAP, *map(str, rlimits), f"/job/{script}", *arguments]


# `python -c _BOOTSTRAP AS CPU FSIZE NPROC SCRIPT ARGS...`: set the limits, then run SCRIPT as __main__
_BOOTSTRAP = """
import resource, sys
kinds = (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NPROC)
for kind, value in zip(kinds, map(int, sys.argv[1:5])):
    resource.setrlimit(kind, (value, value))
sys.argv = sys.argv[5:]
with open(sys.argv[0]) as f:
    code = compile(f.read(), sys.argv[0], "exec")
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


def require_sandbox() -> str:
    """The path of `bwrap` after checking that it can create the sandbox here; raises `RelexError` otherwise."""
    problem = sandbox_problem()
    if problem is not None:
        raise RelexError(f"code verifier: {problem}")
    return shutil.which("bwrap")


@functools.cache
def sandbox_problem() -> str | None:
    """Why the sandbox cannot run on this machine, in one sentence; None when it can."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return (
            "bubblewrap (bwrap) is not installed; install Debian's bubblewrap package (scripts/setup.sh does so "
            "when run as root): untrusted code runs only inside it"
        )
    if platform.machine() not in _AUDIT_ARCH:
        return f"no seccomp filter for the {platform.machine()} architecture (x86_64 and aarch64 only)"
    probe = subprocess.run(
        [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "true"],
        capture_output=True, text=True, check=False,
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return (
            f"bubblewrap cannot create a sandbox here ({reason}); it needs user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, or a container that allows them)"
        )
    return None


# seccomp: ERRNO(EPERM) for the syscalls that create processes and threads, on the two architectures relex runs on
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SPAWN_SYSCALLS = {"x86_64": (56, 57, 58, 435), "aarch64": (220, 435)}  # clone, fork, vfork, clone3 / clone, clone3
_X32_BIT = 0x40000000  # x86_64's x32 ABI numbers; refused outright


def seccomp_program(machine: str) -> bytes:
    """A classic BPF program for bubblewrap's `--seccomp`: deny process and thread creation, allow the rest."""
    load_arch, load_nr = (0x20, 0, 0, 4), (0x20, 0, 0, 0)  # BPF_LD|BPF_W|BPF_ABS of seccomp_data.arch / .nr
    allow, deny = (0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x00050000 | 1)  # RET ALLOW / RET ERRNO(EPERM)
    syscalls = _SPAWN_SYSCALLS[machine]
    program = [load_arch, (0x15, 1, 0, _AUDIT_ARCH[machine]), allow, load_nr]  # another arch: allow (see docstring)
    if machine == "x86_64":
        program.append((0x35, len(syscalls) + 1, 0, _X32_BIT))  # JGE x32 -> deny
    for i, number in enumerate(syscalls):
        program.append((0x15, len(syscalls) - i, 0, number))  # JEQ -> deny
    program += [allow, deny]
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)


@contextlib.contextmanager
def _seccomp_fd():
    """A pipe's read end holding the seccomp program. Each descriptor is closed exactly once: jobs run in threads,
    and a second close of a number another thread has just been given (its report file, say) would close theirs."""
    read, write = os.pipe()
    try:
        try:
            os.write(write, seccomp_program(platform.machine()))
        finally:
            os.close(write)
        yield read
    finally:
        os.close(read)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)
