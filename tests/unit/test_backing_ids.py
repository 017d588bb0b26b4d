"""The passthrough part's bookkeeping and its reasons for being off where the real thing cannot run here: a stock
pyfuse3 and a kernel that does not offer passthrough (this machine's 6.18 does; tests/mount/test_passthrough.py
runs the rest on real mounts)."""

from __future__ import annotations

import errno

from tierfs.daemon.cache.store import CacheEntry
from tierfs.daemon.kernel.passthrough import BackingIds


class Kernel:
    """pyfuse3's three calls, answering as a kernel would (KernelBackings)."""

    def __init__(self, active: bool | None = True, refuse: int = 0) -> None:
        self.active, self.refuse = active, refuse
        self.open_ids: set[int] = set()
        self._next = 0

    def backing_open(self, fd: int) -> int:
        if self.refuse:
            raise OSError(self.refuse, "refused")
        self._next += 1
        self.open_ids.add(self._next)
        return self._next

    def backing_close(self, backing_id: int) -> None:
        self.open_ids.remove(backing_id)

    def passthrough_active(self) -> bool | None:
        return self.active


def _entry(fidx: int) -> CacheEntry:
    return CacheEntry(fidx, f"c{fidx}", 10, 4096, (10, 1, 2, 3), None, (5, 6))


def test_off_and_why_where_it_cannot_work():
    stock = BackingIds(asked=True)
    stock.attach(None)
    assert not stock.on and stock.statistics().state == "off (pyfuse3 without the passthrough patch)"
    old_kernel = BackingIds(asked=True)
    old_kernel.attach(Kernel(active=False))
    assert not old_kernel.on and "the kernel did not offer it" in old_kernel.statistics().state
    not_root = BackingIds(asked=True)
    not_root.attach(Kernel(refuse=errno.EPERM))
    assert not_root.on and not_root.register(_entry(0), 3) == 0
    assert not not_root.on and not_root.statistics().state.startswith("off (EPERM: the daemon lacks CAP_SYS_ADMIN")
    asked_off = BackingIds(asked=False)
    asked_off.attach(Kernel())
    assert not asked_off.on and asked_off.statistics().state == "off (passthrough=off)"
    waiting = BackingIds(asked=True)
    waiting.attach(Kernel(active=None))  # (before the kernel's INIT)
    assert not waiting.on and waiting.statistics().state == "on"


def test_one_registration_per_copy_dropped_with_it_and_the_opens_an_inode_shares():
    kernel = Kernel()
    ids = BackingIds(asked=True)
    ids.attach(kernel)
    a, b = _entry(1), _entry(2)
    assert ids.register(a, 3) == ids.register(a, 3) == a.backing_id == 1  # (once)
    ids.opened(1, a)
    ids.opened(1, a)
    assert ids.shared(1) is a and ids.shared(2) is None
    ids.released(1)
    assert ids.shared(1) is a  # (one left: a new open must share it)
    ids.released(1)
    assert ids.shared(1) is None
    ids.opened_plain(2)
    assert ids.plain_open(2) and ids.register(b, 4) == 2
    ids.released_plain(2)
    assert not ids.plain_open(2)
    ids.deleted(a)
    assert a.backing_id == 0 and kernel.open_ids == {2}
    st = ids.statistics()
    assert (st.registered, st.registrations, st.opens, st.plain_opens) == (1, 2, 2, 1)
