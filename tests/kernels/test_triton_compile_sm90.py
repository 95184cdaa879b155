"""Compiles the attention kernels for an H100/H200 (sm_90) without a GPU: catches errors the interpreter
cannot (tl.dot shape minimums, loop-carried types) and checks the generated code is the fast kind.

Arguments are specialised the way a real launch specialises them: pointers and strides divisible by
16, last-dim strides == 1 (Triton turns an int argument equal to 1 into a constant).
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from common.attention import triton_kernels  # noqa: E402

if "nvidia" not in triton.backends.backends:
    pytest.skip("triton has no NVIDIA backend here", allow_module_level=True)
if triton_kernels._INTERPRETED:
    pytest.skip("the process runs with TRITON_INTERPRET=1", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)
_ALIGNED = ["query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr", "stride_qt", "stride_qh",
            "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch", "stride_bt"]


def _compile_attention(dtype: str, group: int, head_dim: int, max_query_len: int):
    block_m, block_n, num_warps, num_stages = triton_kernels._pick_tiles(max_query_len, group, head_dim)
    signature = {"query_ptr": f"*{dtype}", "key_cache_ptr": f"*{dtype}", "value_cache_ptr": f"*{dtype}",
                 "out_ptr": f"*{dtype}", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "block_tables_ptr": "*i32", "num_seqs": "i32", "num_heads": "i32", "block_size": "i32",
                 "qk_scale": "fp32"}
    for name in ["stride_qt", "stride_qh", "stride_qd", "stride_ot", "stride_oh", "stride_od",
                 "stride_cb", "stride_cs", "stride_ch", "stride_cd", "stride_bt"]:
        signature[name] = "constexpr" if name.endswith("d") else "i32"
    low_precision = dtype != "fp32"
    constexprs = {"stride_qd": 1, "stride_od": 1, "stride_cd": 1, "HEAD_DIM": head_dim, "G": group,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "D_PAD": max(16, triton.next_power_of_2(head_dim)),
                  "LOW_PRECISION_DOT": low_precision, "DOT_PRECISION": None if low_precision else "ieee"}
    names = list(signature) + ["HEAD_DIM", "G", "BLOCK_M", "BLOCK_N", "D_PAD", "LOW_PRECISION_DOT", "DOT_PRECISION"]
    for name in names[len(signature):]:
        signature[name] = "constexpr"
    attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in _ALIGNED}
    src = ASTSource(triton_kernels._paged_attention_kernel, signature, constexprs, attrs)
    return block_m, triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.parametrize(
    "dtype,group,head_dim,max_query_len",
    [("bf16", 4, 128, 1), ("bf16", 4, 128, 512), ("fp32", 7, 64, 3)],
    ids=["decode-bf16-gqa4-d128", "prefill-bf16-gqa4-d128", "verify-fp32-gqa7-d64"],
)
def test_attention_compiles_for_sm90(dtype, group, head_dim, max_query_len):
    block_m, kernel = _compile_attention(dtype, group, head_dim, max_query_len)
    ptx = kernel.asm["ptx"]
    assert "cubin" in kernel.asm
    assert not re.search(r"\b(ld|st)\.local", ptx), "register spills"
    if dtype == "bf16":
        assert "cp.async" in ptx, "K/V loads are not pipelined"
        if block_m >= 64:
            assert "wgmma" in ptx, "prefill tiles should use Hopper wgmma"
