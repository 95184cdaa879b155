"""Can two engines exchange KV blocks? The layout both sides compare at the KV handshake.

KV bytes carry no meaning of their own: a block written with another block size, dtype, head
count or model is silently garbage to the reader. So before any bytes move, the sender's
`KVLayout` must equal the receiver's field by field; a mismatch is an error that names every
differing field, never wrong output.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from common.kv_transfer.codec import dtype_name

# Version of the KV wire protocol (piece layout, checksum algorithm); bump on any change.
PROTOCOL_VERSION = 1
# [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim], row-major.
DEFAULT_LAYOUT = "layers_kv_blocks_tokens_heads_dim"


class KVCompatibilityError(ValueError):
    """Two KV layouts differ; `mismatches` lists (field, local value, remote value)."""

    def __init__(self, mismatches: list[tuple[str, Any, Any]]) -> None:
        detail = "; ".join(f"{f}: local {a!r} != remote {b!r}" for f, a, b in mismatches)
        super().__init__(f"incompatible KV layout: {detail}")
        self.mismatches = mismatches

    @property
    def fields(self) -> list[str]:
        return [f for f, _, _ in self.mismatches]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything that decides how one KV block is laid out in memory and on the wire."""

    model_id: str
    """Served model name; both sides must run the same weights."""
    architecture: str
    """HF architecture, e.g. "LlamaForCausalLM"."""
    dtype: str
    """KV cache dtype name ("float32", "float16", "bfloat16"); a torch.dtype is accepted."""
    block_size: int
    """Tokens per block."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = DEFAULT_LAYOUT
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "protocol_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        for name in ("model_id", "architecture", "layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"KVLayout.{name} must be a non-empty string, got {getattr(self, name)!r}")

    @classmethod
    def from_model_config(cls, model_id: str, config: Any, block_size: int, dtype: torch.dtype | str | None = None) -> KVLayout:
        """From a `ModelConfig` (architecture, num_layers, num_kv_heads, head_dim, dtype) and the cache's block size."""
        return cls(
            model_id=model_id,
            architecture=config.architecture,
            dtype=dtype_name(dtype if dtype is not None else config.dtype),
            block_size=block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def compatibility_hash(self) -> str:
        """Hex xxh3-64 of the fields in canonical JSON: equal layouts <=> equal hashes."""
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(canonical.encode())


def mismatched_fields(local: KVLayout, remote: KVLayout) -> list[tuple[str, Any, Any]]:
    """(field, local value, remote value) for every field that differs, in declaration order."""
    return [
        (f.name, getattr(local, f.name), getattr(remote, f.name))
        for f in dataclasses.fields(KVLayout)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]


def check_compatible(local: KVLayout, remote: KVLayout, remote_hash: str | None = None) -> None:
    """Raises KVCompatibilityError naming each mismatched field.

    remote_hash: the hash the remote claimed (from the wire). If the fields agree but the claimed
    hash does not, the remote hashes differently (another protocol build): also incompatible.
    """
    mismatches = mismatched_fields(local, remote)
    if not mismatches and remote_hash is not None and remote_hash != local.compatibility_hash():
        mismatches = [("compatibility_hash", local.compatibility_hash(), remote_hash)]
    if mismatches:
        raise KVCompatibilityError(mismatches)
