"""Model code: config normalisation, our decoder, the safetensors loader, random-model maker.

`ARCHITECTURES` is the registry of supported HF architecture names (see architectures.py).
`make_model` is imported from `common.models.make_model` on demand (it pulls in transformers).
"""

from __future__ import annotations

from common.models.architectures import ARCHITECTURES, SHORT_NAMES, ArchSpec, get_arch_spec
from common.models.config import ModelConfig, RopeConfig
from common.models.decoder import DecoderModel
from common.models.loader import load_model

__all__ = [
    "ARCHITECTURES",
    "SHORT_NAMES",
    "ArchSpec",
    "DecoderModel",
    "ModelConfig",
    "RopeConfig",
    "get_arch_spec",
    "load_model",
]
