"""Small helpers that several parts of relex need, defined once (below everything but `relex.errors`).

    from relex.util import comma_list, grouped, is_positive_int, module_type, most_common_float_dtype, read_log, reused
    comma_list("relex, two-point,")                       # ['relex', 'two-point']
    module_type("model.layers.7.mlp.up_proj.weight")      # 'mlp.up_proj.weight'
    grouped((module_type(name), cos) for name, cos in drift.items())   # {module type: [cos, …]}, types sorted
    read_log("RUN")                                       # the lines of RUN/log.jsonl, [] before the first step
    self.buffer = reused(self.buffer, n, torch.uint8)     # at least n values: the same memory while it is enough

Before adding a helper to a module, look here (and run `duplicates --change`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from relex.errors import RelexError

T = TypeVar("T")

LOG_NAME = "log.jsonl"  # one JSON line per optimizer step of a training run (relex.train.progress)


def comma_list(text: str | None) -> list[str]:
    """The stripped, non-empty parts of a comma-separated option (`None` or "" gives [])."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def is_int(value: Any) -> bool:
    """An integer that is not a bool (YAML and JSON give `true` where a number was meant)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: Any) -> bool:
    return is_int(value) and value > 0


def module_type(name: str) -> str:
    """`model.layers.7.mlp.up_proj.weight` -> `mlp.up_proj.weight`: the name after its last numeric part."""
    parts = name.split(".")
    numeric = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[numeric[-1] + 1 :]) if numeric else name


def grouped(pairs: Iterable[tuple[str, T]]) -> dict[str, list[T]]:
    """{key: values} from (key, value) pairs, keys sorted, values in the order given: rows by module type."""
    groups: dict[str, list[T]] = {}
    for key, value in pairs:
        groups.setdefault(key, []).append(value)
    return dict(sorted(groups.items()))


def most_common_float_dtype(dtypes: Iterable) -> Any:
    """The torch dtype most of the floating-point `dtypes` have (the first seen on a tie); None when none is a float.

    What a checkpoint's config.json states as its `torch_dtype`, and what a store records as the source dtype."""
    counts = Counter(dtype for dtype in dtypes if dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else None


def reused(buffer: Any, numel: int, dtype: Any) -> Any:
    """`buffer` (a flat torch tensor, or None) when it holds at least `numel` values, else a new one of `numel` values
    of `dtype`: memory reused from call to call (new memory costs a page fault per 4 KiB), for the caller to view
    the part it needs."""
    if buffer is not None and buffer.numel() >= numel:
        return buffer
    import torch

    return torch.empty(numel, dtype=dtype)


def read_log(run_or_file: str | Path) -> list[dict]:
    """The lines of a training run's log.jsonl (give RUN or the file), in file order; [] when there is none yet.

    A line that is not JSON is refused, naming the file and the line."""
    path = Path(run_or_file)
    path = path / LOG_NAME if path.is_dir() else path
    if not path.is_file():
        return []
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise RelexError(f"{path}, line {number}: not JSON ({error})") from None
    return lines
