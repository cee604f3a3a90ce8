"""The `response_format` request field: OpenAI's `text`, `json_object` and `json_schema`, checked
before a request reaches the engine.

Everything here is about the field itself (types, names, size limits, which keywords `strict`
may use); whether xgrammar can compile a schema is asked by runtime/grammar.py when the engine
checks the request. Either way a bad format fails its own line with a 400 naming
`response_format`, never the batch.

`strict: true` promises that every output validates against the schema, so a strict schema may
only use keywords the grammar enforces (`STRICT_KEYWORDS`); without `strict` other keywords are
accepted and not enforced (best effort, as OpenAI's non-strict mode).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from runtime.types import RequestError, ResponseFormat

PARAM = "response_format"
MAX_SCHEMA_CHARS = 100_000  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 32  # nested subschemas
MAX_SCHEMA_PROPERTIES = 1_000  # object properties over the whole schema (compile time grows ~n²)
MAX_ENUM_VALUES = 1_000  # enum values over the whole schema
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name

# Keywords that constrain generation (probed against xgrammar: a violating value is refused),
# plus annotations that constrain nothing. Only these may appear in a `strict` schema.
_ENFORCED = {
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "unevaluatedProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
}
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "nullable",
}
STRICT_KEYWORDS = frozenset(_ENFORCED | _ANNOTATIONS)
STRICT_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# Where subschemas live: one schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames",
        "additionalItems", "unevaluatedItems", "not", "if", "then", "else", "contains")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class FormatError(Exception):
    """A bad `response_format`; `error` is the 400 for its line."""

    def __init__(self, message: str, param: str = PARAM, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.error = RequestError(message=message, param=param, code=code)


def parse_response_format(value: Any, prompt_text: str) -> ResponseFormat | None:
    """The validated format, or None for free text (`text` or absent). `prompt_text` is what the
    user wrote (message contents or the prompt): `json_object` needs the word JSON in it."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise FormatError("Invalid type for 'response_format': expected an object.",
                          code="invalid_type")
    kind = value.get("type")
    if kind is None:
        raise FormatError("Missing required parameter: 'response_format.type'.",
                          code="missing_required_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        if "json" not in prompt_text.lower():
            raise FormatError("'messages' must contain the word 'json' in some form, to use "
                              "'response_format' of type 'json_object'.")
        return ResponseFormat("json_object")
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    raise FormatError(f"Invalid value: {json.dumps(kind, default=str)[:40]}. Supported values "
                      "are: 'text', 'json_object' and 'json_schema'.")


def _json_schema(spec: Any) -> ResponseFormat:
    where = "'response_format.json_schema"
    if spec is None:
        raise FormatError(f"Missing required parameter: {where}'.",
                          code="missing_required_parameter")
    if not isinstance(spec, Mapping):
        raise FormatError(f"Invalid type for {where}': expected an object.", code="invalid_type")
    name = spec.get("name")
    if name is None:
        raise FormatError(f"Missing required parameter: {where}.name'.",
                          code="missing_required_parameter")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FormatError(f"Invalid {where}.name': use 1 to 64 characters a-z, A-Z, 0-9, '_' "
                          "or '-'.")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError(f"Invalid type for {where}.strict': expected a boolean.",
                          code="invalid_type")
    if spec.get("description") is not None and not isinstance(spec.get("description"), str):
        raise FormatError(f"Invalid type for {where}.description': expected a string.",
                          code="invalid_type")
    schema = spec.get("schema")
    if schema is None:  # OpenAI makes it optional: any JSON object
        return ResponseFormat("json_object", name=name, strict=bool(strict))
    if not isinstance(schema, Mapping):
        raise FormatError(f"Invalid type for {where}.schema': expected a JSON Schema object.",
                          code="invalid_type")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # NaN / Infinity: not JSON
        raise FormatError(f"Invalid schema for response_format '{name}': {exc}.") from exc
    if len(text) > MAX_SCHEMA_CHARS:
        raise FormatError(f"Invalid schema for response_format '{name}': {len(text)} characters; "
                          f"at most {MAX_SCHEMA_CHARS} are allowed.")
    _check_schema(schema, name, bool(strict))
    return ResponseFormat("json_schema", schema=text, name=name, strict=bool(strict))


def _check_schema(schema: Mapping[str, Any], name: str, strict: bool) -> None:
    """Limits always; under `strict`, only keywords the grammar enforces."""
    properties = enums = 0
    for node, path, depth in _subschemas(schema, ()):
        if depth > MAX_SCHEMA_DEPTH:
            _bad(name, path, f"nesting is deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, bool):
            continue  # true / false: any value / no value
        if not isinstance(node, Mapping):
            _bad(name, path, "a schema must be an object or a boolean")
        props = node.get("properties")
        properties += len(props) if isinstance(props, Mapping) else 0
        enum = node.get("enum")
        enums += len(enum) if isinstance(enum, list) else 0
        if properties > MAX_SCHEMA_PROPERTIES:
            _bad(name, (), f"more than {MAX_SCHEMA_PROPERTIES} object properties in all")
        if enums > MAX_ENUM_VALUES:
            _bad(name, (), f"more than {MAX_ENUM_VALUES} enum values in all")
        if strict:
            _check_strict(node, name, path)


def _check_strict(node: Mapping[str, Any], name: str, path: tuple[str, ...]) -> None:
    for key in node:
        if key not in STRICT_KEYWORDS:
            _bad(name, path, f"'{key}' is not permitted with strict: true (it would not be "
                             "enforced)")
    fmt = node.get("format")
    if fmt is not None and fmt not in STRICT_FORMATS:
        _bad(name, path, f"format {json.dumps(fmt, default=str)[:40]} is not permitted with "
                         f"strict: true; supported formats: {', '.join(sorted(STRICT_FORMATS))}")
    if isinstance(node.get("items"), list):
        _bad(name, path, "'items' must be a schema; use 'prefixItems' for tuples")
    required = node.get("required")
    props = node.get("properties")
    if isinstance(required, list):
        known = props if isinstance(props, Mapping) else {}
        missing = [r for r in required if r not in known]
        if missing:
            _bad(name, path, f"'required' names {json.dumps(missing[0], default=str)[:40]}, which "
                             "is not in 'properties'")


def _subschemas(node: Any, path: tuple[str, ...]) -> Iterator[tuple[Any, tuple[str, ...], int]]:
    """Every schema inside `node` (itself first) with its path of keywords and names and its
    depth; nothing below MAX_SCHEMA_DEPTH + 1 levels."""
    stack = [(node, path, 0)]
    while stack:
        cur, where, depth = stack.pop()
        yield cur, where, depth
        if not isinstance(cur, Mapping) or depth > MAX_SCHEMA_DEPTH:
            continue
        inner = depth + 1
        for key in _ONE:
            if isinstance(cur.get(key), (Mapping, bool)):
                stack.append((cur[key], (*where, key), inner))
        for key in _LIST:
            if isinstance(cur.get(key), list):
                stack.extend((s, (*where, key, str(i)), inner) for i, s in enumerate(cur[key]))
        if isinstance(cur.get("items"), list):  # draft-4 tuples
            stack.extend((s, (*where, "items", str(i)), inner)
                         for i, s in enumerate(cur["items"]))
        for key in _MAP:
            if isinstance(cur.get(key), Mapping):
                stack.extend((s, (*where, key, str(k)), inner) for k, s in cur[key].items())


def _bad(name: str, path: tuple[str, ...], why: str) -> None:
    context = ", ".join(repr(p) for p in path)
    raise FormatError(f"Invalid schema for response_format '{name}': In context=({context}), "
                      f"{why}.")
