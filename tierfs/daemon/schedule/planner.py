"""The planner: the background job that makes the schedule's plans ahead, in a worker thread.

Planning an epoch of 10 million files takes 0.25-2.6 s (docs/benchmarks.md, "Planning 10 million files"); made
on the trio thread, inside the request that ended a pass, it held every reader of the mount for that long.  The
:class:`~tierfs.daemon.schedule.schedule.Schedule` owns the plans and says which one is missing (``plan_job``: the next
epoch's, from the moment an epoch starts); this job makes it in a worker thread (threads.py) (the sampler is pure numpy
and the job's inputs are not written meanwhile) and hands it back (``adopt``), which keeps it unless the
settings changed meanwhile -- then the next job plans with the new ones.

It makes the views the next pass may show the same way, in a second loop (``view_job``, ``adopt_view``): a view
is 20-30 ms a million files, needed at the end of the pass shown now, while a plan may take seconds.  A plan that
lands while a switch waits for it (``pos.switch_due``) gets its first view made before the engine hears of it,
so the switch it makes then only flips to what is ready.
"""

from __future__ import annotations

from typing import Protocol

import trio

from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.schedule.schedule import HeldCopies, Schedule

__all__ = ["Planner", "PlannerEvents"]


class PlannerEvents(Protocol):
    """What the planner tells the engine (the engine implements it)."""

    def plan_landed(self) -> None:
        """A plan made the next mini-epoch known: stage it, or make the switch that waited for it."""


class Planner:
    """See the module docstring.  The ``cache`` says which files are cached when a plan is adopted; ``events``
    hears when a plan made the next mini-epoch known; ``notify()`` says the schedule may lack a plan now."""

    def __init__(self, schedule: Schedule, cache: HeldCopies, events: PlannerEvents) -> None:
        self.schedule = schedule
        self.cache = cache
        self.events = events
        self._wake = Wakeup()
        self._views_wake = Wakeup()
        self.made = 0  # plans made in a worker thread (the trio thread makes none while this runs)

    def notify(self) -> None:
        """The schedule may lack a plan or a view now (a new pass, mini-epoch, settings, a changed file)."""
        self._wake.notify()
        self._views_wake.notify()

    async def run(self) -> None:
        """Make each plan and view the schedule lacks, until cancelled (the engine sets ``plans_ahead`` before it
        starts this, so no request plans on the trio thread meanwhile)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._make_views)
            await self._make_plans()

    async def _make_views(self) -> None:
        while True:
            if not await self._make_view():
                await self._views_wake.wait()

    async def _make_view(self) -> bool:
        """Make one view the schedule lacks; False if it lacks none."""
        job = self.schedule.view_job()
        if job is None:
            return False
        view = await in_thread(job.make, abandon_on_cancel=True)
        self.schedule.adopt_view(job, view)  # (not kept if it is no longer wanted: the next job is another)
        return True

    async def _make_plans(self) -> None:
        sch = self.schedule
        while True:
            job = sch.plan_job()
            if job is None:
                await self._wake.wait()
                continue
            try:
                # abandoned on unmount: the thread only computes, and a stop must not wait seconds for it
                plan, note = await in_thread(job.make, abandon_on_cancel=True)
            except ValueError as exc:  # a file grew past half the cache since the mount checked the sizes
                sch.plan_failed(job, str(exc))
                await self._wake.wait()  # (a replan, a changed file, a new mini-epoch: try again)
                continue
            self.made += 1
            if sch.adopt(job, plan, note, self.cache):
                while sch.pos.switch_due and await self._make_view():
                    pass  # (the switch plan_landed makes now takes its view ready-made)
                if sch.next_coords is not None:  # (else a replan meanwhile dropped it: the next job plans again)
                    self.events.plan_landed()
                self._views_wake.notify()
