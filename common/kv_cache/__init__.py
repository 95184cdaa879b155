"""Paged KV cache: block pool (ids, ref counts, prefix cache), per-request tables, torch storage."""

from common.kv_cache.block_pool import BlockPool
from common.kv_cache.kv_cache_manager import KVCacheManager
from common.kv_cache.prefix_hash import compute_block_hashes, hash_block_tokens

__all__ = ["BlockPool", "KVCacheManager", "compute_block_hashes", "hash_block_tokens"]
