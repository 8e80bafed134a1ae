"""Test-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (Triton reads TRITON_INTERPRET when a kernel is decorated), so it is
set here, at the top of the first conftest pytest loads. Tests that want the
fast torch path on CPU use `cuboid.kernels.use_backend("torch")`.
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository root holds kernels/, parallel/ and zoo/ (installed as cuboid.kernels, ...). `python -m pytest`
# puts it first on sys.path, where those folders would shadow installed top-level packages of the same names
# (Hugging Face's `kernels`, which transformers imports). The tests need the root only to import `tests.*`,
# here and in the processes they spawn (which inherit sys.path), so it goes last: after site-packages.
# pyproject's `--import-mode=append` keeps pytest from putting it back in front.
ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != ROOT] + [ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; runs in bench/gpu.py and on GPU machines")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
