"""Zoo tests run the torch reference kernels (fast on CPU); the interpreter path
has its own small composition test in test_models.py."""
import pytest

from cuboid.kernels import use_backend


@pytest.fixture(autouse=True)
def torch_backend():
    with use_backend("torch"):
        yield
