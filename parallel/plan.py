"""A parallel plan: data that says how a model is spread over devices.

A :class:`Plan` is a frozen dataclass that round-trips through dicts, JSON and
TOML, and parses from the inline ``dp=2,tp=2`` form the CLI takes. It knows
nothing of any model: :meth:`Plan.validate` takes the model's config (any
object with ``n_heads``/``dim``/``vocab_size``/``n_layers`` attributes where
they exist) and the world size, and says in one sentence what does not fit.

Fields (sizes multiply to the world size: ``dp * pp * tp * sp``):

- ``dp``: data-parallel replicas (gradients averaged over the ``dp`` group);
- ``pp``: pipeline stages, with ``microbatches`` and ``schedule``
  (``gpipe | 1f1b | interleaved | zbv``); ``microbatches`` left out (0) is what the
  schedule needs: ``pp`` for 1f1b, interleaved and zbv, else 1 (:func:`default_microbatches`);
- ``tp``: tensor-parallel ranks laid out by ``tp_mode``: ``1d`` (Megatron),
  ``2d`` (q x q, tp = q^2), ``2.5d`` (depth x q x q, tp = depth q^2),
  ``3d`` (q x q x q, tp = q^3);
- ``sp``: sequence-parallel ranks, ``sp_mode`` ``ring | all_to_all``;
- ``zero``: 0 (off), 1 (optimizer state sharded over dp, or dp x sp under sp), 2 (+ gradients),
  3 (+ parameters), see :mod:`cuboid.parallel.zero`;
- ``tp_sequence``: under 1D ``tp``, the norms, dropout and residual stream
  between the linears hold only ``T / tp`` tokens (Megatron's sequence
  parallelism: all-gather before column linears, reduce-scatter after row
  linears);
- ``checkpoint``: activation checkpointing per block, ``none | full | selective``:
  ``full`` keeps each block's input and recomputes the whole block in backward;
  ``selective`` keeps the outputs of the block's matmuls, attention and
  collectives and recomputes only the cheap ops between them (norms,
  activations, dropout, adds), see :func:`cuboid.parallel.recompute.recompute_blocks`.
  ``activation_checkpoint=true|false`` is another spelling of ``full`` /
  ``none`` that :meth:`Plan.parse`, :meth:`Plan.from_dict` and
  :meth:`Plan.replace` accept (plan strings and saved plans use it); it is
  not a field, and :meth:`Plan.describe` writes ``checkpoint=full``;
- ``dtype``: ``fp32 | bf16 | fp16`` for training (autocast);
- ``ep``: expert-parallel ranks of a mixture-of-experts model, taken from the
  ``dp x sp`` ranks (torchtitan's layout: it does not change the world size):
  each holds ``n_experts / ep`` experts, tokens reach them by all-to-all, and
  an expert's gradients are averaged over the ``dp x sp / ep`` ranks holding
  the same experts, see :mod:`cuboid.parallel.experts`;
- ``compile``: ``torch.compile`` each block (torchtitan's per-block compile),
  where the plan composes with it (:meth:`Plan.unimplemented` says where not).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

TP_MODES = ("1d", "2d", "2.5d", "3d")
SP_MODES = ("ring", "all_to_all")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
DTYPES = ("fp32", "bf16", "fp16")
CHECKPOINTS = ("none", "full", "selective")


def _int_root(n: int, k: int) -> Optional[int]:
    r = round(n ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c > 0 and c ** k == n:
            return c
    return None


def default_microbatches(pp: int, schedule: str) -> int:
    """The micro-batches a plan that names none gets: ``pp`` for the schedules that need at least one per
    stage (1f1b, interleaved, zbv), 1 without pipeline or under gpipe."""
    return pp if pp > 1 and schedule != "gpipe" else 1


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    tp_mode: str = "1d"
    depth: int = 1                      # 2.5D depth d (tp = d * q * q)
    sp_mode: str = "ring"
    zero: int = 0
    microbatches: int = 0               # 0: what the schedule needs (default_microbatches)
    schedule: str = "1f1b"
    dtype: str = "fp32"
    stage_blocks: tuple = ()            # blocks per pipeline stage, overriding the cost-balanced cut ("2/1/1")
    tp_sequence: bool = False           # 1D tp: norms, dropout and residuals sharded along the sequence (Megatron)
    checkpoint: str = "none"            # recompute per block: none | full | selective
    ep: int = 1                         # expert-parallel ranks, taken from dp x sp (mixture-of-experts models)
    compile: bool = False               # torch.compile each block

    def __post_init__(self) -> None:
        blocks = self.stage_blocks
        if isinstance(blocks, str):
            try:
                blocks = tuple(int(b) for b in blocks.split("/")) if blocks else ()
            except ValueError:
                raise ValueError(f"plan field stage_blocks takes block counts per stage like 2/1/1, "
                                 f"got {self.stage_blocks!r}") from None
        if not isinstance(blocks, (tuple, list)):
            raise ValueError(f"plan field stage_blocks takes block counts per stage like 2/1/1 or [2, 1, 1], "
                             f"got {self.stage_blocks!r}")
        blocks = tuple(blocks)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
            raise ValueError(f"plan field stage_blocks must be whole numbers >= 0, got {self.stage_blocks!r}")
        object.__setattr__(self, "stage_blocks", blocks)
        if self.microbatches == 0 and isinstance(self.pp, int) and self.schedule in SCHEDULES:
            object.__setattr__(self, "microbatches", default_microbatches(self.pp, self.schedule))
        for name in ("dp", "pp", "tp", "sp", "depth", "microbatches", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"plan field {name} must be a whole number >= 1, got {value!r}")
        for name, allowed in (("tp_mode", TP_MODES), ("sp_mode", SP_MODES), ("schedule", SCHEDULES),
                              ("dtype", DTYPES)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in allowed:
                raise ValueError(f"plan field {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not isinstance(self.zero, int) or isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"plan field zero must be 0, 1, 2 or 3, got {self.zero!r}")
        for name in ("tp_sequence", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"plan field {name} must be true or false, got {getattr(self, name)!r}")
        if (self.dp * self.sp) % self.ep:
            raise ValueError(f"ep={self.ep} expert-parallel ranks are taken from the dp x sp = {self.dp * self.sp} "
                             f"data ranks, which they must divide")
        if self.tp_sequence and (self.tp == 1 or self.tp_mode != "1d"):
            raise ValueError(f"tp_sequence shards the sequence inside a 1D tensor-parallel group: it needs "
                             f"tp > 1 and tp_mode 1d, got tp={self.tp}, tp_mode={self.tp_mode}")
        if not isinstance(self.checkpoint, str) or self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"plan field checkpoint must be one of {', '.join(CHECKPOINTS)}, got {self.checkpoint!r}")
        if self.depth != 1 and self.tp_mode != "2.5d":
            raise ValueError(f"depth={self.depth} only applies to tp_mode 2.5d, not {self.tp_mode}")

    # ------------------------------------------------------------ shape

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.sp

    @property
    def tp_grid(self) -> tuple[int, ...]:
        """The tensor-parallel grid: (tp,) for 1D, (q, q), (d, q, q) or (q, q, q)."""
        if self.tp_mode == "1d":
            return (self.tp,)
        if self.tp_mode == "2d":
            q = _int_root(self.tp, 2)
            if q is None:
                raise ValueError(f"tp_mode 2d needs tp to be a square (q*q), got tp={self.tp}")
            return (q, q)
        if self.tp_mode == "2.5d":
            q = _int_root(self.tp // self.depth, 2) if self.tp % self.depth == 0 else None
            if q is None:
                raise ValueError(f"tp_mode 2.5d needs tp = depth*q*q, got tp={self.tp} with depth={self.depth}")
            return (self.depth, q, q)
        q = _int_root(self.tp, 3)
        if q is None:
            raise ValueError(f"tp_mode 3d needs tp to be a cube (q*q*q), got tp={self.tp}")
        return (q, q, q)

    @property
    def batch_parts(self) -> int:
        """How many blocks the tensor mode cuts each dp rank's batch into (1 for 1D)."""
        if self.tp == 1 or self.tp_mode == "1d":
            return 1
        grid = self.tp_grid
        return {"2d": grid[0], "2.5d": grid[0] * grid[1], "3d": grid[0] ** 2}[self.tp_mode]

    def validate(self, model_config: Any = None, world_size: Optional[int] = None) -> "Plan":
        """Raise a one-sentence ``ValueError`` when the plan does not fit; returns self."""
        if self.sp > 1 and self.tp > 1 and self.tp_mode != "1d":
            raise ValueError(f"sequence parallelism (sp={self.sp}) does not combine with tp_mode {self.tp_mode}: "
                             f"the {self.tp_mode} grid already cuts each batch into blocks along rows and hidden "
                             "columns, so sequence chunks would have to cut across those blocks and ring attention "
                             "follow the grid's layout; use sp with tp_mode 1d, or the grid alone")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"plan {self.describe()} needs dp*pp*tp*sp = {self.world_size} processes, "
                f"but the world size is {world_size}"
            )
        grid = self.tp_grid
        if self.tp_mode == "2.5d" and (self.depth == 1 or grid[1] == 1):
            raise ValueError(f"tp_mode 2.5d needs depth >= 2 and q >= 2 (tp = depth*q*q), got depth={self.depth}, "
                             f"q={grid[1]}: depth 1 is tp_mode 2d, and q 1 is data parallelism over the depth")
        if self.pp > 1 and self.microbatches < self.pp and self.schedule != "gpipe":
            raise ValueError(f"schedule {self.schedule} with pp={self.pp} needs microbatches >= pp, "
                             f"got {self.microbatches}")
        if model_config is not None:
            heads = getattr(model_config, "n_heads", None)
            dim = getattr(model_config, "dim", None)
            layers = getattr(model_config, "n_layers", None)
            split = self.tp if self.tp_mode == "1d" else grid[-1]  # ranks that split the heads
            if heads is not None and heads % split:
                raise ValueError(f"{heads} attention heads do not divide over the tensor-parallel split of "
                                 f"{split} (tp={self.tp}, tp_mode={self.tp_mode})")
            kv = getattr(model_config, "n_kv_heads", None) or heads
            if kv is not None and kv != heads:  # grouped-query attention
                if self.tp_mode == "1d" and kv % split and split % kv:
                    raise ValueError(f"{kv} key/value heads neither divide over tp={split} nor are a divisor of it "
                                     "(1D cuts them like the query heads, or gives each rank a copy of one)")
                if self.tp_mode != "1d" and kv % split:
                    raise ValueError(f"{kv} key/value heads do not divide over the {split} ranks that split heads "
                                     f"in tp_mode {self.tp_mode}; use tp_mode 1d, which replicates them")
                local_kv = kv // split if kv % split == 0 else 1
                if self.sp > 1 and self.sp_mode == "all_to_all" and local_kv % self.sp:
                    raise ValueError(f"all_to_all sequence parallelism needs the key/value heads of each tensor rank "
                                     f"({local_kv} of {kv}) to divide over sp={self.sp}; use sp_mode ring")
            hidden_parts = 1 if self.tp_mode == "1d" else grid[-1] ** (3 if self.tp_mode == "3d" else 2)
            if dim is not None and dim % hidden_parts:
                raise ValueError(f"hidden size {dim} does not divide into the {hidden_parts} blocks the "
                                 f"{self.tp_mode} grid {'x'.join(map(str, grid))} needs")
            if heads is not None and self.sp > 1 and self.sp_mode == "all_to_all" and heads % (self.sp * split):
                raise ValueError(f"all_to_all sequence parallelism needs the {heads} attention heads to divide over "
                                 f"sp x the tensor split of heads = {self.sp} x {split}")
            experts = getattr(model_config, "n_experts", 0) or 0
            if self.ep > 1 and not experts:
                raise ValueError(f"ep={self.ep} shards a mixture-of-experts model's experts, and this model has none")
            if experts and experts % self.ep:
                raise ValueError(f"{experts} experts do not divide over ep={self.ep} expert-parallel ranks")
            if experts and self.tp > 1 and self.tp_mode != "1d":
                raise ValueError(f"a mixture-of-experts layer routes whole tokens, which tp_mode {self.tp_mode} cuts "
                                 "into hidden blocks: use tp_mode 1d, under which the experts stay whole on the tp "
                                 "ranks")
            if getattr(model_config, "qk_norm_width", "head") == "full" and self.tp > 1:
                raise ValueError("q/k norms over all heads' width (OLMoE) under tensor parallelism are not built: "
                                 "each tp rank holds some heads, and the norm needs them all; use dp, sp, pp or ep")
            if experts and self.tp_sequence:
                raise ValueError("tp_sequence with a mixture-of-experts model is not built: its routers and "
                                 "experts would see T / tp tokens; use tp without tp_sequence")
            stages = self.pp * (2 if self.schedule in ("interleaved", "zbv") else 1)
            if self.stage_blocks and (len(self.stage_blocks) != stages
                                      or (layers is not None and sum(self.stage_blocks) != layers)):
                raise ValueError(f"stage_blocks {'/'.join(map(str, self.stage_blocks))} must give each of the "
                                 f"{stages} pipeline stages its blocks, {layers} in all")
            if layers is not None and self.pp > 1 and stages > layers + 2:
                raise ValueError(f"{stages} pipeline stages for a model of {layers} layers (at most layers + 2: "
                                 f"the embeddings and the head may have a stage each)")
        return self

    def unimplemented(self) -> list[str]:
        """The features this plan asks for that this build does not have yet."""
        missing = []
        if self.tp_sequence and self.sp > 1:
            missing.append("tp_sequence with sequence parallelism")
        return missing

    def require_implemented(self) -> "Plan":
        missing = self.unimplemented()
        if missing:
            raise NotImplementedError(f"plan {self.describe()} needs {', '.join(missing)}, "
                                      "which this build of cuboid does not have yet")
        return self

    # ------------------------------------------------------------ (de)serialisation

    def describe(self) -> str:
        """The inline form, naming only fields that differ from the default."""
        default = Plan()
        parts = [f"{f.name}={_inline(getattr(self, f.name))}" for f in fields(self)
                 if getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(parts) or "single"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """A plan from its fields; ``activation_checkpoint`` is read as ``checkpoint`` (module docstring)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a plan is a table of fields ({', '.join(f.name for f in fields(cls))}), "
                             f"not a {_kind(data)}")
        data = _checkpoint_spelled(dict(data))
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) or "''" for k in set(data) - known)
        if unknown:
            raise ValueError(f"unknown plan field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from a JSON object of fields; any other JSON, or text that is not JSON, is a one-line error."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({' '.join(str(e).split())})") from None
        except RecursionError:
            raise ValueError("not valid JSON (nested too deeply to read)") from None
        return cls.from_dict(data)

    def to_toml(self) -> str:
        lines = []
        for k, v in self.to_dict().items():
            if isinstance(v, (str, list, tuple)):
                v = json.dumps(list(v) if isinstance(v, tuple) else v)  # JSON strings and lists are TOML
            elif isinstance(v, bool):
                v = str(v).lower()
            lines.append(f"{k} = {v}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> "Plan":
        """A plan from TOML: the fields at the top level, or in a ``[plan]`` table (nothing else beside it)."""
        import tomllib

        try:
            data = tomllib.loads(text)
        except ValueError as e:  # tomllib.TOMLDecodeError
            raise ValueError(f"not valid TOML ({' '.join(str(e).split())})") from None
        except RecursionError:
            raise ValueError("not valid TOML (nested too deeply to read)") from None
        if "plan" in data:
            if not isinstance(data["plan"], dict):
                raise ValueError(f"'plan' must be a [plan] table of fields, not a {_kind(data['plan'])} "
                                 f"({_FILE_KEYS})")
            if len(data) > 1:
                raise ValueError(f"keys {', '.join(sorted(k for k in data if k != 'plan'))} beside the [plan] "
                                 f"table ({_FILE_KEYS})")
            data = data["plan"]
        return cls.from_dict(data)

    @classmethod
    def parse(cls, spec: Union[str, "Plan", Mapping, None], ready: Optional[Mapping[str, "Plan"]] = None) -> "Plan":
        """A plan from a Plan, a dict, a ready-plan name, a .json/.toml file, or ``dp=2,tp=2``."""
        if spec is None:
            return cls()
        if isinstance(spec, Plan):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        text = str(spec).strip()
        if ready and text in ready:
            return ready[text]
        if text == "single":
            return cls()
        if text.endswith((".json", ".toml")):
            return cls.read(text)
        if "=" not in text:
            names = ", ".join(sorted(ready)) if ready else "single"
            raise ValueError(f"unknown plan {text!r}: give a ready plan ({names}), a .json/.toml file, "
                             "or fields like dp=2,tp=2")
        values: dict[str, Any] = {}
        for part in text.split(","):
            if "=" not in part:
                raise ValueError(f"plan part {part!r} is not of the form field=value")
            key, raw = (s.strip() for s in part.split("=", 1))
            values[key] = _parse_value(raw)
        return cls.from_dict(values)

    @classmethod
    def read(cls, path) -> "Plan":
        """A plan from a .json or .toml file (:data:`_FILE_KEYS`); every problem is one ``ValueError`` line
        that names the file."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"plan file {path} does not exist")
        size = path.stat().st_size
        if size > MAX_PLAN_FILE:
            raise ValueError(f"plan file {path} is {size} bytes, not a plan ({_FILE_KEYS})")
        try:
            body = path.read_bytes().decode("utf-8")
            return cls.from_json(body) if path.suffix == ".json" else cls.from_toml(body)
        except UnicodeDecodeError:
            raise ValueError(f"plan file {path}: not UTF-8 text ({_FILE_KEYS})") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"plan file {path}: {' '.join(str(e).split())}") from None

    def replace(self, **changes) -> "Plan":
        """A copy with ``changes``; ``activation_checkpoint=True`` / ``False`` sets ``checkpoint`` to full / none
        (of a selective plan too). Micro-batches that were the schedule's default follow a new ``pp`` or
        ``schedule``."""
        changes = _checkpoint_spelled(changes)
        if "microbatches" not in changes and ("pp" in changes or "schedule" in changes) and \
                self.microbatches == default_microbatches(self.pp, self.schedule):
            changes["microbatches"] = 0  # it was the schedule's default: it stays the new one's
        return replace(self, **changes)


def _checkpoint_spelled(values: dict) -> dict:
    """``values`` with ``activation_checkpoint`` read as ``checkpoint``: ``true`` is ``full`` (refused beside
    ``checkpoint=selective``), ``false`` leaves ``checkpoint`` as given (``none`` by default)."""
    if "activation_checkpoint" not in values:
        return values
    values = dict(values)
    flag = values.pop("activation_checkpoint")
    if not isinstance(flag, bool):
        raise ValueError(f"plan field activation_checkpoint must be true or false, got {flag!r}"
                         + (" (selective recompute is checkpoint=selective)" if isinstance(flag, str) else ""))
    if flag and values.get("checkpoint") == "selective":
        raise ValueError("plan fields activation_checkpoint=true (whole blocks recomputed) and checkpoint=selective "
                         "contradict each other: give checkpoint=none, full or selective alone")
    if flag:
        values["checkpoint"] = "full"
    else:
        values.setdefault("checkpoint", "none")
    return values


MAX_PLAN_FILE = 1 << 20  # a plan file is a few lines; anything larger is not one
_FILE_KEYS = ("a plan file holds plan fields (" + ", ".join(f.name for f in fields(Plan)) + "): a JSON object, or "
              "TOML keys at the top level or in a [plan] table, e.g. dp = 2")


def _kind(value: Any) -> str:
    """What a JSON / TOML value is, in words: "list", "string", "number"..."""
    return {str: "string", list: "list", tuple: "list", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _inline(value: Any) -> str:
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(raw)
    except ValueError:
        return raw
