"""A small JSON-schema checker for tool-call arguments: type, enum, const, properties, required,
additionalProperties, items, anyOf/oneOf/allOf. Keywords it does not know (formats, $ref, bounds) pass."""

from typing import Any

_TYPE_CHECKS = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}


def schema_error(value: Any, schema: Any, path: str = "$") -> str | None:
    """The first violation of `schema` by `value` as "path: reason", or None if it conforms."""
    if schema is True or not isinstance(schema, dict):
        return None if schema is not False else f"{path}: no value is allowed here"
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_TYPE_CHECKS.get(t, lambda v: True)(value) for t in names):
            return f"{path}: expected {' or '.join(map(str, names))}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']!r}"
    if "const" in schema and value != schema["const"]:
        return f"{path}: must be {schema['const']!r}"
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema and all(schema_error(value, s, path) for s in schema[keyword]):
            return f"{path}: matches none of the {keyword} alternatives"
    for sub in schema.get("allOf", []):
        if (error := schema_error(value, sub, path)) is not None:
            return error
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{path}: missing required property {key!r}"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            sub = properties.get(key, extra)
            if sub is False:
                return f"{path}: unexpected property {key!r}"
            if (error := schema_error(item, sub, f"{path}.{key}")) is not None:
                return error
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for k, item in enumerate(value):
            if (error := schema_error(item, schema["items"], f"{path}[{k}]")) is not None:
                return error
    return None
