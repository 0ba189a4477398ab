"""reasoning-gym entries stored as JSON strings that keep their tuples.

An entry (`{"question", "answer", "metadata"}`) goes into a dataset column, but Arrow rejects the mixed types
that metadata dicts hold across items, so relex stores `encode_entry(entry)`, a JSON string. Plain JSON would
turn tuples into lists, and some reasoning-gym scorers compare metadata with `==` against tuples (arc_agi,
rearc give 0.05 instead of 1.0 to the gold answer), so tuples are tagged as `{"__tuple__": [...]}` and
`decode_entry` restores them. Readers must decode with `decode_entry`, not `json.loads`: a plainly loaded
tagged entry breaks other scorers (advanced_geometry, complex_arithmetic).
"""

from __future__ import annotations

import json
from typing import Any

TUPLE_TAG = "__tuple__"


def encode_entry(entry: dict[str, Any]) -> str:
    """`entry` as a JSON string, tuples tagged; raises TypeError for values JSON cannot hold."""
    return json.dumps(_tag_tuples(entry))


def decode_entry(entry: str | dict[str, Any]) -> dict[str, Any]:
    """The entry dict from `encode_entry`'s string (tuples restored); a dict is returned as it is."""
    if isinstance(entry, dict):
        return entry
    return json.loads(entry, object_hook=_untag_tuple)


def _tag_tuples(value: Any) -> Any:
    if isinstance(value, tuple):
        return {TUPLE_TAG: [_tag_tuples(v) for v in value]}
    if isinstance(value, list):
        return [_tag_tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: _tag_tuples(v) for k, v in value.items()}
    return value


def _untag_tuple(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and TUPLE_TAG in obj:
        return tuple(obj[TUPLE_TAG])
    return obj
