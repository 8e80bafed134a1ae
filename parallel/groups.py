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


def is_named(group) -> bool:
    """Whether ``group`` was given a name with :func:`name_group`."""
    entry = _NAMES.get(id(group))
    return entry is not None and entry[0] is group


def group_name(group) -> str:
    """The name :func:`name_group` gave ``group``, else ``group[r0,r1,...]`` (its global ranks)."""
    if group is None:
        return "none"
    if is_named(group):
        return _NAMES[id(group)][1]
    try:
        return "group[" + ",".join(map(str, dist.get_process_group_ranks(group))) + "]"
    except Exception:  # noqa: BLE001 - a name is only a label
        return f"group@{id(group):x}"
