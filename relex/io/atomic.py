"""Atomic outputs and write locks: how every relex writer creates or replaces a file or folder.

    with atomic_output(out, overwrite=args.overwrite, inputs=[store.path, store.base_dir]) as tmp:
        ...  # write everything into `tmp` (a folder, or a file path with folder=False)

One meaning of `--overwrite`, for every command: the new output is written completely under a temporary name
beside OUT, then the old OUT is moved aside, the new one renamed into place and the old one removed. An
interrupted run therefore leaves the old output intact, or nothing, never a mix. `--overwrite` refuses an OUT
that is, contains or lies inside an input of the same command, so no input is ever deleted.

Names beside an output OUT (all hidden, all with the PID of the process that made them):

    .OUT.lock            the write lock: an OS file lock held while a command writes OUT; holds the writer's PID
    .OUT.tmp-PID-XXXX    the new output while it is being written
    .OUT.old-PID         the previous output, between being moved aside and being removed

The next writer of OUT, holding the lock, removes the leftovers of processes that are no longer running (and
puts a moved-aside old output back when the new one never arrived), and says so in one line. Locks are
`flock` locks: the OS releases them when the process dies, so a killed writer never blocks the next one; the
lock file is removed when released, so nothing is left beside a finished output.
A trajectory store, which is appended to in place, is locked through its manifest
(`write_lock(STORE/manifest.json)`, lock file `STORE/.manifest.json.lock`), so the lock moves with the store.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no OS locks; a second writer is not detected there
    fcntl = None

from relex.errors import RelexError

LOG = logging.getLogger(__name__)

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>[0-9]+)(?:-[0-9a-f]+)?")
_held: dict[str, tuple[int, int]] = {}  # lock file -> (fd, depth): locks this process holds, re-entrant
_held_guard = threading.Lock()


# ---- locks ---------------------------------------------------------------------------------------------------------
def lock_path(target: str | Path) -> Path:
    target = Path(target)
    return target.parent / f".{target.name}.lock"


def lock_holder(target: str | Path) -> int | None:
    """The PID written into `target`'s lock file by its last holder (None when unknown)."""
    try:
        text = lock_path(target).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def write_lock(target: str | Path) -> Iterator[None]:
    """Hold the write lock of `target` (a file or folder, existing or not); re-entrant within a process.

    A second process gets a `RelexError` naming the PID that holds it, at once rather than waiting.
    """
    path = lock_path(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unwritable(Path(target), error) from None
    key = str(path.resolve())
    with _held_guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
            reentered = True
        else:
            reentered = False
    if not reentered:
        _acquire(Path(target), path, key)
    try:
        yield
    finally:
        with _held_guard:
            fd, depth = _held[key]
            if depth > 1:
                _held[key] = (fd, depth - 1)
            else:
                del _held[key]
                with contextlib.suppress(OSError):  # removed while still held: a newcomer locks a fresh file
                    os.unlink(path)
                os.close(fd)  # closing the descriptor releases the flock


def _acquire(target: Path, path: Path, key: str) -> None:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise _unwritable(target, error) from None
        if fcntl is None:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(target)
            who = f"process {holder}" if holder else "another process"
            raise RelexError(
                f"{target}: {who} is writing it (lock {path}); wait for it to finish, or choose another output"
            ) from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break  # the lock file is still the one at `path`, not one its last holder removed
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    with _held_guard:
        _held[key] = (fd, 1)


def holds_lock(target: str | Path) -> bool:
    """Whether this process holds `target`'s write lock."""
    with _held_guard:
        return str(lock_path(target).resolve()) in _held


# ---- leftovers of interrupted writers ---------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OverflowError:
        return False
    return True


def leftovers(target: str | Path) -> list[tuple[Path, str, int]]:
    """(path, "tmp" or "old", pid) of temporary and moved-aside copies of `target` left by dead processes."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    found = []
    for entry in sorted(target.parent.iterdir()):
        match = _LEFTOVER.fullmatch(entry.name)
        if match and match["name"] == target.name and not pid_alive(int(match["pid"])):
            found.append((entry, match["kind"], int(match["pid"])))
    return found


def clean_leftovers(target: str | Path, keep: Path | None = None) -> list[Path]:
    """Remove the leftovers of `target` by dead processes (call with its lock held); returns what was removed.

    A moved-aside old output whose replacement never arrived is put back in place instead. `keep` is spared.
    """
    target = Path(target)
    removed = []
    for path, kind, pid in leftovers(target):
        if path == keep:
            continue
        if kind == "old" and not target.exists() and not target.is_symlink():
            os.replace(path, target)
            LOG.warning("%s: put back in place; process %d had moved it aside to %s and was interrupted", target, pid, path.name)
            continue
        _remove(path)
        removed.append(path)
    if removed:
        pids = sorted({int(_LEFTOVER.fullmatch(p.name)["pid"]) for p in removed})
        LOG.warning(
            "%s: removed %s, left by interrupted process%s %s",
            target, ", ".join(p.name for p in removed), "es" if len(pids) > 1 else "", ", ".join(map(str, pids)),
        )
    return removed


def clean_leftovers_inside(folder: str | Path) -> list[Path]:
    """Remove leftovers of dead processes directly inside `folder` (e.g. `.step-S.tmp-PID` of an older relex)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for entry in folder.iterdir():
        match = _LEFTOVER.fullmatch(entry.name)
        if match and match["kind"] == "tmp" and not pid_alive(int(match["pid"])):
            _remove(entry)
            removed.append(entry)
    if removed:
        LOG.warning("%s: removed %s, left by interrupted runs", folder, ", ".join(sorted(p.name for p in removed)))
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---- checks ------------------------------------------------------------------------------------------------------
def check_output(
    target: str | Path, *, overwrite: bool = False, inputs: Iterable[str | Path | None] = (), folder: bool = True
) -> None:
    """Refuse, before any work, an output that cannot be written: a file where a folder goes (or the reverse),
    an existing non-empty output without `overwrite`, and with `overwrite` one that is, contains or lies inside
    an input of the command."""
    target = Path(target)
    if target.exists():
        if folder and not target.is_dir():
            raise RelexError(f"{target}: exists and is a file, not a folder; choose another --out")
        if not folder and target.is_dir():
            raise RelexError(f"{target}: exists and is a folder; choose another output file")
        if not overwrite and (not folder or _has_entries(target)):
            raise RelexError(f"{target}: exists and is not empty; choose another --out or pass --overwrite to replace it")
    if overwrite:
        refuse_inputs(target, inputs)


def _has_entries(folder: Path) -> bool:
    """Whether `folder` holds anything besides the leftovers of dead processes (removed by the next writer)."""
    for entry in folder.iterdir():
        match = _LEFTOVER.fullmatch(entry.name)
        if not (match and not pid_alive(int(match["pid"]))):
            return True
    return False


def refuse_inputs(target: str | Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse an output path that is, contains or lies inside one of `inputs` (replacing it would delete it)."""
    out = Path(target).resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if out == source:
            relation = "is"
        elif out in source.parents:
            relation = "contains"
        elif source in out.parents:
            relation = "lies inside"
        else:
            continue
        raise RelexError(
            f"{target}: {relation} the input {given} of this command; --overwrite would delete it, so choose another --out"
        )


class WriteFailed(RelexError, OSError):
    """A write that the OS refused (full disk, read-only folder): one line for the CLI, an OSError for callers."""


def _unwritable(target: Path, error: OSError) -> RelexError:
    return WriteFailed(f"{target}: cannot write there ({error.strerror or error})")


# ---- writing ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_output(
    target: str | Path,
    *,
    overwrite: bool = False,
    inputs: Iterable[str | Path | None] = (),
    folder: bool = True,
    adopt: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield a temporary path beside `target` to write into; on success it replaces `target` atomically.

    The write lock of `target` is held throughout. `adopt(path) -> bool`, when given, may claim the leftover
    temporary folder of an interrupted run to continue it (`relex ingest` does); it is then yielded, renamed
    to this process's name. On failure nothing of the new output is left; an `OSError` (a full disk, a
    read-only folder) becomes one line naming the output.
    """
    target = Path(target)
    inputs = list(inputs)
    check_output(target, overwrite=overwrite, inputs=inputs, folder=folder)
    with write_lock(target):
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
        adopted = _adopt(target, tmp, adopt) if adopt is not None else None
        clean_leftovers(target, keep=tmp)
        if target.is_dir():
            clean_leftovers_inside(target)
        check_output(target, overwrite=overwrite, inputs=inputs, folder=folder)
        try:
            if folder and adopted is None:
                tmp.mkdir()
                tmp.chmod(0o755)
            yield tmp
            commit(tmp, target)
        except BaseException as error:
            if tmp.exists() or tmp.is_symlink():
                _remove(tmp)
            if isinstance(error, OSError):
                if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise _unwritable(target, error) from error
                raise WriteFailed(f"{target}: nothing written: {error.strerror or error}") from error
            if type(error) is RelexError and str(tmp) in str(error):  # the user knows the output, not its temporary name
                raise RelexError(str(error).replace(str(tmp), str(target))) from error
            raise


def _adopt(target: Path, tmp: Path, adopt: Callable[[Path], bool]) -> Path | None:
    for path, kind, pid in leftovers(target):
        if kind == "tmp" and path.is_dir() and adopt(path):
            os.replace(path, tmp)
            LOG.warning("%s: continuing the run that process %d left unfinished in %s", target, pid, path.name)
            return tmp
    return None


def commit(tmp: Path, target: Path) -> None:
    """Move `tmp` into place as `target`: the old output is moved aside first and removed after."""
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        if old.exists():
            _remove(old)
        os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        _remove(old)
    else:
        os.replace(tmp, target)
        _fsync_dir(target.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not sync folders
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str, *, lock: bool = False) -> Path:
    """Replace the file `path` with `text` whole: readers see the old file or the new one, never a part.

    With `lock`, `path`'s write lock is held (callers that already hold a lock for the folder leave it off).
    """
    return write_bytes_atomic(path, text.encode(), lock=lock)


def write_bytes_atomic(path: str | Path, data: bytes, *, lock: bool = False, make_parents: bool = False) -> Path:
    """As `write_text_atomic`, for bytes; with `make_parents`, the folders above `path` are made where missing."""
    path = Path(path)
    if path.is_dir():
        raise RelexError(f"{path}: is a folder; choose another output file")
    with write_lock(path) if lock else contextlib.nullcontext():
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            if make_parents:
                path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException as error:
            tmp.unlink(missing_ok=True)
            if isinstance(error, OSError):
                raise WriteFailed(f"{path}: not written: {error.strerror or error}") from error
            raise
    return path


def write_json_atomic(path: str | Path, payload, *, lock: bool = False, indent: int | None = 1) -> Path:
    return write_text_atomic(path, json.dumps(payload, indent=indent, default=str) + "\n", lock=lock)
