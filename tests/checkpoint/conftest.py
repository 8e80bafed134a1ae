"""Checkpoint tests run the torch reference kernels (fast on CPU), as tests/zoo does."""
import pytest

from cuboid.kernels import use_backend


@pytest.fixture(autouse=True)
def torch_backend():
    with use_backend("torch"):
        yield
