"""Ctrl-C during a fine-tune: the first finishes the step, saves a checkpoint and stops; a second aborts.

The loop installs :class:`StopOnInterrupt` around its steps and final save (main thread only). The first
SIGINT only asks for a stop (one that comes after the last step lets the final save end the run); after each step every rank learns whether any rank was asked (:meth:`StopOnInterrupt.agreed`:
one all-reduce of a flag over the whole world, every step, whatever the flag: the plan's world size
decides the collective, not one rank's signal), so all stop after the same step. The loop then writes
``checkpoint-<step>`` (atomically, as every save) and raises :class:`Interrupted`, which ``cuboid
finetune`` turns into one line and exit code 130. A second SIGINT raises ``KeyboardInterrupt`` at once
(a save it cuts short leaves no checkpoint folder: saves are renamed into place when complete).

Under torch's elastic launcher the workers run in sessions of their own: the agent receives the terminal's
Ctrl-C and sends each worker one SIGINT (the first), then waits for them; a second Ctrl-C makes the agent
send SIGTERM, which ends them at once.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
import torch

__all__ = ["Interrupted", "StopOnInterrupt", "EXIT_CODE", "Terminated", "TerminateOnSigterm", "SIGTERM_EXIT_CODE",
           "terminated_line"]

EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C after step ``step`` of ``steps``, its state saved in ``checkpoint``."""

    def __init__(self, step: int, steps: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step} of {steps}; checkpoint {checkpoint}")
        self.step, self.steps, self.checkpoint = step, steps, Path(checkpoint)


class SignalScope:
    """Within: ``_handler`` handles ``signum`` (main thread only: outside it there are no signals, and nothing
    is installed); the previous handler comes back on exit."""

    signum = signal.SIGINT

    def __init__(self) -> None:
        self._previous, self._installed = None, False

    def _handler(self, signum, frame) -> None:  # pragma: no cover - each scope's own
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


class StopOnInterrupt(SignalScope):
    """Within: the first SIGINT sets :attr:`requested`; a second raises ``KeyboardInterrupt``. The previous
    handler comes back on exit. Outside the main thread (no signals there) it installs nothing."""

    signum = signal.SIGINT

    def __init__(self) -> None:
        super().__init__()
        self.requested = False

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


    def agreed(self, world_size: int, device: torch.device) -> bool:
        """Whether any rank was asked to stop: this rank's flag, all-reduced (max) over the world when it
        has more than one rank. Every rank calls it after every step."""
        if world_size == 1:
            return self.requested
        import torch.distributed as dist

        from cuboid.parallel import comm

        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        with comm.guarded("all_reduce (the Ctrl-C stop flag)", None):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def resume_command(argv: list, module: str = "cuboid") -> str:
    """The command that resumes the run ``argv`` (a ``cuboid finetune`` command line without the program)
    started: the same flags, ``--resume latest`` instead of any ``--resume``."""
    import shlex

    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--resume":  # bare, or with a value (a value never starts with --)
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            continue
        if not a.startswith("--resume="):
            out.append(a)
        i += 1
    if "finetune" not in out:
        out.insert(0, "finetune")
    prog = "cuboid" if module == "cuboid" else f"python -m {module}"
    return f"{prog} {shlex.join(out)} --resume latest"


def interrupted_line(e: Interrupted, argv: list, module: str = "cuboid") -> str:
    """The one line ``cuboid finetune`` prints when Ctrl-C stopped it."""
    return (f"cuboid finetune: interrupted after step {e.step} of {e.steps}: saved {e.checkpoint}; resume with: "
            f"{resume_command(argv, module)}")


class Terminated(BaseException):
    """A run ended by SIGTERM (a scheduler's stop, ``kill``): it stops at once, as it would without a handler,
    and ``cuboid finetune`` says so in one line (:func:`terminated_line`) and exits 143."""


class TerminateOnSigterm(SignalScope):
    """Within (main thread only): SIGTERM raises :class:`Terminated`; the previous handler comes back on exit.
    Launched workers keep the default SIGTERM action (they end at once when the agent stops them)."""

    signum = signal.SIGTERM

    @staticmethod
    def _handler(signum, frame) -> None:
        raise Terminated()


def terminated_line(output_dir, argv: list, module: str = "cuboid") -> str:
    """The one line ``cuboid finetune`` prints when SIGTERM stopped it: the newest complete checkpoint of the
    run that last started in ``output_dir`` (what a resume takes) and the command that resumes, or that none
    was saved."""
    from cuboid.train.resume import folder_run_id, resolve_resume

    out = Path(output_dir)
    found = resolve_resume("latest", out, folder_run_id(out)) if out.is_dir() else None
    if found is None:
        return f"cuboid finetune: stopped by SIGTERM before a checkpoint was saved in {out}"
    return (f"cuboid finetune: stopped by SIGTERM, checkpoint {found} is the newest complete one; resume with: "
            f"{resume_command(argv, module)}")
