"""The control file's writes as the kernel's pieces arrive (``ControlWriter``): whole or refused (issue 22)."""

from __future__ import annotations

import errno

import pytest

from tierfs.common.protocol import CONTROL_WRITE_MAX


def test_a_piece_over_the_limit_is_refused_and_nothing_applied(open_engine):
    e = open_engine(rf=2)
    w = e.control_writer()
    with pytest.raises(OSError) as info:
        w.write(0, b"rf=7\n" + b" " * CONTROL_WRITE_MAX)
    assert info.value.errno == errno.EFBIG
    assert e.settings.rf == 2 and "nothing applied" in e.last_error
    assert w.write(0, b"rf=7\n") == 5  # the writer's next write (its file offset did not move) is applied
    assert e.settings.rf == 7 and e.control_error is None


def test_a_piece_past_what_the_open_file_wrote_is_a_later_piece_of_a_refused_write(open_engine):
    e = open_engine(rf=2)
    w = e.control_writer()
    assert w.write(0, b"rf=3\n") == 5
    assert w.write(5, b"rf=4\n") == 5  # the next write on the same open file: applied
    with pytest.raises(OSError) as info:  # (an asynchronous write's last piece, its first refused)
        w.write(5 + (1 << 20), b"rf=5\n")
    assert info.value.errno == errno.EFBIG and e.settings.rf == 4
    assert w.write(0, b"rf=6\n") == 5 and e.settings.rf == 6  # from the start again (O_TRUNC, pwrite at 0)


def test_bad_input_within_the_limit_is_einval_and_changes_nothing(open_engine):
    e = open_engine(rf=2)
    with pytest.raises(ValueError, match="unknown key"):
        e.control_writer().write(0, b"rf=9\nbogus=1\n")
    assert e.settings.rf == 2
