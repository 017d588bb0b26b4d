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
from dslide.gen import generate, write_dataset
from dslide.model import ModelConfig, SlideModel
from dslide.mpirun import job_env
from dslide.train import TrainOptions, run_training


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


@pytest.mark.parametrize("shared", [{}, {"batch_budget": 96}])
def test_resume_continues_bit_for_bit(planted: Path, tmp_path: Path, shared: dict) -> None:
    cfg = small_cfg(hash="dwta", k=2, **shared)
    straight, rs = run_training(cfg, opts(planted, epochs=3, checkpoint=str(tmp_path / "a")), emit=lambda r: None)
    run_training(cfg, opts(planted, epochs=2, checkpoint=str(tmp_path / "b")), emit=lambda r: None)
    assert read_manifest(tmp_path / "b")["meta"]["passes"] == 2
    resumed, rr = run_training(
        cfg, opts(planted, epochs=3, checkpoint=str(tmp_path / "b"), resume=True), emit=lambda r: None
    )
    states_equal(straight, resumed)
    assert rr[-1]["loss"] == rs[-1]["loss"] and rr[-1]["p_at_1"] == rs[-1]["p_at_1"]
    assert len(list((tmp_path / "b").glob("ck-*/*.npz"))) == 1  # older shards are removed


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


def test_held_out_points_are_never_trained_and_scored_after_every_pass(planted: Path) -> None:
    seen: list[dict] = []
    _, records = run_training(small_cfg(), opts(planted, epochs=3, eval_every=2, val_fraction=0.1, val_points=100,
                                                eval_points=50),
                              emit=lambda r: None, before_report=lambda r: seen.append(dict(r)))  # fmt: skip
    assert [r["pass"] for r in records] == [2, 3]  # test points only every eval_every passes ...
    assert [r["val_points"] for r in seen] == [100, 100, 100]  # ... the held-out ones after every pass
    assert all(r["val_err"] == pytest.approx(1 - r["val_p_at_1"]) for r in seen)
    # ~10 % of the 6000 training points are held out of every pass, always the same ones
    per_pass = [b["samples"] - a["samples"] for a, b in zip([{"samples": 0}, *seen], seen, strict=False)]
    assert len(set(per_pass)) == 1 and 5000 < per_pass[0] < 5700, per_pass
    _, plain = run_training(small_cfg(), opts(planted, epochs=1), emit=lambda r: None)
    assert plain[0]["samples"] == 6000 and "val_err" not in plain[0]


def dslide(*args: str) -> subprocess.CompletedProcess:
    """The real command line in a process of its own (this checkout's ``dslide``, one numba thread)."""
    return subprocess.run(
        [sys.executable, "-m", "dslide", *args], capture_output=True, text=True, env=job_env(), timeout=240
    )


@pytest.mark.parametrize("extra", [[], ["--batch-budget", "24"]])
def test_cli_gen_train_eval(tmp_path: Path, extra: list[str]) -> None:
    r = dslide("gen", str(tmp_path / "d"), "--points", "600", "--features", "300", "--labels", "50", "--shards", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "d" / "train").iterdir()) == ["part-00000.txt", "part-00001.txt"]
    r = dslide("train", "--train", str(tmp_path / "d" / "train"), "--test", str(tmp_path / "d" / "test.txt"),
               "--epochs", "2", "--hidden", "16", "--budget", "16", "--tables", "2", "--checkpoint",
               str(tmp_path / "ck"), "--batch", "64", *extra)  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    assert manifest["model"]["batch_budget"] == (24 if extra else 0)
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


OVERFLOW = "overflows float32 (|value| must be at most 3.4028235e38)"
BAD_LABELS = "bad label list (expected comma-separated non-negative integers, then a space)"


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("2 10 5\n0 1:0.5\n1,2 3:x\n", 3, "bad feature value (expected a number after ':')"),
        ("2 10 5\n0 1:0.5\n1 3:NaN\n", 3, "feature 3: value NaN is not a finite number"),
        ("2 10 5\n0 1:0.5\n1 3:-inf\n", 3, "feature 3: value -inf is not a finite number"),
        ("2 10 5\n0 1:0.5\n1 3:1e999\n", 3, f"feature 3: value 1e999 {OVERFLOW}"),
        ("2 10 5\n0 1:0.5\n-1 3:1\n", 3, BAD_LABELS),
        ("2 10 5\n0 1:0.5\n1.0 3:1\n", 3, BAD_LABELS),
        # headers that lie: L or F smaller than what the lines use, more or fewer points than N
        ("2 10 5\n0 1:0.5\n1,5 3:1\n", 3, "label 5 out of range [0, 5)"),
        ("2 10 5\n0 1:0.5\n1 10:1\n", 3, "feature 10 out of range [0, 10)"),
        ("3 10 5\n0 1:0.5\n1 3:1\n", 1, "header says 3 points but the file has 2"),
        ("1 10 5\n0 1:0.5\n1 3:1\n", 1, "header says 1 points but the file has 2"),
    ],
)  # fmt: skip
def test_cli_refuses_bad_data_before_training(tmp_path: Path, text: str, line: int, reason: str) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text(text)
    ck = tmp_path / "ck"
    r = dslide("train", "--train", str(bad), "--epochs", "1", "--budget", "4", "--hidden", "4", "--checkpoint", str(ck))
    assert (r.returncode, r.stderr) == (1, f"dslide: {bad}:{line}: {reason}\n")
    assert r.stdout == "" and not ck.exists()  # no pass ran, nothing was saved


def test_cli_refuses_a_shard_whose_header_disagrees_with_the_model(tmp_path: Path) -> None:
    """The model is sized from the test file's header; a training file that says other F or L is refused, and so
    is a test file the parser refuses, before any step."""
    good, shard = tmp_path / "test.txt", tmp_path / "part.txt"
    good.write_text("1 10 5\n0 1:1\n")
    shard.write_text("1 12 5\n0 11:1\n")
    r = dslide("train", "--train", str(shard), "--test", str(good), "--epochs", "1", "--budget", "4", "--hidden", "4")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"dslide: {shard}:1: header says F=12 L=5, the model has F=10 L=5\n"
    good.write_text("1 10 5\n0 1:-1e39\n")
    r = dslide("train", "--train", str(shard), "--test", str(good), "--epochs", "1", "--budget", "4", "--hidden", "4")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith(f"dslide: {good}:2: feature 1: value -1e39 overflows float32")


def test_a_bad_shard_found_mid_pass_changes_no_checkpoint(planted: Path, tmp_path: Path) -> None:
    """Bad data met after other files of the pass were trained on: the pass is not saved, the checkpoint the
    job resumed from stays byte for byte what it was."""
    train = tmp_path / "train"
    train.mkdir()
    for part in (planted / "train").iterdir():
        os.link(part, train / part.name)
    args = ["--train", str(train), "--budget", "16", "--hidden", "8", "--tables", "2", "--batch", "256",
            "--eval-points", "50", "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
    assert dslide("train", "--epochs", "1", *args).returncode == 0
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    (train / "zz-bad.txt").write_text("2 1500 400\n0 1:0.5\n1 3:inf\n")
    r = dslide("train", "--epochs", "2", "--resume", *args)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"dslide: {train / 'zz-bad.txt'}:3: feature 3: value inf is not a finite number\n"
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert after == before


def test_shared_training_learns_and_touches_only_the_shared_rows(numba_threads) -> None:
    """The batch-shared active set (``ModelConfig.batch_budget``, tests/unit/test_dslide_shared.py) trained: only
    the shared set's rows change, and the model learns."""
    with numba_threads(2):
        data = generate(2048, 600, 3000, seed=9)
        cfg = ModelConfig(600, 3000, hidden=32, tables=4, batch_budget=512, lr_decay=0)
        model = SlideModel(cfg)
        before = model.W2.copy()
        rows = np.arange(128, dtype=np.int64)
        _, h = model._hidden(data, rows)
        want, _, _, _ = model._select_shared(data, rows, h)
        model.train_step(data, rows)
        changed = np.flatnonzero(np.any(before != model.W2, axis=1))
        np.testing.assert_array_equal(changed, np.sort(want))  # the shared set's rows and no other
        assert (model.opt["T2"][want] == 1).all() and model.opt["T2"].sum() == 512
        first = np.mean([model.train_step(data, np.arange(s, s + 128)).loss_sum / 128 for s in range(0, 1024, 128)])
        for _ in range(3):
            for s in range(0, 2048, 128):
                model.train_step(data, np.arange(s, s + 128))
        last = np.mean([model.train_step(data, np.arange(s, s + 128)).loss_sum / 128 for s in range(0, 1024, 128)])
        assert last < first - 1.0
        assert model.evaluate(data, 512)["p_at_1"] > 0.3  # the most frequent label alone scores ~0.05


def teardown_module() -> None:
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
