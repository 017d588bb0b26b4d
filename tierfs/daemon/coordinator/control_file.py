"""The control file, daemon side: how a write to ``/.tierfs/control`` is applied.

What a write may say is the protocol's (:func:`tierfs.common.protocol.parse_control`, the grammar the client checks
with too); this module applies a parsed write to the engine through :class:`ControlTarget`.

**A write is applied whole or refused whole, however the kernel splits it.**  The kernel hands a long
``write()`` to the daemon in pieces (FUSE's ``max_write``, 128 KiB to 1 MiB, or fewer bytes when the buffer
spans more pages than one request holds) and sends each piece only once the one before was answered; a piece
does not say whether more follow, and a piece answered "done" cannot be taken back (the writer would see a
short count with a prefix applied).  So :class:`ControlWriter` refuses any piece longer than
:data:`CONTROL_WRITE_MAX` with ``EFBIG`` and ``last_error``: a ``write()`` up to that size always arrives in one
piece and is applied whole (or refused whole: ``EINVAL``), and a longer one is refused at its first piece, so
the writer gets the error and nothing is applied.  A piece that starts past what its open file has written so
far (the later piece of a refused write, which only asynchronous I/O could still send) is refused the same
way.  Write longer input in several whole-line writes (``tierfs.client`` cuts its ``consumed`` reports so).

:func:`parse_control` turns the whole write into one ``ControlRequest`` or raises ``ValueError`` with a
message for ``last_error``; :func:`apply_control` validates everything that can fail first and then applies the
request all at once, so a write with one bad item changes nothing.

**Which pass a ``feedback`` line is about.**  A trainer reports after it has trained on a pass, but tierfs ends
a pass when the last file of the view is *opened* -- so when that pass was the rf-th, tierfs has already
switched to the next mini-epoch by the time the feedback arrives.  A feedback line is therefore about the last
*completed* pass and its mini-epoch (:attr:`PassRule.last_pass`; the current mini-epoch if no pass has ended
yet): the :class:`Arf` controller scores it within that mini-epoch (its best score and wait counter start
afresh only at the first feedback about a new mini-epoch), and its history records that epoch and mini-epoch.
An ``advance`` decision applies only while that mini-epoch is still current; about one already left it is
recorded and has no effect (the switch it asks for has happened).

The commands (``next-pass``, ``advance``, the ranks' shares, ``feedback``'s votes) go to the pass rule
(:class:`~tierfs.daemon.schedule.passes.PassRule`), the settings to the engine.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Protocol

from tierfs.common.options import Settings
from tierfs.common.protocol import CONTROL_WRITE_MAX, parse_control
from tierfs.daemon.schedule.arfs import Arf
from tierfs.daemon.schedule.consumers import ANONYMOUS
from tierfs.daemon.schedule.passes import PassRule

__all__ = ["BatchReports", "ControlTarget", "ControlWriter", "apply_control", "apply_feedback"]

_REPLAN_KEYS = frozenset({"nm", "mini_epoch_size", "composition"})
_ARF_KEYS = frozenset({"arf", "arf_wait", "arf_window", "arf_k", "arf_weights"})
_LIMIT_KEYS = frozenset({"rf", "rf_max", "advance"})  # what bounds the passes of the current mini-epoch


class BatchReports(Protocol):
    """Where ``consumed`` reports go (:class:`tierfs.daemon.serving.batch_plans.BatchPlans`)."""

    def check_consumed(self, plan_id: int, indices: list[int]) -> None: ...

    def consumed(self, plan_id: int, indices: list[int]) -> None: ...


class WalksPlans(Protocol):
    """The cache policy's one answer a control write needs: whether the mount has plans to redo."""

    @property
    def walks_plans(self) -> bool: ...


class ControlTarget(Protocol):
    """What a control write may touch: the narrow interface the engine offers this module (no import of it).
    (Read-only properties: a control write replaces the settings through ``apply_settings``, never by assignment.)"""

    control_error: str | None

    @property
    def settings(self) -> Settings: ...

    @property
    def passes(self) -> PassRule: ...

    @property
    def batch(self) -> BatchReports: ...

    @property
    def policy(self) -> WalksPlans: ...

    def check_plan(self, settings: Settings) -> None: ...

    def apply_settings(self, new: Settings, *, replan: bool) -> None: ...

    def notify(self) -> None: ...


def apply_feedback(engine: ControlTarget, metrics: Mapping[str, float], who: str = ANONYMOUS) -> None:
    """Feed one ``feedback`` line of consumer ``who`` to its ARF controller, attributed to the last completed
    pass (see the module docstring); the mini-epoch is left early once every live consumer's ARF says so."""
    passes = engine.passes
    about = passes.last_pass or passes.current_mini_epoch
    decision = passes.arf_of(who).observe(metrics, about)
    if decision == "advance" and engine.settings.arf != "off" and about == passes.current_mini_epoch:
        passes.arf_advance(who)


def apply_control(engine: ControlTarget, data: bytes, who: str = ANONYMOUS) -> None:
    """Apply one write to the control file by consumer ``who`` (whose pass ``next-pass`` ends and whose ARF
    ``feedback`` feeds), all of it or (``ValueError``, ``last_error`` set) nothing."""
    try:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("control writes must be UTF-8 text") from None
        req = parse_control(text, engine.settings)
        new = req.settings
        replan = bool(req.changed & _REPLAN_KEYS) and engine.policy.walks_plans
        if replan:
            engine.check_plan(new)
        controller = Arf.controller_for(new) if req.changed & _ARF_KEYS else None
        for plan_id, indices in req.consumed:
            engine.batch.check_consumed(plan_id, list(indices))
    except ValueError as exc:
        engine.control_error = str(exc)[:500]  # a 1 MiB line gets a message, not a 1 MiB status
        raise
    engine.control_error = None
    engine.apply_settings(new, replan=replan)
    passes = engine.passes
    if controller is not None:
        passes.arf.replace(controller)
    for plan_id, indices in req.consumed:  # (reads reported in the same write as a next-pass came before it)
        engine.batch.consumed(plan_id, list(indices))
    for cmd in req.commands:
        if cmd == "next-pass":
            passes.next_pass(who)
        elif cmd == "advance":
            passes.request_advance()
    for share in req.shares:
        passes.rank_share_done(share, who)
    for metrics in req.feedback:
        apply_feedback(engine, metrics, who)
    if req.changed & _LIMIT_KEYS:
        passes.rf_changed()
    passes.save_journal()
    engine.notify()


class ControlWriter:
    """The writes of one open control file: each applied whole or refused whole (see the module docstring)."""

    def __init__(self, engine: ControlTarget, who: str = ANONYMOUS) -> None:
        self.engine = engine
        self.who = who  # the consumer that opened it
        self.end = 0  # where the bytes accepted through this open file end

    def write(self, offset: int, data: bytes) -> int:
        """Apply one piece the kernel sent; returns its length.  ``OSError`` EFBIG for a piece that may be part
        of a longer write, ``ValueError`` (EINVAL) for bad input; either way nothing is applied."""
        if len(data) > CONTROL_WRITE_MAX or offset > self.end:
            why = (f"control write refused: more than {CONTROL_WRITE_MAX} bytes in one write() (a piece of "
                   f"{len(data)} bytes at offset {offset} arrived); nothing applied: write at most "
                   f"{CONTROL_WRITE_MAX} bytes of whole lines at a time")
            self.engine.control_error = why
            raise OSError(errno.EFBIG, why)
        apply_control(self.engine, data, self.who)
        self.end = max(self.end, offset + len(data))
        return len(data)
