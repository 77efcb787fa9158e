"""The small JSON-schema checker used for tool-call arguments."""

import pytest

from kimi_jax.chat import schema_error

SCHEMA = {"type": "object", "required": ["id"], "additionalProperties": False, "properties": {
    "id": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    "size": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
}}


@pytest.mark.parametrize("value", [{"id": 1}, {"id": 3, "size": 1.5},
                                   {"id": 2.0, "tags": ["a", "b"], "size": None, "meta": {"ok": True, "x": 1}}])
def test_conforming_values(value):
    assert schema_error(value, SCHEMA) is None


@pytest.mark.parametrize("value, where", [
    ([], "$: expected object"),
    ({}, "$: missing required property 'id'"),
    ({"id": 1.5}, "$.id: expected integer"),
    ({"id": True}, "$.id: expected integer"),
    ({"id": 1, "tags": ["c"]}, "$.tags[0]: 'c' is not one of"),
    ({"id": 1, "size": "big"}, "$.size: matches none of the anyOf"),
    ({"id": 1, "meta": {"ok": "yes"}}, "$.meta.ok: expected boolean"),
    ({"id": 1, "extra": 0}, "$: unexpected property 'extra'"),
])
def test_violations_name_the_path(value, where):
    assert schema_error(value, SCHEMA).startswith(where)


def test_empty_and_unknown_keywords_accept():
    assert schema_error({"anything": [1]}, {}) is None
    assert schema_error("x", {"type": "string", "format": "uri", "$ref": "#/x"}) is None
