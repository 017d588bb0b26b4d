"""The control-file protocol: what a write to ``/.tierfs/control`` may say, and how it is applied.

A write holds lines; each line is a command or ``KEY=VALUE`` items (several per line allowed)::

    rf=8 advance=strict
    next-pass
    advance
    feedback loss=0.71 train_err=0.2 val_err=0.31 [score=0.5]

:func:`parse_control` turns the whole write into one :class:`ControlRequest` or raises ``ValueError`` with a
message for ``last_error``; :func:`apply_control` validates everything that can fail first and then applies the
request all at once, so a write with one bad item changes nothing.  Settings go through the one option table
and parser in :mod:`tierfs.options` (``live_only``: the cache dir, the backing dir, the mountpoint and the other
mount-time options are refused by name).

**Which pass a ``feedback`` line is about.**  A trainer reports after it has trained on a pass, but tierfs ends
a pass when the last file of the view is *opened* -- so when that pass was the rf-th, tierfs has already
switched to the next mini-epoch by the time the feedback arrives.  A feedback line is therefore about the last
*completed* pass and its mini-epoch (:attr:`Engine.last_pass`; the current mini-epoch if no pass has ended
yet): the :class:`Arf` controller scores it within that mini-epoch (its best score and wait counter start
afresh only at the first feedback about a new mini-epoch), and its history records that epoch and mini-epoch.
An ``advance`` decision applies only while that mini-epoch is still current; about one already left it is
recorded and has no effect (the switch it asks for has happened).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sampler.arf import Controller, make_controller
from tierfs.options import Settings, apply_assignments, parse_assignments

if TYPE_CHECKING:
    from tierfs.engine import Engine

__all__ = ["COMMANDS", "Arf", "ControlRequest", "apply_control", "apply_feedback", "parse_control"]

_REPLAN_KEYS = frozenset({"nm", "mini_epoch_size", "composition"})
_ARF_KEYS = frozenset({"arf", "arf_wait", "arf_window", "arf_k", "arf_weights"})

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


# ------------------------------------------------------------------------------------------------- applying


class Arf:
    """The ARF controller fed by ``feedback`` lines, and the mini-epoch its per-mini-epoch state is about."""

    def __init__(self, controller: Controller | None = None, history: list[dict[str, Any]] | None = None) -> None:
        self.controller = controller or make_controller("off")
        self.controller.history.extend(history or ())
        self.about: tuple[int, int] | None = None  # (epoch, mini_epoch) of the observations so far

    @staticmethod
    def controller_for(settings: Settings) -> Controller:
        """A fresh controller for ``settings`` (``ValueError`` on a bad combination)."""
        s = settings
        return make_controller(s.arf, wait=s.arf_wait, window=s.arf_window, k=s.arf_k, weights=s.arf_weights)

    @property
    def score(self) -> float | None:
        return self.controller.score

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.controller.history

    def replace(self, controller: Controller) -> None:
        """New ARF settings: a fresh controller that keeps the history."""
        controller.history = self.controller.history
        self.controller = controller
        self.about = None

    def observe(self, metrics: Mapping[str, float], about: tuple[int, int]) -> str:
        """Score one feedback about a pass of mini-epoch ``about`` = (epoch, mini_epoch); returns the decision."""
        if about != self.about:
            self.controller.new_mini_epoch(about[1])
            self.about = about
        decision = self.controller.observe(metrics)
        self.controller.history[-1]["epoch"] = about[0]
        return decision


def apply_feedback(engine: Engine, metrics: Mapping[str, float]) -> None:
    """Feed one ``feedback`` line to ARF, attributed to the last completed pass (see the module docstring)."""
    about = engine.last_pass or engine.current_mini_epoch
    decision = engine.arf.observe(metrics, about)
    if decision == "advance" and engine.settings.arf != "off" and about == engine.current_mini_epoch:
        engine.request_advance()


def apply_control(engine: Engine, data: bytes) -> None:
    """Apply one write to the control file, all of it or (``ValueError``, ``last_error`` set) nothing."""
    try:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("control writes must be UTF-8 text") from None
        req = parse_control(text, engine.settings)
        new = req.settings
        replan = bool(req.changed & _REPLAN_KEYS) and new.policy == "met"
        if replan:
            engine.check_plan(new)
        controller = Arf.controller_for(new) if req.changed & _ARF_KEYS else None
    except ValueError as exc:
        engine.last_error = str(exc)
        raise
    engine.last_error = None
    engine.apply_settings(new, replan=replan)
    if controller is not None:
        engine.arf.replace(controller)
    for cmd in req.commands:
        if cmd == "next-pass":
            engine.end_pass()
        elif cmd == "advance":
            engine.request_advance()
    for metrics in req.feedback:
        apply_feedback(engine, metrics)
    if "rf" in req.changed:
        engine.rf_changed()
    engine.save_journal()
    engine.notify()
