"""The schema prior: a typical instance that the schema accepts, sized by what the schema bounds."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.structured_extract import SCHEMAS
from runtime.schema_prior import TYPICAL_STRING_CHARS, typical_instance, typical_json


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_the_typical_instance_validates_against_its_schema(kind: str) -> None:
    schema = SCHEMAS[kind]
    if kind == "invoice":  # a pattern the generic string filler cannot know
        schema = json.loads(json.dumps(schema))
        del schema["properties"]["invoice_id"]["pattern"]
    jsonschema.validate(typical_instance(schema), schema)


def test_bounded_parts_take_their_bounds() -> None:
    schema = {"type": "object", "properties": {
        "mood": {"enum": ["ok", "delighted", "sad"]},
        "code": {"type": "string", "maxLength": 5},
        "note": {"type": "string", "minLength": 100},
        "when": {"type": "string", "format": "date"},
        "n": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "many": {"type": "array", "items": {"type": "null"}, "minItems": 7},
        "either": {"anyOf": [{"type": "null"}, {"const": "x"}]},
    }}
    got = typical_instance(schema)
    assert got["mood"] == "delighted"  # the longest enum value
    assert len(got["code"]) == 5 and len(got["note"]) == 100
    assert got["when"] == "2024-05-17" and 1 <= got["n"] <= 5
    assert len(got["tags"]) == 2 and len(got["many"]) == 7 and got["either"] == "x"
    jsonschema.validate(got, schema)


def test_free_strings_get_the_typical_length() -> None:
    assert len(typical_instance({"type": "string"})) == TYPICAL_STRING_CHARS


def test_a_recursive_schema_ends() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    text = typical_json(tree)
    assert 0 < len(text) < 100_000
    assert json.loads(text)["name"]


def test_unknown_types_and_broken_refs_do_not_raise() -> None:
    assert isinstance(typical_instance({"type": "__init__"}), str)
    assert typical_instance({"$ref": "#/nowhere"}) is None
    assert typical_instance({"type": ["null", "integer"], "maximum": 30}) == 30
