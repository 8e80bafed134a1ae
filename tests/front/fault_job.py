"""The fault tests' deterministic SIGKILL, as a fine-tune callback, and the two jobs that install it.

    torchrun --nproc-per-node 2 [--max-restarts N] tests/front/fault_job.py DATA PLAN OUTPUT_DIR
    python -m tests.front.fault_job finetune [cuboid finetune flags]

``CUBOID_FAULT=rank:step:where[,rank:step:where...]`` (:class:`Fault`) says which rank dies where;
:class:`FaultCallback` does it through the trainer's callbacks (:mod:`cuboid.train.callbacks`).

The first form is a fine-tune with dropout through the Python API. The CLI's models train without
dropout, so nothing in their step draws from the global RNG. This job's ViT drops with p = 0.1: a resume
that did not restore every rank's RNG state would drop other elements and end with other parameters, so
the fault test sees RNG restore as well as model, optimizer, scheduler and data position. It also shows
that the Python API under ``torchrun --max-restarts`` resumes like ``cuboid finetune --max-restarts``.

The second form is ``cuboid finetune`` with the callback installed: it passes this module to
:func:`cuboid.cli.main`, so the workers its launcher starts (and restarts) run it too. Any flags go
through, so one job shows any run surviving kills: tests/front/test_faults.py kills a dp=2 ViT run three
times, tests/front/test_streaming.py a dp=2 ``--streaming`` SFT run twice (``1:3:step,0:5:step``: mid-step
on attempt 0, and on attempt 1 again after it resumed the stream, which is where a stream's second resume
would show).
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from cuboid.train.callbacks import TrainerCallback

STEPS, BATCH, SAVE_EVERY, LR = 6, 8, 2, 5e-3
FAULT_ENV = "CUBOID_FAULT"
FAULT_POINTS = ("step", "save", "saved", "raise", "crash")


@dataclass(frozen=True)
class Fault:
    """One entry of ``CUBOID_FAULT``: rank ``rank`` kills itself (SIGKILL, as an out-of-memory killer or a
    lost node would) at step ``step`` (1-based). The k-th entry acts on attempt k only (the job's restart
    count is k), so one entry kills the first attempt and the restarted workers run through, and a list
    kills one attempt after another. ``where``:

    - ``step``: in the model's forward of step ``step``, while the other ranks are in that step's collectives;
    - ``save``: while ``checkpoint-<step>`` is being written: the writing rank (rank 0) once the second file
      is in the temporary folder, any other rank as the save begins;
    - ``saved``: once ``checkpoint-<step>`` is committed and every rank has returned from the save;
    - ``raise``, ``crash``: the rank raises a ValueError (a bad value), a RuntimeError (a bug) as step ``step``
      begins, alone: the others meet its absence in that step's collectives.
    """

    rank: int
    step: int
    where: str

    @classmethod
    def parse(cls, spec: str) -> list["Fault"]:
        """Every entry of ``spec``; a malformed one is an error (on every attempt)."""
        faults = []
        for entry in spec.split(","):
            parts = entry.strip().split(":")
            if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULT_POINTS:
                raise ValueError(f"{FAULT_ENV}={spec!r}: expected rank:step:where entries, where one of "
                                 f"{', '.join(FAULT_POINTS)}, separated by commas (e.g. 1:3:step)")
            faults.append(cls(int(parts[0]), int(parts[1]), parts[2]))
        return faults

    @classmethod
    def pick(cls, faults: list["Fault"], rank: int, restart: int) -> Optional["Fault"]:
        """Attempt ``restart``'s fault if it is ``rank``'s, else None."""
        fault = faults[restart] if restart < len(faults) else None
        return fault if fault is not None and fault.rank == rank else None

    def at(self, where: str, step: int) -> bool:
        return self.where == where and self.step == step


def kill() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FaultCallback(TrainerCallback):
    """Kills this rank where ``CUBOID_FAULT`` says (nothing when it is unset or names another rank or attempt)."""

    def __init__(self, spec: Optional[str] = None) -> None:
        spec = os.environ.get(FAULT_ENV, "").strip() if spec is None else spec
        self.faults = Fault.parse(spec) if spec else []
        self.fault: Optional[Fault] = None
        self.files = 0
        self.dying = None

    def on_train_begin(self, run) -> None:
        self.fault = Fault.pick(self.faults, run.mesh.rank, run.restart)

    def on_step_begin(self, run, step: int) -> None:
        for where, kind in (("raise", ValueError), ("crash", RuntimeError)):
            if self.fault is not None and self.fault.at(where, step):
                raise kind(f"rank {run.mesh.rank} was told to fail at step {step} ({FAULT_ENV})")
        if self.fault is not None and self.fault.at("step", step):
            self.dying = run.model.register_forward_pre_hook(lambda *_: kill())

    def on_step_end(self, run, step: int, row: dict) -> None:
        if self.dying is not None:
            self.dying.remove()
            self.dying = None

    def on_save_begin(self, run, step: int, path) -> None:
        self.files = 0
        if self.fault is not None and self.fault.at("save", step) and not run.mesh.is_main:
            kill()

    def on_save_file(self, run, step: int, name: str) -> None:  # the writer: half the checkpoint is written
        self.files += 1
        if self.fault is not None and self.fault.at("save", step) and self.files == 2:
            kill()

    def on_save(self, run, step: int, path) -> None:
        if self.fault is not None and self.fault.at("saved", step):
            kill()


def main(data: str, plan: str, output_dir: str) -> None:
    import cuboid
    from cuboid import zoo

    model = zoo.materialize(zoo.build("vit-debug", dropout=0.1, num_labels=2), seed=0)
    cuboid.finetune(model, data, plan=plan, steps=STEPS, batch_size=BATCH, lr=LR, save_every=SAVE_EVERY,
                    log_every=1, eval_every=100, output_dir=output_dir, progress=False, plot=False,
                    callbacks=[FaultCallback()])


if __name__ == "__main__":
    if sys.argv[1:2] == ["finetune"]:
        from cuboid.cli import main as cli

        sys.exit(cli(sys.argv[1:], callbacks=[FaultCallback()], module="tests.front.fault_job"))
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
