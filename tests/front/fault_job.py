"""A fine-tune with dropout, run under ``torchrun`` by tests/front/test_faults.py.

    torchrun --nproc-per-node 2 [--max-restarts N] tests/front/fault_job.py DATA PLAN OUTPUT_DIR

The CLI's models train without dropout, so nothing in their step draws from
the global RNG. This job's ViT drops with p = 0.1: a resume that did not
restore every rank's RNG state would drop other elements and end with other
parameters, so the fault test sees RNG restore as well as model, optimizer,
scheduler and data position. It also shows that the Python API under
``torchrun --max-restarts`` resumes like ``cuboid finetune --max-restarts``.
"""
from __future__ import annotations

import sys

STEPS, BATCH, SAVE_EVERY, LR = 6, 8, 2, 5e-3


def main(data: str, plan: str, output_dir: str) -> None:
    import cuboid
    from cuboid import zoo

    model = zoo.materialize(zoo.build("vit-debug", dropout=0.1, num_labels=2), seed=0)
    cuboid.finetune(model, data, plan=plan, steps=STEPS, batch_size=BATCH, lr=LR, save_every=SAVE_EVERY,
                    log_every=1, eval_every=100, output_dir=output_dir, progress=False, plot=False)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
