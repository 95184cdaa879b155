"""Incremental detokenization and stop strings against a tiny byte-level BPE trained here.

The vocabulary is small (320), so accented letters, CJK and emoji are split across byte tokens:
exactly the case where per-token decoding would emit U+FFFD halves.
"""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.sampling.detokenizer import IncrementalDetokenizer
from common.sampling.stop_strings import StopStringMatcher

CORPUS = [
    "Café crème brûlée, naïve façade, déjà vu. Ærøskøbing Straße; señor año.",
    "你好，世界！今天天气很好。我们一起学习中文。",
    "Emoji time 😀🎉👍🏽 and 🇫🇷 flags, ❤️ hearts.",
    "The quick brown fox jumps over the lazy dog. END of line.",
]
TEXTS = [
    "Café crème brûlée — naïve façade, déjà vu!",
    "你好，世界！我们一起学习中文。",
    "Emoji 😀🎉👍🏽 and 🇫🇷 flags ❤️ plus 𝄞 (rare char).",
    "Mixed: straße 你好 😀 END tail",
]
REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def test_tokenizer_really_splits_characters() -> None:
    tok = tokenizer()
    ids = _encode(TEXTS[2])
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "test would not exercise split chars"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streaming_deltas_concatenate_to_full_decode(text: str, chunk: int) -> None:
    tok = tokenizer()
    ids = _encode(text)
    detok = IncrementalDetokenizer(tok, _encode("User: 你好 "), skip_special_tokens=True)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert all(REPLACEMENT not in d for d in deltas)
    deltas.append(detok.finish())
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    assert detok.num_output_tokens == len(ids)


def test_each_character_emitted_once_complete() -> None:
    tok = tokenizer()
    ids = _encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_prompt_context_and_prompt_cut_mid_character() -> None:
    tok = tokenizer()
    full = _encode("Say 你好 now")
    # Prompts ending mid-character: the output's first tokens alone decode to U+FFFD; the
    # stream must still equal decode(output ids).
    for cut in range(1, len(full)):
        prompt, output = full[:cut], full[cut:]
        detok = IncrementalDetokenizer(tok, prompt)
        text = "".join(detok.add_tokens([t]) for t in output) + detok.finish()
        assert text == tok.decode(output)


def test_special_tokens_skipped_or_kept() -> None:
    tok = tokenizer()
    eos = tok.eos_token_id
    im_start = tok.convert_tokens_to_string(["<|im_start|>"])
    ids = _encode("héllo") + [tok.convert_tokens_to_ids("<|im_start|>")] + _encode(" 世界") + [eos]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [eos, 5, 6], skip_special_tokens=skip)
        text = "".join(detok.add_tokens([t]) for t in ids) + detok.finish()
        assert text == tok.decode(ids, skip_special_tokens=skip)
    assert im_start not in tok.decode(ids, skip_special_tokens=True)


def test_truly_invalid_bytes_flushed_at_finish() -> None:
    tok = tokenizer()
    ids = _encode("😀")
    cut = ids[:-1]  # the emoji never completes
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add_tokens([t]) for t in cut)
    assert streamed == ""
    assert streamed + detok.finish() == tok.decode(cut)
    assert REPLACEMENT in tok.decode(cut)


class _CountingTokenizer:
    """Wraps the tokenizer and records how many ids each decode call gets."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, **kw) -> str:  # noqa: ANN001
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kw)


def test_decode_window_stays_small() -> None:
    counting = _CountingTokenizer(tokenizer())
    ids = _encode(" ".join(TEXTS) * 8)
    detok = IncrementalDetokenizer(counting, _encode("prompt " * 50))
    text = "".join(detok.add_tokens([t]) for t in ids) + detok.finish()
    assert text == tokenizer().decode(ids)
    assert len(ids) > 400 and max(counting.sizes) <= 10
    assert len(counting.sizes) <= 2 * len(ids) + 3


# ----------------------------------------------------------------------------- stop strings


def _stream(
    text_chunks: list[str], stop: list[str], include: bool = False
) -> tuple[list[str], str | None, str]:
    matcher = StopStringMatcher(stop, include)
    released: list[str] = []
    for chunk in text_chunks:
        check = matcher.add_text(chunk)
        released.append(check.text)
        if check.stop is not None:
            return released, check.stop, "".join(released)
    released.append(matcher.flush())
    return released, None, "".join(released)


def test_stop_string_spanning_tokens_trimmed() -> None:
    tok = tokenizer()
    ids = _encode(TEXTS[3])  # "... 😀 END tail"
    detok = IncrementalDetokenizer(tok, [])
    matcher = StopStringMatcher([" END"])
    streamed = []
    stop = None
    for t in ids:
        check = matcher.add_text(detok.add_tokens([t]))
        streamed.append(check.text)
        # Never a partial stop string on the wire.
        assert not "".join(streamed).endswith((" ", " E", " EN"))
        if check.stop:
            stop = check.stop
            break
    assert stop == " END"
    assert "".join(streamed) == "Mixed: straße 你好 😀"


def test_stop_string_kept_when_included_and_rest_dropped() -> None:
    released, stop, text = _stream(["ab", "c<", "/s", "> more"], ["</s>"], include=True)
    assert stop == "</s>" and text == "abc</s>"
    released, stop, text = _stream(["ab", "c<", "/s", "> more"], ["</s>"])
    assert stop == "</s>" and text == "abc"
    assert released == ["ab", "c", "", ""]  # "<" and "</s" held back


def test_stop_held_back_then_released_when_not_a_stop() -> None:
    released, stop, text = _stream(["hello E", "N", "Dless", " story"], ["END!"])
    assert stop is None and text == "hello ENDless story"
    assert released[:2] == ["hello ", ""]
    matcher = StopStringMatcher(["###"])
    assert matcher.add_text("x ##").text == "x " and matcher.held_text == "##"
    assert matcher.flush() == "##"


def test_stop_match_independent_of_chunking() -> None:
    stops = ["bc", "abcd", "xyz", "你好"]
    text = "qq ab abcd 你好 end"
    rng = random.Random(0)
    results = set()
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 6)))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        for include in (False, True):
            _, stop, out = _stream(chunks, stops, include)
            results.add((include, stop, out))
    # "bc" inside "abcd" completes first, whatever the chunking.
    assert results == {(False, "bc", "qq ab a"), (True, "bc", "qq ab abc")}


def test_no_stop_strings_passes_text_through() -> None:
    released, stop, text = _stream(["a", "b"], [])
    assert released == ["a", "b", ""] and stop is None
    matcher = StopStringMatcher("x")
    assert matcher.add_text("abx").stop == "x"
    assert matcher.add_text("more").text == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_text_decoder_matches_the_tokenizers_decode() -> None:
    """The fast path (the Rust backend called directly) renders what tokenizer.decode renders,
    special tokens skipped or kept, whole texts and every split of them."""
    from common.sampling.detokenizer import text_decoder

    tok = tokenizer()
    decode = text_decoder(tok)
    assert decode.__code__ is not text_decoder(object()).__code__  # this tokenizer takes the fast path
    special = tok.convert_tokens_to_ids("<|im_start|>")
    for text in TEXTS:
        ids = [special, *_encode(text), tok.eos_token_id]
        for cut in range(len(ids)):
            for skip in (True, False):
                assert decode(ids[cut:], skip) == tok.decode(ids[cut:], skip_special_tokens=skip,
                                                           clean_up_tokenization_spaces=False)


def test_text_decoder_keeps_a_subclass_s_own_decoding() -> None:
    """A tokenizer class that changes decoding is called through its decode()."""
    from common.sampling.detokenizer import text_decoder

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):  # noqa: ANN001, ANN003
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    tok = Shouting(tokenizer_object=tokenizer().backend_tokenizer, eos_token="<|endoftext|>")
    ids = _encode(TEXTS[0])
    assert text_decoder(tok)(ids, True) == tok.decode(ids, skip_special_tokens=True) == TEXTS[0].upper()
