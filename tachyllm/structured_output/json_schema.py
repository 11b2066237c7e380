"""JSON schemas as structured outputs enforce them: an object allows no key it does not declare.

JSON Schema allows any further key in an object unless the schema says `additionalProperties: false`;
vLLM's default grammar backend (xgrammar) and OpenAI's strict mode allow none, and clients rely on
that (LiteLLM strips `additionalProperties` from tool schemas it sends to vLLM). So an object schema
that declares its keys (`properties` or `patternProperties`) and says nothing of the others gets
`additionalProperties: false`. What a schema states explicitly is kept: `additionalProperties: true`
or a schema for the other keys, and an object that declares no keys at all (`{"type": "object"}`,
any object).

The members of an `allOf` of several schemas stay as written, and so do the definitions such members
refer to: the grammar engine intersects them, and each one closed would forbid the others' keys.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of subschemas, or a map of names to subschemas.
_SUBSCHEMA = (
    "items", "additionalItems", "additionalProperties", "unevaluatedItems", "contains", "not", "if", "then",
    "else", "propertyNames",
)  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_DEFINITIONS = ("$defs", "definitions")


def without_undeclared_keys(schema: Any) -> Any:
    """`schema` (left unchanged) with every object that declares its keys closed to others."""
    return _close(schema, keep_open=False, open_definitions=_intersected_definitions(schema))


def _close(node: Any, keep_open: bool, open_definitions: set[tuple[str, str]]) -> Any:
    if not isinstance(node, dict):
        return node  # true / false, or not a schema (the grammar engine reports that)
    out = dict(node)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], False, open_definitions)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            intersected = key == "allOf" and len(out[key]) > 1
            out[key] = [_close(member, intersected, open_definitions) for member in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _close(sub, (key, name) in open_definitions, open_definitions) for name, sub in out[key].items()
            }
    declares_keys = "properties" in out or "patternProperties" in out
    says_nothing = "additionalProperties" not in out and "unevaluatedProperties" not in out
    if declares_keys and says_nothing and not keep_open and not _is_intersection(out):
        out["additionalProperties"] = False
    return out


def _is_intersection(node: dict) -> bool:
    """An object whose keys an allOf of several schemas declares in part (closing it would forbid theirs)."""
    return isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1


def _intersected_definitions(node: Any, found: set[tuple[str, str]] | None = None) -> set[tuple[str, str]]:
    """(`$defs` or `definitions`, name) of each local definition a member of a several-schema allOf refers to."""
    found = set() if found is None else found
    if isinstance(node, dict):
        if _is_intersection(node):
            for member in node["allOf"]:
                ref = member.get("$ref") if isinstance(member, dict) else None
                if isinstance(ref, str) and (target := _local_definition(ref)) is not None:
                    found.add(target)
        for value in node.values():
            _intersected_definitions(value, found)
    elif isinstance(node, list):
        for value in node:
            _intersected_definitions(value, found)
    return found


def _local_definition(ref: str) -> tuple[str, str] | None:
    for key in _DEFINITIONS:
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and "/" not in ref[len(prefix) :]:
            return key, ref[len(prefix) :]
    return None
