"""Hooks into the fine-tune loop: subclass :class:`TrainerCallback`, override the events you need and pass
instances as ``cuboid.finetune(..., callbacks=[...])`` (or ``cuboid.cli.main(argv, callbacks=[...])``).

The convention is Hugging Face ``transformers.TrainerCallback``'s: one object, one method per event, each
a no-op by default. Every rank calls every event, in the loop's order:

- ``on_train_begin(run)``: the model, optimizer and scheduler are built and any checkpoint is resumed;
- ``on_step_begin(run, step)`` / ``on_step_end(run, step, row)``: around optimizer step ``step``
  (1-based); ``row`` is the step's metrics (``loss``, ``lr``, ``eval_loss``, ...);
- ``on_log(run, row)``: rank 0 only, the one exception: ``row`` was just written to ``metrics.jsonl`` (every
  ``log_every`` steps, at evals and last; the experiment trackers of ``--report-to`` log it,
  :mod:`cuboid.train.trackers`);
- ``on_save_begin(run, step, path)``: a training checkpoint ``path`` is about to be written;
- ``on_save_file(run, step, name)``: the writing rank (rank 0) has put file ``name`` into the save's
  temporary folder (:mod:`cuboid.zoo.checkpoint.folder`: the folder is renamed into place when complete);
- ``on_save(run, step, path)``: the checkpoint is committed and every rank has returned from the save;
- ``on_train_end(run, summary)``: ``final/`` is written; ``summary`` is what ``finetune`` returns;
- ``on_train_abort(run, error)``: training began but stops on ``error`` instead (an exception, Ctrl-C's
  :class:`~cuboid.train.interrupt.Interrupted`, SIGTERM's ``Terminated``), which is raised on after it; each
  rank calls it for its own error (the experiment trackers close their runs, as killed or failed).

``run`` is the loop's state (:class:`cuboid.train.loop.Run`): ``cfg``, ``plan``, ``mesh``, ``restart`` (how
often the job was restarted), ``model``, ``optimizer``, ``scheduler``, ``output_dir``. Callbacks read it;
changing it changes the run.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

EVENTS = ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_save_begin", "on_save_file", "on_save",
          "on_train_end", "on_train_abort")


class TrainerCallback:
    """A no-op for every event; override the ones you need (module docstring)."""

    def on_train_begin(self, run: Any) -> None:
        pass

    def on_step_begin(self, run: Any, step: int) -> None:
        pass

    def on_step_end(self, run: Any, step: int, row: dict) -> None:
        pass

    def on_log(self, run: Any, row: dict) -> None:
        pass

    def on_save_begin(self, run: Any, step: int, path: Path) -> None:
        pass

    def on_save_file(self, run: Any, step: int, name: str) -> None:
        pass

    def on_save(self, run: Any, step: int, path: Path) -> None:
        pass

    def on_train_end(self, run: Any, summary: dict) -> None:
        pass

    def on_train_abort(self, run: Any, error: BaseException) -> None:
        pass


class Callbacks:
    """The run's callbacks, called in the order given: ``callbacks.fire("on_step_begin", run, step)``."""

    def __init__(self, callbacks: Iterable[TrainerCallback] = ()) -> None:
        self.items = list(callbacks)
        for cb in self.items:
            if not isinstance(cb, TrainerCallback):
                raise TypeError(f"callbacks are cuboid.train.callbacks.TrainerCallback instances, got {type(cb).__name__}")

    def fire(self, event: str, run: Any, *args) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown trainer event {event!r}; events: {', '.join(EVENTS)}")
        for cb in self.items:
            getattr(cb, event)(run, *args)

    @contextmanager
    def save_files(self, run: Any, step: int) -> Iterator[None]:
        """Within: each file the checkpoint writer puts into its temporary folder fires ``on_save_file``
        (through the writer's stage hook, :data:`cuboid.zoo.checkpoint.folder.hook`, restored after)."""
        if not self.items:
            yield
            return
        from cuboid.zoo.checkpoint import folder

        previous = folder.hook

        def hook(stage: str) -> None:
            previous(stage)
            if stage.startswith("file:"):
                self.fire("on_save_file", run, step, stage[len("file:"):])

        folder.hook = hook
        try:
            yield
        finally:
            folder.hook = previous
