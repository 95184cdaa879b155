"""GrammarSpec, its wire form, and the gateway's translation of the request fields (no engine)."""

from __future__ import annotations

import pytest

from common.sampling.params import SamplingParams, SamplingParamsError
from common.structured.spec import GrammarSpec, GrammarSpecError
from services.gateway.errors import InvalidRequest
from services.gateway.structured import grammar_from_body
from services.runtime.kv_wire import sampling_params_from_dict, sampling_params_to_dict

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_equal_schemas_share_one_key():
    a = GrammarSpec.json_schema(SCHEMA)
    b = GrammarSpec.json_schema('{"type": "object",\n  "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
                                source="guided_json")
    assert a == b and hash(a) == hash(b)  # compact text; the source is not part of the identity
    assert a.source == "response_format" and b.source == "guided_json"
    # Key order is meaning (properties are generated in order): a reordered schema is another grammar.
    assert GrammarSpec.json_schema({"required": ["a"], **SCHEMA}) != a


@pytest.mark.parametrize("make, field", [
    (lambda: GrammarSpec.json_schema("{not json", source="guided_json"), "guided_json"),
    (lambda: GrammarSpec.json_schema([1, 2]), "response_format"),
    (lambda: GrammarSpec.choice([], source="guided_choice"), "guided_choice"),
    (lambda: GrammarSpec.choice(["a", ""], source="guided_choice"), "guided_choice"),
    (lambda: GrammarSpec.regex("", source="guided_regex"), "guided_regex"),
    (lambda: GrammarSpec("yaml", "x", source="structured_outputs"), "structured_outputs"),
])  # fmt: skip
def test_bad_specs_name_their_field(make, field):
    with pytest.raises(GrammarSpecError) as e:
        make()
    assert e.value.field == field


def test_spec_crosses_the_proto_and_back():
    for spec in (GrammarSpec.json_schema(SCHEMA), GrammarSpec.json_object(), GrammarSpec.regex(r"\d+"),
                 GrammarSpec.choice(["yes", 'say "no"']), GrammarSpec.ebnf('root ::= "x"')):
        params = SamplingParams(max_tokens=5, grammar=spec)
        msg = sampling_params_from_dict({"max_tokens": 5, "grammar": spec})
        back = SamplingParams.from_dict(sampling_params_to_dict(msg))
        assert back == params and back.grammar.source == spec.source
    assert not sampling_params_from_dict({"max_tokens": 5}).HasField("grammar")
    assert "grammar" not in sampling_params_to_dict(sampling_params_from_dict({"max_tokens": 5}))


def test_unknown_wire_kind_is_rejected_by_name():
    msg = sampling_params_from_dict({"max_tokens": 5})
    msg.grammar.kind = 99
    msg.grammar.source = "guided_regex"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict(sampling_params_to_dict(msg))
    assert e.value.field == "guided_regex"


@pytest.mark.parametrize("body, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, GrammarSpec.regex("a+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, GrammarSpec.ebnf('root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec.json_object()),
    ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA)),
    ({"guided_regex": "a+"}, GrammarSpec.regex("a+")),
    ({"guided_choice": ["a", "b"]}, GrammarSpec.choice(["a", "b"])),
    ({"guided_grammar": 'root ::= "a"'}, GrammarSpec.ebnf('root ::= "a"')),
    ({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}},
     GrammarSpec.structural_tag({"format": {"type": "const_string", "value": "hi"}})),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
                          "triggers": ["<a"]}},
     GrammarSpec.structural_tag({"structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}], "triggers": ["<a"]})),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'}},
     GrammarSpec.structural_tag({"format": {"type": "const_string", "value": "hi"}})),
])  # fmt: skip
def test_request_fields_to_spec(body, expected):
    assert grammar_from_body(body) == expected


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{bad"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": ["x"]}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.format"),
    ({"response_format": {"type": "structural_tag", "structures": {}, "triggers": []}}, "response_format"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])  # fmt: skip
def test_bad_request_fields_are_400_by_name(body, param):
    with pytest.raises(InvalidRequest) as e:
        grammar_from_body(body)
    assert e.value.param == param
