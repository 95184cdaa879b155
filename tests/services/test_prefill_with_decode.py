"""Prefill worker -> the real decode service (services/decode): Reserve, Generate(REMOTE), Prefill.

The gateway's choreography of docs/cluster.md done by hand, over real gRPC: the decode stream's
tokens equal transformers and decode's own local prefill; both pools end at baseline.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.decode.server import serve as serve_decode
from services.prefill.main import serve as serve_prefill
from services.runtime.kv_wire import sampling_params_from_dict
from tests.engine.engine_helpers import hf_greedy, random_prompts
from tests.services.decode_helpers import MODEL_ID, collect, decode_request, decode_settings
from tests.services.prefill_helpers import prefill_settings
from tests.services.test_prefill_transfer import wait_idle
from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

MAX_TOKENS = 5


def test_prefill_into_the_decode_service_matches_local_and_transformers(tiny_model):
    prompts = random_prompts([90, 41], vocab=512, seed=9)

    async def main():
        decode = await serve_decode(decode_settings(tiny_model))
        prefill = await serve_prefill(prefill_settings(tiny_model, budget=32, model_id=MODEL_ID), grpc_port=0)
        d_chan, p_chan = grpc.aio.insecure_channel(decode.address), grpc.aio.insecure_channel(prefill.address)
        decode_stub, prefill_stub = decode_pb2_grpc.DecodeStub(d_chan), prefill_pb2_grpc.PrefillStub(p_chan)
        try:
            async def remote(rid, prompt):
                r = await decode_stub.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt))
                assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
                tokens = asyncio.ensure_future(collect(decode_stub.Generate(decode_request(rid, prompt, MAX_TOKENS, remote=True))))
                header = prefill_pb2.PrefillHeader(
                    decode_address=r.kv_transfer_address, dest_block_ids=r.dest_block_ids,
                    num_skip_tokens=r.num_cached_tokens, num_prompt_tokens=len(prompt),
                    sampling=sampling_params_from_dict({"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}),
                    compatibility_hash=r.compatibility_hash, lease_deadline_unix_ms=r.lease_deadline_unix_ms,
                )  # fmt: skip
                chunks = [prefill_pb2.PrefillChunk(request_id=rid, chunk_index=i, token_ids=prompt[s:s + 32],
                                                   is_last=s + 32 >= len(prompt), header=header if i == 0 else None)
                          for i, s in enumerate(range(0, len(prompt), 32))]  # fmt: skip
                progress = [m async for m in prefill_stub.Prefill(iter(chunks))]
                assert progress[-1].done
                return (await tokens).tokens[0], progress[-1].first_tokens[0].token_id

            remote_out = await asyncio.gather(*(remote(f"r{i}", p) for i, p in enumerate(prompts)))
            local_out = [
                (await collect(decode_stub.Generate(decode_request(f"l{i}", p, MAX_TOKENS, remote=False)))).tokens[0]
                for i, p in enumerate(prompts)
            ]
            await wait_idle(prefill.engine_loop)
            return remote_out, local_out
        finally:
            await d_chan.close()
            await p_chan.close()
            await prefill.stop()
            await decode.stop()

    remote_out, local_out = asyncio.run(main())
    expected = hf_greedy(tiny_model, prompts, MAX_TOKENS)
    assert [tokens for tokens, _ in remote_out] == expected
    assert [first for _, first in remote_out] == [e[0] for e in expected], "prefill sampled token 0"
    assert local_out == expected
