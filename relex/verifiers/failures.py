"""Count the completions whose checking crashed inside a third-party library.

A malformed completion can make math-verify, reasoning-gym or jsonschema raise. The verifier scores it 0.0 and
counts it, so a run can report how often that happened instead of hiding crashes as wrong answers. The counts
belong to the caller, who counts over a block of its own (they are not a process-wide total that one caller
resets under another):

    from relex.verifiers import count_failures
    with count_failures() as failures:
        scores = get_verifier("math")(completions, answer=answers)
    dict(failures)  # {"math": 3}

Every block open at the time counts a failure, in whichever thread the check ran (the code verifier checks in a
thread pool), so an evaluation inside a training run is counted by both.

Only the call into the library goes through `guarded_call`; an exception in relex's own code propagates.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

LOG = logging.getLogger(__name__)

_COUNTING: list[Counter[str]] = []  # the counters of the blocks open now (count_failures)
_LOCK = threading.Lock()


@contextmanager
def count_failures() -> Iterator[Counter[str]]:
    """A Counter, per verifier, of the completions whose check raised (scored 0.0) while the block runs."""
    counts: Counter[str] = Counter()
    with _LOCK:
        _COUNTING.append(counts)
    try:
        yield counts
    finally:
        with _LOCK:
            _COUNTING[:] = [c for c in _COUNTING if c is not counts]  # by identity: empty Counters compare equal


def guarded_call(verifier: str, check: Callable[..., Any], *args, **kwargs) -> tuple[bool, Any]:
    """`(True, check(...))`, or `(False, None)` after logging and counting an exception raised by `check`."""
    try:
        return True, check(*args, **kwargs)
    except Exception:
        LOG.debug("verifier %s: %s raised; scoring 0.0", verifier, getattr(check, "__name__", check), exc_info=True)
        with _LOCK:
            for counts in _COUNTING:
                counts[verifier] += 1
        return False, None
