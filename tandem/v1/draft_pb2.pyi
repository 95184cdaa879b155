from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROB_DTYPE_UNSPECIFIED: _ClassVar[ProbDtype]
    PROB_DTYPE_FLOAT16: _ClassVar[ProbDtype]
    PROB_DTYPE_FLOAT32: _ClassVar[ProbDtype]

class ProposalStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSAL_STATUS_UNSPECIFIED: _ClassVar[ProposalStatus]
    PROPOSAL_STATUS_OK: _ClassVar[ProposalStatus]
    PROPOSAL_STATUS_NEEDS_RESET: _ClassVar[ProposalStatus]
    PROPOSAL_STATUS_NO_CAPACITY: _ClassVar[ProposalStatus]
PROB_DTYPE_UNSPECIFIED: ProbDtype
PROB_DTYPE_FLOAT16: ProbDtype
PROB_DTYPE_FLOAT32: ProbDtype
PROPOSAL_STATUS_UNSPECIFIED: ProposalStatus
PROPOSAL_STATUS_OK: ProposalStatus
PROPOSAL_STATUS_NEEDS_RESET: ProposalStatus
PROPOSAL_STATUS_NO_CAPACITY: ProposalStatus

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_hash", "max_num_draft_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_num_draft_tokens: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., max_num_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class DraftSequence(_message.Message):
    __slots__ = ("request_id", "choice_index", "reset", "num_accepted", "token_ids", "num_context_tokens", "num_draft_tokens", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choice_index: int
    reset: bool
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_context_tokens: int
    num_draft_tokens: int
    sampling: DraftSampling
    def __init__(self, request_id: _Optional[str] = ..., choice_index: _Optional[int] = ..., reset: _Optional[bool] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_context_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[DraftSampling, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequences", "prob_dtype", "step")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROB_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequence]
    prob_dtype: ProbDtype
    step: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[DraftSequence, _Mapping]]] = ..., prob_dtype: _Optional[_Union[ProbDtype, str]] = ..., step: _Optional[int] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("dtype", "num_rows", "vocab_size", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: ProbDtype
    num_rows: int
    vocab_size: int
    data: bytes
    def __init__(self, dtype: _Optional[_Union[ProbDtype, str]] = ..., num_rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("request_id", "choice_index", "status", "draft_token_ids", "probs", "num_context_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choice_index: int
    status: ProposalStatus
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    num_context_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., choice_index: _Optional[int] = ..., status: _Optional[_Union[ProposalStatus, str]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., num_context_tokens: _Optional[int] = ...) -> None: ...

class DraftSequenceRef(_message.Message):
    __slots__ = ("request_id", "choice_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choice_index: int
    def __init__(self, request_id: _Optional[str] = ..., choice_index: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sequences", "request_ids")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequenceRef]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequences: _Optional[_Iterable[_Union[DraftSequenceRef, _Mapping]]] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class DraftLoad(_message.Message):
    __slots__ = ("num_sequences", "num_free_blocks", "num_total_blocks", "kv_integrity_error")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    num_free_blocks: int
    num_total_blocks: int
    kv_integrity_error: str
    def __init__(self, num_sequences: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_integrity_error: _Optional[str] = ...) -> None: ...
