"""The protobuf edge of KV transfer and sampling: domain objects <-> tandem.v1 messages.

Everything here is a field-by-field conversion; the logic (chunking, checksums, compatibility)
lives in `common/kv_transfer/`, which never sees protobuf. Services call these at their boundary:

    prefill:  for chunk in encode_kv_chunks(...): yield chunk_to_proto(chunk, compatibility_hash=h)
    decode:   chunk = chunk_from_proto(msg); write_chunk(cache.storage, chunk)   # verifies checksum
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from common.kv_transfer.codec import KVChunkData
from common.kv_transfer.compat import KVCompatibilityError, KVLayout, check_compatible
from tandem.v1 import common_pb2, kv_transfer_pb2

# --------------------------------------------------------------------------- KV pieces


def chunk_to_proto(
    chunk: KVChunkData,
    *,
    compatibility_hash: str = "",
    first_tokens: Iterable[common_pb2.TokenLogprob] = (),
    prefill_cached_tokens: int = 0,
) -> kv_transfer_pb2.KVChunk:
    """A codec piece as a KVChunk. first_tokens / prefill_cached_tokens belong on the last piece only."""
    msg = kv_transfer_pb2.KVChunk(
        request_id=chunk.request_id,
        chunk_index=chunk.chunk_index,
        block_ids=chunk.block_ids,
        layer_start=chunk.layer_start,
        layer_end=chunk.layer_end,
        dtype=chunk.dtype,
        shape=chunk.shape,
        payload=chunk.payload,
        checksum=chunk.checksum,
        is_last=chunk.is_last,
        compatibility_hash=compatibility_hash,
        prefill_cached_tokens=prefill_cached_tokens,
    )
    first = list(first_tokens)
    if first:
        if not chunk.is_last:
            raise ValueError(f"KV chunk {chunk.chunk_index}: first_tokens belong on the last piece only")
        msg.first_tokens.extend(first)
    return msg


def chunk_from_proto(msg: kv_transfer_pb2.KVChunk) -> KVChunkData:
    """A KVChunk as a codec piece. The payload is the message's bytes object itself (no copy);
    nothing is verified here: write_chunk / chunk_tensor check the checksum and shape."""
    return KVChunkData(
        request_id=msg.request_id,
        chunk_index=msg.chunk_index,
        block_ids=tuple(msg.block_ids),
        layer_start=msg.layer_start,
        layer_end=msg.layer_end,
        dtype=msg.dtype,
        shape=tuple(msg.shape),
        payload=msg.payload,
        checksum=msg.checksum,
        is_last=msg.is_last,
    )


# --------------------------------------------------------------------------- layout / handshake


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        model_id=layout.model_id,
        architecture=layout.architecture,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layout=layout.layout,
        protocol_version=layout.protocol_version,
        compatibility_hash=layout.compatibility_hash(),
    )


def layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    """The layout a peer sent (its claimed hash stays in msg.compatibility_hash). Raises
    ValueError naming the field if the message is not a valid layout (e.g. block_size 0)."""
    return KVLayout(
        model_id=msg.model_id,
        architecture=msg.architecture,
        dtype=msg.dtype,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        layout=msg.layout,
        protocol_version=msg.protocol_version,
    )


def handshake_response(
    local: KVLayout, request: kv_transfer_pb2.HandshakeRequest, max_payload_bytes: int = 0
) -> kv_transfer_pb2.HandshakeResponse:
    """Decode's answer to a Handshake: compatible, or the reason naming every mismatched field."""
    response = kv_transfer_pb2.HandshakeResponse(layout=layout_to_proto(local), max_payload_bytes=max_payload_bytes)
    try:
        remote = layout_from_proto(request.layout)
        check_compatible(local, remote, remote_hash=request.layout.compatibility_hash or None)
    except KVCompatibilityError as e:
        response.reason = str(e)
    except ValueError as e:  # the sender's layout is itself malformed
        response.reason = f"invalid KV layout from {request.sender_id or 'sender'}: {e}"
    else:
        response.compatible = True
    return response


# --------------------------------------------------------------------------- tokens


def token_logprob_to_proto(
    token_id: int, logprob: float = 0.0, top_logprobs: Sequence[tuple[int, float]] = ()
) -> common_pb2.TokenLogprob:
    """A sampled token (and its top alternatives as (token_id, logprob), most likely first)."""
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top_logprobs],
    )


def prompt_logprobs_to_proto(
    prompt_logprobs: Sequence[tuple[int, float, Sequence[tuple[int, float]]]] | None,
) -> list[common_pb2.TokenLogprob]:
    """The engine's prompt logprobs (token id, logprob, top) as TokenLogprob messages."""
    return [token_logprob_to_proto(t, lp, top) for t, lp, top in prompt_logprobs or ()]


# --------------------------------------------------------------------------- sampling params

# proto3 `optional` fields: present in the dict only when set on the wire.
_OPTIONAL_FIELDS = (
    "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "skip_special_tokens", "prompt_logprobs",
)  # fmt: skip
# Plain fields whose zero value is also the domain default: present only when non-zero.
_PLAIN_FIELDS = ("min_tokens", "ignore_eos", "include_stop_str_in_output")
_REPEATED_FIELDS = ("stop", "stop_token_ids")
_MAP_FIELDS = ("logit_bias",)  # token id -> value; a dict, or the domain's (id, value) pairs
SAMPLING_FIELDS: frozenset[str] = frozenset(_OPTIONAL_FIELDS + _PLAIN_FIELDS + _REPEATED_FIELDS + _MAP_FIELDS
                                            + ("grammar",))
# GrammarSpec.kind <-> tandem.v1.GrammarKind.
_GRAMMAR_KINDS = {"json_schema": 1, "json_object": 2, "regex": 3, "choice": 4, "grammar": 5, "structural_tag": 6}
_GRAMMAR_KIND_NAMES = {v: k for k, v in _GRAMMAR_KINDS.items()}


def sampling_params_to_dict(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields the sender set, by their OpenAI names, for `SamplingParams.from_dict`.

    Unset fields are left out so the domain defaults apply. max_tokens = 0 on the wire means
    "no limit" and comes out as None (note: from_dict reads None as "default"; build with
    SamplingParams(**d) when that distinction matters, or have the gateway always send a number).
    """
    d: dict[str, Any] = {}
    for name in _OPTIONAL_FIELDS:
        if msg.HasField(name):
            d[name] = getattr(msg, name)
    if d.get("max_tokens") == 0:
        d["max_tokens"] = None
    for name in _PLAIN_FIELDS:
        value = getattr(msg, name)
        if value:
            d[name] = value
    for name in _REPEATED_FIELDS:
        values = list(getattr(msg, name))
        if values:
            d[name] = values
    for name in _MAP_FIELDS:
        entries = getattr(msg, name)
        if entries:
            d[name] = dict(entries)
    if msg.HasField("grammar"):
        g = msg.grammar
        # An unknown kind becomes "" so the domain GrammarSpec rejects it by name.
        d["grammar"] = {"kind": _GRAMMAR_KIND_NAMES.get(g.kind, ""), "value": g.value, "source": g.source}
    return d


def sampling_params_from_dict(d: Mapping[str, Any], *, strict: bool = True) -> common_pb2.SamplingParams:
    """A SamplingParams message from OpenAI-named fields (a request body's, or
    dataclasses.asdict(params)). None means unset, except max_tokens=None ("no limit") -> 0.

    strict: unknown keys raise ValueError naming them; strict=False drops them. Range checks are
    the domain SamplingParams' job; values protobuf cannot hold (negative n, ...) raise ValueError
    naming the field.
    """
    unknown = sorted(set(d) - SAMPLING_FIELDS)
    if unknown and strict:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    msg = common_pb2.SamplingParams()
    for name, value in d.items():
        if name not in SAMPLING_FIELDS:
            continue
        if value is None:
            if name == "max_tokens":
                msg.max_tokens = 0
            continue
        try:
            if name == "stop":
                msg.stop.extend([value] if isinstance(value, str) else list(value))
            elif name == "stop_token_ids":
                msg.stop_token_ids.extend(int(t) for t in value)
            elif name in _MAP_FIELDS:
                items = value.items() if isinstance(value, Mapping) else value
                getattr(msg, name).update({int(k): float(v) for k, v in items})
            elif name == "grammar":
                g = value if isinstance(value, Mapping) else value.to_dict()  # a dict or a GrammarSpec
                msg.grammar.kind = _GRAMMAR_KINDS.get(g.get("kind"), 0)
                msg.grammar.value = g.get("value") or ""
                msg.grammar.source = g.get("source") or ""
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: cannot be sent as {value!r} ({e})") from e
    return msg
