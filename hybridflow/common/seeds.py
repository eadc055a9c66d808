"""Deterministic seeds derived from integers, so every rank and every step draws from its own reproducible stream."""

from __future__ import annotations


def derive_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (base seed, step, rank, ...)."""
    h = 0x9E3779B1
    for p in parts:
        h = (h * 0x01000193 ^ (int(p) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return h & 0x7FFFFFFF
