"""The data room's one error class, below every data module (chat, damage, formats, sft import it)."""
from __future__ import annotations


class DataError(ValueError):
    """Bad data or a bad column: one line that says what is wrong. :mod:`cuboid.data.formats` is its public
    home; the modules of the data room raise this one class."""
