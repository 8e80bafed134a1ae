"""Human names of process groups (``dp``, ``tp``, ``tp_row``, ...), read by byte tallies and failure messages.

Below both :mod:`.comm` (tallies) and :mod:`.timeouts` (errors), which import
it; it imports neither.
"""
from __future__ import annotations

import torch.distributed as dist


_NAMES: dict[int, tuple[object, str]] = {}  # id(group) -> (group kept alive, name)


def name_group(group, name: str) -> None:
    """Give ``group`` a human name for the tallies (the mesh calls this for its groups)."""
    if group is not None:
        _NAMES[id(group)] = (group, name)


def group_name(group) -> str:
    if group is None:
        return "none"
    entry = _NAMES.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    try:
        return "group[" + ",".join(map(str, dist.get_process_group_ranks(group))) + "]"
    except Exception:  # noqa: BLE001 - a name is only a label
        return f"group@{id(group):x}"
