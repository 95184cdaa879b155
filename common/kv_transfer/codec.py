"""KV blocks <-> wire pieces: the pure codec under the KVTransfer service (no protobuf, no sockets).

Prefill gathers the blocks of one prompt chunk from its paged cache into one tensor

    kv  [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]

and `encode_kv_chunks` cuts it into pieces whose payload stays under a byte limit (default
1 MiB: on loopback 256 KiB-1 MiB protobuf messages stream at 250-600 MiB/s, single 4 MiB ones at
60-90 MiB/s, and gRPC refuses messages over 4 MiB by default):

    layers ->  0   1   2   3   4   5 ...            one layer too big for a piece:
    blocks  +-------+-------+-------+               layer 0: blocks [0, 40) [40, 80) [80, 97)
      all   | piece | piece | piece |               layer 1: blocks [0, 40) [40, 80) [80, 97)
            +-------+-------+-------+               ...
            (whole layer ranges)                    (one layer, a block range per piece)

Each piece is addressed by destination block ids and a layer range, so decode writes it straight
into its own cache (`write_chunk`) with no reassembly buffer, in any order.

Bytes go through a numpy view of the tensor (bfloat16 as uint16, which numpy lacks): one copy
into the payload, never `bytes(t.untyped_storage())` (that copies the whole storage, not the
view). Decoding wraps the payload with `torch.frombuffer`, no copy. The wire is little-endian.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
# gRPC's default message limit is 4 MiB; keep 64 KiB for the piece's other fields.
MAX_SAFE_PAYLOAD_BYTES = (4 << 20) - (64 << 10)
# Block ids cost up to 5 bytes each on the wire; with tiny blocks they could dominate a message.
MAX_BLOCKS_PER_CHUNK = 4096

# Wire dtype name -> (torch dtype, numpy dtype of the same width used to get at the bytes).
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(_DTYPES)

# torch.frombuffer warns on read-only buffers (protobuf bytes are immutable). The tensors we make
# from payloads are only ever read (copied into the cache), so silence it for this module only.
warnings.filterwarnings(
    "ignore", message=r"The given buffer is not writable", category=UserWarning, module=__name__
)


class KVChecksumError(ValueError):
    """A piece's payload does not hash to its checksum: it was corrupted and must not be used."""

    def __init__(self, request_id: str, chunk_index: int, expected: int, actual: int) -> None:
        super().__init__(
            f"KV chunk {chunk_index} of request {request_id!r}: checksum mismatch "
            f"(sent {expected:#018x}, payload hashes to {actual:#018x})"
        )
        self.request_id = request_id
        self.chunk_index = chunk_index


class KVChunkError(ValueError):
    """A piece is malformed: unknown dtype, inconsistent shape / layer range / block ids / size."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """The wire name of a KV dtype: torch.bfloat16 / "torch.bfloat16" / "bfloat16" -> "bfloat16"."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise KVChunkError(f"unsupported KV dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name."""
    return _DTYPES[dtype_name(name)][0]


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    """xxh3-64 (seed 0) of the payload, as an unsigned 64-bit int (fits protobuf uint64)."""
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class KVChunkData:
    """One wire piece: the KV of layers [layer_start, layer_end) for the blocks `block_ids`."""

    request_id: str
    chunk_index: int
    """0, 1, 2, ... over all pieces of the request, across prompt chunks."""
    block_ids: tuple[int, ...]
    """Destination block ids on the receiver, in payload order."""
    layer_start: int
    layer_end: int
    """Exclusive."""
    dtype: str
    """Wire dtype name ("float32", "float16", "bfloat16")."""
    shape: tuple[int, ...]
    """[layer_end - layer_start, 2, len(block_ids), block_size, num_kv_heads, head_dim]."""
    payload: bytes
    checksum: int
    """payload_checksum(payload)."""
    is_last: bool
    """The request's final piece."""

    @property
    def num_bytes(self) -> int:
        return len(self.payload)


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Where one piece sits in the gathered tensor: layers [layer_start, layer_end), blocks [block_start, block_end)."""

    layer_start: int
    layer_end: int
    block_start: int
    block_end: int


def plan_chunks(
    shape: Sequence[int], itemsize: int, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> list[ChunkSpan]:
    """Cuts a [L, 2, B, block_size, heads, dim] tensor into spans of at most max_payload_bytes.

    Whole layer ranges when one layer of all blocks fits, otherwise one layer per span and as
    many blocks as fit. Raises ValueError if even one block of one layer does not fit.
    """
    if len(shape) != 6 or shape[1] != 2:
        raise KVChunkError(f"KV tensor must be [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], got {tuple(shape)}")
    if not 0 < max_payload_bytes <= MAX_SAFE_PAYLOAD_BYTES:
        raise ValueError(f"max_payload_bytes must be in (0, {MAX_SAFE_PAYLOAD_BYTES}], got {max_payload_bytes}")
    num_layers, _, num_blocks, block_size, heads, head_dim = (int(s) for s in shape)
    bytes_per_block_layer = 2 * block_size * heads * head_dim * itemsize
    if bytes_per_block_layer > max_payload_bytes:
        raise ValueError(
            f"one block of one layer is {bytes_per_block_layer} bytes, over max_payload_bytes={max_payload_bytes}"
        )
    if num_blocks == 0:
        return []
    if num_blocks <= MAX_BLOCKS_PER_CHUNK and bytes_per_block_layer * num_blocks <= max_payload_bytes:
        layers_per_span = max_payload_bytes // (bytes_per_block_layer * num_blocks)
        return [
            ChunkSpan(l0, min(l0 + layers_per_span, num_layers), 0, num_blocks)
            for l0 in range(0, num_layers, layers_per_span)
        ]
    blocks_per_span = min(max_payload_bytes // bytes_per_block_layer, MAX_BLOCKS_PER_CHUNK)
    return [
        ChunkSpan(layer, layer + 1, b0, min(b0 + blocks_per_span, num_blocks))
        for layer in range(num_layers)
        for b0 in range(0, num_blocks, blocks_per_span)
    ]


def _tensor_bytes(t: torch.Tensor, wire: np.dtype) -> bytes:
    # Same-width integer view for bf16 (numpy has no bfloat16); tobytes copies a strided view
    # in C order in one pass, so block-range slices need no .contiguous() first.
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy().view(wire).tobytes()


def encode_kv_chunks(
    kv: torch.Tensor,
    block_ids: Sequence[int],
    *,
    request_id: str,
    first_chunk_index: int = 0,
    is_final: bool = True,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> Iterator[KVChunkData]:
    """Yields the wire pieces of `kv`, lazily (so the caller can send piece i while encoding i+1).

    kv: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim] on any device (moved to
    the host once). block_ids: the destination block of each kv[:, :, i]. Pieces are numbered from
    first_chunk_index; the last one has is_last = is_final. A final call with no blocks yields one
    empty piece so the receiver still learns the transfer is complete.
    """
    if sys.byteorder != "little":  # pragma: no cover - every platform we run on
        raise RuntimeError("the KV wire format is little-endian; big-endian hosts are not supported")
    name = dtype_name(kv.dtype)
    wire = _DTYPES[name][1]
    if kv.dim() != 6 or kv.shape[2] != len(block_ids):
        raise KVChunkError(
            f"kv shape {tuple(kv.shape)} does not match {len(block_ids)} block ids "
            "(expected [num_layers, 2, num_blocks, block_size, kv_heads, head_dim])"
        )
    kv = kv.detach().cpu()
    ids = tuple(int(b) for b in block_ids)
    spans = plan_chunks(kv.shape, kv.element_size(), max_payload_bytes)
    if not spans:
        if is_final:
            shape = (kv.shape[0], 2, 0, *kv.shape[3:])
            yield KVChunkData(request_id, first_chunk_index, (), 0, kv.shape[0], name, tuple(shape),
                              b"", payload_checksum(b""), True)  # fmt: skip
        return
    for i, span in enumerate(spans):
        # [layer_end - layer_start, 2, block_end - block_start, block_size, kv_heads, head_dim]
        piece = kv[span.layer_start : span.layer_end, :, span.block_start : span.block_end]
        payload = _tensor_bytes(piece, wire)
        yield KVChunkData(
            request_id=request_id,
            chunk_index=first_chunk_index + i,
            block_ids=ids[span.block_start : span.block_end],
            layer_start=span.layer_start,
            layer_end=span.layer_end,
            dtype=name,
            shape=tuple(piece.shape),
            payload=payload,
            checksum=payload_checksum(payload),
            is_last=is_final and i == len(spans) - 1,
        )


def split_kv(
    kv: torch.Tensor,
    block_ids: Sequence[int],
    *,
    request_id: str,
    first_chunk_index: int = 0,
    is_final: bool = True,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[KVChunkData]:
    """encode_kv_chunks as a list."""
    return list(
        encode_kv_chunks(kv, block_ids, request_id=request_id, first_chunk_index=first_chunk_index,
                         is_final=is_final, max_payload_bytes=max_payload_bytes)  # fmt: skip
    )


def verify_checksum(chunk: KVChunkData) -> None:
    """Raises KVChecksumError if the payload does not hash to chunk.checksum."""
    actual = payload_checksum(chunk.payload)
    if actual != chunk.checksum:
        raise KVChecksumError(chunk.request_id, chunk.chunk_index, chunk.checksum, actual)


def validate_chunk(chunk: KVChunkData, num_layers: int | None = None) -> None:
    """Raises KVChunkError naming the inconsistency between shape, layer range, block ids and size."""
    where = f"KV chunk {chunk.chunk_index} of request {chunk.request_id!r}"
    dtype_name(chunk.dtype)
    shape = chunk.shape
    if len(shape) != 6 or shape[1] != 2:
        raise KVChunkError(f"{where}: shape {shape} is not [layers, 2, blocks, block_size, kv_heads, head_dim]")
    if not 0 <= chunk.layer_start < chunk.layer_end or (num_layers is not None and chunk.layer_end > num_layers):
        raise KVChunkError(f"{where}: layer range [{chunk.layer_start}, {chunk.layer_end}) out of bounds (num_layers={num_layers})")
    if shape[0] != chunk.layer_end - chunk.layer_start:
        raise KVChunkError(f"{where}: shape[0]={shape[0]} != layer_end - layer_start = {chunk.layer_end - chunk.layer_start}")
    if shape[2] != len(chunk.block_ids):
        raise KVChunkError(f"{where}: shape[2]={shape[2]} != {len(chunk.block_ids)} block ids")
    expected = math.prod(shape) * _DTYPES[chunk.dtype][1].itemsize
    if expected != len(chunk.payload):
        raise KVChunkError(f"{where}: payload is {len(chunk.payload)} bytes, shape {shape} {chunk.dtype} needs {expected}")


def chunk_tensor(chunk: KVChunkData, *, verify: bool = True) -> torch.Tensor:
    """The piece as a tensor of chunk.shape, viewing the payload without a copy.

    The result aliases the (immutable) payload: read it (e.g. copy it into the cache), never write
    it. verify=True checks the checksum and the shape first.
    """
    if verify:
        verify_checksum(chunk)
    validate_chunk(chunk)
    dtype = _DTYPES[chunk.dtype][0]
    if not chunk.payload:
        return torch.empty(chunk.shape, dtype=dtype)
    return torch.frombuffer(chunk.payload, dtype=dtype).view(chunk.shape)


def write_chunk(storage: torch.Tensor, chunk: KVChunkData, *, verify: bool = True) -> None:
    """Writes a piece into a paged cache's storage [num_layers, 2, num_blocks, block_size, kv_heads, head_dim].

    Checks the checksum (before touching storage), the layer range and block ids against the
    storage; copies host -> storage device in one index_copy_ per piece.
    """
    data = chunk_tensor(chunk, verify=verify)  # [layers, 2, n, block_size, kv_heads, head_dim]
    validate_chunk(chunk, num_layers=storage.shape[0])
    if tuple(data.shape[3:]) != tuple(storage.shape[3:]) or data.dtype != storage.dtype:
        raise KVChunkError(
            f"KV chunk {chunk.chunk_index}: block shape {tuple(data.shape[3:])} {chunk.dtype} does not match "
            f"the cache's {tuple(storage.shape[3:])} {dtype_name(storage.dtype)}"
        )
    if not chunk.block_ids:
        return
    index = torch.tensor(chunk.block_ids, dtype=torch.int64)
    if int(index.min()) < 0 or int(index.max()) >= storage.shape[2]:
        raise KVChunkError(f"KV chunk {chunk.chunk_index}: block ids out of range [0, {storage.shape[2]}): {list(chunk.block_ids)}")
    target = storage[chunk.layer_start : chunk.layer_end]
    target.index_copy_(2, index.to(storage.device), data.to(storage.device))


def assemble_kv(chunks: Iterable[KVChunkData], *, verify: bool = True) -> tuple[list[int], torch.Tensor]:
    """Rebuilds the gathered tensor from pieces (tests, benchmarks, debugging).

    Returns (block_ids in first-seen order, kv [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]).
    Every (layer, block) must be covered exactly once.
    """
    chunks = sorted(chunks, key=lambda c: c.chunk_index)
    if not chunks:
        raise KVChunkError("no chunks to assemble")
    block_ids: list[int] = []
    position: dict[int, int] = {}
    for c in chunks:
        for b in c.block_ids:
            if b not in position:
                position[b] = len(block_ids)
                block_ids.append(b)
    num_layers = max(c.layer_end for c in chunks)
    first = chunks[0]
    kv = torch.empty((num_layers, 2, len(block_ids), *first.shape[3:]), dtype=torch_dtype(first.dtype))
    covered = torch.zeros((num_layers, len(block_ids)), dtype=torch.int32)
    for c in chunks:
        data = chunk_tensor(c, verify=verify)
        index = torch.tensor([position[b] for b in c.block_ids], dtype=torch.int64)
        kv[c.layer_start : c.layer_end].index_copy_(2, index, data)
        covered[c.layer_start : c.layer_end, index] += 1
    if not bool((covered == 1).all()):
        raise KVChunkError("chunks do not cover every (layer, block) exactly once")
    return block_ids, kv
