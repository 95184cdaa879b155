"""The protobuf edge: codec pieces, layouts and sampling params survive the wire exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.kv_transfer import KVChecksumError, KVLayout, assemble_kv, split_kv
from services.runtime.kv_wire import (
    chunk_from_proto,
    chunk_to_proto,
    handshake_response,
    layout_from_proto,
    layout_to_proto,
    sampling_params_from_dict,
    sampling_params_to_dict,
    token_logprob_to_proto,
)
from tandem.v1 import common_pb2, kv_transfer_pb2

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

GRPC_DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024


def over_the_wire(msg):
    """Serialize and parse, as gRPC would."""
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_proto_codec_round_trip_is_exact(dtype):
    g = torch.Generator().manual_seed(1)
    # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    kv = torch.randn((6, 2, 5, 16, 4, 32), generator=g).to(dtype)
    block_ids = [7, 70, 700, 3, 33]
    chunks = split_kv(kv, block_ids, request_id="rt", max_payload_bytes=16 << 10)
    assert len(chunks) > 1
    first = [token_logprob_to_proto(42, -0.25, [(42, -0.25), (7, -1.5)])]
    msgs = [
        over_the_wire(chunk_to_proto(c, compatibility_hash="abc", first_tokens=first if c.is_last else ()))
        for c in chunks
    ]
    back = [chunk_from_proto(m) for m in msgs]
    assert back == chunks  # every field, payload bytes and checksum included
    ids, kv_back = assemble_kv(back)
    assert ids == block_ids and torch.equal(kv_back.view(torch.uint8), kv.view(torch.uint8))
    assert msgs[-1].first_tokens[0].token_id == 42 and msgs[-1].first_tokens[0].top_logprobs[1].logprob == -1.5
    assert all(m.compatibility_hash == "abc" for m in msgs)


def test_first_tokens_only_on_the_last_piece():
    chunks = split_kv(torch.zeros((2, 2, 2, 16, 2, 8)), [0, 1], request_id="r", max_payload_bytes=2048)
    with pytest.raises(ValueError, match="last piece"):
        chunk_to_proto(chunks[0], first_tokens=[token_logprob_to_proto(1)])


def test_every_message_of_a_big_transfer_fits_grpc_default():
    # 8 layers x 96 blocks x 16 tokens x 8 heads x 128 dim, bf16 = 48 MiB (3 MiB per layer)
    kv = torch.zeros((8, 2, 96, 16, 8, 128), dtype=torch.bfloat16)
    for max_payload in (256 << 10, 1 << 20, (4 << 20) - (64 << 10)):
        sizes = [
            chunk_to_proto(c, compatibility_hash="f" * 16).ByteSize()
            for c in split_kv(kv, range(1000, 1096), request_id="x" * 64, max_payload_bytes=max_payload)
        ]
        assert max(sizes) < GRPC_DEFAULT_MAX_MESSAGE, (max_payload, max(sizes))
        assert max(sizes) <= max_payload + 1024


def test_corruption_on_the_wire_is_detected():
    chunk = split_kv(torch.ones((1, 2, 1, 16, 2, 8)), [5], request_id="r")[0]
    wire = bytearray(chunk_to_proto(chunk).SerializeToString())
    wire[-40] ^= 0xFF  # somewhere in the payload (the last fields are the checksum and is_last)
    corrupt = chunk_from_proto(kv_transfer_pb2.KVChunk.FromString(bytes(wire)))
    with pytest.raises(KVChecksumError):
        assemble_kv([corrupt])


LAYOUT = KVLayout("tandem-small", "Qwen2ForCausalLM", "float16", 16, 4, 2, 64)


def test_layout_round_trip_and_handshake():
    msg = over_the_wire(layout_to_proto(LAYOUT))
    assert msg.compatibility_hash == LAYOUT.compatibility_hash()
    assert layout_from_proto(msg) == LAYOUT
    ok = handshake_response(LAYOUT, kv_transfer_pb2.HandshakeRequest(layout=msg, sender_id="prefill-0"))
    assert ok.compatible and ok.reason == ""
    other = layout_to_proto(dataclasses.replace(LAYOUT, num_kv_heads=8))
    bad = handshake_response(LAYOUT, kv_transfer_pb2.HandshakeRequest(layout=other))
    assert not bad.compatible and "num_kv_heads: local 2 != remote 8" in bad.reason
    broken = handshake_response(LAYOUT, kv_transfer_pb2.HandshakeRequest(layout=common_pb2.KVLayout(), sender_id="p1"))
    assert not broken.compatible and "p1" in broken.reason


def test_sampling_params_dict_round_trip():
    d = {
        "n": 2, "max_tokens": 64, "min_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "min_p": 0.05, "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "repetition_penalty": 1.1, "stop": ["\n\n", "END"], "stop_token_ids": [2, 7], "ignore_eos": True,
        "logprobs": 5, "skip_special_tokens": False, "include_stop_str_in_output": True,
    }  # fmt: skip
    assert sampling_params_to_dict(over_the_wire(sampling_params_from_dict(d))) == d


def test_sampling_params_unset_differs_from_zero():
    msg = sampling_params_from_dict({"temperature": 0.0, "top_k": None, "stop": "x"})
    assert msg.HasField("temperature") and not msg.HasField("top_k")
    assert sampling_params_to_dict(msg) == {"temperature": 0.0, "stop": ["x"]}
    assert sampling_params_to_dict(common_pb2.SamplingParams()) == {}
    no_limit = sampling_params_from_dict({"max_tokens": None})
    assert no_limit.HasField("max_tokens") and sampling_params_to_dict(no_limit) == {"max_tokens": None}


def test_sampling_params_bad_input_names_the_field():
    with pytest.raises(ValueError, match="bogus"):
        sampling_params_from_dict({"bogus": 1})
    assert sampling_params_from_dict({"bogus": 1, "n": 3}, strict=False).n == 3
    with pytest.raises(ValueError, match="^n:"):
        sampling_params_from_dict({"n": -1})


def test_sampling_params_with_the_domain_dataclass():
    params_mod = pytest.importorskip("common.sampling.params")
    SamplingParams = params_mod.SamplingParams
    sp = SamplingParams(n=2, max_tokens=20, temperature=0.5, top_k=10, seed=7, stop=["a"], logprobs=2)
    msg = over_the_wire(sampling_params_from_dict(dataclasses.asdict(sp)))
    assert SamplingParams.from_dict(sampling_params_to_dict(msg)) == sp
    assert SamplingParams.from_dict(sampling_params_to_dict(common_pb2.SamplingParams())) == SamplingParams()
