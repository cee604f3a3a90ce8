"""`response_format` validation: what each type accepts, what `strict` refuses, the limits, and the
400 (naming response_format) every bad format becomes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.response_format import (
    MAX_ENUM_VALUES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
    FormatError,
    parse_response_format,
)
from runtime.types import ResponseFormat

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def js(schema: Any, *, strict: bool | None = None, name: str = "person") -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def refused(value: Any, text: str = "reply in JSON") -> FormatError:
    with pytest.raises(FormatError) as info:
        parse_response_format(value, text)
    assert info.value.error.param == "response_format"
    assert info.value.error.status_code == 400
    return info.value


def test_text_and_absent_mean_free_text() -> None:
    assert parse_response_format(None, "") is None
    assert parse_response_format({"type": "text"}, "") is None


def test_json_object_needs_the_word_json_in_any_case() -> None:
    assert parse_response_format({"type": "json_object"}, "Answer as Json please") == \
        ResponseFormat("json_object")
    err = refused({"type": "json_object"}, "Answer as an object please")
    assert "must contain the word 'json'" in str(err)


def test_json_schema_keeps_property_order_in_its_key() -> None:
    fmt = parse_response_format(js(PERSON, strict=True), "")
    assert fmt is not None and fmt.type == "json_schema" and fmt.strict and fmt.name == "person"
    assert list(json.loads(fmt.key)["properties"]) == ["name", "age"]
    swapped = {**PERSON, "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
    other = parse_response_format(js(swapped), "")
    assert other is not None and other.key != fmt.key  # generation follows declared order
    again = parse_response_format(js(json.loads(json.dumps(PERSON)), strict=False), "")
    assert again is not None and again.key == fmt.key and not again.strict


def test_json_schema_without_a_schema_is_any_object_without_the_json_word() -> None:
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x"}}, "hello")
    assert fmt == ResponseFormat("json_object", name="x")


@pytest.mark.parametrize("value", [
    "json_object", {"type": "yaml"}, {}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": []},
    {"type": "json_schema", "json_schema": {"schema": PERSON}},  # no name
    js(PERSON, name="has space"), js(PERSON, name="x" * 65),
    {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "description": 3}},
    js([PERSON]), js({"type": "number", "minimum": float("nan")}),
    js({"type": "object", "properties": {"a": 5}}),  # a property's schema must be an object
])
def test_malformed_formats_are_refused(value: Any) -> None:
    refused(value)


@pytest.mark.parametrize(("keyword", "schema"), [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("contains", {"type": "array", "contains": {"const": 3}}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5}]}),
    ("not", {"not": {"type": "integer"}}),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 9}}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}),
    ("frobnicate", {"type": "string", "frobnicate": 1}),
    ("format", {"type": "string", "format": "idn-email"}),
    ("items", {"type": "array", "items": [{"type": "integer"}]}),
    ("required", {"type": "object", "properties": {}, "required": ["zz"]}),
])
def test_strict_refuses_what_the_grammar_would_not_enforce(keyword: str, schema: dict) -> None:
    nested = {"type": "object", "properties": {"field": schema}, "required": ["field"],
              "additionalProperties": False}
    err = refused(js(nested, strict=True))
    assert keyword in str(err) and "'properties', 'field'" in str(err)


def test_without_strict_the_same_keywords_are_accepted_unenforced() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    fmt = parse_response_format(js(schema), "")
    assert fmt is not None and not fmt.strict


def test_strict_accepts_the_enforced_keywords() -> None:
    schema = {
        "$defs": {"tag": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[a-z]+$"}},
        "type": "object", "title": "T", "description": "d",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 9, "multipleOf": 3},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1,
                     "maxItems": 3},
            "kind": {"anyOf": [{"enum": ["a", "b"]}, {"type": "null"}]},
            "pair": {"type": "array", "prefixItems": [{"type": "number"}, {"const": 1}]},
        },
        "required": ["when", "n", "tags", "kind", "pair"], "additionalProperties": False,
    }
    assert parse_response_format(js(schema, strict=True), "") is not None


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_limits_apply_with_or_without_strict() -> None:
    assert parse_response_format(js(nested(MAX_SCHEMA_DEPTH)), "") is not None
    assert "deeper than" in str(refused(js(nested(MAX_SCHEMA_DEPTH + 1))))
    many = {"type": "object",
            "properties": {f"k{i}": {"type": "integer"} for i in range(MAX_SCHEMA_PROPERTIES + 1)}}
    assert "properties in all" in str(refused(js(many)))
    enums = {"type": "object", "properties": {
        "a": {"enum": list(range(MAX_ENUM_VALUES))}, "b": {"enum": [1]}}}
    assert "enum values" in str(refused(js(enums)))
    huge = {"type": "string", "description": "x" * 100_001}
    assert "characters" in str(refused(js(huge)))
