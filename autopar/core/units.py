"""Quantities written for people: byte counts in the unit that keeps them readable (one place, for the
plan views and the planner's messages alike)."""

from __future__ import annotations


def fmt_bytes(b: float) -> str:
    """``b`` bytes as ``1.50 GiB``, ``12.00 KiB`` or ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"
