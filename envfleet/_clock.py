"""Durations as people read them, for the command line and the benchmark engine alike."""

from __future__ import annotations


def clock(seconds: float) -> str:
    """``1:05`` for 65 s, ``1:02:03`` past an hour."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


__all__ = ["clock"]
