"""What sampling costs per decode step: plain rows in one native call vs the general torch path.

    python benchmarks/sampling_step.py [--repeats 300] [--threads 2]

For each vocabulary (the tiny model's 1024, SmolLM2's 49152, Qwen2.5's 151936) and batch (1, 16,
64), at temperature 1.0 and greedy, the same Sampler in one process, the two paths alternating
call by call: `Sampler.sample` (rows that sample plainly go to common/kernels/sample_rows.cpp)
against the torch path those rows took before: at temperature 1.0 `Sampler._sample_processed`
(compute_probs, the inverse-CDF draw, log_softmax), greedy the argmax + log_softmax of
`sample_rows.reference` (the old all-greedy shortcut). Reports the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_common import print_table, write_result
from common.kernels import sample_rows
from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler, SamplingState

VOCABS = {"tiny (1024)": 1024, "SmolLM2 (49152)": 49152, "Qwen2.5 (151936)": 151936}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sampler = Sampler(seed=0)
    rows, results = [], []
    for label, vocab in VOCABS.items():
        for batch in args.batches:
            for temperature in (1.0, 0.0):
                logits = torch.randn(batch, vocab) * 3
                states = [SamplingState.create(SamplingParams(temperature=temperature, max_tokens=64), [1]) for _ in range(batch)]
                if temperature:
                    before = lambda: sampler._sample_processed(logits, states)  # noqa: E731
                else:
                    before = lambda: sample_rows.reference(logits, [0.0] * batch, [0.0] * batch)  # noqa: E731
                paths = {"plain": lambda: sampler.sample(logits, states), "torch": before}
                times: dict[str, list[float]] = {k: [] for k in paths}
                for _ in range(args.repeats):
                    for key, fn in paths.items():
                        start = time.perf_counter()
                        fn()
                        times[key].append(time.perf_counter() - start)
                plain, general = (statistics.median(times[k]) * 1e6 for k in ("plain", "torch"))
                r = dict(vocab=label, batch=batch, temperature=temperature, plain_us=plain, torch_us=general,
                         speedup=general / plain)  # fmt: skip
                results.append(r)
                rows.append([label, batch, temperature, general, plain, general / plain])
                print(r, flush=True)
    table = print_table(
        f"Sampling one decode step: the torch path vs plain rows in one native call "
        f"({'native kernel' if sample_rows.available() else 'torch reference: no kernel here'}, "
        f"{args.threads} threads, median of {args.repeats} alternating calls)",
        ["vocabulary", "batch", "temperature", "torch us", "plain us", "speedup"], rows)  # fmt: skip
    write_result("sampling_step", {"threads": args.threads, "repeats": args.repeats, "results": results, "table": table})


if __name__ == "__main__":
    main()
