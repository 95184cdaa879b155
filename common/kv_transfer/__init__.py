"""KV transfer between engines: the wire codec, the layout compatibility check, the transfer state.

Pure: numpy/torch/xxhash only. The protobuf edge is `services/runtime/kv_wire.py`.
"""

from common.kv_transfer.codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_SAFE_PAYLOAD_BYTES,
    SUPPORTED_DTYPES,
    ChunkSpan,
    KVChecksumError,
    KVChunkData,
    KVChunkError,
    assemble_kv,
    chunk_tensor,
    dtype_name,
    encode_kv_chunks,
    payload_checksum,
    plan_chunks,
    split_kv,
    torch_dtype,
    validate_chunk,
    verify_checksum,
    write_chunk,
)
from common.kv_transfer.compat import (
    DEFAULT_LAYOUT,
    PROTOCOL_VERSION,
    KVCompatibilityError,
    KVLayout,
    check_compatible,
    mismatched_fields,
)
from common.kv_transfer.state import (
    IllegalKVTransitionError,
    KVTransferState,
    KVTransferTracker,
    can_transition,
)

__all__ = [
    "DEFAULT_LAYOUT",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_SAFE_PAYLOAD_BYTES",
    "PROTOCOL_VERSION",
    "SUPPORTED_DTYPES",
    "ChunkSpan",
    "IllegalKVTransitionError",
    "KVChecksumError",
    "KVChunkData",
    "KVChunkError",
    "KVCompatibilityError",
    "KVLayout",
    "KVTransferState",
    "KVTransferTracker",
    "assemble_kv",
    "can_transition",
    "check_compatible",
    "chunk_tensor",
    "dtype_name",
    "encode_kv_chunks",
    "mismatched_fields",
    "payload_checksum",
    "plan_chunks",
    "split_kv",
    "torch_dtype",
    "validate_chunk",
    "verify_checksum",
    "write_chunk",
]
