"""The type check: mypy over tierfs, sampler and dslide (pyproject.toml's ``[tool.mypy]``), which
``scripts/test.sh`` runs.  Here: that it passes, and that it fails on a planted drift of the parts' events
Protocols -- the typed interface each part reports upward through, which the engine (or another part) implements:
each part is given its implementer as a parameter typed as its Protocol, so a method that differs on either side
is an error where the implementer is handed over."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from operator import attrgetter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAEMON = ROOT / "tierfs" / "daemon"


def _mypy(root: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``mypy`` over the packages in ``root`` (its pyproject.toml's settings), with its cache in ``cache``."""
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=root, capture_output=True,
                          text=True, timeout=280)


def _events_protocols(root: Path) -> dict[str, Path]:
    """Each ``*Events`` Protocol of the daemon in ``root``: its name -> the module declaring it."""
    found = {}
    for path in sorted((root / "tierfs" / "daemon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef) and node.name.endswith("Events")
                    and any(getattr(b, "id", None) == "Protocol" for b in node.bases)):
                found[node.name] = path
    return found


def _add_a_parameter(path: Path, protocol: str) -> None:
    """Give every method of ``protocol`` (in ``path``) one more parameter, right after ``self``."""
    lines = path.read_text().splitlines(keepends=True)
    cls = next(n for n in ast.walk(ast.parse("".join(lines))) if isinstance(n, ast.ClassDef) and n.name == protocol)
    selves = [f.args.args[0] for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    for s in sorted(selves, key=attrgetter("lineno", "col_offset"), reverse=True):  # (from the end: offsets hold)
        line = lines[s.lineno - 1]
        lines[s.lineno - 1] = line[:s.end_col_offset] + ", planted: int" + line[s.end_col_offset:]
    path.write_text("".join(lines))


@pytest.mark.slow
def test_the_type_check_passes(tmp_path):
    run = _mypy(ROOT, tmp_path / "mypy-cache")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout, run.stdout


@pytest.mark.slow
def test_a_planted_protocol_drift_fails_the_type_check(tmp_path):
    # (one run for all: a drift in each events Protocol is reported where its implementer is handed to the part,
    # and at the part's own calls of the changed methods)
    for name in ("tierfs", "sampler", "dslide"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    protocols = _events_protocols(tmp_path)
    assert len(protocols) >= 8, protocols  # (the stager's, data path's, revalidator's, pusher's, ... cache's)
    for protocol, path in protocols.items():
        _add_a_parameter(path, protocol)
    run = _mypy(tmp_path, tmp_path / "mypy-cache")
    assert run.returncode == 1, run.stdout + run.stderr
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    for protocol, path in protocols.items():
        handed = [e for e in errors if re.search(rf'has incompatible type "\w+"; expected "{protocol}( \| None)?"', e)]
        assert handed, f"no error where {protocol}'s implementer is handed over:\n" + run.stdout
        assert any(e.startswith(f"{path.relative_to(tmp_path)}:") for e in errors), (protocol, run.stdout)
