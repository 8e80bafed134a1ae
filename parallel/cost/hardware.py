"""Hardware profiles for the cost model: FLOP/s, memory, links, and how a collective is priced on them.

A profile is a TOML file (``parallel/cost/profiles/*.toml``; ``local`` is measured
on this machine by ``cuboid plans --calibrate``). :meth:`Hardware.collective_time`
prices one group's traffic:

- a group inside one node runs on the intra-node link (NVLink);
- a ring that spans nodes is hierarchical, as NCCL runs it: a reduce-scatter
  inside each node over NVLink, the cross-node part over all the node's NICs
  at once (each of the ``k`` ranks a node holds of the group carries ``1 / k``
  of the bytes on its own NIC: the profiles' ``inter`` bandwidth is per GPU,
  one HCA per GPU), then an all-gather inside the node;
- point-to-point sends and broadcasts between nodes run on one NIC.

:meth:`Hardware.efficiency` is the fraction of the profile's sustained matmul
rate a GEMM of a given smallest dimension reaches (``d / (d + half_rate_dim)``,
relative to a large one): tensor-parallel slices and one-sequence
micro-batches run slower per FLOP than whole layers. CPU profiles leave it
at 1 (their rate is measured at the block sizes they run).

:func:`detect_hardware` names the profile for this process's device (a CUDA
device's name, else the CPU's ``local`` profile) and :func:`free_memory_bytes`
the memory a rank may use now.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

HARDWARE_DIR = Path(__file__).with_name("profiles")
# substrings of torch.cuda.get_device_name() -> shipped profile (the first match wins)
CUDA_PROFILES = (("H200", "h200"), ("H100", "h100"), ("H800", "h100"), ("A100", "a100"), ("A800", "a100"),
                 ("V100", "longhorn_v100"), ("RTX 5000", "frontera_rtx"))
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha_s`` per collective, ``bytes_per_s`` per rank and direction."""

    alpha_s: float
    bytes_per_s: float

    def time(self, nbytes: float, calls: float) -> float:
        return calls * self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Hardware:
    """A hardware profile: sustained FLOP/s per device by dtype, memory, and two links."""

    name: str
    gpus_per_node: int
    memory_bytes: float
    flops: dict                      # dtype name -> sustained FLOP/s per device (large matmuls)
    memory_bytes_per_s: float
    intra: Link
    inter: Link
    description: str = ""
    source: str = ""
    cores: int = 0                   # CPU profiles: devices beyond this many share the cores
    elementwise_ns: float = 0.0      # CPU profiles: ns per activation element per step (norms, softmax, adds)
    busy: float = 1.0                # CPU profiles: slowdown of a rank when every core runs one
    oversubscribed: float = 1.0      # CPU profiles: extra slowdown at two ranks per core, beyond time slicing
    half_rate_dim: float = 0.0       # a GEMM whose smallest dimension is this runs at half the large-GEMM rate
    overlap: float = 1.0             # share of overlappable communication hidden behind compute (CPU: 0, the
                                     # collectives run on the cores the compute needs)

    def rate(self, dtype: str) -> float:
        """Sustained matmul FLOP/s of one rank (GPU profiles: of training, other work included)."""
        if dtype not in self.flops:
            raise ValueError(f"hardware profile {self.name} has no FLOP/s for dtype {dtype}")
        return float(self.flops[dtype])

    def efficiency(self, dim: float) -> float:
        """Fraction of :meth:`rate` a GEMM reaches whose smallest dimension is ``dim`` (1 on CPU profiles)."""
        if self.half_rate_dim <= 0 or dim <= 0:
            return 1.0
        return dim / (dim + self.half_rate_dim)

    def crowding(self, ranks_here: int) -> float:
        """Slowdown of every part of a rank's step when ``ranks_here`` ranks share the node's cores (CPU
        profiles; 1 on accelerators): ``busy`` once the cores are all in use, times the time slicing of
        more ranks than cores, and ``oversubscribed``'s measured extra at two ranks per core."""
        if not self.cores:
            return 1.0
        share = ranks_here / self.cores
        if share <= 1:
            return 1.0 + (self.busy - 1.0) * max(0.0, (ranks_here - 1) / max(self.cores - 1, 1))
        return self.busy * share * (1.0 + (self.oversubscribed - 1.0) * min(1.0, share - 1.0))

    def link(self, ranks: Sequence[int]) -> Link:
        """The link a group of global ``ranks`` uses: intra-node when all sit on one node."""
        nodes = {r // self.gpus_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    def collective_time(self, op: str, nbytes: float, calls: float, ranks: Sequence[int]) -> float:
        """Seconds of ``calls`` collectives ``op`` over the group of global ``ranks`` in which this rank sends
        ``nbytes`` (a flat ring's bytes, :mod:`.comm`'s convention). Inside a node: the intra link. Across
        nodes, a ring collective is hierarchical (module docstring); sends and broadcasts use one NIC."""
        ranks = list(ranks) or [0]
        per_node: dict = {}
        for r in ranks:
            per_node[r // self.gpus_per_node] = per_node.get(r // self.gpus_per_node, 0) + 1
        n, nodes = len(ranks), len(per_node)
        if nodes <= 1:
            return self.intra.time(nbytes, calls)
        k = max(per_node.values())
        if op not in COLLECTIVES or k == 1 or n == 1:
            return self.inter.time(nbytes, calls)
        flat = (n - 1) / n                          # the flat ring's share; the hierarchy's two legs:
        intra_share = ((k - 1) / k) / flat          # inside the node, the whole buffer
        inter_share = ((nodes - 1) / nodes / k) / flat  # across nodes, 1 / k of it on each of k NICs
        return (calls * (self.intra.alpha_s + self.inter.alpha_s) + nbytes * intra_share / self.intra.bytes_per_s
                + nbytes * inter_share / self.inter.bytes_per_s)

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "Hardware":
        try:
            return cls(name=d.get("name", name), gpus_per_node=int(d["gpus_per_node"]),
                       memory_bytes=float(d["memory_gb"]) * 1e9,
                       flops={k: float(v) for k, v in d["flops"].items()},
                       memory_bytes_per_s=float(d["memory_bandwidth_gbs"]) * 1e9,
                       intra=Link(float(d["intra"]["alpha_us"]) * 1e-6, float(d["intra"]["bandwidth_gbs"]) * 1e9),
                       inter=Link(float(d["inter"]["alpha_us"]) * 1e-6, float(d["inter"]["bandwidth_gbs"]) * 1e9),
                       description=d.get("description", ""), source=d.get("source", ""),
                       cores=int(d.get("cores", 0)), elementwise_ns=float(d.get("elementwise_ns", 0.0)),
                       busy=float(d.get("busy", 1.0)), oversubscribed=float(d.get("oversubscribed", 1.0)),
                       half_rate_dim=float(d.get("half_rate_dim", 0.0)),
                       overlap=float(d.get("overlap", 0.0 if int(d.get("cores", 0)) else 1.0)))
        except KeyError as e:
            raise ValueError(f"hardware profile {name or d.get('name', '?')} lacks the field {e.args[0]}") from None

    def to_toml(self) -> str:
        f = ", ".join(f"{k} = {v:.4g}" for k, v in self.flops.items())
        return (f'name = "{self.name}"\ndescription = "{self.description}"\nsource = "{self.source}"\n'
                f"gpus_per_node = {self.gpus_per_node}\ncores = {self.cores}\n"
                f"elementwise_ns = {self.elementwise_ns:.4g}\nbusy = {self.busy:.4g}\n"
                f"oversubscribed = {self.oversubscribed:.4g}\n"
                f"half_rate_dim = {self.half_rate_dim:.4g}\noverlap = {self.overlap:.4g}\n"
                f"memory_gb = {self.memory_bytes / 1e9:.4g}\nmemory_bandwidth_gbs = {self.memory_bytes_per_s / 1e9:.4g}\n"
                f"flops = {{ {f} }}\n"
                f"intra = {{ alpha_us = {self.intra.alpha_s * 1e6:.4g}, bandwidth_gbs = {self.intra.bytes_per_s / 1e9:.4g} }}\n"
                f"inter = {{ alpha_us = {self.inter.alpha_s * 1e6:.4g}, bandwidth_gbs = {self.inter.bytes_per_s / 1e9:.4g} }}\n")


def user_hardware_dir() -> Path:
    """Where ``cuboid plans --calibrate`` writes ``local.toml`` (``$CUBOID_HOME/hardware``, default
    ``~/.cache/cuboid/hardware``)."""
    home = os.environ.get("CUBOID_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "cuboid")
    return Path(home) / "hardware"


def profile_names() -> list[str]:
    names = {p.stem for p in HARDWARE_DIR.glob("*.toml")} | {p.stem for p in user_hardware_dir().glob("*.toml")}
    return sorted(names)


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (the user's calibrated ones first, then the shipped ones) or a .toml path."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".toml") and path.is_file()):
        path = next((d / f"{name_or_path}.toml" for d in (user_hardware_dir(), HARDWARE_DIR)
                     if (d / f"{name_or_path}.toml").is_file()), None)
        if path is None:
            raise ValueError(f"unknown hardware profile {name_or_path!r}: give one of "
                             f"{', '.join(profile_names())} or a .toml file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"hardware profile {path} is not valid TOML: {e}") from None
    return Hardware.from_dict(data, path.stem)


def profile_for_device(device_name: Optional[str]) -> str:
    """The shipped profile for a CUDA device name (``"NVIDIA H100 80GB HBM3"`` -> ``h100``); ``local`` for None
    (a CPU). An unknown GPU is an error that names the profiles to pick from."""
    if device_name is None:
        return "local"
    for key, profile in CUDA_PROFILES:
        if key.lower() in device_name.lower():
            return profile
    raise ValueError(f"no hardware profile for the device {device_name!r}: give one of {', '.join(profile_names())} "
                     "(cuboid plans --list-hardware) or a .toml file")


def detect_hardware() -> Hardware:
    """This process's hardware profile: the CUDA device's (by name), else the CPU's ``local`` one."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return load_hardware(profile_for_device(name))


def free_memory_bytes(ranks_here: int = 1) -> float:
    """Memory a rank may use now: the CUDA device's free bytes, or on CPU the machine's ``MemAvailable``
    shared by the ``ranks_here`` ranks of this node."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return float(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / max(ranks_here, 1)
    except OSError:  # pragma: no cover - not Linux
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(ranks_here, 1)
