"""The Gram matrix G = M Mᵀ of a tensor's trajectory (T × T), accumulated over row chunks (METHOD.md).

G is a sum over any split of the d columns of M, so one chunk of T × rows values is in memory at a time, on
the chosen device. Each chunk's product is a float32 matrix multiply (blocked summation in BLAS keeps it accurate
to ~1e-6 relative) and the chunks are accumulated in float64, so long runs and large tensors do not lose digits.
"""

from __future__ import annotations

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
    """The Gram contribution of one (T × c) chunk, as float64 on `device`."""
    x = chunk.to(device=device, dtype=torch.float32, non_blocking=True)
    return (x @ x.T).double()


def tensor_gram(reader, name: str, device: torch.device, max_elements: int) -> np.ndarray:
    """G for tensor `name` over the reader's steps, reading one row chunk at a time."""
    steps = len(reader.steps)
    gram = torch.zeros(steps, steps, dtype=torch.float64, device=device)
    for _, chunk in reader.chunks(name, max_elements):
        gram += chunk_gram(chunk, device)
    return gram.cpu().numpy()
