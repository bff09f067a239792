"""The size ladders every engine compiles its programs over. Pure Python.

A ladder is a short list of sizes, each `factor` times the one before, closed by the largest size
itself: one program per rung, and any size up to the top fits the least rung that holds it. The
generation engine's token ladder (engine.step.buckets), the embedding engine's rows and
lengths (engine.embed.engine) and the speech engine's slots and feeds (engine.transcribe.engine)
all climb one.
"""

from __future__ import annotations


def ladder(first: int, top: int, factor: int = 2) -> list[int]:
    """first, first * factor, first * factor^2, ... below `top`, then `top` (first >= 1, factor >= 2)."""
    sizes, size = [], first
    while size < top:
        sizes.append(size)
        size *= factor
    return sizes + [top]
