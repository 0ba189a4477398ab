"""Count the completions whose checking crashed inside a third-party library.

A malformed completion can make math-verify, reasoning-gym or jsonschema raise. The verifier scores it 0.0 and
counts it here, so a run can report how often that happened instead of hiding crashes as wrong answers:

    from relex.verifiers import verifier_failures
    verifier_failures()  # {"math": 3}

Only the call into the library goes through `guarded_call`; an exception in relex's own code propagates.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

LOG = logging.getLogger(__name__)

VERIFIER_FAILURES: Counter[str] = Counter()
_LOCK = threading.Lock()


def guarded_call(verifier: str, check: Callable[..., Any], *args, **kwargs) -> tuple[bool, Any]:
    """`(True, check(...))`, or `(False, None)` after logging and counting an exception raised by `check`."""
    try:
        return True, check(*args, **kwargs)
    except Exception:
        LOG.debug("verifier %s: %s raised; scoring 0.0", verifier, getattr(check, "__name__", check), exc_info=True)
        with _LOCK:
            VERIFIER_FAILURES[verifier] += 1
        return False, None


def verifier_failures() -> dict[str, int]:
    """Completions per verifier whose check raised and were scored 0.0, since the last reset."""
    with _LOCK:
        return dict(VERIFIER_FAILURES)


def reset_verifier_failures() -> None:
    with _LOCK:
        VERIFIER_FAILURES.clear()
