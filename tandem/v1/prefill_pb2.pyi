from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillHeader(_message.Message):
    __slots__ = ("decode_address", "dest_block_ids", "num_skip_tokens", "num_prompt_tokens", "sampling", "compatibility_hash", "lease_deadline_unix_ms")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_skip_tokens: int
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    compatibility_hash: str
    lease_deadline_unix_ms: int
    def __init__(self, decode_address: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., num_skip_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., compatibility_hash: _Optional[str] = ..., lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("request_id", "chunk_index", "token_ids", "is_last", "header")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    is_last: bool
    header: PrefillHeader
    def __init__(self, request_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., is_last: _Optional[bool] = ..., header: _Optional[_Union[PrefillHeader, _Mapping]] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("request_id", "chunk_index", "num_computed_tokens", "kv_bytes_sent", "done", "first_tokens", "num_cached_tokens", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_index: int
    num_computed_tokens: int
    kv_bytes_sent: int
    done: bool
    first_tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., done: _Optional[bool] = ..., first_tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillLoad(_message.Message):
    __slots__ = ("num_queued_tokens", "num_running", "num_free_blocks", "num_total_blocks", "num_transfers_in_flight", "draining", "kv_integrity_error")
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    num_queued_tokens: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_transfers_in_flight: int
    draining: bool
    kv_integrity_error: str
    def __init__(self, num_queued_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_transfers_in_flight: _Optional[int] = ..., draining: _Optional[bool] = ..., kv_integrity_error: _Optional[str] = ...) -> None: ...
