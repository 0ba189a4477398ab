"""Rows from question/answer records, shared by the file sources (jsonl, hf).

A record is a dict with a question field and an answer field (`TaskSpec.question_field`, `answer_field`).
An answer in GSM8K style, a worked solution ending in "#### 42", keeps only what follows the last "####".
The record's other fields become extra columns, for verifiers that read them (e.g. a JSON schema, tests).
"""

from __future__ import annotations

from typing import Any

from relex.errors import RelexError
from relex.tasks.spec import TaskSpec
from relex.tasks.task import make_row

ROW_KEYS = ("id", "prompt", "question", "answer")
FINAL_ANSWER_MARK = "####"


def record_row(record: dict[str, Any], spec: TaskSpec, where: str, default_id: str, skip: tuple[str, ...] = ()) -> dict:
    """The row for `record`; `where` (e.g. "data.jsonl:12") names it in errors; `skip` names fields to drop."""
    question = required_field(record, spec.question_field, where)
    if not isinstance(question, str):
        raise RelexError(f"{where}: field {spec.question_field!r} must be a string, got {type(question).__name__}")
    answer = final_answer(required_field(record, spec.answer_field, where))
    used = (spec.question_field, spec.answer_field, *skip, *ROW_KEYS)
    extra = {key: value for key, value in record.items() if key not in used}
    row_id = str(record["id"]) if record.get("id") is not None else default_id
    return make_row(row_id, question, answer, spec, **extra)


def required_field(record: dict[str, Any], field: str, where: str) -> Any:
    value = record.get(field)
    if value is None:
        state = "is null" if field in record else "is missing"
        raise RelexError(f"{where}: field {field!r} {state}; fields present: {', '.join(record) or 'none'}")
    return value


def final_answer(answer: Any) -> str:
    """The gold answer as a string; for a GSM8K-style solution, what follows its last "####"."""
    text = str(answer)
    if FINAL_ANSWER_MARK in text:
        text = text.rsplit(FINAL_ANSWER_MARK, 1)[1]
    return text.strip()
