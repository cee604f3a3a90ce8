"""Wire schemas of what a batch input file holds, for openapi.yaml: the JSONL line and the
`response_format` of its body (openai-python `shared_params/response_format_*`).

No route takes these as a body (a line arrives inside an uploaded file), so the app adds them to
its OpenAPI components itself (`line_schemas`). The runtime validates lines
(runtime/openai_adapter.py, runtime/response_format.py); these models only document them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class ResponseFormatText(BaseModel):
    """Free text (the default)."""

    type: Literal["text"]


class ResponseFormatJSONObject(BaseModel):
    """Any JSON object. The messages (or the prompt) must contain the word "JSON"."""

    type: Literal["json_object"]


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(description="1 to 64 characters: a-z, A-Z, 0-9, '_' or '-'.")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema",
        description="A JSON Schema the output follows (at most 100,000 characters, 32 levels, "
                    "1,000 properties and 1,000 enum values). Absent: any JSON object.")
    strict: bool | None = Field(
        default=False,
        description="true: only keywords the grammar enforces are allowed (type, enum, const, "
                    "anyOf, $ref/$defs, properties, required, additionalProperties, items, "
                    "prefixItems, min/maxItems, min/maxLength, pattern, format, minimum, "
                    "maximum, multipleOf, …); others fail the line with a 400.")


class ResponseFormatJSONSchema(BaseModel):
    """Output that validates against `json_schema.schema` (grammar-constrained decoding)."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]


class BatchRequestInput(BaseModel):
    """One line of a batch input file (JSONL)."""

    custom_id: str = Field(description="Unique within the file; output lines carry it back.")
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any] = Field(
        description="The endpoint's OpenAI request body. `response_format` (a ResponseFormat) "
                    "is honoured on /v1/chat/completions and, as an extension, on "
                    "/v1/completions; a bad one fails only its line (a 400 naming "
                    "response_format in the error file).")


def line_schemas() -> dict[str, Any]:
    """These models as OpenAPI component schemas (`#/components/schemas/<Name>` references)."""
    ref = "#/components/schemas/{model}"
    out: dict[str, Any] = {}
    adapters: dict[str, TypeAdapter[Any]] = {"ResponseFormat": TypeAdapter(ResponseFormat),
                                             "BatchRequestInput": TypeAdapter(BatchRequestInput)}
    for name, adapter in adapters.items():
        schema = adapter.json_schema(ref_template=ref, by_alias=True)
        out.update(schema.pop("$defs", {}))
        out[name] = schema
    return out
