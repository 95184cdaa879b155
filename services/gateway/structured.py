"""OpenAI / vLLM structured-output request fields -> one `GrammarSpec` (or None).

    response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}
                     {"type": "structural_tag", "format": {...}}  (xgrammar's structural tag)
                     {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]}
    structured_outputs: {"json": schema | "regex": str | "choice": [str] | "grammar": str | "json_object": true
                         | "structural_tag": the structural tag, as JSON text (vLLM) or an object}
    guided_json | guided_regex | guided_choice | guided_grammar       (vLLM's older spelling)

At most one constraint per request; anything we cannot serve is a 400 naming its field. The engine
does the rest (`common/structured/`): the gateway never compiles, it only says what to match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.structured.spec import GrammarSpec, GrammarSpecError
from services.gateway.errors import InvalidRequest

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM knobs that change how a grammar is built; we serve the defaults only, so a request that
# sets them is refused by name rather than silently served differently.
_UNSUPPORTED = ("guided_whitespace_pattern", "guided_decoding_backend")


def grammar_from_body(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The request's output constraint, or None when it has none. Raises InvalidRequest."""
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is not supported", param=name)
    specs: list[GrammarSpec] = []
    try:
        fmt = _response_format(body.get("response_format"))
        if fmt is not None:
            specs.append(fmt)
        specs.extend(_structured_outputs(body.get("structured_outputs")))
        specs.extend(_guided(body))
    except GrammarSpecError as e:
        raise InvalidRequest(e.message, param=e.field) from None
    if len(specs) > 1:
        names = ", ".join(s.source for s in specs)
        raise InvalidRequest(f"give at most one output constraint, got {names}", param=specs[1].source)
    return specs[0] if specs else None


def _response_format(fmt: Any) -> GrammarSpec | None:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise GrammarSpecError("response_format", f"must be an object, got {fmt!r}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object("response_format")
    if kind == "json_schema":
        source = "response_format.json_schema"
        inner = fmt.get("json_schema")
        if not isinstance(inner, Mapping):
            raise GrammarSpecError(source, f"must be an object with name and schema, got {inner!r}")
        name = inner.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarSpecError(f"{source}.name", f"must be a string, got {name!r}")
        strict = inner.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarSpecError(f"{source}.strict", f"must be a boolean, got {strict!r}")
        schema = inner.get("schema")
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object then
            return GrammarSpec.json_object(source)
        return GrammarSpec.json_schema(schema, f"{source}.schema")
    if kind == "structural_tag":
        return GrammarSpec.structural_tag(fmt, "response_format")
    raise GrammarSpecError("response_format.type",
                           f"must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}")


def _structured_outputs(so: Any) -> list[GrammarSpec]:
    if so is None:
        return []
    source = "structured_outputs"
    if not isinstance(so, Mapping):
        raise GrammarSpecError(source, f"must be an object, got {so!r}")
    unknown = sorted(k for k, v in so.items() if k not in _STRUCTURED_KEYS and v is not None)
    if unknown:
        raise GrammarSpecError(f"{source}.{unknown[0]}", f"is not supported (supported: {', '.join(_STRUCTURED_KEYS)})")
    out = []
    for key in _STRUCTURED_KEYS:
        value = so.get(key)
        if value is None or value is False:
            continue
        out.append(_one(key, value, f"{source}.{key}"))
    return out


def _guided(body: Mapping[str, Any]) -> list[GrammarSpec]:
    return [_one(name.removeprefix("guided_"), body[name], name) for name in _GUIDED if body.get(name) is not None]


def _one(key: str, value: Any, source: str) -> GrammarSpec:
    if key == "json":
        return GrammarSpec.json_schema(value, source)
    if key == "json_object":
        if value is not True:
            raise GrammarSpecError(source, f"must be true, got {value!r}")
        return GrammarSpec.json_object(source)
    if key == "regex":
        return GrammarSpec.regex(value, source)
    if key == "choice":
        return GrammarSpec.choice(value, source)
    if key == "structural_tag":
        return GrammarSpec.structural_tag(value, source)
    return GrammarSpec.ebnf(value, source)
