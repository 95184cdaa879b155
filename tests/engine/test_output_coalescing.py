"""coalesce: what a consumer that fell behind merges (pure logic, no engine)."""

from __future__ import annotations

from common.engine.outputs import CompletionOutput, coalesce


def out(rid: str, index: int, tokens: list[int], done_before: int, finished: bool = False,
        prompt_logprobs=None) -> CompletionOutput:  # fmt: skip
    so_far = list(range(100, 100 + done_before)) + tokens
    return CompletionOutput(
        request_id=rid, index=index, new_token_ids=tokens, new_logprobs=[(-0.5, None)] * len(tokens),
        text_delta="".join(f"<{t}>" for t in tokens), finished=finished, finish_reason="length" if finished else None,
        stop_reason=None, num_prompt_tokens=7, num_cached_tokens=3, token_ids=so_far, prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def test_a_choices_outputs_merge_in_order_and_keep_the_finish():
    a = out("r", 0, [1], 0, prompt_logprobs=[(5, -1.0, [])])
    b, c = out("r", 0, [2, 3], 1), out("r", 0, [4], 3, finished=True)
    (merged,) = coalesce([a, b, c])
    assert merged.new_token_ids == [1, 2, 3, 4] and merged.token_ids == c.token_ids
    assert merged.text_delta == "<1><2><3><4>" and len(merged.new_logprobs) == 4
    assert merged.finished and merged.finish_reason == "length"
    assert merged.prompt_logprobs == [(5, -1.0, [])]  # the first output's, kept
    assert a.new_token_ids == [1]  # inputs untouched


def test_choices_merge_apart_and_other_items_split_runs():
    marker = object()
    a0, a1, b0, b1 = out("r", 0, [1], 0), out("r", 1, [9], 0), out("r", 0, [2], 1), out("r", 1, [8], 1)
    c0 = out("r", 0, [3], 2)
    merged = coalesce([a0, a1, b0, b1, marker, c0])
    assert [(m.index, m.new_token_ids) for m in merged[:2]] == [(0, [1, 2]), (1, [9, 8])]
    assert merged[2] is marker and merged[3] is c0  # nothing crosses a non-output item
    assert coalesce([out("x", 0, [1], 0), out("y", 0, [2], 0)])[1].request_id == "y"  # requests stay apart


def test_a_long_run_merges_into_one_output_per_choice():
    # A streaming interval's run of decode steps (25 steps, two choices interleaved) comes out as
    # one output per choice with every token in order, the last output's totals and finish.
    steps = [out("r", i % 2, [i], i // 2, finished=i >= 48) for i in range(50)]
    zero, one = coalesce(steps)
    assert zero.new_token_ids == list(range(0, 50, 2)) and one.new_token_ids == list(range(1, 50, 2))
    assert zero.token_ids == steps[-2].token_ids and one.finished and zero.finished
    assert zero.text_delta == "".join(f"<{t}>" for t in range(0, 50, 2)) and len(one.new_logprobs) == 25
