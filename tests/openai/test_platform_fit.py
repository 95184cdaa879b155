"""Platform fit: the Responses API through the official client, and the gateway's request counters."""

from __future__ import annotations

import openai
import pytest

from tests.cluster.cluster_helpers import gateway_metrics


def test_responses_create_and_stream(client, model_id):
    resp = client.responses.create(model=model_id, input="Say hello", instructions="Be brief.", max_output_tokens=5,
                                   temperature=0)  # fmt: skip
    assert resp.object == "response" and resp.status in ("completed", "incomplete")
    assert resp.output[0].type == "message" and resp.output_text == resp.output[0].content[0].text
    assert resp.usage.output_tokens <= 5 and resp.usage.input_tokens > 0
    chat = client.chat.completions.create(model=model_id, max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}])
    assert resp.output_text == chat.choices[0].message.content  # the same request, another shape
    events = list(client.responses.create(model=model_id, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say hello"}]}], max_output_tokens=5, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model=model_id, input="Say hello", max_output_tokens=3) as stream:
        last = list(stream)[-1]
    # Cut by max_output_tokens: OpenAI's "response.incomplete" (the SDK's get_final_response wants
    # "response.completed", which only a natural end sends).
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 3


def test_responses_text_format_json_schema(client, model_id):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = client.responses.create(model=model_id, input="Answer in JSON", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                    "strict": True}})  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_responses_function_tools(client, model_id):
    """Flat function tools, function_call / function_call_output input items, function_call
    output items (required: grammar-constrained), streamed as output_item + arguments events."""
    import json

    tool = {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}
    history = [{"role": "user", "content": "Time?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
               {"role": "user", "content": "And CET?"}]  # fmt: skip
    resp = client.responses.create(model=model_id, input=history, tools=[tool], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=60, extra_body={"seed": 2})  # fmt: skip
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
    events = list(client.responses.create(model=model_id, input=history, tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=60, extra_body={"seed": 2}, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(calls[0].arguments)
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"), ({"tools": [{"type": "web_search"}]}, "tools"), ({"text": {"format": {"type": "xml"}}}, "text.format"), ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"frobnicate": 1}, "frobnicate"), ({"max_output_tokens": 10**7}, "max_output_tokens"),
])  # fmt: skip
def test_responses_clear_400s(http, model_id, extra, param):
    r = http.post("/v1/responses", json={"model": model_id, "input": "hi", **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_request_counters_exist_from_the_start_and_count_4xx(disagg, http, client, model_id):
    before = gateway_metrics(disagg)
    for outcome in ("success", "aborted", "rejected", "timeout", "invalid", "error"):
        assert f'tandem_requests_total{{outcome="{outcome}"}}' in before
    r = http.post("/v1/completions", json={"model": model_id, "prompt": "hi", "temperature": -1})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    after = gateway_metrics(disagg)
    key = 'tandem_requests_total{outcome="invalid"}'
    assert after[key] == before[key] + 2
