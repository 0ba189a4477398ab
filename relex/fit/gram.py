"""The Gram matrix G = M Mᵀ of a tensor's trajectory (T × T), accumulated over row blocks (METHOD.md).

G is a sum over any split of the d columns of M, so one block of T × rows values is in memory at a time, on
the chosen device; a block of a few MiB is still in the CPU cache when its product is formed. Each block's
product is a float32 matrix multiply (blocked summation in BLAS keeps it accurate to ~1e-6 relative) and the
blocks are accumulated in float64, so long runs and large tensors do not lose digits.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from relex.errors import RelexError


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RelexError(f"device {name!r} asked for, but torch sees no CUDA device; use --device cpu or auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise RelexError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N")
    return torch.device(name)


def chunk_gram(chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The Gram contribution of one (T × c) block, as float64 on `device`."""
    x = chunk.to(device=device, dtype=torch.float32, non_blocking=True)
    return (x @ x.T).double()


def tensor_gram(reader, name: str, device: torch.device, max_elements: int) -> np.ndarray:
    """G for tensor `name` over the reader's steps, reading one row block at a time."""
    return dict(tensor_grams(reader, [name], device, max_elements))[name]


def tensor_grams(reader, names: list[str], device: torch.device, max_elements: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, G) for each of `names` in order; the blocks of all of them are read ahead in one stream."""
    from relex.store import Block

    plan = [Block(name, rows, gram=True) for name in names for rows in reader.row_blocks(name, max_elements)]
    steps = len(reader.steps)
    current, gram = None, None
    for block, _, part in reader.stream(plan, device):
        if block.name != current:
            if current is not None:
                yield current, gram.cpu().numpy()
            current, gram = block.name, torch.zeros(steps, steps, dtype=torch.float64, device=device)
        gram += part
    if current is not None:
        yield current, gram.cpu().numpy()
