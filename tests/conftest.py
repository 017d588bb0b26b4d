"""Shared fixtures.  Tier-specific fixtures live in each tier's conftest."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def benchmark_module():
    """``benchmark_module("loop")``: ``benchmarks/loop.py`` imported as module ``loop`` (in ``sys.modules``:
    dataclasses look their module up)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
