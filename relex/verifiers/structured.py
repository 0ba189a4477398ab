"""The `json_schema` verifier: is the completion a JSON document valid under the row's JSON Schema?

    json_schema_reward(['```json\\n{"name": "Ada"}\\n```'], schema=[{"type": "object", "required": ["name"]}])

The document is the last ```json (or untagged) fenced block when there is one, else the whole stripped
completion. `schema` is a dict or its JSON text; a schema that is itself invalid is a configuration error.
"""

from __future__ import annotations

import json
from typing import Any

from relex.errors import RelexError
from relex.verifiers.answers import completion_text, last_fenced_block
from relex.verifiers.columns import required_column
from relex.verifiers.failures import guarded_call

NAME = "json_schema"


def json_schema_reward(completions, **columns) -> list[float]:
    """1.0 where the completion's JSON validates against the `schema` column, else 0.0.

    Args:
        completions: strings or chat completions.
        schema: the dataset column with one JSON schema per row.

    Returns:
        One score per completion.

    Example:
        json_schema_reward(['{"a": 1}'], schema=[{"type": "object", "required": ["a"]}])  # [1.0]
    """
    schemas = required_column(columns, "schema", len(completions), NAME)
    return [score_json(completion_text(c), schema_validator(s)) for c, s in zip(completions, schemas, strict=True)]


def score_json(text: str, validator) -> float:
    document = json_document(text)
    try:
        instance = json.loads(document)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to decode
        return 0.0
    ok, valid = guarded_call(NAME, validator.is_valid, instance)
    return 1.0 if ok and valid else 0.0


def json_document(text: str) -> str:
    block = last_fenced_block(text, ("json", ""))
    return (block if block is not None else text).strip()


def schema_validator(schema: Any):
    """A jsonschema validator for a schema dict or JSON text, in the schema's own draft."""
    from jsonschema import exceptions, validators

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RelexError(f"json_schema verifier: column 'schema' holds a string that is not JSON: {e}") from e
    cls = validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except exceptions.SchemaError as e:
        raise RelexError(f"json_schema verifier: invalid JSON Schema: {e.message}") from e
    return cls(schema)
