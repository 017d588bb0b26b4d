"""Issue 47's status and help nits: counts that read right (no ``pass 5/4``, ``1 passes`` or ``256 copies in
flight of 16``), and ``tierfs mount --help`` with its options under headings and an ``--advance`` that says where
it stalls."""

from __future__ import annotations

from tierfs.cli.commands import parsers
from tierfs.cli.status_text import format_status
from tierfs.common.options import OPTION_SECTIONS, OPTIONS


def _status(**changes) -> dict:
    st = {"epoch": 0, "mini_epoch": 1, "nm": 8, "pass": 0, "rf": 4, "rf_max": 8, "passes_total": 0,
          "rf_effective": [4], "staging": {"inflight": 0, "streams": 4}, "prefetch": {"bytes_done": 0,
                                                                                      "bytes_total": 100}}
    st.update(changes)
    return st


def test_a_pass_beyond_rf_is_no_fraction_above_one():
    text = format_status(_status(**{"pass": 4, "passes_total": 9}))
    assert "pass 5/4" not in text
    assert "pass 5 (beyond rf 4 until staged; max 8)  (9 passes in all)" in text
    assert "pass 3/4" in format_status(_status(**{"pass": 2}))


def test_counts_have_their_noun_in_the_right_number():
    assert "(1 pass in all)" in format_status(_status(passes_total=1))
    assert "(2 passes in all)" in format_status(_status(passes_total=2))
    assert "(1 mini-epoch done)" in format_status(_status(rf_effective=[4, 4]))
    assert "(3 mini-epochs done)" in format_status(_status(rf_effective=[4, 4, 4, 4]))


def test_copies_in_flight_are_not_read_against_the_streams_as_a_limit():
    text = format_status(_status(staging={"inflight": 256, "streams": 16}))
    assert "of 16" not in text
    assert "256 copies in flight on 16 streams (small files several to a stream)" in text
    assert "1 copy in flight on 4 streams; " in format_status(_status(staging={"inflight": 1, "streams": 4}))


def test_mount_help_puts_every_option_under_one_heading():
    named = [n for names in OPTION_SECTIONS.values() for n in names]
    assert sorted(named) == sorted(OPTIONS) and len(named) == len(set(named))
    parser = parsers()["mount"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    for heading, names in OPTION_SECTIONS.items():
        assert groups[heading] == [f"opt_{n}" for n in names], heading
    text = parser.format_help()
    assert all(f"\n{heading}:\n" in text for heading in OPTION_SECTIONS)


def test_advance_help_says_where_ready_stalls():
    text = " ".join(parsers()["mount"].format_help().split())
    assert "never stall" not in text
    assert "up to rf_max passes, then switch" in text and "readers then wait on what is not staged" in text


def test_opens_outside_the_view_warn_only_while_the_loader_does_not_follow_it():
    # (a new user's walkthrough: after the sampler was put back, the human status kept a warning that told a
    # listing=all mount's user to re-list each pass, from the count of opens since mount)
    followed = format_status(_status(reads={"out_of_view": 856}, loader={"follows_view": True, "warning": None}))
    assert "outside" not in followed and "list the mount" not in followed
    standing = "856 opens outside the view: keep the dataset and add tierfs.torch.MountSampler"
    assert standing in format_status(_status(reads={"out_of_view": 856},
                                             loader={"follows_view": False, "warning": standing}))
