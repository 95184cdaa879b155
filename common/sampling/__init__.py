"""Sampling: parameters, the batched sampler, incremental detokenization and stop strings."""

from common.sampling.detokenizer import IncrementalDetokenizer
from common.sampling.params import SamplingParams, SamplingParamsError
from common.sampling.sampler import Sampler, SamplerOutput, SamplingState
from common.sampling.stop_strings import StopCheck, StopStringMatcher

__all__ = [
    "IncrementalDetokenizer",
    "SamplerOutput",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "SamplingState",
    "StopCheck",
    "StopStringMatcher",
]
