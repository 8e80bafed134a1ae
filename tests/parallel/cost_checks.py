"""The cost model against a run: what a rank sends in a ``train_step`` and what it holds.

:func:`cost_worker` runs on every rank of a world: for each plan it loads a
held-out GPT config (sizes no other test uses) through ``cuboid.load``, takes
one step, then counts a second one with ``comm.count`` and returns, per
group, the measured bytes beside :func:`cuboid.parallel.cost.traffic`'s, and
the model-state bytes :func:`cuboid.parallel.zero.model_state_bytes` finds
beside :func:`cuboid.parallel.cost.model_states`'. :func:`check_cost`
asserts they are equal (1e-9 relative: both are sums of integers).
"""
from __future__ import annotations

import torch

# held out: a vocabulary that pads under vocab-parallel heads, 3 blocks (uneven pipeline cuts), MLP 3x
HELD_OUT = dict(vocab_size=301, n_positions=64, dim=64, n_layers=3, n_heads=4, mlp_hidden=192)
BATCH, SEQ = 8, 16
TP_GROUPS = ("tp", "tp_row", "tp_col", "tp_dep")


def _grouped(sent: dict) -> dict:
    out: dict = {}
    for (_, group), (nbytes, _) in sent.items():
        g = "tp" if group in TP_GROUPS or group == "tensor" else group
        out[g] = out.get(g, 0.0) + nbytes
    return {k: v for k, v in out.items() if v}


def cost_worker(plans, preset: str = "gpt-debug", fields: dict = HELD_OUT) -> dict:
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import comm, cost, state_of, zero
    from cuboid.loading.planner import meta_shards

    config = zoo.config_of(preset, **fields)
    report = {}
    for spec in plans:
        model, opt, batch = stepped(config, spec, BATCH, SEQ)
        plan, mesh = model.parallel.plan, model.parallel.mesh
        routed = RoutedPairs(model, plan, mesh)
        with comm.count() as tally, routed:
            cuboid.train_step(model, opt, batch)
        measured = _grouped({k: (v[1], v[0]) for k, v in tally.items().items()})

        meta = meta_shards(config, plan, mesh.rank)  # what the planner prices for this rank
        named = dict(meta.named_parameters())
        stage = cost.stages_of(plan, state_of(meta).stages or (), config.n_layers)[mesh.coords.get("pp", 0)]
        predicted = _grouped(cost.traffic(config, plan, named, stage, BATCH, SEQ, spec=zoo.spec_of(meta)))

        held = zero.model_state_bytes(model, opt)  # after the step: no gradients held
        want = cost.model_states(list(named.values()), plan, dp_rank=mesh.coords.get("dpsp", mesh.coords.get("dp", 0)),
                                 experts=cost.expert_parameters(named, zoo.spec_of(meta)))
        states = {"params": (held["params"], want["params"]), "optimizer": (held["optimizer"], want["optimizer"]),
                  "masters": (held["masters"], want["masters"])}
        if plan.pp == 1:  # gradients as a backward leaves them (train_step's own are cleared by its step)
            share = cuboid.rank_share(model, batch)
            model(**share).loss.backward()
            states["grads"] = (zero.model_state_bytes(model, opt)["grads"], want["grads"])
            opt.zero_grad(set_to_none=True)
        report[spec if isinstance(spec, str) else plan.describe()] = {
            "sent": (measured, predicted), "states": states, "routed": routed.result(config)}
    return report


def stepped(config, spec, rows: int, seq: int, lr: float = 1e-3, seed: int = 1) -> tuple:
    """(model, AdamW, batch): ``config`` loaded under plan ``spec`` (seed 0) after one ``train_step`` of a random
    ``rows`` x ``seq`` batch (``seed``), so that the optimizer's state and every engine's buffers exist."""
    import cuboid
    from cuboid.parallel.optim import AdamW

    torch.manual_seed(0)
    model = cuboid.load(config, plan=spec)
    opt = AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "labels": ids}
    cuboid.train_step(model, opt, batch)
    return model, opt, batch


class RoutedPairs:
    """Under ``ep``: while open, how many of this rank's (token, choice) pairs each sparse layer's router sends to
    an expert on another rank, per forward (a recomputed forward routes again), to price the all-to-alls of the
    routing the run made: :func:`routed_bytes`."""

    def __init__(self, model, plan, mesh) -> None:
        self.model, self.ep = model, plan.ep
        self.recomputed = 2 if plan.checkpoint != "none" else 1  # forwards of each block per step
        self.rank = mesh.coords.get("ep", 0)
        self.pairs, self.forwards, self.handles = 0, 0, []

    def __enter__(self):
        if self.ep > 1:
            self.handles = [m.register_forward_hook(self._hook) for n, m in self.model.named_modules()
                            if n.endswith("mlp.router")]
        return self

    def _hook(self, mod, _inputs, output) -> None:
        per_rank = mod.n_experts // self.ep
        self.pairs += int((output[2] // per_rank != self.rank).sum())
        self.forwards += 1

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def result(self, config) -> dict:
        return {"pairs": self.pairs, "forwards": self.forwards, "ep": self.ep, "recomputed": self.recomputed,
                "row_bytes": getattr(config, "dim", 0) * 4, "experts": getattr(config, "n_experts", 0)}


def routed_bytes(routed: list) -> float:
    """Bytes the ranks of a world send over ``ep`` in a step, summed over them, from the routing they made
    (:class:`RoutedPairs`, one per rank): per router forward (a recomputed one too) the counts exchange,
    ``(ep - 1) / ep x 8 E`` bytes a rank, and each pair routed off its rank a row sent there (dispatch) and a row
    sent back (combine); backward sends each of a forward's rows once more as a gradient. The world sends as
    many combine rows as dispatch rows, so the sum over ranks is exact whatever the routing."""
    counts = sum(r["forwards"] * (r["ep"] - 1) / r["ep"] * 8 * r["experts"] for r in routed)
    rows = sum(2 * r["pairs"] + 2 * r["pairs"] / r["recomputed"] for r in routed)
    return counts + rows * routed[0]["row_bytes"]


def check_cost(reports) -> None:
    """Every group's bytes sent and every state's bytes held equal the cost model's on every rank; the experts'
    all-to-alls (whose bytes follow the routing a run makes, the model pricing an even one) equal, summed over
    the ranks, the formula applied to the routing the ranks made (:func:`routed_bytes`)."""
    assert reports
    for rank, report in enumerate(reports):
        assert report
        for plan, r in report.items():
            measured, predicted = r["sent"]
            assert set(measured) == set(predicted), (rank, plan, "groups differ", measured, predicted)
            for g in measured:
                if g == "ep":
                    continue
                assert abs(measured[g] - predicted[g]) <= 1e-9 * max(measured[g], 1.0), (
                    rank, plan, g, "bytes sent", measured[g], predicted[g])
            for what, (got, want) in r["states"].items():
                assert got == want, (rank, plan, what, "bytes held", got, want)
    for plan in reports[0]:
        if "ep" in reports[0][plan]["sent"][0]:
            world = sum(r[plan]["sent"][0]["ep"] for r in reports)
            routed = routed_bytes([r[plan]["routed"] for r in reports])
            assert abs(world - routed) <= 1e-9 * world, (plan, "ep bytes sent over the world", world, routed)


# a model big enough that matmuls, not Python, take most of a step on one CPU core
TIMED = dict(vocab_size=1024, n_positions=128, dim=256, n_layers=4, n_heads=8, mlp_hidden=0)
TIMED_BATCH, TIMED_SEQ = 8, 128


def time_worker(plans, steps: int = 3) -> dict:
    """Median seconds of ``steps`` timed ``train_step`` calls (after one untimed) per plan on this rank."""
    from cuboid import zoo

    config = zoo.config_of("gpt-debug", **TIMED)
    out = {}
    for spec in plans:
        out[spec] = median_step(*stepped(config, spec, TIMED_BATCH, TIMED_SEQ, lr=1e-4, seed=2), steps)
    return out


def median_step(model, opt, batch, steps: int) -> float:
    """Median seconds of ``steps`` ``train_step`` calls, the ranks lined up before each."""
    import statistics
    import time

    import cuboid

    times = []
    for _ in range(steps):
        model.parallel.mesh.barrier()
        t0 = time.perf_counter()
        cuboid.train_step(model, opt, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
