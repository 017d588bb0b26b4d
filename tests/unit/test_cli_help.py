"""Help that teaches: every option of every command says its default (or that it is required), the mount
options' choices are shown, both commands answer --version, and sizes an error names are sizes that work."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dslide import __version__ as dslide_version
from dslide.cli import build_parser
from tierfs import __version__ as tierfs_version
from tierfs.cli.commands import parsers
from tierfs.common.options import OPTIONS, Settings, format_size_at_least, parse_assignments, parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    found = {f"tierfs {name}": p for name, p in parsers().items()}
    dslide = build_parser()
    sub = next(a for a in dslide._actions if isinstance(a, argparse._SubParsersAction))
    found.update({f"dslide {name}": p for name, p in sub.choices.items()})
    return found


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action) if action.help else ""


@pytest.mark.parametrize("command", sorted(_all_parsers()))
def test_every_option_that_takes_a_value_says_its_default(command):
    parser = _all_parsers()[command]
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0:
            continue
        text = _help_of(parser, action)
        if "default" not in text and "required" not in text:
            missing.append(action.option_strings[-1])
        for choice in action.choices or ():
            assert choice in parser.format_help(), (command, choice)
    assert not missing, f"{command}: no default in the help of {missing}"


def test_mount_help_shows_each_options_default_and_choices():
    parser = parsers()["mount"]
    text = " ".join(parser.format_help().split())
    defaults = dict(parse_assignments(Settings().as_lines()))
    for opt in OPTIONS.values():
        action = next(a for a in parser._actions if a.dest == f"opt_{opt.name}")
        shown = "off" if opt.flag else defaults[opt.name] or "none"
        assert f"(default {shown})" in _help_of(parser, action), opt.name
        if opt.choices:
            assert "|".join(opt.choices) in text, opt.name


@pytest.mark.parametrize(("module", "version"), [("tierfs", tierfs_version), ("dslide", dslide_version)])
def test_version(module, version):
    res = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{module} {version}"


@given(st.integers(0, 1 << 52))
def test_format_size_at_least_names_a_size_that_suffices(n):
    text = format_size_at_least(n)
    assert parse_size(text) >= n
    assert parse_size(text) <= n * 1.1 + 1  # and not much more: within the last digit


def test_format_size_at_least_rounds_up():
    assert format_size_at_least(int(3.04 * (1 << 30))) == "3.1G"
    assert format_size_at_least(3 << 30) == "3G"
    assert format_size_at_least(1000) == "1000"
