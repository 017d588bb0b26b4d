"""The control-file protocol: what a write to ``/.tierfs/control`` may say, parsed before anything changes.

A write holds lines; each line is a command or ``KEY=VALUE`` items (several per line allowed)::

    rf=8 advance=strict
    next-pass
    advance
    feedback loss=0.71 train_err=0.2 val_err=0.31 [score=0.5]

:func:`parse_control` turns the whole write into one :class:`ControlRequest` or raises ``ValueError`` with a
message for ``last_error``; the engine applies a request all at once, so a write with one bad item changes
nothing.  Settings go through the one option table and parser in :mod:`tierfs.options` (``live_only``: the
cache dir, the backing dir, the mountpoint and the other mount-time options are refused by name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierfs.options import Settings, apply_assignments, parse_assignments

__all__ = ["COMMANDS", "ControlRequest", "parse_control"]

COMMANDS = ("next-pass", "advance", "feedback")
_FEEDBACK_KEYS = ("loss", "train_err", "val_err", "score")


@dataclass(frozen=True)
class ControlRequest:
    settings: Settings
    changed: frozenset[str] = frozenset()
    commands: tuple[str, ...] = ()  # "next-pass" / "advance", in the order written
    feedback: tuple[dict[str, float], ...] = field(default_factory=tuple)


def _parse_feedback(words: list[str]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for key, text in parse_assignments(" ".join(words)):
        if key not in _FEEDBACK_KEYS:
            raise ValueError(f"feedback: unknown metric {key!r} (expected {', '.join(_FEEDBACK_KEYS)})")
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"feedback: {key} must be a number, got {text!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"feedback: {key} must be finite, got {text!r}")
        metrics[key] = v
    if not metrics:
        raise ValueError("feedback needs at least one of loss=, train_err=, val_err=, score=")
    return metrics


def parse_control(text: str, settings: Settings) -> ControlRequest:
    """Parse one write against the current ``settings``; ``ValueError`` if any part of it is bad."""
    assignments: list[tuple[str, str]] = []
    commands: list[str] = []
    feedback: list[dict[str, float]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        head = words[0].replace("_", "-").lower()
        if head == "feedback":
            feedback.append(_parse_feedback(words[1:]))
        elif head in ("next-pass", "advance") and len(words) == 1:
            commands.append(head)
        elif head in ("next-pass", "advance") and "=" not in words[0]:
            raise ValueError(f"{head} takes no arguments, got {line!r}")
        else:
            assignments.extend(parse_assignments(line))
    for key, value in assignments:
        if value == "" and key in ("next_pass", "advance"):
            raise ValueError(f"{key.replace('_', '-')} is a command: write it on a line of its own")
    new = apply_assignments(settings, assignments, live_only=True)
    if not (assignments or commands or feedback):
        raise ValueError("empty control write (expected KEY=VALUE lines or next-pass, advance, feedback)")
    return ControlRequest(new, frozenset(k for k, _ in assignments), tuple(commands), tuple(feedback))
