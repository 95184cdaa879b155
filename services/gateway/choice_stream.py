"""Per-choice output handling: dedupe, incremental detokenization, stop strings, logprobs text.

Decode streams token ids only (its engine runs without a detokenizer); each choice here owns an
IncrementalDetokenizer and a StopStringMatcher:

    decode delta (output_index, ids, logprobs, finish)
      -> drop ids already seen (output_index < num_tokens)
      -> per token: text = matcher.add_text(detok.add_tokens([id]))
           stop string hit -> choice finished "stop" (tokens after it are dropped;
                              the orchestrator aborts decode once every choice is done)
      -> decode's finish (EOS, stop id, length): text += detok.finish() + matcher.flush()

Tokens are fed one at a time so a stop string cuts the token list at the token that completed it.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.sampling.detokenizer import IncrementalDetokenizer
from common.sampling.params import SamplingParams
from common.sampling.stop_strings import StopStringMatcher
from services.gateway.model import ServedModel
from services.gateway.request_types import ChoiceUpdate, TokenLogprob, TopLogprob

# (token_id, logprob, [(token_id, logprob), ...]) as the worker sent it.
RawLogprob = tuple[int, float, Sequence[tuple[int, float]]]


class ChoiceStream:
    def __init__(self, index: int, model: ServedModel, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self.index = index
        self.model = model
        self.want_logprobs = params.logprobs is not None
        self.detokenizer = IncrementalDetokenizer(model.tokenizer, prompt_token_ids,
                                                  skip_special_tokens=params.skip_special_tokens)
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0  # output tokens accepted (up to and including a stop-string token)
        self.token_ids: list[int] = []  # those tokens (a migrated request continues from them)
        self.finish_reason: str | None = None
        self.ended_by_worker = False  # decode finished this choice itself (no abort needed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, output_index: int, token_ids: Sequence[int], logprobs: Sequence[RawLogprob] | None,
            finish_reason: str | None, stop_token_id: int | None) -> ChoiceUpdate | None:
        """One worker delta; returns what to send the client (None when nothing new)."""
        if self.finished:
            return None
        skip = max(0, self.num_tokens - output_index)  # a resent prefix (e.g. the first token)
        token_ids = list(token_ids)[skip:]
        raw = list(logprobs or [])[skip:]
        update = ChoiceUpdate(self.index, [], "", [] if self.want_logprobs else None)
        for i, token in enumerate(token_ids):
            update.token_ids.append(token)
            self.token_ids.append(token)
            self.num_tokens += 1
            if self.want_logprobs and i < len(raw):
                update.logprobs.append(self._logprob(raw[i]))
            check = self.matcher.add_text(self.detokenizer.add_tokens([token]))
            update.text += check.text
            if check.stop is not None:
                return self._finish(update, "stop", check.stop, flush=False)
        if finish_reason is not None:
            self.ended_by_worker = True
            return self._finish(update, finish_reason, stop_token_id, flush=True)
        return update if update.token_ids or update.text else None

    def abort(self, reason: str = "abort") -> ChoiceUpdate | None:
        """The request ended before this choice did (abort, error): close it, release held text."""
        if self.finished:
            return None
        return self._finish(ChoiceUpdate(self.index, [], "", [] if self.want_logprobs else None),
                            reason, None, flush=True)

    def _finish(self, update: ChoiceUpdate, reason: str, stop_reason: int | str | None,
                flush: bool) -> ChoiceUpdate:
        if flush:
            tail = self.matcher.add_text(self.detokenizer.finish())
            update.text += tail.text
            if tail.stop is not None:  # the held-back last character completed a stop string
                reason, stop_reason = "stop", tail.stop
            else:
                update.text += self.matcher.flush()
        self.finish_reason = reason
        update.finish_reason, update.stop_reason = reason, stop_reason
        return update

    def _logprob(self, raw: RawLogprob) -> TokenLogprob:
        return token_logprob(self.model, raw)


def token_logprob(model: ServedModel, raw: RawLogprob) -> TokenLogprob:
    """A worker's (id, logprob, top) with the token texts filled in."""
    token_id, logprob, top = raw
    return TokenLogprob(
        token_id=token_id, token=model.token_text(token_id), logprob=logprob,
        top_logprobs=[TopLogprob(t, model.token_text(t), lp) for t, lp in top],
    )
