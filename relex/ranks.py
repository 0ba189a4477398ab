"""The processes torchrun starts, seen from one of them: joining them, and agreeing on failures.

    with process_group() as ranks:          # RANK, WORLD_SIZE, MASTER_ADDR ... from torchrun
        with together(ranks, "writing shards"):
            ...                               # this rank's part of the phase

At the end of each `together` phase the ranks exchange one status each; if any failed, every rank raises the same
`RankFailed` (`rank R of N: PHASE: cause`), so none is left waiting in a collective for a rank that gave up. Used by
`relex.distributed` (fit and extrapolate across ranks) and `relex.record_sharded` (recording under FSDP2); only
small Python objects travel (gloo for them, also on GPU machines), never tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
from typing import Iterator

import torch

from relex.errors import RelexError

LOG = logging.getLogger(__name__)

# how long a rank waits for the others at an exchange: a share of a large model can take hours, and a rank that
# dies outright is noticed sooner (its connections close, and torchrun stops the others)
EXCHANGE_TIMEOUT = datetime.timedelta(hours=12)


class RankFailed(RelexError):
    """A rank failed: the message names the rank and its cause, and is the same on every rank."""

    agreed = False  # every rank raised it after the same exchange (so every rank is still there)


def launched() -> bool:
    """Whether this process is one of several started by torchrun (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Ranks:
    """This process's place among the ranks, and the few collectives relex needs (pickled Python objects)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_gather(self, value) -> list:
        import torch.distributed as dist

        values = [None] * self.world
        try:
            dist.all_gather_object(values, value)
        except (RuntimeError, OSError) as error:  # gloo and NCCL say so when a peer's connection closes
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RankFailed(f"rank {self.rank} of {self.world}: lost contact with another rank ({first[:200]})") from None
        return values

    def broadcast(self, value):
        """Rank 0's `value`, on every rank."""
        return self.all_gather(value if self.is_first else None)[0]


@contextlib.contextmanager
def process_group() -> Iterator[Ranks]:
    """Join the ranks torchrun started (environment variables RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Each rank uses its local GPU when there is one (NCCL for CUDA tensors, gloo for the objects exchanged);
    otherwise gloo. SIGTERM (torchrun stopping the ranks after one failed) becomes an error, so temporary outputs
    are removed on the way out; one that arrives while a failure is already being handled lets that clean-up finish.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield Ranks(dist.get_rank(), dist.get_world_size())
        return
    if not dist.is_available():
        raise RelexError("this torch build has no torch.distributed; run relex in a single process")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=EXCHANGE_TIMEOUT)
    ranks = Ranks(dist.get_rank(), dist.get_world_size())

    def stop(signum, frame):
        if sys.exc_info()[1] is not None:
            # this rank is already failing and removing what it wrote (torchrun's signal often follows the error
            # that a dead peer's closed connection raised here): raising now would stop that removal half-way
            # and leave a temporary output behind. The process exits with its own error once the removal is done.
            LOG.debug("rank %d: signal %d while already failing: finishing the clean-up first", ranks.rank, signum)
            return
        raise RankFailed(f"rank {ranks.rank} of {ranks.world}: stopped by signal {signum} (another rank failed)")

    previous = signal.signal(signal.SIGTERM, stop)
    failed = False
    try:
        yield ranks
    except BaseException as failure:
        failed = True
        if isinstance(failure, RankFailed) and failure.agreed:  # wait until every rank has removed what it wrote
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not failed:  # after a failure a peer may be gone: destroying the group then can abort the process
            # before it has printed its one line. After success, every rank waits for the others first: a rank
            # that left at once would close its connections while rank 0 still writes the run's summary, and
            # gloo aborts a process whose peer vanished ("terminate called without an active exception", seen
            # once in CI on the two-process train test)
            with contextlib.suppress(RuntimeError):
                dist.barrier()
            dist.destroy_process_group()


@contextlib.contextmanager
def together(ranks: Ranks, what: str) -> Iterator[None]:
    """Run a phase on every rank; at its end the ranks exchange statuses and all raise the first failure.

    A failure is always raised on every rank with the same message: `rank R of N: WHAT: cause`.
    """
    failure: BaseException | None = None
    try:
        yield
    except RankFailed:  # agreed already, or the ranks are no longer all there: nothing to exchange
        raise
    except Exception as error:  # exchanged with the others, raised again below (as one line, the same everywhere)
        failure = error
        LOG.debug("rank %d: %s failed", ranks.rank, what, exc_info=True)
    statuses = ranks.all_gather(None if failure is None else describe(failure))
    for rank, status in enumerate(statuses):
        if status is not None:
            agreed = RankFailed(f"rank {rank} of {ranks.world}: {what}: {status}")
            agreed.agreed = True
            raise agreed from failure


def describe(error: BaseException) -> str:
    """One line for an error: a RelexError's message, anything else with its type."""
    text = " ".join(str(error).split())
    if isinstance(error, RelexError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
