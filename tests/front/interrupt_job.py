"""Ctrl-C at a chosen step, as a fine-tune callback, and ``cuboid finetune`` with it installed.

    python -m tests.front.interrupt_job finetune [cuboid finetune flags]

``CUBOID_SIGINT=rank:step[:who]`` (:class:`SigintCallback`): at the end of step ``step`` rank ``rank`` sends
SIGINT: ``self`` (default) to its own process only, as a signal that reached one worker; ``twice`` to itself
twice (the second aborts); ``agent`` to its parent, the elastic agent, as a terminal's Ctrl-C reaches a
launched job (the agent forwards it to every worker); ``term``, ``agent-term``: SIGTERM instead, to itself, to
the agent (a scheduler's stop). ``CUBOID_SIGINT_LOG=FOLDER``: each rank writes the
last step it finished to ``FOLDER/rank<R>``, so a test sees where every rank stopped.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from cuboid.train.callbacks import TrainerCallback


class SigintCallback(TrainerCallback):
    def __init__(self, spec: str = "", log: str = "") -> None:
        parts = spec.split(":") if spec else []
        self.rank, self.step = (int(parts[0]), int(parts[1])) if parts else (-1, -1)
        self.who = parts[2] if len(parts) > 2 else "self"
        self.log = Path(log) if log else None
        self.sent = False

    def on_step_end(self, run, step: int, row: dict) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if self.log is not None:
            self.log.mkdir(parents=True, exist_ok=True)
            (self.log / f"rank{rank}").write_text(str(step))
        if rank != self.rank or step != self.step or self.sent or int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                       "0")):
            return
        self.sent = True
        if self.who in ("agent", "agent-term"):
            os.kill(os.getppid(), signal.SIGTERM if self.who == "agent-term" else signal.SIGINT)
            if self.who == "agent-term":
                time.sleep(5)  # ended by the agent's SIGTERM here, before another step could save
            return
        if self.who == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            return
        os.kill(os.getpid(), signal.SIGINT)
        if self.who == "twice":
            time.sleep(0.2)  # the first is handled (a stop asked for) before the second arrives
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)


if __name__ == "__main__":
    from cuboid.cli import main

    callback = SigintCallback(os.environ.get("CUBOID_SIGINT", ""), os.environ.get("CUBOID_SIGINT_LOG", ""))
    sys.exit(main(sys.argv[1:], callbacks=[callback], module="tests.front.interrupt_job"))
