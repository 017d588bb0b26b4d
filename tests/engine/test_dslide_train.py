"""The dslide model and training loop without MPI: learning, determinism, resume, re-listing, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from dslide.checkpoint import read_manifest
from dslide.data import load_xc
from dslide.gen import write_dataset
from dslide.model import ModelConfig
from dslide.train import TrainOptions, run_training

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("planted")
    write_dataset(out, 6000, 1500, 400, shards=2, test_points=1000, seed=11)
    return out


def small_cfg(**kw) -> ModelConfig:
    base = dict(n_features=1500, n_labels=400, hidden=32, budget=64, tables=6, bucket_cap=16, lr=3e-3, seed=5)
    return ModelConfig(**{**base, **kw})


def opts(planted: Path, **kw) -> TrainOptions:
    base = dict(train=(str(planted / "train"),), test=str(planted / "test.txt"), epochs=2, batch=128, threads=1)
    return TrainOptions(**{**base, **kw})


def states_equal(a, b) -> None:
    sa, sb = a.state(), b.state()
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def test_learns_what_no_frequency_baseline_can(planted: Path) -> None:
    train, test = load_xc(sorted((planted / "train").iterdir())), load_xc(planted / "test.txt")
    top = int(np.argmax(train.label_counts()))
    baseline = np.mean([top in test.y_indices[test.y_indptr[i] : test.y_indptr[i + 1]] for i in range(len(test))])
    _, records = run_training(small_cfg(), opts(planted, epochs=4, threads=2), emit=lambda r: None)
    p1 = [r["p_at_1"] for r in records]
    assert records[-1]["loss"] < records[0]["loss"]
    assert 0 <= records[-1]["train_err"] < records[0]["train_err"] <= 1
    # the best constant prediction (the most frequent label) is the ceiling of every frequency baseline's P@1
    assert p1[-1] > max(3 * baseline, baseline + 0.2), (p1, baseline)


def test_single_thread_runs_are_bit_for_bit_equal(planted: Path) -> None:
    a, ra = run_training(small_cfg(), opts(planted), emit=lambda r: None)
    b, rb = run_training(small_cfg(), opts(planted), emit=lambda r: None)
    states_equal(a, b)
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    c, _ = run_training(small_cfg(seed=6), opts(planted, epochs=1), emit=lambda r: None)
    assert not np.array_equal(c.W2, b.W2)


def test_resume_continues_bit_for_bit(planted: Path, tmp_path: Path) -> None:
    cfg = small_cfg(hash="dwta", k=2)
    straight, rs = run_training(cfg, opts(planted, epochs=3, checkpoint=str(tmp_path / "a")), emit=lambda r: None)
    run_training(cfg, opts(planted, epochs=2, checkpoint=str(tmp_path / "b")), emit=lambda r: None)
    assert read_manifest(tmp_path / "b")["meta"]["passes"] == 2
    resumed, rr = run_training(
        cfg, opts(planted, epochs=3, checkpoint=str(tmp_path / "b"), resume=True), emit=lambda r: None
    )
    states_equal(straight, resumed)
    assert rr[-1]["loss"] == rs[-1]["loss"] and rr[-1]["p_at_1"] == rs[-1]["p_at_1"]
    assert len(list((tmp_path / "b").glob("state-*.npz"))) == 1  # older shards are removed


def test_each_pass_relists_the_training_directory(planted: Path, tmp_path: Path) -> None:
    train = tmp_path / "train"
    train.mkdir()
    first = sorted((planted / "train").iterdir())
    os.link(first[0], train / first[0].name)

    def add_file(record: dict) -> None:
        if record["pass"] == 1:
            os.link(first[1], train / "zz-late.txt")

    _, recs = run_training(
        small_cfg(), opts(planted, train=(str(train),), eval_points=50), emit=lambda r: None, before_report=add_file
    )
    assert [r["files"] for r in recs] == [1, 2]
    assert recs[1]["steps"] - recs[0]["steps"] == 2 * recs[0]["steps"]


def test_lsh_inference_is_an_option(planted: Path) -> None:
    model, _ = run_training(small_cfg(), opts(planted, epochs=1), emit=lambda r: None)
    test = load_xc(planted / "test.txt")
    exact, lsh = model.evaluate(test, 300), model.evaluate(test, 300, mode="lsh")
    assert 0 < lsh["p_at_1"] <= exact["p_at_1"] + 0.1


def dslide(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "NUMBA_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dslide", *args], capture_output=True, text=True, env=env, timeout=240)


def test_cli_gen_train_eval(tmp_path: Path) -> None:
    r = dslide("gen", str(tmp_path / "d"), "--points", "600", "--features", "300", "--labels", "50", "--shards", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "d" / "train").iterdir()) == ["part-00000.txt", "part-00001.txt"]
    r = dslide("train", "--train", str(tmp_path / "d" / "train"), "--test", str(tmp_path / "d" / "test.txt"),
               "--epochs", "2", "--hidden", "16", "--budget", "16", "--tables", "2", "--checkpoint",
               str(tmp_path / "ck"), "--batch", "64")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    keys = {"epoch", "pass", "seconds", "samples_per_s", "loss", "p_at_1", "p_at_5", "comm_bytes"}
    assert len(lines) == 2 and keys <= lines[0].keys() and lines[1]["pass"] == 2
    r = dslide("eval", "--checkpoint", str(tmp_path / "ck"), "--test", str(tmp_path / "d" / "test.txt"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["p_at_1"] == pytest.approx(lines[-1]["p_at_1"], abs=1e-6)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["train", "--train", "X", "--epochs", "-1"], 2, "dslide: error: argument --epochs: must be >= 0, got -1"),
        (["train", "--train", "X", "--hash", "md5"], 2, "dslide: error: argument --hash: invalid choice"),
        (["train"], 2, "dslide: error: the following arguments are required: --train"),
        (["frobnicate"], 2, "dslide: error: argument command: invalid choice"),
        (["train", "--train", "/nonexistent/x"], 1, "dslide: /nonexistent/x: no such file or directory"),
        (["eval", "--checkpoint", "/nonexistent", "--test", "t"], 1, "dslide: no checkpoint in /nonexistent"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], code: int, message: str) -> None:
    r = dslide(*args)
    assert r.returncode == code
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr


def test_cli_malformed_data_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("2 10 5\n0 1:0.5\n1,2 3:x\n")
    r = dslide("train", "--train", str(bad), "--epochs", "1", "--budget", "4", "--hidden", "4")
    assert r.returncode == 1
    assert r.stderr == f"dslide: {bad}:3: bad feature value (expected a number after ':')\n"


def teardown_module() -> None:
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
