"""The pure KV codec, layout check and transfer state machine (no protobuf)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.kv_transfer import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    IllegalKVTransitionError,
    KVChecksumError,
    KVChunkError,
    KVCompatibilityError,
    KVLayout,
    KVTransferState,
    KVTransferTracker,
    assemble_kv,
    chunk_tensor,
    check_compatible,
    plan_chunks,
    split_kv,
    write_chunk,
)

# The payload views are read-only by design; torch says so once per process.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_kv(num_layers=4, num_blocks=6, block_size=16, heads=2, head_dim=8, dtype=torch.float32, seed=0):
    # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_layers, 2, num_blocks, block_size, heads, head_dim), generator=g).to(dtype)


def test_plan_whole_layers_when_they_fit():
    # one layer of 6 blocks: 2 * 6 * 16 * 2 * 8 * 4 = 12288 bytes; 3 layers per 40000-byte piece
    spans = plan_chunks((8, 2, 6, 16, 2, 8), 4, 40_000)
    assert [(s.layer_start, s.layer_end, s.block_start, s.block_end) for s in spans] == [
        (0, 3, 0, 6), (3, 6, 0, 6), (6, 8, 0, 6),
    ]  # fmt: skip


def test_plan_splits_blocks_when_one_layer_is_too_big():
    # one block of one layer: 2048 bytes; 5 blocks per 10240-byte piece
    spans = plan_chunks((2, 2, 12, 16, 2, 8), 4, 10_240)
    assert [(s.layer_start, s.layer_end, s.block_start, s.block_end) for s in spans] == [
        (0, 1, 0, 5), (0, 1, 5, 10), (0, 1, 10, 12), (1, 2, 0, 5), (1, 2, 5, 10), (1, 2, 10, 12),
    ]  # fmt: skip


def test_plan_rejects_a_block_bigger_than_the_limit():
    with pytest.raises(ValueError, match="one block of one layer"):
        plan_chunks((1, 2, 1, 16, 2, 8), 4, 1000)
    with pytest.raises(ValueError, match="max_payload_bytes"):
        plan_chunks((1, 2, 1, 16, 2, 8), 4, 4 << 20)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_payload", [2048, 5_000, 1 << 20])
def test_round_trip_is_exact(dtype, max_payload):
    kv = make_kv(dtype=dtype)
    block_ids = [40, 3, 17, 8, 99, 1]
    chunks = split_kv(kv, block_ids, request_id="r1", max_payload_bytes=max_payload)
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(len(c.payload) <= max_payload for c in chunks)
    ids, back = assemble_kv(chunks)
    assert ids == block_ids
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


def test_encode_accepts_non_contiguous_views_and_numbers_across_prompt_chunks():
    full = make_kv(num_blocks=8)
    part = full[:, :, 2:6]  # a strided view, as a slice of a bigger gather would be
    first = split_kv(part[:, :, :2], [5, 6], request_id="r", is_final=False, max_payload_bytes=2048)
    second = split_kv(part[:, :, 2:], [7, 8], request_id="r", first_chunk_index=len(first), max_payload_bytes=2048)
    chunks = first + second
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assert not any(c.is_last for c in first) and second[-1].is_last
    ids, back = assemble_kv(chunks)
    assert ids == [5, 6, 7, 8] and torch.equal(back, part)


def test_chunk_tensor_views_the_payload_without_copy():
    chunk = split_kv(make_kv(), range(6), request_id="r")[0]
    t = chunk_tensor(chunk)
    assert t.shape == chunk.shape
    assert t.data_ptr() == chunk_tensor(chunk).data_ptr()  # both alias the payload


def test_write_chunk_scatters_into_the_cache_storage():
    kv = make_kv(dtype=torch.bfloat16)
    storage = torch.zeros((4, 2, 32, 16, 2, 8), dtype=torch.bfloat16)
    block_ids = [30, 2, 9, 4, 11, 0]
    for c in split_kv(kv, block_ids, request_id="r", max_payload_bytes=3000):
        write_chunk(storage, c)
    assert torch.equal(storage[:, :, block_ids], kv)
    untouched = [b for b in range(32) if b not in block_ids]
    assert not storage[:, :, untouched].any()


def test_write_chunk_rejects_out_of_range_blocks_and_wrong_block_shape():
    kv = make_kv(num_blocks=1)
    chunk = split_kv(kv, [40], request_id="r")[0]
    with pytest.raises(KVChunkError, match="out of range"):
        write_chunk(torch.zeros((4, 2, 8, 16, 2, 8)), chunk)
    with pytest.raises(KVChunkError, match="block shape"):
        write_chunk(torch.zeros((4, 2, 64, 32, 2, 8)), chunk)


def test_corrupt_payload_is_detected_before_use():
    chunk = split_kv(make_kv(), range(6), request_id="req-7", max_payload_bytes=4096)[2]
    bad = bytearray(chunk.payload)
    bad[100] ^= 0x01
    corrupt = dataclasses.replace(chunk, payload=bytes(bad))
    with pytest.raises(KVChecksumError, match="chunk 2 of request 'req-7': checksum mismatch"):
        chunk_tensor(corrupt)
    storage = torch.zeros((4, 2, 8, 16, 2, 8))
    with pytest.raises(KVChecksumError):
        write_chunk(storage, corrupt)
    assert not storage.any()  # nothing was written


def test_inconsistent_shape_is_rejected():
    chunk = split_kv(make_kv(), range(6), request_id="r")[0]
    with pytest.raises(KVChunkError, match="payload is"):
        chunk_tensor(dataclasses.replace(chunk, payload=chunk.payload[:-4], checksum=0), verify=False)
    with pytest.raises(KVChunkError, match="block ids"):
        chunk_tensor(dataclasses.replace(chunk, block_ids=(1, 2)), verify=False)


def test_empty_final_transfer_still_sends_a_last_piece():
    kv = make_kv(num_blocks=0)
    chunks = split_kv(kv, [], request_id="r")
    assert len(chunks) == 1 and chunks[0].is_last and chunks[0].payload == b""
    assert split_kv(kv, [], request_id="r", is_final=False) == []


def test_default_chunks_of_a_big_tensor_stay_under_the_limit():
    # 16 layers x 32 blocks x 16 tokens x 8 heads x 128 dim, bf16: 2 MiB per layer, 32 MiB in all
    kv = torch.zeros((16, 2, 32, 16, 8, 128), dtype=torch.bfloat16)
    chunks = split_kv(kv, range(32), request_id="big")
    assert len(chunks) == 32  # each layer in two block ranges of 16
    assert max(len(c.payload) for c in chunks) <= DEFAULT_MAX_PAYLOAD_BYTES


# --------------------------------------------------------------------------- compatibility

LAYOUT = KVLayout("tandem-small", "LlamaForCausalLM", torch.bfloat16, block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)


def test_equal_layouts_are_compatible_and_hash_alike():
    same = KVLayout("tandem-small", "LlamaForCausalLM", "bfloat16", 16, 4, 2, 64)
    check_compatible(LAYOUT, same, remote_hash=same.compatibility_hash())
    assert LAYOUT.compatibility_hash() == same.compatibility_hash()
    assert LAYOUT.dtype == "bfloat16"


def test_mismatch_names_every_field():
    other = dataclasses.replace(LAYOUT, block_size=32, dtype="float16")
    assert other.compatibility_hash() != LAYOUT.compatibility_hash()
    with pytest.raises(KVCompatibilityError) as err:
        check_compatible(LAYOUT, other)
    assert err.value.fields == ["dtype", "block_size"]
    assert "dtype: local 'bfloat16' != remote 'float16'" in str(err.value)
    assert "block_size: local 16 != remote 32" in str(err.value)


def test_same_fields_different_claimed_hash_is_incompatible():
    with pytest.raises(KVCompatibilityError, match="compatibility_hash"):
        check_compatible(LAYOUT, LAYOUT, remote_hash="0000000000000000")


def test_layout_validates_its_fields():
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(LAYOUT, block_size=0)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        dataclasses.replace(LAYOUT, dtype="int8")


# --------------------------------------------------------------------------- state machine


def test_happy_path_and_terminal_states():
    t = KVTransferTracker("r")
    assert t.state is KVTransferState.BOOTSTRAPPING
    for s in (KVTransferState.WAITING, KVTransferState.TRANSFERRING, KVTransferState.SUCCESS):
        t.advance(s)
    assert t.is_terminal and t.state is KVTransferState.SUCCESS
    assert t.fail("late abort") is False and t.state is KVTransferState.SUCCESS


@pytest.mark.parametrize(
    "path, illegal",
    [
        ((), KVTransferState.TRANSFERRING),
        ((), KVTransferState.SUCCESS),
        ((KVTransferState.WAITING,), KVTransferState.SUCCESS),
        ((KVTransferState.WAITING,), KVTransferState.BOOTSTRAPPING),
        ((KVTransferState.WAITING, KVTransferState.TRANSFERRING), KVTransferState.WAITING),
        ((KVTransferState.WAITING, KVTransferState.TRANSFERRING, KVTransferState.SUCCESS), KVTransferState.TRANSFERRING),
    ],
)
def test_illegal_transitions_raise(path, illegal):
    t = KVTransferTracker("r")
    for s in path:
        t.advance(s)
    with pytest.raises(IllegalKVTransitionError, match=f"-> {illegal.name} is not allowed"):
        t.advance(illegal)


def test_fail_from_any_live_state_once():
    t = KVTransferTracker("r")
    t.advance(KVTransferState.WAITING)
    assert t.fail("checksum mismatch at chunk 3")
    assert t.state is KVTransferState.FAILED and t.reason == "checksum mismatch at chunk 3"
    assert not t.fail("again") and t.reason == "checksum mismatch at chunk 3"
    with pytest.raises(IllegalKVTransitionError):
        t.advance(KVTransferState.TRANSFERRING)
    with pytest.raises(IllegalKVTransitionError, match="fail"):
        KVTransferTracker("x").advance(KVTransferState.FAILED)
