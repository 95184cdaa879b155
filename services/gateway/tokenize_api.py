"""vLLM's /tokenize and /detokenize bodies (the gateway owns the tokenizer, so it answers them).

    POST /tokenize    {"prompt": str, "add_special_tokens": true}                 -> {"count", "tokens",
                      {"messages": [...], "add_generation_prompt": true}            "max_model_len",
                      ("return_token_strs": true adds "token_strs")                 "token_strs"?}
    POST /detokenize  {"tokens": [int, ...]}                                      -> {"prompt": str}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.gateway.errors import InvalidRequest
from services.gateway.model import ServedModel
from services.gateway.openai_schemas import bool_field, check_token_ids, chat_messages, check_model


def tokenize(body: Mapping[str, Any], model: ServedModel) -> dict[str, Any]:
    check_model(body, model)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        ids = model.tokenize(prompt, add_special_tokens=bool_field(body, "add_special_tokens", True))
    else:
        ids = model.tokenize_chat(chat_messages(body["messages"]),
                                  add_generation_prompt=bool_field(body, "add_generation_prompt", True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if bool_field(body, "return_token_strs"):
        out["token_strs"] = model.token_strings(ids)
    return out


def detokenize(body: Mapping[str, Any], model: ServedModel) -> dict[str, Any]:
    check_model(body, model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequest("tokens must be a list of token ids", param="tokens")
    return {"prompt": model.tokenizer.decode(check_token_ids(tokens, model, "tokens"))}
