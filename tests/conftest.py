"""Test-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (Triton reads TRITON_INTERPRET when a kernel is decorated), so it is
set here, at the top of the first conftest pytest loads. Tests that want the
fast torch path on CPU use `cuboid.kernels.use_backend("torch")`.

One exception: a run that selects the GPU tests only (`-m gpu`, exactly) on a
machine with CUDA leaves the interpreter off, so those tests run compiled, as
on a GPU user's machine: `python -m pytest -m gpu tests/kernels`. (The
interpreter cannot run CUDA tensors, and the tests that need it, the kernels
on CPU tensors, are not selected then.) Every other run, and any run with
TRITON_INTERPRET already in the environment, is as before. The marker
expression is read from the command line (and PYTEST_ADDOPTS) here, since
this has to happen before a conftest below imports `cuboid.kernels`;
`pytest_configure` checks the decision against the parsed options.
"""
import os
import shlex
import sys


def _markexpr_from_command_line() -> str:
    """The value of the last ``-m EXPR`` / ``-mEXPR`` in PYTEST_ADDOPTS and the command line ("" if none)."""
    args = shlex.split(os.environ.get("PYTEST_ADDOPTS", "")) + sys.argv[1:]
    expr = ""
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            expr = args[i + 1]
        elif a.startswith("-m") and len(a) > 2:
            expr = a[2:]
    return expr


def _compiled_gpu_run(markexpr: str) -> bool:
    """A run of the GPU tests only, on a machine with CUDA (torch imported only then)."""
    if (markexpr or "").strip() != "gpu":
        return False
    import torch
    return torch.cuda.is_available()


USER_SET_INTERPRET = "TRITON_INTERPRET" in os.environ
COMPILED_GPU_RUN = not USER_SET_INTERPRET and _compiled_gpu_run(_markexpr_from_command_line())
if not COMPILED_GPU_RUN:
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


def pytest_configure(config):
    """The interpreter decision above, made from the raw command line, against the parsed ``-m`` (they differ
    when pytest is started from Python, ``pytest.main([...])``): corrected while no kernel module is imported,
    else a usage error rather than GPU tests run through the interpreter (or CPU ones without it)."""
    if USER_SET_INTERPRET:
        return
    want = _compiled_gpu_run(config.getoption("markexpr", ""))
    if want == COMPILED_GPU_RUN:
        return
    backend = sys.modules.get("cuboid.kernels._backend")  # imported by every kernel module
    if backend is not None and backend.INTERPRETER == want:
        raise pytest.UsageError("tests/conftest.py: cuboid.kernels was imported, "
                                f"{'with' if want else 'without'} the Triton interpreter, before the -m option was "
                                "known; set TRITON_INTERPRET (1: interpreter, 0: compiled) in the environment")
    if want:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU; runs in bench/gpu.py and on GPU machines"
    elif os.environ.get("TRITON_INTERPRET") == "1":  # a whole-suite run on a GPU machine: the CPU tests need it
        reason = ("the Triton interpreter is on in this run and cannot take CUDA tensors; run the GPU tests "
                  "compiled: python -m pytest -m gpu tests/kernels")
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)



# folders whose tests run models, not kernels: on CPU they take a user's path, the torch reference kernels
# (a user's CPU run has no interpreter), not the Triton interpreter this process switches on for tests/kernels.
# Set around a test's whole protocol (its setup too: a module's fixture runs models in its first test's setup).
# A test there that wants the interpreted kernels asks for them with use_backend("triton").
MODEL_FOLDERS = ("checkpoint", "front", "parallel", "zoo")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.path.relpath(str(item.path), os.path.dirname(os.path.abspath(__file__))).split(os.sep)[0]
    if folder not in MODEL_FOLDERS or "gpu" in item.keywords or COMPILED_GPU_RUN:
        yield
        return
    from cuboid.kernels import use_backend

    with use_backend("torch"):
        yield
