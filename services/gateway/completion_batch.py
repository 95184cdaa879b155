"""Completions with a batch of prompts, `echo` and `max_tokens: 0`, on top of per-prompt requests.

Each prompt is its own orchestrator request (routed, admitted and aborted on its own); this file
merges their update streams into one, renumbering choice c of prompt i to i * n + c (OpenAI's
order), and shapes each prompt's choices. REST /v1/completions and gRPC Generation (PromptBatch,
`echo`) both go through it:

    echo:          the prompt's text goes in front of each choice's first text; with logprobs the
                   prompt tokens' logprobs (first one null) go in front of its logprobs. They come
                   from the engine (params.prompt_logprobs), with the first token's update.
    scoring_only:  max_tokens 0 with echo: the cluster generates one token (an engine needs one);
                   it is dropped here, the choice ends "length", and usage counts 0 output tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from common.sampling.params import SamplingParams
from services.gateway.model import ServedModel
from services.gateway.request_types import ChoiceResult, ChoiceUpdate, GenerationUpdate, TokenLogprob, Usage


def echo_params(params: SamplingParams, echo: bool) -> SamplingParams:
    """echo + logprobs: the prompt's logprobs too, computed by the engine (params.prompt_logprobs)."""
    if echo and params.logprobs is not None:
        return replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, params.logprobs))
    return params


def echo_texts(raw_prompts: Sequence[Any], prompts: Sequence[list[int]], model: ServedModel) -> list[str]:
    """What echo puts in front of each prompt's choices: the client's text, or its decoded ids."""
    return [p if isinstance(p, str) else model.tokenizer.decode(ids) for p, ids in zip(raw_prompts, prompts)]


@dataclass
class PromptShaper:
    """Turns one prompt's updates into the batch's choice updates."""

    offset: int  # this prompt's first global choice index (prompt index * n)
    echo_text: str | None = None  # set when echo is on
    echo_first: TokenLogprob | None = None  # the first prompt token (null logprob), for echo + logprobs
    want_logprobs: bool = False
    scoring_only: bool = False
    prompt_logprobs: list[TokenLogprob] | None = None
    _prefixed: set[int] = field(default_factory=set)
    _pending: list[ChoiceUpdate] = field(default_factory=list)

    def shape(self, update: GenerationUpdate) -> list[ChoiceUpdate]:
        if update.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = update.prompt_logprobs
        choices = [self._scored(c) for c in update.choices] if self.scoring_only else list(update.choices)
        if self.echo_text is not None:
            if self.want_logprobs and self.prompt_logprobs is None:
                self._pending.extend(choices)  # hold until the prompt's logprobs are known
                return []
            choices, self._pending = self._pending + choices, []
            for c in choices:
                if c.index not in self._prefixed:
                    self._prefixed.add(c.index)
                    c.text = self.echo_text + c.text
                    if self.want_logprobs:
                        c.logprobs = [self.echo_first, *self.prompt_logprobs, *(c.logprobs or [])]
        for c in choices:
            c.index += self.offset
        return choices

    def usage(self, usage: Usage) -> Usage:
        return Usage(usage.prompt_tokens, 0, usage.cached_tokens) if self.scoring_only else usage

    def _scored(self, c: ChoiceUpdate) -> ChoiceUpdate:
        finished = c.finish_reason is not None
        return ChoiceUpdate(c.index, [], "", [] if c.logprobs is not None else None,
                            "length" if finished else None, None)


def shapers(api, model: ServedModel) -> list[PromptShaper]:
    """One shaper per prompt of a parsed ApiRequest (openai_schemas.ApiRequest)."""
    out = []
    for i, gen in enumerate(api.generations):
        shaper = PromptShaper(offset=i * api.n, scoring_only=api.scoring_only,
                              want_logprobs=gen.params.logprobs is not None)
        if api.echo:
            shaper.echo_text = api.prompt_texts[i]
            first = gen.prompt_token_ids[0]
            shaper.echo_first = TokenLogprob(first, model.token_text(first), None)  # type: ignore[arg-type]
        out.append(shaper)
    return out


class BatchShaper:
    """A merged batch stream's updates -> the client's choice updates and the summed usage."""

    def __init__(self, api, model: ServedModel) -> None:
        self.prompts = shapers(api, model)
        self.usage: Usage | None = None
        self._running = len(self.prompts)  # prompts whose last update (the one with usage) is still to come

    def shape(self, prompt_index: int, update: GenerationUpdate) -> list[ChoiceUpdate]:
        shaper = self.prompts[prompt_index]
        choices = shaper.shape(update)
        if update.usage is not None:
            self.usage = add_usage(self.usage, shaper.usage(update.usage))
            self._running -= 1
        return choices

    @property
    def finished(self) -> bool:
        """Every prompt has sent its last update (the current one was the batch's last)."""
        return self._running == 0

    def results(self, got: Sequence[tuple[int, GenerationUpdate]], num_choices: int) -> list[ChoiceResult]:
        """A finished (non-streamed) batch's choices, indexed across its prompts."""
        return fold([c for i, u in got for c in self.shape(i, u)], num_choices)

    @property
    def prompt_logprobs(self) -> list[list[TokenLogprob] | None]:
        return [s.prompt_logprobs for s in self.prompts]


def fold(shaped: Sequence[ChoiceUpdate], num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult(index=i) for i in range(num_choices)]
    for c in shaped:
        results[c.index].add(c)
    return results


def add_usage(total: Usage | None, usage: Usage) -> Usage:
    if total is None:
        return usage
    return Usage(total.prompt_tokens + usage.prompt_tokens, total.completion_tokens + usage.completion_tokens,
                 total.cached_tokens + usage.cached_tokens)


async def merge(streams: Sequence[AsyncIterator[GenerationUpdate]]) -> AsyncIterator[tuple[int, GenerationUpdate]]:
    """(prompt index, update) from several update streams, as they come. The first error ends the
    merge (and so the request); closing it closes every stream, which aborts what still runs."""
    if len(streams) == 1:  # the common case: no tasks
        async for update in streams[0]:
            yield 0, update
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[GenerationUpdate]) -> None:
        try:
            async for update in stream:
                queue.put_nowait((i, update))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()
