#!/usr/bin/env bash
# The main job on an embedded default: make a small XC data set, mount tierfs over it with a cache smaller than
# the data, train dslide from the mount with 2 MPI ranks and score-based ARF feedback (a progress line per pass),
# unmount, and end with a short summary (P@1, data seen, slow-tier bytes saved, a plot with matplotlib); the
# JSON records are left in files.  Idempotent: run it again and it starts over (the data set is kept).  DEMO_DIR overrides the place.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
bin=$root/.venv/bin
work=${DEMO_DIR:-$root/demo-run}
mnt=$work/mnt

cleanup() {
    if grep -qs " $mnt fuse" /proc/mounts; then
        "$bin/tierfs" umount "$mnt" 2>/dev/null || fusermount3 -uz "$mnt" 2>/dev/null || true
    fi
}
trap cleanup EXIT
cleanup
mkdir -p "$work" "$mnt"

if [ ! -f "$work/data/test.txt" ]; then
    echo "== making a planted data set (24,000 points, 2,000 labels, 32 shards)"
    "$bin/dslide" gen "$work/data" --points 24000 --test-points 2000 --features 20000 --labels 2000 --shards 32 --seed 1 \
        > "$work/data.json"  # (what it made, as JSON)
fi
data_bytes=$(du -sb "$work/data/train" | cut -f1)
capacity=$((data_bytes * 3 / 8))
rm -rf "$work/cache" "$work/checkpoint"

echo "== mounting tierfs: $(numfmt --to=iec "$data_bytes") of data, cache capped at $(numfmt --to=iec "$capacity")"
"$bin/tierfs" mount "$work/data/train" "$mnt" --cache "$work/cache" --capacity "$capacity" \
    --nm 8 --rf 4 --arf score --arf-wait 2 --seed 1 --daemon

echo "== training dslide from the mount: 2 MPI ranks x 1 thread, feedback to .tierfs/control"
echo "   (a line per pass from rank 0: samples/s, the cache's hit rate, the slow tier's read rate, stalls;"
echo "   the JSON record of each pass goes to $work/train.jsonl)"
"$bin/mpiexec" -n 2 "$bin/dslide" train --train "$mnt" --test "$work/data/test.txt" \
    --control "$mnt/.tierfs/control" --epochs 12 --hidden 64 --batch 128 --threads 1 --seed 1 \
    --checkpoint "$work/checkpoint" > "$work/train.jsonl"

echo "== tierfs status after training"
"$bin/tierfs" status "$mnt"
"$bin/tierfs" status "$mnt" --json > "$work/status.json"
"$bin/tierfs" umount "$mnt"
"$bin/dslide" eval --checkpoint "$work/checkpoint" --test "$work/data/test.txt" > "$work/eval.json"

echo "== summary"
# Each JSON line carries tierfs's own position for its pass ("tierfs": epoch, mini_epoch, counted from 0 as in
# status --json), the trainer's pass count being "pass": the mini-epochs it saw, out of nm, are the share of the
# data set it trained on.  The slow tier's bytes saved: what the trainer opened less what was read from the slow
# tier (every pass read straight from the slow tier would have read all it opened).
"$bin/python" - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
records = [json.loads(line) for line in open(os.path.join(work, "train.jsonl")) if line.strip()]
st = json.load(open(os.path.join(work, "status.json")))
final = json.load(open(os.path.join(work, "eval.json")))
nm = st["nm"]


def size(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


print(f"  model:        P@1 {final['p_at_1']:.3f}, P@5 {final['p_at_5']:.3f} on {final.get('eval_points', 'the')} "
      f"test points after {len(records)} passes")
print("                (P@k: the share of the model's k top-scored labels that are true; a point with fewer than 5 "
      "true labels\n                caps P@5 below 1, so P@5 under P@1 is expected)")
seen = {(r["tierfs"]["epoch"], r["tierfs"]["mini_epoch"]) for r in records if r.get("tierfs")}
if not seen:
    print("  data seen:    (no tierfs position in the JSON lines: was --control given?)")
else:
    last = max(e for e, _ in seen)
    now = sum(1 for e, _ in seen if e == last)
    if last == 0:
        print(f"  data seen:    {now} of {nm} mini-epochs, about {now / nm:.0%} of the data set (more passes, "
              "--epochs, or a larger cache reach the rest)")
    else:
        print(f"  data seen:    all of the data set ({last} whole epoch{'s' if last > 1 else ''}, then {now} of "
              f"{nm} mini-epochs)")
opened, slow = st.get("opened_bytes", 0), st.get("backing_bytes_read", 0)
saved = max(0, opened - slow)
share = f" ({saved / opened:.0%} of what it opened)" if opened else ""
print(f"  slow tier:    read {size(slow)} for {size(opened)} the trainer opened: {size(saved)} saved{share}; "
      f"readers stalled {st.get('stall_seconds', 0.0):.1f} s")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("  plot:         none (pip install matplotlib for one)")
else:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    scored = [r for r in records if r.get("p_at_1") is not None]
    ax.plot([r["pass"] for r in scored], [r["p_at_1"] for r in scored], marker="o")
    ax.set_xlabel("pass")
    ax.set_ylabel("test P@1")
    ax.set_title("dslide from a tierfs mount")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(work, "p_at_1.png"), dpi=100)
    print(f"  plot:         {os.path.join(work, 'p_at_1.png')} (test P@1 per pass)")
PY
echo "  checkpoint:   $work/checkpoint ($(du -sh "$work/checkpoint" | cut -f1))"
echo "  JSON:         $work/train.jsonl (a record per pass), status.json, eval.json"
echo "  cache:        $work/cache (index and journal; a remount resumes from here)"
