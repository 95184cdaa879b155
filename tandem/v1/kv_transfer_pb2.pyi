from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushKVStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KV_STATUS_UNSPECIFIED: _ClassVar[PushKVStatus]
    PUSH_KV_STATUS_ACCEPTED: _ClassVar[PushKVStatus]
    PUSH_KV_STATUS_UNKNOWN_REQUEST: _ClassVar[PushKVStatus]
    PUSH_KV_STATUS_CHECKSUM_MISMATCH: _ClassVar[PushKVStatus]
    PUSH_KV_STATUS_INCOMPATIBLE: _ClassVar[PushKVStatus]
    PUSH_KV_STATUS_INVALID: _ClassVar[PushKVStatus]
    PUSH_KV_STATUS_INCOMPLETE: _ClassVar[PushKVStatus]
PUSH_KV_STATUS_UNSPECIFIED: PushKVStatus
PUSH_KV_STATUS_ACCEPTED: PushKVStatus
PUSH_KV_STATUS_UNKNOWN_REQUEST: PushKVStatus
PUSH_KV_STATUS_CHECKSUM_MISMATCH: PushKVStatus
PUSH_KV_STATUS_INCOMPATIBLE: PushKVStatus
PUSH_KV_STATUS_INVALID: PushKVStatus
PUSH_KV_STATUS_INCOMPLETE: PushKVStatus

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "sender_id")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.KVLayout
    sender_id: str
    def __init__(self, layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., sender_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("compatible", "reason", "layout", "max_payload_bytes")
    COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    compatible: bool
    reason: str
    layout: _common_pb2.KVLayout
    max_payload_bytes: int
    def __init__(self, compatible: _Optional[bool] = ..., reason: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., max_payload_bytes: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "chunk_index", "block_ids", "layer_start", "layer_end", "dtype", "shape", "payload", "checksum", "is_last", "compatibility_hash", "first_tokens", "prefill_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    checksum: int
    is_last: bool
    compatibility_hash: str
    first_tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prefill_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., is_last: _Optional[bool] = ..., compatibility_hash: _Optional[str] = ..., first_tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("request_id", "status", "reason", "bytes_received", "num_chunks_received", "rejected_chunk_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: PushKVStatus
    reason: str
    bytes_received: int
    num_chunks_received: int
    rejected_chunk_index: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[PushKVStatus, str]] = ..., reason: _Optional[str] = ..., bytes_received: _Optional[int] = ..., num_chunks_received: _Optional[int] = ..., rejected_chunk_index: _Optional[int] = ...) -> None: ...
