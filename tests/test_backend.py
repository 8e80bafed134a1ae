"""The backend rule (kernels/_backend.py) and `cuboid info`."""
import subprocess
import sys

import pytest
import torch

from cuboid import kernels
from cuboid.cli import main
from cuboid.kernels import _backend


def test_interpreter_was_on_at_import():
    # tests/conftest.py sets TRITON_INTERPRET=1 before any kernel import
    assert kernels.interpreter_active()


def test_cpu_picks_triton_under_interpreter_and_torch_when_forced():
    x = torch.zeros(2)
    assert kernels.resolve_backend("op", [x]) == "triton"
    assert kernels.resolve_backend("op", [x], "torch") == "torch"
    with kernels.use_backend("torch"):
        assert kernels.resolve_backend("op", [x]) == "torch"
        assert kernels.resolve_backend("op", [x], "triton") == "triton"
    assert kernels.resolve_backend("op", [x]) == "triton"


def test_cpu_without_interpreter_uses_torch_and_refuses_triton(monkeypatch):
    monkeypatch.setattr(_backend, "INTERPRETER", False)
    x = torch.zeros(2)
    assert kernels.resolve_backend("op", [x]) == "torch"
    with pytest.raises(ValueError, match="backend='triton' cannot run on CPU"):
        kernels.resolve_backend("layer_norm", [x], "triton")
    with pytest.raises(ValueError, match="was not when the kernels were imported"):
        kernels.resolve_backend("layer_norm", [x], "triton")


def test_bad_backend_name_and_mixed_devices():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.resolve_backend("op", [x], "cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        with kernels.use_backend("numpy"):
            pass
    with pytest.raises(ValueError, match="one device"):
        kernels.resolve_backend("op", [x, torch.zeros(2, device="meta")])


def test_kernels_import_is_lazy():
    # importing the package must not import Triton or compile anything
    code = "import sys, cuboid.kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    with pytest.raises(AttributeError, match="no attribute"):
        kernels.not_an_op


def test_info_prints_backend_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out
    for op in kernels.OPS:
        assert op in out
    assert "Triton interpreter: on" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out
