"""What output a JSON Schema implies before anything is generated: a typical instance of it, whose
token count is the planner's prior for a constrained request's output length.

A schema bounds its output far better than a global prior: enums, numbers, booleans and bounded
strings have known sizes, objects list their keys. Free strings and unbounded arrays are guesses
(TYPICAL_STRING_CHARS, TYPICAL_ARRAY_ITEMS); the warm-up sample corrects them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TYPICAL_STRING_CHARS = 24  # a free string's guess (a name, a short phrase)
TYPICAL_ARRAY_ITEMS = 3  # an unbounded array's guess
_MAX_DEPTH = 16  # nesting expanded at most (a $ref counts 4 levels: recursive schemas stop)
_KINDS = ("object", "array", "string", "integer", "number", "boolean", "null")
_WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
_FORMATS = {
    "date": "2024-05-17", "date-time": "2024-05-17T09:30:00Z", "time": "09:30:00",
    "duration": "P3DT4H", "email": "jane.doe@example.com", "hostname": "mail.example.com",
    "ipv4": "192.168.10.24", "ipv6": "2001:db8::8a2e:370:7334",
    "uuid": "123e4567-e89b-12d3-a456-426614174000", "uri": "https://example.com/a/b",
}


def typical_instance(schema: Mapping[str, Any]) -> Any:
    """A value that `schema` accepts and that is about as long as a typical output."""
    return _Instance(schema).of(schema, 0)


def typical_json(schema: Mapping[str, Any]) -> str:
    """typical_instance as the constrained decoder lays JSON out (", " and ": " separators)."""
    return json.dumps(typical_instance(schema), ensure_ascii=False)


class _Instance:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root

    def of(self, s: Any, depth: int) -> Any:
        if not isinstance(s, Mapping) or depth > _MAX_DEPTH:
            return None
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            return max(s["enum"], key=lambda v: len(json.dumps(v, default=str)))
        if isinstance(s.get("$ref"), str):
            return self.of(self._ref(s["$ref"]), depth + 4)
        for key in ("anyOf", "oneOf"):
            options = [o for o in s.get(key) or () if isinstance(o, Mapping)
                       and o.get("type") != "null"]
            if options:
                return self.of(options[0], depth + 1)
        kind = s.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind is None:
            kind = ("object" if "properties" in s else "array" if "items" in s
                    or "prefixItems" in s else "string")
        return getattr(self, f"_{kind}")(s, depth) if kind in _KINDS else self._string(s, depth)

    def _ref(self, ref: str) -> Any:
        node: Any = self.root
        for part in ref.removeprefix("#").strip("/").split("/"):
            if not part:
                continue
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def _object(self, s: Mapping[str, Any], depth: int) -> dict[str, Any]:
        props = s.get("properties")
        if isinstance(props, Mapping) and props:
            return {k: self.of(v, depth + 1) for k, v in props.items()}
        extra = s.get("additionalProperties")
        if isinstance(extra, Mapping):
            return {f"key{i}": self.of(extra, depth + 1) for i in range(2)}
        return {}

    def _array(self, s: Mapping[str, Any], depth: int) -> list[Any]:
        prefix = s.get("prefixItems")
        if isinstance(prefix, list) and prefix:
            return [self.of(p, depth + 1) for p in prefix]
        lo, hi = _int(s.get("minItems"), 0), _int(s.get("maxItems"), None)
        n = max(lo, TYPICAL_ARRAY_ITEMS if hi is None else min(hi, TYPICAL_ARRAY_ITEMS))
        item = self.of(s.get("items"), depth + 1) if isinstance(s.get("items"), Mapping) else 1
        return [item] * min(n, 64)

    def _string(self, s: Mapping[str, Any], depth: int) -> str:
        fmt = s.get("format")
        if isinstance(fmt, str) and fmt in _FORMATS:
            return _FORMATS[fmt]
        lo, hi = _int(s.get("minLength"), 0), _int(s.get("maxLength"), None)
        n = max(lo, TYPICAL_STRING_CHARS if hi is None else min(hi, TYPICAL_STRING_CHARS))
        n = min(n, 4096)
        return (_WORDS * (n // len(_WORDS) + 1))[:n]

    def _integer(self, s: Mapping[str, Any], depth: int) -> int:
        lo, hi = s.get("minimum"), s.get("maximum")
        bound = max((abs(v) for v in (lo, hi) if isinstance(v, (int, float))), default=1000)
        return int(min(bound, 10**15))

    def _number(self, s: Mapping[str, Any], depth: int) -> float:
        return self._integer(s, depth) + 0.25

    def _boolean(self, s: Mapping[str, Any], depth: int) -> bool:
        return False

    def _null(self, s: Mapping[str, Any], depth: int) -> None:
        return None


def _int(v: Any, default: int | None) -> Any:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default
