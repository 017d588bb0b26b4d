"""dslide.feedback: the feedback line, the one-write control protocol, the status snapshot (no mount needed)."""

from __future__ import annotations

import json
import math

import pytest

from dslide.comm import SerialComm
from dslide.feedback import PassReporter, format_feedback, read_status, write_control


def test_feedback_line_has_only_the_finite_metrics():
    assert (
        format_feedback(loss=0.5, train_err=0.25, val_err=0.125) == "feedback loss=0.5 train_err=0.25 val_err=0.125\n"
    )
    assert format_feedback(loss=math.nan, val_err=0.3) == "feedback val_err=0.3\n"
    assert format_feedback(loss=math.inf) is None
    assert format_feedback() is None


def _fake_mount(tmp_path):
    """A control dir laid out as on a mount (MOUNT/.tierfs/{control,status}), for the client to find."""
    d = tmp_path / ".tierfs"
    d.mkdir()
    (d / "control").write_text("")
    (d / "status").write_text("{}")
    return d / "control", d / "status"


def test_write_control_is_one_line_in_one_write(tmp_path):
    control, _ = _fake_mount(tmp_path)
    write_control(control, "feedback loss=1\n")
    assert control.read_text() == "feedback loss=1\n"
    with pytest.raises(ValueError):
        write_control(control, "feedback loss=1")
    with pytest.raises(ValueError):
        write_control(control, "a=1\nb=2\n")


def test_status_is_read_beside_the_control_file(tmp_path):
    assert read_status(tmp_path / ".tierfs" / "control") is None  # not a mount
    control, status = _fake_mount(tmp_path)
    status.write_text("{not json")
    assert read_status(control) is None
    status.write_text(json.dumps({"epoch": 2, "mini_epoch": 1, "pass": 0, "rf": 3}))
    assert read_status(control)["mini_epoch"] == 1


def test_reporter_snapshots_status_at_listing_and_writes_feedback(tmp_path):
    control, status = _fake_mount(tmp_path)
    status.write_text(json.dumps({"epoch": 0, "mini_epoch": 4, "pass": 1, "rf": 2, "other": 1}))
    reporter = PassReporter(SerialComm(), str(control), list_files=lambda specs: sorted(specs))
    assert reporter.lister(["b", "a"]) == ["a", "b"]
    status.write_text(json.dumps({"epoch": 0, "mini_epoch": 5, "pass": 0, "rf": 2}))  # moved on meanwhile
    record = {"loss": 0.75, "train_err": 0.5, "p_at_1": 0.25, "val_err": 0.625, "val_loss": 4.5}
    reporter(record)
    assert record["tierfs"] == {"epoch": 0, "mini_epoch": 4, "pass": 1, "rf": 2}
    # val_err is the held-out error (never 1 - the test set's P@1); the held-out loss is the score ARF steers by
    assert control.read_text() == "feedback loss=0.75 train_err=0.5 val_err=0.625 score=4.5\n"
    assert reporter.feedback_written == 1


def test_reporter_never_reports_the_test_set_and_can_leave_the_score_to_the_mount(tmp_path):
    control, _ = _fake_mount(tmp_path)
    PassReporter(SerialComm(), str(control), list_files=list)({"loss": 0.5, "train_err": 0.25, "p_at_1": 0.5})
    assert control.read_text() == "feedback loss=0.5 train_err=0.25\n"
    control.write_text("")
    PassReporter(SerialComm(), str(control), list_files=list, score="none")({"loss": 0.5, "val_err": 0.25})
    assert control.read_text() == "feedback loss=0.5 val_err=0.25\n"
    control.write_text("")
    PassReporter(SerialComm(), str(control), list_files=list, score="val_err")({"val_err": 0.25, "val_loss": 3.0})
    assert control.read_text() == "feedback val_err=0.25 score=0.25\n"
    with pytest.raises(ValueError, match="feedback score"):
        PassReporter(SerialComm(), str(control), score="loss")


def test_reporter_survives_a_refused_feedback(tmp_path, capsys):
    reporter = PassReporter(SerialComm(), str(tmp_path / "missing" / "control"), list_files=list)
    reporter({"loss": 1.0})
    assert "feedback not accepted" in capsys.readouterr().err
    assert reporter.feedback_written == 0
