"""Shared fixtures: tiny model folders made once per session through the real make-model code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Test processes share two cores with the servers they start.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_TORCH_THREADS", "1")))

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "granite")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, seed=0) -> Path of a tiny model folder, cached for the session."""
    from common.models.make_model import make_model

    made: dict[tuple[str, int], Path] = {}

    def make(arch: str = "llama", seed: int = 0) -> Path:
        key = (arch, seed)
        if key not in made:
            made[key] = make_model(arch, "tiny", seed, tmp_path_factory.mktemp(f"{arch}-{seed}"))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    return model_factory("llama", 0)
