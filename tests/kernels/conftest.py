"""Loads a private copy of the Triton kernels under the Triton interpreter, so they run on CPU.

Triton decides interpreter-or-compiler when `@triton.jit` runs, i.e. when the module is imported.
Instead of setting TRITON_INTERPRET=1 for the whole pytest process (which would also make every other
test's Triton code interpret, and fails if the module was already imported), we set it only while
executing a fresh copy of triton_kernels.py under another module name. The shared
`common.attention.triton_kernels` module (if anyone imported it) is left untouched.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

import common.attention

_KERNELS_FILE = Path(common.attention.__file__).with_name("triton_kernels.py")


def load_interpreted_kernels() -> ModuleType:
    pytest.importorskip("triton")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("_tandem_triton_kernels_interpreted", _KERNELS_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    assert module._INTERPRETED, "triton did not pick up TRITON_INTERPRET=1 at decoration time"
    return module


@pytest.fixture(scope="session")
def kernels() -> ModuleType:
    return load_interpreted_kernels()


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
