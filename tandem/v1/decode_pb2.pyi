from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVE_STATUS_UNSPECIFIED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_RESERVED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_NO_CAPACITY: _ClassVar[ReserveStatus]
    RESERVE_STATUS_TOO_LONG: _ClassVar[ReserveStatus]
    RESERVE_STATUS_INCOMPATIBLE: _ClassVar[ReserveStatus]
    RESERVE_STATUS_DRAINING: _ClassVar[ReserveStatus]

class KVSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_SOURCE_UNSPECIFIED: _ClassVar[KVSource]
    KV_SOURCE_LOCAL: _ClassVar[KVSource]
    KV_SOURCE_REMOTE: _ClassVar[KVSource]

class KVFailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FAILURE_POLICY_UNSPECIFIED: _ClassVar[KVFailurePolicy]
    KV_FAILURE_POLICY_RECOMPUTE: _ClassVar[KVFailurePolicy]
    KV_FAILURE_POLICY_FAIL: _ClassVar[KVFailurePolicy]
RESERVE_STATUS_UNSPECIFIED: ReserveStatus
RESERVE_STATUS_RESERVED: ReserveStatus
RESERVE_STATUS_NO_CAPACITY: ReserveStatus
RESERVE_STATUS_TOO_LONG: ReserveStatus
RESERVE_STATUS_INCOMPATIBLE: ReserveStatus
RESERVE_STATUS_DRAINING: ReserveStatus
KV_SOURCE_UNSPECIFIED: KVSource
KV_SOURCE_LOCAL: KVSource
KV_SOURCE_REMOTE: KVSource
KV_FAILURE_POLICY_UNSPECIFIED: KVFailurePolicy
KV_FAILURE_POLICY_RECOMPUTE: KVFailurePolicy
KV_FAILURE_POLICY_FAIL: KVFailurePolicy

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "lease_ms", "compatibility_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    compatibility_hash: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ..., compatibility_hash: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("status", "message", "num_cached_tokens", "dest_block_ids", "block_size", "lease_deadline_unix_ms", "kv_transfer_address", "compatibility_hash")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    status: ReserveStatus
    message: str
    num_cached_tokens: int
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lease_deadline_unix_ms: int
    kv_transfer_address: str
    compatibility_hash: str
    def __init__(self, status: _Optional[_Union[ReserveStatus, str]] = ..., message: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., kv_transfer_address: _Optional[str] = ..., compatibility_hash: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_source", "kv_failure_policy", "disable_speculative_decoding", "num_resumed_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_source: KVSource
    kv_failure_policy: KVFailurePolicy
    disable_speculative_decoding: bool
    num_resumed_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_source: _Optional[_Union[KVSource, str]] = ..., kv_failure_policy: _Optional[_Union[KVFailurePolicy, str]] = ..., disable_speculative_decoding: _Optional[bool] = ..., num_resumed_output_tokens: _Optional[int] = ...) -> None: ...

class DecodeChoiceDelta(_message.Message):
    __slots__ = ("choice_index", "output_index", "token_ids", "logprobs", "finish_reason", "stop_token_id")
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    choice_index: int
    output_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    def __init__(self, choice_index: _Optional[int] = ..., output_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "choices", "usage", "kv_source_used", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_USED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[DecodeChoiceDelta]
    usage: _common_pb2.Usage
    kv_source_used: KVSource
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[DecodeChoiceDelta, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., kv_source_used: _Optional[_Union[KVSource, str]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeLoad(_message.Message):
    __slots__ = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "num_reserved_blocks", "num_waiting_for_kv", "block_size", "draining", "kv_integrity_error")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_reserved_blocks: int
    num_waiting_for_kv: int
    block_size: int
    draining: bool
    kv_integrity_error: str
    def __init__(self, num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_reserved_blocks: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., block_size: _Optional[int] = ..., draining: _Optional[bool] = ..., kv_integrity_error: _Optional[str] = ...) -> None: ...
