"""Several users (access.py): who moves the schedule, how many descriptors another user's handles may hold, and
who may open which ``/.tierfs`` file."""

from __future__ import annotations

import errno
import os
import resource
import stat

import pytest

from tierfs.daemon.access import CONTROL_MODES, OWNER_UID, Steering, may_open_control_file

NOBODY = 65534


def test_other_users_opens_and_root_listings_do_not_move_the_schedule(open_engine, t):
    e = open_engine(rf=10)

    async def main():
        order = e.schedule.view.order.tolist()
        for _ in range(3):
            e.names.list_dir(1, NOBODY)
            for f in order:  # every file of the view: a pass, had the owner read them
                h = await e.data.open_file(f, NOBODY)
                assert await e.data.read(h, 0, 1 << 20)
                await e.data.release(h)
        e.names.list_dir(1, NOBODY)
        assert (e.schedule.pos.pass_index, e.schedule.pos.passes_total) == (0, 0)
        assert e.data.hits + e.data.misses == 3 * len(order)  # served all the same
        await t.read_file(e, order[0])  # the owner's read, then the owner's listing: a pass
        e.names.list_dir(1, OWNER_UID)
        assert e.schedule.pos.passes_total == 1
        await t.read_file(e, order[0])
        e.names.list_dir(1, 0)  # root's too
        assert e.schedule.pos.passes_total == 2

    t.run(main)


@pytest.fixture
def fd_limit_256():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_another_user_gets_emfile_past_its_share_and_the_owner_does_not(open_engine, t, fd_limit_256):
    e = open_engine()
    fidx = e.schedule.view.order.tolist()[0]

    async def main():
        budget = e.data.fd_budget.statistics()
        assert (budget.reserve, budget.others_limit, budget.per_user_limit) == (64, 96, 48)
        held = []
        with pytest.raises(OSError) as exc:
            while True:
                held.append(await e.data.open_file(fidx, NOBODY))
        assert exc.value.errno == errno.EMFILE and len(held) == 48
        second = [await e.data.open_file(fidx, NOBODY + 1) for _ in range(48)]  # another user: its own share
        with pytest.raises(OSError):
            await e.data.open_file(fidx, NOBODY + 2)  # all others together: half the handles
        mine = [await e.data.open_file(fidx, OWNER_UID) for _ in range(64)]  # the owner is not starved
        budget = e.data.fd_budget.statistics()
        assert (budget.others_held, budget.refused) == (96, 2)
        for h in held + second + mine:
            await e.data.release(h)
        assert e.data.fd_budget.statistics().others_held == 0
        await e.data.release(await e.data.open_file(fidx, NOBODY))  # given back: opens again

    t.run(main)


def test_the_control_files_modes_are_what_opens_are_checked_against():
    for name, mode in CONTROL_MODES.items():
        if stat.S_ISDIR(mode):
            continue
        for uid in (0, OWNER_UID):
            assert may_open_control_file(name, uid, write=False)
            assert may_open_control_file(name, uid, write=True) == (name == b"control")
        assert may_open_control_file(name, NOBODY, write=False) == (name in (b"control", b"metrics"))
        assert not may_open_control_file(name, NOBODY, write=True)
    assert os.getuid() == OWNER_UID


def test_a_steering_groups_members_steer_and_read_what_the_owner_does(open_engine, t):
    """group=nogroup: nobody (whose primary group it is) steers like the owner and gets the group's bits of the
    files that name files; cached paths (plan) stay the owner's; a group that does not exist is refused."""
    steering = Steering.of_group("nogroup")
    assert steering.gid == 65534 and NOBODY in steering.uids and steering.steers(NOBODY)
    assert Steering.of_group(str(steering.gid)) == steering
    for name in (b"status", b"order", b"order0"):
        assert steering.mode(name) == CONTROL_MODES[name] | stat.S_IRGRP
        assert steering.may_open(name, NOBODY, write=False) and not Steering().may_open(name, NOBODY, write=False)
    assert steering.may_open(b"control", NOBODY, write=True)
    assert not steering.may_open(b"plan", NOBODY, write=False) and steering.mode(b"plan") == CONTROL_MODES[b"plan"]
    with pytest.raises(ValueError, match="no such group 'no-such-group-here'"):
        Steering.of_group("no-such-group-here")

    e = open_engine(rf=10, group="nogroup")

    async def main():
        for f in e.schedule.view.order.tolist():
            await e.data.release(await e.data.open_file(f, NOBODY))
        assert e.schedule.pos.passes_total == 1  # nobody's reads of the whole view ended the pass

    t.run(main)
