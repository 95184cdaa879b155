"""`tandem generate`: offline batch inference from a JSONL file.

Every input line is submitted at once and the engine batches them. Output lines keep the input
order. n == 1: {"index", "token_ids", "text", "finish_reason", "logprobs"?, "num_cached_tokens"};
n > 1: {"index", "num_cached_tokens", "choices": [{"index", "token_ids", "text", "finish_reason",
"logprobs"?}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from common.config import ConfigError
from common.engine.llm_engine import CompletionOutput, LLMEngine, RequestError
from common.models.gguf_convert import resolve_model_path
from common.sampling.params import SamplingParams, SamplingParamsError
from services.runtime.engine_factory import engine_config
from services.runtime.settings import SettingsError, add_engine_arguments, engine_settings_from_namespace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem generate", description="Offline batch inference.")
    parser.add_argument("--input", required=True, type=Path, help="JSONL of requests")
    parser.add_argument("--output", required=True, type=Path, help="JSONL of results, in input order")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--model", required=True, help="Hugging Face model folder or a .gguf file")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests that give none")
    return add_engine_arguments(parser)  # the services' engine flags and TANDEM_* env vars


def parse_line(line_no: int, raw: str) -> tuple[str | None, list[int] | None, SamplingParams]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(f"line {line_no}", f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise RequestError(f"line {line_no}", "each line must be a JSON object")
    prompt = obj.pop("prompt", None)
    token_ids = obj.pop("prompt_token_ids", None)
    if (prompt is None) == (token_ids is None):
        raise RequestError(f"line {line_no}", "give exactly one of 'prompt' or 'prompt_token_ids'")
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError(f"line {line_no}: prompt", "must be a string")
    if token_ids is not None and not (isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids)):
        raise RequestError(f"line {line_no}: prompt_token_ids", "must be a list of integers")
    try:
        params = SamplingParams.from_dict(obj)
    except SamplingParamsError as e:
        raise RequestError(f"line {line_no}: {e.field}", e.message) from None
    return prompt, token_ids, params


def _choice(out: CompletionOutput, want_logprobs: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}
    if want_logprobs:
        d["logprobs"] = [
            {
                "token_id": tok,
                "logprob": lp,
                **({"top_logprobs": [{"token_id": t, "logprob": v} for t, v in top]} if top is not None else {}),
            }
            for tok, (lp, top) in zip(out.token_ids, out.logprobs)
        ]
    return d


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lines = args.input.read_text(encoding="utf-8").splitlines()
    requests = []
    try:
        settings = engine_settings_from_namespace(args)
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        for i, raw in enumerate(lines):
            if raw.strip():
                requests.append(parse_line(i + 1, raw))
        engine = LLMEngine(engine_config(resolve_model_path(args.model), settings, seed=args.seed, max_model_len=args.max_model_len))
        for i, (prompt, token_ids, params) in enumerate(requests):
            engine.add_request(str(i), prompt=prompt, params=params, prompt_token_ids=token_ids)
    except (RequestError, ConfigError, SamplingParamsError, SettingsError) as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2

    from tqdm import tqdm

    finals: dict[str, dict[int, CompletionOutput]] = {str(i): {} for i in range(len(requests))}
    total = sum(p.n for _, _, p in requests)
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=args.no_progress) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id][out.index] = out
                    bar.update(1)
    with args.output.open("w", encoding="utf-8") as f:
        for i, (_, _, params) in enumerate(requests):
            rid = str(i)
            want = params.logprobs is not None
            choices = [finals[rid][k] for k in sorted(finals[rid])]
            line: dict[str, Any] = {"index": i}
            if params.n == 1:
                line.update(_choice(choices[0], want))
            else:
                line["choices"] = [{"index": c.index, **_choice(c, want)} for c in choices]
            line["num_cached_tokens"] = choices[0].num_cached_tokens
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return 0
