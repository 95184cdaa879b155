"""The protobuf edge of the draft service, shared by both ends (the draft servicer and decode's
draft client): tandem.v1 Draft messages <-> draft_worker domain values.

Nothing else touches `draft_pb2` field by field; bad input becomes `InvalidField`, answered
INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import numpy as np
import torch

from common.spec_decode.draft_worker import DraftResult, DraftSampling, DraftStatus, DraftUpdate
from tandem.v1 import draft_pb2

# Sampled sequences send k x vocab probabilities in one message: keep it under gRPC's 4 MiB.
MAX_PROBS_BYTES = int(3.5 * 2**20)

_STATUS = {
    DraftStatus.OK: draft_pb2.PROPOSAL_STATUS_OK,
    DraftStatus.NEEDS_RESET: draft_pb2.PROPOSAL_STATUS_NEEDS_RESET,
    DraftStatus.NO_CAPACITY: draft_pb2.PROPOSAL_STATUS_NO_CAPACITY,
}
_DTYPES = {  # wire dtype -> (torch dtype to round to, numpy little-endian dtype)
    draft_pb2.PROB_DTYPE_UNSPECIFIED: (torch.float16, np.dtype("<f2")),
    draft_pb2.PROB_DTYPE_FLOAT16: (torch.float16, np.dtype("<f2")),
    draft_pb2.PROB_DTYPE_FLOAT32: (torch.float32, np.dtype("<f4")),
}


class InvalidField(ValueError):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")


def prob_dtype_from_proto(value: int) -> torch.dtype:
    if value not in _DTYPES:
        raise InvalidField("prob_dtype", f"unknown value {value}")
    return _DTYPES[value][0]


def updates_from_proto(msg: draft_pb2.ProposeRequest, vocab_size: int, max_k: int) -> list[DraftUpdate]:
    itemsize = _DTYPES.get(msg.prob_dtype, _DTYPES[0])[1].itemsize
    seen: set[tuple[str, int]] = set()
    updates = []
    for i, s in enumerate(msg.sequences):
        where = f"sequences[{i}]"
        if not s.request_id:
            raise InvalidField(f"{where}.request_id", "must be non-empty")
        if (s.request_id, s.choice_index) in seen:
            raise InvalidField(f"{where}.request_id", f"({s.request_id!r}, {s.choice_index}) appears twice")
        seen.add((s.request_id, s.choice_index))
        if s.num_draft_tokens > max_k:
            raise InvalidField(f"{where}.num_draft_tokens", f"{s.num_draft_tokens} > max_num_draft_tokens {max_k}")
        bad = next((t for t in s.token_ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidField(f"{where}.token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if s.reset and not s.token_ids:
            raise InvalidField(f"{where}.token_ids", "reset needs the full context")
        sp = s.sampling
        sampling = DraftSampling(sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed if sp.HasField("seed") else None)
        if sp.temperature < 0 or not 0 <= sp.top_p <= 1 or not 0 <= sp.min_p <= 1 or sp.top_k < -1:
            raise InvalidField(f"{where}.sampling", "temperature >= 0, top_k >= -1, top_p and min_p in [0, 1]")
        if not sampling.is_greedy and s.num_draft_tokens * vocab_size * itemsize > MAX_PROBS_BYTES:
            raise InvalidField(f"{where}.num_draft_tokens", f"{s.num_draft_tokens} x vocab {vocab_size} probabilities "
                               f"exceed {MAX_PROBS_BYTES} bytes per message")  # fmt: skip
        updates.append(DraftUpdate(s.request_id, s.choice_index, s.reset, s.num_accepted, list(s.token_ids),
                                   s.num_context_tokens, s.num_draft_tokens, sampling))  # fmt: skip
    return updates


def proposal_to_proto(u: DraftUpdate, r: DraftResult, prob_dtype: int) -> draft_pb2.DraftProposal:
    msg = draft_pb2.DraftProposal(request_id=u.request_id, choice_index=u.choice_index, status=_STATUS[r.status],
                                  draft_token_ids=r.token_ids, num_context_tokens=r.num_context_tokens)  # fmt: skip
    if r.probs is not None:
        dtype = prob_dtype or draft_pb2.PROB_DTYPE_FLOAT16
        rows = r.probs.detach().cpu().numpy().astype(_DTYPES[dtype][1])  # [k, vocab]
        msg.probs.CopyFrom(draft_pb2.DraftProbs(dtype=dtype, num_rows=rows.shape[0], vocab_size=rows.shape[1],
                                                data=rows.tobytes()))  # fmt: skip
    return msg


def probs_from_proto(msg: draft_pb2.DraftProbs) -> torch.Tensor:
    """[num_rows, vocab_size] float32 as sent (pad_probs renormalizes each row, as the draft did)."""
    np_dtype = _DTYPES.get(msg.dtype, _DTYPES[0])[1]
    rows = np.frombuffer(msg.data, dtype=np_dtype)
    if rows.size != msg.num_rows * msg.vocab_size:
        raise ValueError(f"DraftProbs: {rows.size} values for {msg.num_rows} x {msg.vocab_size}")
    return torch.from_numpy(rows.astype(np.float32)).reshape(msg.num_rows, msg.vocab_size)
