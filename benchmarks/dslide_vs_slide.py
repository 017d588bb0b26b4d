"""dslide against the reference SLIDE (C++/OpenMP, ``keroro824/HashingDeepLearning``) on the same data and cores.

The reference is built here from a source checkout given on the command line, with its own Makefile and its
own flags; only make-line overrides say where cnpy is (the Makefile names ``/slide/cnpy``) and a ``g++-7``
on PATH that is the system's g++ (the Makefile calls ``g++-7`` by name).  Nothing of the reference is copied
into this project: the build happens in a temporary directory.

    git --git-dir=<mirror of keroro824/HashingDeepLearning> archive HEAD | tar -x -C /tmp/slide-src
    git --git-dir=<mirror of rogersce/cnpy> archive HEAD | tar -x -C /tmp/cnpy-src
    .venv/bin/python benchmarks/dslide_vs_slide.py /tmp/slide-src --cnpy /tmp/cnpy-src             # 100k labels
    .venv/bin/python benchmarks/dslide_vs_slide.py /tmp/slide-src --cnpy /tmp/cnpy-src --amazon    # 670K shape
    .venv/bin/python benchmarks/dslide_vs_slide.py /tmp/slide-src --cnpy /tmp/cnpy-src \\
        --train data/train.txt --test data/test.txt                                                # any XC data

Both sides train on the same XC files (the reference reads the XC format: it skips the header line), the same
batch, the same thread count (``OMP_NUM_THREADS`` / numba threads), hidden 128, the same number of hash tables
(L) and the same active budget per sample (the reference's output ``Sparsity`` = budget / labels).  Each side
hashes with its own default family (reference: DWTA, K = 6, RangePow = 18, as its Amazon config; dslide: SRP
with its automatic K): the families are not interchangeable, so each keeps the one it was tuned with.  The
reference trains with its own Adam at a constant lr (swept with ``--slide-lr``; the best is reported), dslide
with its defaults.  Training time is each side's own step timing (the reference's ``globalTime``: whole
seconds around ``ProcessInput``; dslide: around ``train_step``), so reading and parsing the file does not count
for the reference and evaluation counts for neither.  P@1 after each epoch on the same test points (the
reference evaluates 50 batches after an epoch, so the test set is exactly 50 x batch points); the reference
reports no P@5.  Peak RSS of each side's process (``wait4``); the reference is stopped when its RSS passes
``--rss-limit-gib`` (the machine is shared) and the figure it reached is reported.

Prints a table, writes ``results.json`` and a plot (named by data set) into ``--out``; ``--plot
docs/img/NAME.png`` also writes the plot there (the docs' plots are updated on purpose, never by default).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EVAL_BATCHES = 50  # what the reference's main evaluates after every epoch but the last


# -- the reference: build, configure, run ------------------------------------------------------------------------


def build_reference(src: Path, cnpy: Path, work: Path) -> Path:
    """Build ``src/SLIDE`` with its Makefile in ``work``; returns the binary.  cnpy is compiled to a static
    library from its one source file (its CMake build does the same plus a shared library)."""
    slide = src / "SLIDE"
    if not (slide / "Makefile").is_file():
        raise SystemExit(f"{src}: no SLIDE/Makefile here (want a checkout of keroro824/HashingDeepLearning)")
    if not (cnpy / "cnpy.cpp").is_file():
        raise SystemExit(f"{cnpy}: no cnpy.cpp here (want a checkout of rogersce/cnpy)")
    build = work / "SLIDE"
    shutil.copytree(slide, build)
    shim = work / "bin"
    shim.mkdir()
    for name, real in (("g++-7", "g++"), ("gcc-7", "gcc")):
        (shim / name).symlink_to(shutil.which(real) or f"/usr/bin/{real}")
    subprocess.run(["g++", "-O3", "-fPIC", "-c", str(cnpy / "cnpy.cpp"), "-o", str(work / "cnpy.o")], check=True)
    subprocess.run(["ar", "rcs", str(work / "libcnpy.a"), str(work / "cnpy.o")], check=True)
    # the Makefile's own flags, with -I/-L pointing at this cnpy instead of /slide/cnpy
    opt = "-fno-strict-aliasing -g -O3 -fopenmp -mtune=intel -mavx2"
    make = [
        "make", f"-j{os.cpu_count() or 1}",
        f"CXXFLAGS=-m64 -DUNIX -I{cnpy} -std=c++11 {opt} -I/usr/include/",
        f"LIB=-fPIC -fopenmp -L{work} -lcnpy -lz",
    ]  # fmt: skip
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}")
    r = subprocess.run(make, cwd=build, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"building the reference failed:\n{r.stderr[-3000:]}")
    return build / "runme"


def write_config(path: Path, a: argparse.Namespace, n_features: int, n_labels: int, n_train: int, lr: float,
                 epochs: int, work: Path) -> None:  # fmt: skip
    """The reference's config file (its ``Config_amz.csv`` keys), with this run's sizes and settings."""
    sparsity = min(1.0, a.budget / n_labels)
    lines = [
        "RangePow = 6,18", f"K = 2,{a.slide_k}", f"L = 20,{a.tables}", f"Sparsity = 1,{sparsity:.6g},1,1",
        f"Batchsize={a.batch}", "Rehash=6400", "Rebuild=128000", f"InputDim={n_features}",
        f"totRecords={n_train}", f"totRecordsTest={EVAL_BATCHES * a.batch}", f"Lr={lr:g}", f"Epoch={epochs}",
        "Stepsize=1000000000",  # evaluate once before training and after each epoch only
        f"sizesOfLayers={a.hidden},{n_labels}", "numLayer=2",
        f"trainData={work / 'train.txt'}", f"testData={work / 'test.txt'}",
        f"weight={work / 'unused.npz'}", f"savedweight={work / 'saved.npz'}", f"logFile={work / 'log.txt'}",
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def run_reference(binary: Path, config: Path, work: Path, threads: int, limit_gib: float, timeout: float) -> dict:
    """Run the reference; per epoch its cumulative training seconds and P@1 from its log file."""
    log = work / "log.txt"
    log.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(work / "stdout.txt", "wb") as out:
        p = subprocess.Popen([str(binary), str(config)], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    seen, stopped, t0 = 0.0, None, time.monotonic()
    status = None  # reaped with wait4 (not Popen.poll), which also gives the process's own peak RSS
    try:
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            seen = max(seen, rss_gib(p.pid))
            if seen > limit_gib:
                stopped = f"RSS passed {limit_gib:g} GiB"
            elif time.monotonic() - t0 > timeout:
                stopped = f"still running after {timeout:g} s"
            if stopped:
                break
            time.sleep(0.2)
    finally:
        if not pid:
            p.kill()
            _, status, usage = os.wait4(p.pid, 0)
        p.returncode = 0  # reaped here; keeps Popen from waiting on it again
    epochs = parse_log(log.read_text() if log.exists() else "")
    if stopped is None and os.waitstatus_to_exitcode(status) != 0:
        stopped = f"exit status {os.waitstatus_to_exitcode(status)}"
    return {"epochs": epochs, "peak_rss_gib": max(seen, usage.ru_maxrss / 2**20), "stopped": stopped,
            "wall_s": time.monotonic() - t0}  # fmt: skip


def parse_log(text: str) -> list[dict]:
    """The reference's log: ``Epoch e`` lines, then ``iter seconds accuracy`` per evaluation; the last evaluation
    of each epoch block is the one after that epoch's training."""
    out: list[dict] = []
    block: list[tuple[int, float, float]] = []

    def close() -> None:
        if block and (len(block) > 1 or out):  # epoch 0's block starts with the evaluation before training
            _, secs, acc = block[-1]
            out.append({"epoch": len(out) + 1, "train_s": secs, "p_at_1": acc})

    for line in text.splitlines():
        if line.startswith("Epoch"):
            close()
            block = []
        elif line.strip():
            it, secs, acc = line.split()
            block.append((int(it), float(secs), float(acc)))
    close()
    return out


# -- dslide ------------------------------------------------------------------------------------------------------


def worker_dslide(a: argparse.Namespace) -> dict:
    import numba

    from dslide.data import load_xc
    from dslide.model import ModelConfig, SlideModel

    numba.set_num_threads(a.threads)
    train, test = load_xc(a.train), load_xc(a.test)
    cfg = ModelConfig(train.n_features, train.n_labels, hidden=a.hidden, budget=a.budget, tables=a.tables,
                      seed=a.seed)  # fmt: skip
    net = SlideModel(cfg)
    steps = len(train) // a.batch  # the reference drops the last partial batch too
    epochs, train_s = [], 0.0
    for e in range(a.epochs):
        order = np.random.default_rng((a.seed, e)).permutation(len(train))[: steps * a.batch]
        for rows in order.reshape(steps, a.batch):
            t0 = time.perf_counter()
            net.train_step(train, rows)
            train_s += time.perf_counter() - t0
        ev = net.evaluate(test)
        epochs.append({"epoch": e + 1, "train_s": train_s, "p_at_1": ev["p_at_1"], "p_at_5": ev["p_at_5"]})
    import resource

    return {"epochs": epochs, "samples_per_epoch": steps * a.batch, "config": cfg.to_json(),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # fmt: skip


def run_dslide(a: argparse.Namespace, train: Path, test: Path, epochs: int) -> dict:
    cmd = [sys.executable, __file__, "-", "--worker", "--train", str(train), "--test", str(test),
           "--epochs", str(epochs), "--threads", str(a.threads), "--batch", str(a.batch), "--budget", str(a.budget),
           "--tables", str(a.tables), "--hidden", str(a.hidden), "--seed", str(a.seed)]  # fmt: skip
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS=str(a.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"dslide worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- data --------------------------------------------------------------------------------------------------------


def prepare_data(a: argparse.Namespace, work: Path) -> tuple[int, int, int]:
    """``work/train.txt`` and ``work/test.txt`` (exactly 50 x batch points, every point with a label: the
    reference reads a line without labels wrongly); returns (features, labels, train points)."""
    from dslide.data import XCData, load_xc, write_xc
    from dslide.gen import AMAZON_670K, generate

    def labelled(d: XCData) -> XCData:
        return d.subset(np.flatnonzero(np.diff(d.y_indptr) > 0))

    n_test = EVAL_BATCHES * a.batch
    if a.train:
        train, test = labelled(load_xc(a.train)), labelled(load_xc(a.test))
        if len(test) < n_test:
            raise SystemExit(f"--test has {len(test)} labelled points, the reference's evaluation needs {n_test}")
        test = test.subset(np.arange(n_test))
    else:
        F, L = AMAZON_670K if a.amazon else (a.features, a.labels)
        data = labelled(generate(a.points + 2 * n_test, F, L, seed=a.seed + 1))
        train, test = data.subset(np.arange(a.points)), data.subset(np.arange(len(data) - n_test, len(data)))
    write_xc(work / "train.txt", train)
    write_xc(work / "test.txt", test)
    return train.n_features, train.n_labels, len(train)


# -- the driver --------------------------------------------------------------------------------------------------


def plot(res: dict, paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    d = res["dslide"]["epochs"]
    ax.plot([0] + [e["train_s"] for e in d], [0] + [e["p_at_1"] for e in d], "o-", label="dslide")
    for lr, r in sorted(res["reference"].items()):
        if r["epochs"]:
            ax.plot([0] + [e["train_s"] for e in r["epochs"]], [0] + [e["p_at_1"] for e in r["epochs"]], "s--",
                    label=f"SLIDE reference, lr {lr}")  # fmt: skip
    ax.set_xlabel("training seconds (each side's own step timing)")
    ax.set_ylabel("P@1 after each epoch")
    ax.set_title(f"{res['data']['labels']:,} labels, {res['data']['train']:,} points, {res['threads']} threads")
    ax.legend()
    fig.tight_layout()
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(paths[0], dpi=110)
    for p in paths[1:]:
        shutil.copyfile(paths[0], p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("slide_src", help="checkout of keroro824/HashingDeepLearning (the directory holding SLIDE/)")
    ap.add_argument("--cnpy", help="checkout of rogersce/cnpy (the reference's one dependency)")
    ap.add_argument("--amazon", action="store_true", help="planted data at Amazon-670K shape")
    ap.add_argument("--labels", type=int, default=100_000)
    ap.add_argument("--features", type=int, default=50_000)
    ap.add_argument("--points", type=int, default=25_600, help="planted training points")
    ap.add_argument("--train", help="an XC training file instead of planted data")
    ap.add_argument("--test", help="its XC test file")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--budget", type=int, default=1024, help="active output neurons per sample, both sides")
    ap.add_argument("--tables", type=int, default=50, help="hash tables (L), both sides")
    ap.add_argument("--slide-k", type=int, default=6, help="the reference's K (DWTA)")
    ap.add_argument("--slide-lr", default="1e-4,1e-3,1e-2,3e-2", help="the reference's lr sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-limit-gib", type=float, default=16.0, help="stop the reference past this RSS")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per reference run")
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "dslide_vs_slide"))
    ap.add_argument("--plot", default=None, help="also write the plot here (e.g. docs/img/dslide_vs_slide_100k.png)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker_dslide(a)))
        return
    if bool(a.train) != bool(a.test):
        raise SystemExit("--train and --test go together")
    if not a.cnpy:
        raise SystemExit("--cnpy: the path of a cnpy checkout is needed to build the reference")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slide-ref-") as tmp:
        work = Path(tmp)
        binary = build_reference(Path(a.slide_src).resolve(), Path(a.cnpy).resolve(), work)
        F, L, n_train = prepare_data(a, work)
        n_train -= n_train % a.batch
        res = {"threads": a.threads, "loadavg_at_start": os.getloadavg(), "data": {"features": F, "labels": L,
               "train": n_train, "test": EVAL_BATCHES * a.batch}, "settings": {k: v for k, v in vars(a).items()
               if k not in ("worker",)}}  # fmt: skip
        res["dslide"] = run_dslide(a, work / "train.txt", work / "test.txt", a.epochs)
        res["reference"] = {}
        for lr in a.slide_lr.split(","):
            write_config(work / "config.csv", a, F, L, n_train, float(lr), a.epochs, work)
            res["reference"][lr] = run_reference(binary, work / "config.csv", work, a.threads, a.rss_limit_gib,
                                                 a.timeout)  # fmt: skip
            print(f"reference lr {lr}: {res['reference'][lr]}", file=sys.stderr)
        res["loadavg_at_end"] = os.getloadavg()
    summarise(res)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    name = "dslide_vs_slide_" + ("amazon" if a.amazon else "real" if a.train else f"{L // 1000}k")
    plot(res, [out / f"{name}.png", *([Path(a.plot)] if a.plot else [])])


def summarise(res: dict) -> None:
    d = res["dslide"]
    ran = {lr: r for lr, r in res["reference"].items() if r["epochs"]}
    best = max(ran, key=lambda lr: ran[lr]["epochs"][-1]["p_at_1"]) if ran else None
    res["best_lr"] = best
    n = res["data"]["train"]
    print(f"{res['data']['labels']:,} labels, {res['data']['features']:,} features, {n:,} training points, "
          f"{res['threads']} threads, load {res['loadavg_at_start'][0]:.2f} at start")  # fmt: skip
    for lr, r in res["reference"].items():
        if r["stopped"]:
            print(f"reference lr {lr}: stopped ({r['stopped']}) at {r['peak_rss_gib']:.1f} GiB RSS after "
                  f"{len(r['epochs'])} epochs")  # fmt: skip
    print(f"{'epoch':>5} {'dslide s/s':>11} {'P@1':>7} {'P@5':>7}   {'ref s/s':>9} {'P@1':>7}   {'speed-up':>8}")
    ref = ran[best]["epochs"] if best else []
    prev_d = prev_r = 0.0
    for i, e in enumerate(d["epochs"]):
        sd = n / max(e["train_s"] - prev_d, 1e-9)
        prev_d = e["train_s"]
        row = f"{e['epoch']:5d} {sd:11.0f} {e['p_at_1']:7.4f} {e['p_at_5']:7.4f}"
        if i < len(ref):
            sr = n / max(ref[i]["train_s"] - prev_r, 1e-9)
            prev_r = ref[i]["train_s"]
            row += f"   {sr:9.0f} {ref[i]['p_at_1']:7.4f}   {sd / sr:7.1f}x"
        print(row)
    print(f"peak RSS: dslide {d['peak_rss_gib']:.2f} GiB, reference " +
          ", ".join(f"lr {lr} {r['peak_rss_gib']:.2f} GiB" for lr, r in res["reference"].items()))  # fmt: skip
    if best:
        print(f"reference's best lr (P@1 after the last epoch): {best}; its P@1 by lr: " +
              ", ".join(f"{lr} {[round(e['p_at_1'], 4) for e in r['epochs']]}" for lr, r in ran.items()))  # fmt: skip


if __name__ == "__main__":
    main()
