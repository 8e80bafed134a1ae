"""cuboid: Triton kernels, parallel layers and a declarative model zoo for PyTorch.

The front door. Lower floors are importable on their own as
``cuboid.kernels``, ``cuboid.parallel`` and ``cuboid.zoo``.
"""
__version__ = "0.1.0"
