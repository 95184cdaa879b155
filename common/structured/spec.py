"""What a request's output must match: one `GrammarSpec`, built at the edge, carried as data.

The gateway turns `response_format`, `structured_outputs`, `guided_*` (and, for tool calling,
`tool_choice: required` / a named function) into a GrammarSpec; it rides in `SamplingParams.grammar`
through every service (proto `tandem.v1.GrammarSpec`), and each engine compiles it for its own
tokenizer (`common/structured/compiler.py`). The spec is plain text, so it is hashable and is the
compile cache's key.

    kind           value
    json_schema    the JSON schema, as compact JSON text (the client's key order kept)
    json_object    "" (any JSON object)
    regex          a regular expression the whole output must match
    choice         a JSON array of the allowed output strings
    grammar        an EBNF (GBNF-style) grammar whose `root` rule the output must match
    structural_tag an xgrammar structural tag as compact JSON: {"type": "structural_tag", "format":
                   {...}}, or the older {"type": "structural_tag", "structures": [{begin, schema,
                   end}], "triggers": [...]} (vLLM's response_format spelling)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # 1 MiB of schema or grammar text: beyond that, a 400 before any compile


class GrammarSpecError(ValueError):
    """A malformed grammar spec; `field` names the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's whole output (see the module docstring for the kinds)."""

    kind: str
    value: str = ""
    source: str = field(default="response_format", compare=False)
    """The request field this spec came from, for error messages (not part of the identity)."""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarSpecError(self.source, f"unknown grammar kind {self.kind!r} (one of {', '.join(GRAMMAR_KINDS)})")
        if not isinstance(self.value, str):
            raise GrammarSpecError(self.source, f"grammar value must be a string, got {type(self.value).__name__}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise GrammarSpecError(self.source, f"is {len(self.value)} characters; the limit is {MAX_SPEC_CHARS}")
        if self.kind in ("regex", "grammar") and not self.value:
            raise GrammarSpecError(self.source, f"the {self.kind} is empty")
        if self.kind == "choice":
            _check_choices(json.loads(self.value) if self.value else None, self.source)

    # -- constructors: what callers use ------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool, source: str = "response_format") -> GrammarSpec:
        """A JSON schema (a dict, or its JSON text), stored as compact JSON so the same schema shares
        a cache entry however it was spaced. Key order is kept: properties are generated in the
        schema's order (OpenAI's too), so a reordered schema is a different grammar."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarSpecError(source, f"the schema is not valid JSON ({e})") from None
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarSpecError(source, f"the schema must be a JSON object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise GrammarSpecError(source, f"the schema cannot be encoded as JSON ({e})") from None
        return cls("json_schema", text, source)

    @classmethod
    def json_object(cls, source: str = "response_format") -> GrammarSpec:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls("json_object", "", source)

    @classmethod
    def regex(cls, pattern: str, source: str = "guided_regex") -> GrammarSpec:
        if not isinstance(pattern, str):
            raise GrammarSpecError(source, f"must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern, source)

    @classmethod
    def choice(cls, choices: Sequence[str], source: str = "guided_choice") -> GrammarSpec:
        """The output is exactly one of `choices`."""
        _check_choices(choices, source)
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), source)

    @classmethod
    def ebnf(cls, grammar: str, source: str = "guided_grammar") -> GrammarSpec:
        """An EBNF grammar (xgrammar's GBNF dialect) with a `root` rule."""
        if not isinstance(grammar, str):
            raise GrammarSpecError(source, f"must be a string, got {type(grammar).__name__}")
        return cls("grammar", grammar, source)

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any] | str, source: str = "response_format") -> GrammarSpec:
        """An xgrammar structural tag (a dict, or its JSON text). Only its outline is checked here;
        the engine's compile checks the rest (an invalid one is a 400 naming `source` then)."""
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except ValueError as e:
                raise GrammarSpecError(source, f"the structural tag is not valid JSON ({e})") from None
        if not isinstance(tag, Mapping):
            raise GrammarSpecError(source, f"the structural tag must be a JSON object, got {type(tag).__name__}")
        tag = {"type": "structural_tag", **tag}
        if tag["type"] != "structural_tag":
            raise GrammarSpecError(f"{source}.type", f"must be 'structural_tag', got {tag['type']!r}")
        legacy = "structures" in tag
        if legacy and not (isinstance(tag["structures"], list) and isinstance(tag.get("triggers"), list)):
            raise GrammarSpecError(source, "structures and triggers must be lists")
        if not legacy and not isinstance(tag.get("format"), Mapping):
            raise GrammarSpecError(f"{source}.format", "must be an object (or give structures and triggers)")
        try:
            text = json.dumps(tag, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise GrammarSpecError(source, f"the structural tag cannot be encoded as JSON ({e})") from None
        return cls("structural_tag", text, source)

    # -- wire form ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GrammarSpec:
        return cls(str(d.get("kind", "")), d.get("value", ""), str(d.get("source") or "grammar"))

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.value)


def _check_choices(choices: Any, source: str) -> None:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices:
        raise GrammarSpecError(source, f"must be a non-empty list of strings, got {choices!r}")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise GrammarSpecError(source, f"entry {i} must be a non-empty string, got {c!r}")
