"""Version strings as integer tuples: one parser for package versions (``2.20.2``,
``0.16.1.dev0``, ``2.9.0+cu12``), CUDA versions (``12.8``) and user input (``--te 2.9``)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

__all__ = ["version_tuple"]


def version_tuple(v: Union[None, str, Sequence[int]], width: Optional[int] = None) -> Optional[Tuple[int, ...]]:
    """``"2.20.2"`` -> ``(2, 20, 2)``. The local part (``+cu12``) is dropped; parsing stops at the
    first part that does not start with a digit (``dev0``) and after a part with a suffix
    (``2rc1`` -> 2). ``None``, ``"auto"`` or no leading number -> ``None``; a sequence is taken as
    given. ``width``: pad with zeros / cut to that many parts (``"12"`` -> ``(12, 0)`` for 2)."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "auto")):
        return None
    if isinstance(v, (tuple, list)):
        parts = [int(x) for x in v]
    else:
        parts = []
        for p in str(v).strip().split("+")[0].split("."):
            digits = ""
            for ch in p:
                if not ch.isdigit():
                    break
                digits += ch
            if not digits:
                break
            parts.append(int(digits))
            if digits != p:
                break
    if not parts:
        return None
    if width is not None:
        parts = (parts + [0] * width)[:width]
    return tuple(parts)
