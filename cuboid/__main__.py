"""``python -m cuboid``: the ``cuboid`` command (also what torchrun and ``--nproc-per-node`` start per rank).

``python -m`` puts the working directory first on ``sys.path``. In this
checkout's root that directory holds ``kernels/``, ``parallel/`` and ``zoo/``,
which would then shadow installed top-level packages of those names (Hugging
Face's ``kernels``, which ``transformers`` imports for tokenizers and models).
cuboid reaches them only as ``cuboid.kernels`` and so on, so the root moves
behind site-packages before the command imports anything else.
"""
import os
import signal
import sys

_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))  # site-packages when installed
_CHECKOUT = os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) and os.path.isdir(os.path.join(_ROOT, "kernels"))
if _CHECKOUT and any(os.path.realpath(p or os.curdir) == _ROOT for p in sys.path):
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _ROOT] + [_ROOT]

from cuboid.cli import main  # noqa: E402

# once the command is done, a Ctrl-C has nothing left to stop: while the process exits (the process groups'
# clean-up at exit) it would only print a traceback, so it is ignored from then on (main handles its own)
code = 130
try:
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
except KeyboardInterrupt:  # one that came as main returned: the command's exit code stands
    signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.exit(code)
