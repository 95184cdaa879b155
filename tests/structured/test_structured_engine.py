"""Grammar-constrained decoding in the engine: compile (cache, errors, timeout), the batched
mask, speculation, preemption and the prefill -> decode hop, on the tiny random model."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jsonschema
import pytest
import torch

from common.config import EngineConfig, SpeculativeConfig, StructuredOutputConfig
from common.engine.llm_engine import LLMEngine, RequestError
from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler
from common.structured.compiler import GrammarCompileError, GrammarCompiler
from common.structured.matcher import RequestGrammar
from common.structured.spec import GrammarSpec
from tests.engine.engine_helpers import make_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}


# A structural tag that is all structure: a fixed lead, a JSON part and a regex part, each tagged.
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "celsius": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["city", "celsius"], "additionalProperties": False}  # fmt: skip
REPORT_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Report: "},
    {"type": "tag", "begin": "<weather>", "content": {"type": "json_schema", "json_schema": CITY}, "end": "</weather>"},
    {"type": "tag", "begin": "<time>", "content": {"type": "regex", "pattern": "[0-2][0-9]:[0-5][0-9]"},
     "end": "</time>"}]}}  # fmt: skip
REPORT = re.compile(r"Report: <weather>(.*)</weather><time>([0-2][0-9]:[0-5][0-9])</time>", re.S)


def assert_report(text: str) -> None:
    """The tagged parts of a REPORT_TAG output parse as their schemas."""
    match = REPORT.fullmatch(text)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)), CITY)


def slow_schema(n: int = 200, tag: str = "") -> dict:
    """A schema that takes xgrammar a while (~0.2 s on one core) to compile: many patterned fields."""
    pattern = "[a-z]{3,9}(-[0-9]{2,4}){1,3}"
    props = {f"{tag}field_{i}": {"type": "string", "pattern": pattern} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def sampled(seed: int, spec: GrammarSpec, max_tokens: int = 120, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, grammar=spec, **kw)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return make_engine(tiny_model)


def test_json_schema_output_validates_for_20_seeds(engine):
    spec = GrammarSpec.json_schema(PERSON)
    outs = engine.generate(["Describe a person:"] * 20, [sampled(i, spec) for i in range(20)])
    for [out] in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o[0].text for o in outs}) > 1  # sampled, not forced to one answer
    engine.check_integrity()


def test_regex_choice_and_ebnf_hold(engine):
    regex = r"[a-c]{2,5}-\d{3}"
    outs = engine.generate(["x"] * 6, [sampled(i, GrammarSpec.regex(regex)) for i in range(6)])
    assert all(re.fullmatch(regex, o[0].text) and o[0].finish_reason == "stop" for o in outs)
    choices = ["yes", "no", "maybe so", 'say "hi"']
    outs = engine.generate(["x"] * 6, [sampled(i, GrammarSpec.choice(choices)) for i in range(6)])
    assert all(o[0].text in choices and o[0].finish_reason == "stop" for o in outs)
    ebnf = 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'
    outs = engine.generate(["x"] * 4, [sampled(i, GrammarSpec.ebnf(ebnf), max_tokens=60) for i in range(4)])
    finished = [o[0].text for o in outs if o[0].finish_reason == "stop"]
    assert finished and all(re.fullmatch(r"\(\d+(,\d+)*\)", t) for t in finished)


def test_structural_tag_output_conforms(engine):
    spec = GrammarSpec.structural_tag(REPORT_TAG)
    outs = engine.generate(["x"] * 10, [sampled(i, spec) for i in range(10)])
    for [out] in outs:
        assert out.finish_reason == "stop", out.text
        assert_report(out.text)
    assert len({o[0].text for o in outs}) > 1


def test_legacy_structural_tag_dispatches_on_triggers(engine):
    """vLLM's older spelling: free text, and after a trigger the tag with its schema."""
    legacy = {"type": "structural_tag", "triggers": ["<function="],
              "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}]}
    compiled = engine.grammar_compiler.compile(GrammarSpec.structural_tag(json.dumps(legacy)))

    def accepts(text: str) -> bool:
        grammar = RequestGrammar(compiled)
        return all(grammar.accept(t) for t in engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    assert accepts('Sure. <function=get_weather>{"city": "Oslo", "celsius": 3}</function> Done.')
    assert not accepts('<function=get_weather>{"city": "Lima", "celsius": 3}</function>')
    assert not accepts('<function=get_time>{}</function>')  # the trigger leads only to declared tags
    with pytest.raises(RequestError) as e:
        engine.add_request("bad-tag", prompt="x", params=sampled(0, GrammarSpec.structural_tag(
            {"format": {"type": "bogus"}}, source="response_format")))  # fmt: skip
    assert e.value.field == "response_format" and "invalid structural_tag" in e.value.message
    assert "bogus" in e.value.message and "Check failed" not in e.value.message


def test_json_object_and_greedy(engine):
    outs = engine.generate(["x"] * 4, [sampled(i, GrammarSpec.json_object(), max_tokens=200) for i in range(4)])
    for [out] in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
    [[out]] = engine.generate(["x"], SamplingParams(max_tokens=120, temperature=0.0,
                                                    grammar=GrammarSpec.json_schema(PERSON)))
    jsonschema.validate(json.loads(out.text), PERSON)


def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(engine):
    plain = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    [[alone]] = engine.generate(["Once upon a time"], plain)
    both = engine.generate(["Once upon a time", "x"], [plain, sampled(3, GrammarSpec.json_schema(PERSON))])
    assert both[0][0].token_ids == alone.token_ids


def test_sampler_masks_only_constrained_rows(engine):
    compiled = engine.grammar_compiler.compile(GrammarSpec.choice(["yes", "no"]))
    sampler = Sampler("cpu", seed=0)
    logits = torch.randn(3, engine.model_config.vocab_size)
    states = [sampler.new_state(SamplingParams(), [5]) for _ in range(3)]
    states[1].grammar = RequestGrammar(compiled)
    probs = sampler.compute_probs(logits, states)
    plain = sampler.compute_probs(logits[[0, 2]], [states[0], states[2]])
    assert torch.equal(probs[[0, 2]], plain)
    allowed = probs[1].nonzero().flatten().tolist()
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in map(engine.tokenizer.decode, allowed))


def test_grammar_wins_over_min_tokens(engine):
    # The grammar completes after one short answer, but min_tokens bans EOS: the grammar wins.
    [[out]] = engine.generate(["x"], sampled(0, GrammarSpec.choice(["no"]), min_tokens=10))
    assert out.text == "no" and out.finish_reason == "stop"


def test_compile_errors_and_cache(tiny_model, engine):
    with pytest.raises(RequestError) as e:
        engine.add_request("bad", prompt="x", params=sampled(0, GrammarSpec.regex("(unclosed", source="guided_regex")))
    assert e.value.field == "guided_regex" and "invalid regex" in e.value.message
    assert not engine.has_unfinished_requests()
    spec = GrammarSpec.json_schema(PERSON)
    compiler = engine.grammar_compiler
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(json.dumps(PERSON), source="guided_json"))


def test_compile_timeout_is_a_request_error_not_a_stall(tiny_model):
    # A timeout far below any real compile time of the slow schema: the request fails at once
    # with the reason; the compile finishes in the background and is cached for the next one.
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu",
                                    structured=StructuredOutputConfig(compile_timeout_s=1e-4)))
    spec = GrammarSpec.json_schema(slow_schema(tag="t"), source="response_format.json_schema.schema")
    with pytest.raises(RequestError) as e:
        engine.add_request("slow", prompt="x", params=sampled(0, spec))
    assert e.value.field == "response_format.json_schema.schema"
    assert "did not compile within" in e.value.message
    assert not engine.has_unfinished_requests()
    engine.grammar_compiler.timeout_s = 600.0  # generous: the background compile is awaited
    assert engine.grammar_compiler.compile(spec) is engine.grammar_compiler.cached(spec)


def test_compiler_dedupes_in_flight_compiles(tiny_model, engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids, timeout_s=600)
    spec = GrammarSpec.json_schema(slow_schema(50, tag="d"))
    with ThreadPoolExecutor(2) as callers:  # two requests for the same spec at once: one compile
        first, second = callers.submit(compiler.compile, spec), callers.submit(compiler.compile, spec)
        assert first.result() is second.result()
    compiler.close()


def test_matcher_lookahead_and_rollback(engine):
    compiled = engine.grammar_compiler.compile(GrammarSpec.choice(["abc"]))
    grammar = RequestGrammar(compiled)
    tok = engine.tokenizer
    ids = tok("abc", add_special_tokens=False)["input_ids"]
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(2, engine.model_config.vocab_size)
    grammar.fill(mask, 0)
    grammar.fill(mask, 1, lookahead=ids)  # after "abc" only EOS is allowed
    assert grammar.num_accepted == 0  # lookahead rolled back
    bits = lambda row: [t for t in range(engine.model_config.vocab_size) if (int(mask[row, t // 32]) >> (t % 32)) & 1]
    assert ids[0] in bits(0) and bits(1) == engine.eos_token_ids
    assert not grammar.accept(engine.eos_token_ids[0])  # EOS before the grammar is complete
    for t in ids:
        assert grammar.accept(t)
    assert grammar.accept(engine.eos_token_ids[0]) and grammar.is_terminated


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_speculation_keeps_the_grammar(tiny_model, adaptive):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu",
                                    speculative=SpeculativeConfig("ngram", 4, adaptive=adaptive)))
    spec = GrammarSpec.json_schema(PERSON)
    # A prompt full of the schema's own text gives the n-gram proposer drafts to offer.
    prompt = 'Example: {"name": "Ann", "age": 31, "role": "user", "ok": true} ' * 3
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                                add_generation_prompt=True, tokenize=False)
    outs = engine.generate([prompt] * 10 + [chat] * 30, [sampled(i, spec) for i in range(40)])
    for [out] in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert engine.spec_stats.num_draft_tokens > 0
    engine.check_integrity()


def test_preemption_restores_the_matcher(tiny_model, engine):
    spec = GrammarSpec.json_schema(PERSON)
    params = [sampled(i, spec) for i in range(6)]
    prompts = ["a long prompt " * 12] * 6
    expected = [o[0].token_ids for o in engine.generate(prompts, params)]
    small = make_engine(tiny_model, budget=64, num_blocks=16)
    outs = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [o[0].token_ids for o in outs] == expected  # seeded: preemption changes nothing
    small.check_integrity()


def test_decode_rebuilds_the_matcher_from_prefills_first_token(tiny_model, engine):
    """The hop as the services do it: a prefill engine samples token 0 under the grammar; a decode
    engine reserves, gets the spec with the params and the first token, and continues."""
    spec = GrammarSpec.json_schema(PERSON)
    prompt = engine.tokenize("Describe a person:")
    decode = make_engine(tiny_model)
    for seed in range(5):
        params = sampled(seed, spec)
        [[first]] = engine.generate([prompt], replace(params, max_tokens=1))
        decode.reserve_remote(f"r{seed}", prompt, SamplingParams())
        # KV is not copied here (the grammar does not need it): decode's text is arbitrary but legal.
        out = decode.commit_remote(f"r{seed}", first.token_ids[0], 0.0, None, params)
        text = out.text
        while not out.finished:
            for o in decode.step():
                text, out = o.text, o
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    decode.check_integrity()


def test_migrated_request_rebuilds_its_matcher_from_the_resumed_outputs(engine):
    params = sampled(4, GrammarSpec.json_schema(PERSON))
    prompt = engine.tokenize("Describe a person:")
    [[full]] = engine.generate([prompt], params)
    cut = 6
    engine.add_request("moved", params=replace(params, max_tokens=params.max_tokens - cut),
                       prompt_token_ids=prompt + full.token_ids[:cut], num_resumed_outputs=cut)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[cut:]  # as if never moved
    bad = engine.tokenize("not json at all")
    with pytest.raises(RequestError) as e:
        engine.add_request("wrong", params=params, prompt_token_ids=prompt + bad, num_resumed_outputs=len(bad))
    assert e.value.field == "response_format" and not engine.is_unfinished("wrong")


def test_no_surrogate_bytes_across_a_token_boundary(engine):
    """xgrammar 0.2.9 admits UTF-16 surrogates (ED A0-BF ..) in strings; the bans keep them out,
    also when the lead byte ED and the next byte come in two tokens (seen with n-gram drafts)."""
    spec = GrammarSpec.json_schema({"type": "string", "maxLength": 8})
    compiler = engine.grammar_compiler
    vocab = compiler.tokenizer_info.decoded_vocab
    ed, tail = vocab.index(b"\xed"), vocab.index(b"\xa4")
    grammar = RequestGrammar(compiler.compile(spec), compiler.token_bans(spec))
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, engine.model_config.vocab_size)
    assert grammar.accept(vocab.index(b'"'))
    assert not grammar.fill(mask, 0)[tail]
    assert grammar.fill(mask, 0, lookahead=[ed])[tail]  # a draft position after ED
    assert not grammar.fill(mask, 0)[tail]  # the lookahead left no trace
    assert grammar.accept(ed)
    assert grammar.fill(mask, 0)[tail]
    assert (int(mask[0, tail // 32]) >> (tail % 32)) & 1  # the grammar alone would allow it


class _DenseDraftProposer:
    """Random drafts with a dense draft distribution q (as a draft model gives): exercises the
    residual max(0, p - q) of rejection sampling against a grammar-masked p."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.rng = vocab, torch.Generator().manual_seed(0)

    def propose(self, requests):
        from common.spec_decode.proposer import Proposal

        out = {}
        for r in requests:
            q = torch.softmax(torch.randn(r.k, self.vocab, generator=self.rng), dim=-1)
            out[r.request_id] = Proposal(torch.multinomial(q, 1, generator=self.rng).flatten().tolist(), q)
        return out

    def release(self, request_ids):
        pass


def test_draft_proposals_with_a_dense_distribution_keep_the_grammar(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu",
                                    speculative=SpeculativeConfig("draft", 3, adaptive=False)),
                       proposer=_DenseDraftProposer(1024))  # fmt: skip
    spec = GrammarSpec.json_schema(PERSON)
    outs = engine.generate(["Describe a person:"] * 12, [sampled(i, spec) for i in range(12)])
    for [out] in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert engine.spec_stats.num_draft_tokens > 0
    engine.check_integrity()


def test_properties_come_in_the_schemas_order(engine):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    [[out]] = engine.generate(["x"], sampled(0, GrammarSpec.json_schema(schema)))
    assert list(json.loads(out.text)) == ["zeta", "alpha"]
