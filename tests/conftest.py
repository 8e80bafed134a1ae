"""Test-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (Triton reads TRITON_INTERPRET when a kernel is decorated), so it is
set here, at the top of the first conftest pytest loads. Tests that want the
fast torch path on CPU use `cuboid.kernels.use_backend("torch")`.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; runs in bench/gpu.py and on GPU machines")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
