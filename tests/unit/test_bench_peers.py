"""The helpers of the peer benchmarks on tiny inputs: the Debian-index XC converter and the reference SLIDE's
config and log handling (the benchmarks themselves need the reference's source and minutes of CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dslide.data import load_xc

ROOT = Path(__file__).resolve().parents[2]


PACKAGES = """\
Package: foo-utils
Version: 1.0
Depends: libc6 (>= 2.34), libfoo1 (= 1.0) | libfoo-alt, zlib1g:any
Pre-Depends: dpkg (>= 1.15)
Description: command line tools for foo
Tag: role::program,
 interface::commandline
Section: utils

Package: foo-utils
Version: 0.9
Depends: libold
Description: an older stanza of the same name, ignored

Package: libfoo1
Depends: libc6
Description: shared library for foo
Section: libs

Package: bar
Depends: libc6, zlib1g
Description: tools for bar
Section: utils

Package: lonely
Description: no dependencies at all
"""


def test_stanzas_join_continuations_and_dependencies_drop_versions(benchmark_module):
    xc = benchmark_module("xc_from_debian")
    st = list(xc.stanzas(PACKAGES.splitlines(keepends=True)))
    assert [s["Package"] for s in st] == ["foo-utils", "foo-utils", "libfoo1", "bar", "lonely"]
    assert st[0]["Tag"] == "role::program, interface::commandline"
    assert xc.dependencies(st[0]) == ["dpkg", "libc6", "libfoo1", "libfoo-alt", "zlib1g"]
    toks = xc.tokens(st[0])
    assert {"name:foo", "name:utils", "section:utils", "tag:interface::commandline", "tools"} <= set(toks)


def test_build_keeps_frequent_labels_and_tokens_unit_rows_and_a_stable_split(benchmark_module):
    xc = benchmark_module("xc_from_debian")
    train, test, labels = xc.build(xc.stanzas(PACKAGES.splitlines(keepends=True)), min_count=2, test_share=0.5)
    assert labels == ["libc6", "zlib1g"]  # the only dependencies of >= 2 packages
    both = len(train) + len(test)
    assert both == 3  # "lonely" has no label; the older foo-utils stanza is not a point
    for d in (train, test):
        assert d.n_labels == 2
        norms = np.sqrt(np.add.reduceat(d.x_values.astype(np.float64) ** 2, d.x_indptr[:-1])) if len(d) else []
        assert np.allclose(norms, 1.0, atol=1e-6)
    assert [xc.is_test(n, 0.5) for n in ("bar", "foo-utils", "libfoo1")].count(True) == len(test)
    with pytest.raises(ValueError, match="test_share"):
        xc.build([], test_share=1.0)


def test_converter_command_writes_readable_xc(tmp_path):
    (tmp_path / "Packages").write_text(PACKAGES)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "xc_from_debian.py"), str(tmp_path / "Packages"),
                    str(tmp_path / "xc")], check=True, capture_output=True)  # fmt: skip
    train, test = load_xc(tmp_path / "xc" / "train.txt"), load_xc(tmp_path / "xc" / "test.txt")
    assert len(train) + len(test) == 3 and train.n_labels == 2
    assert (tmp_path / "xc" / "labels.txt").read_text() == "0 libc6\n1 zlib1g\n"


def test_reference_log_gives_one_figure_per_epoch(benchmark_module):
    slide = benchmark_module("dslide_vs_slide")
    log = "Epoch 0\n0 0 0.001\n100 12 0.05\nEpoch 1\n200 25 0.11\nEpoch 2\n300 37 0.14\n"
    assert slide.parse_log(log) == [
        {"epoch": 1, "train_s": 12.0, "p_at_1": 0.05},
        {"epoch": 2, "train_s": 25.0, "p_at_1": 0.11},
        {"epoch": 3, "train_s": 37.0, "p_at_1": 0.14},
    ]
    assert slide.parse_log("Epoch 0\n0 0 0.001\n") == []  # stopped before the first epoch ended


def test_reference_config_matches_the_budget_and_sizes(tmp_path, benchmark_module):
    slide = benchmark_module("dslide_vs_slide")
    a = slide.argparse.Namespace(budget=1024, slide_k=6, tables=50, batch=256, hidden=128)
    slide.write_config(tmp_path / "c.csv", a, 5000, 100_000, 25_600, 3e-3, 2, tmp_path)
    cfg = dict(line.replace(" ", "").split("=", 1) for line in (tmp_path / "c.csv").read_text().splitlines())
    assert cfg["Sparsity"] == "1,0.01024,1,1" and cfg["L"] == "20,50" and cfg["K"] == "2,6"
    assert cfg["sizesOfLayers"] == "128,100000" and cfg["InputDim"] == "5000" and cfg["Lr"] == "0.003"
    assert cfg["totRecordsTest"] == str(slide.EVAL_BATCHES * 256) and cfg["Epoch"] == "2"
