"""JSON Schema keywords for the rules between fields that pydantic cannot derive.

Pure. A model's validator refuses `token_burst` without `tokens_per_minute`
and a list that names a model twice; pydantic's schema says neither, so the
OpenAPI document claimed such bodies valid. These fragments say them, next
to the validators they mirror (`json_schema_extra` of the model or field).
A field given as null counts as absent on the server, so each condition
asks for a value of the field's own type, not merely its key.
"""

from __future__ import annotations

from pydantic.config import JsonDict


def present(field: str, json_type: str) -> JsonDict:
    """The subschema of a body that gives `field` a non-null `json_type` value."""
    return {"required": [field], "properties": {field: {"type": json_type}}}


def needs(field: str, other: str) -> JsonDict:
    """`field` (an integer), when given, needs the integer `other` too."""
    return {"if": present(field, "integer"), "then": present(other, "integer")}


# A burst is a bucket's capacity; without its refill rate it means nothing.
BURST_RULES: list[JsonDict] = [
    needs("token_burst", "tokens_per_minute"),
    needs("request_burst", "requests_per_minute"),
]
BURSTS_NEED_RATES: JsonDict = {"allOf": list(BURST_RULES)}
# A list of model names in which none appears twice.
DISTINCT: JsonDict = {"uniqueItems": True}
