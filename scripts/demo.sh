#!/usr/bin/env bash
# The main job on an embedded default: make a small XC data set, mount tierfs over it with a cache smaller than
# the data, train dslide from the mount with 2 MPI ranks and score-based ARF feedback, print what it saved,
# unmount.  Idempotent: run it again and it starts over (the data set is kept).  DEMO_DIR overrides the place.
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
    "$bin/dslide" gen "$work/data" --points 24000 --test-points 2000 --features 20000 --labels 2000 --shards 32 --seed 1
fi
data_bytes=$(du -sb "$work/data/train" | cut -f1)
capacity=$((data_bytes * 3 / 8))
rm -rf "$work/cache" "$work/checkpoint"

echo "== mounting tierfs: $(numfmt --to=iec "$data_bytes") of data, cache capped at $(numfmt --to=iec "$capacity")"
"$bin/tierfs" mount "$work/data/train" "$mnt" --cache "$work/cache" --capacity "$capacity" \
    --nm 8 --rf 4 --arf score --arf-wait 2 --seed 1 --daemon

echo "== training dslide from the mount: 2 MPI ranks x 1 thread, feedback to .tierfs/control"
"$bin/mpiexec" -n 2 "$bin/dslide" train --train "$mnt" --test "$work/data/test.txt" \
    --control "$mnt/.tierfs/control" --epochs 12 --hidden 64 --batch 128 --threads 1 --seed 1 \
    --checkpoint "$work/checkpoint" | tee "$work/train.jsonl"

echo "== tierfs status after training"
"$bin/tierfs" status "$mnt"
"$bin/tierfs" status "$mnt" --json > "$work/status.json"
echo "== what the job trained on"
# Each JSON line carries tierfs's own position for its pass ("tierfs": epoch, mini_epoch), the trainer's pass
# count being "pass": the mini-epochs it saw, out of nm, are the share of the data set it trained on.
"$bin/python" - "$work/train.jsonl" "$work/status.json" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
nm = json.load(open(sys.argv[2]))["nm"]
seen = {(r["tierfs"]["epoch"], r["tierfs"]["mini_epoch"]) for r in records if r.get("tierfs")}
if not seen:
    print("  (no tierfs position in the JSON lines: was --control given?)")
    raise SystemExit(0)
last = max(e for e, _ in seen)
now = sum(1 for e, _ in seen if e == last)
if last == 0:
    print(f"  {len(records)} passes on {now} of {nm} mini-epochs: about {now / nm:.0%} of the data set "
          "(more passes, --epochs, or a larger cache reach the rest)")
else:
    print(f"  {len(records)} passes: all of the data set ({last} whole epoch{'s' if last > 1 else ''}, then {now} "
          f"of {nm} mini-epochs)")
PY
"$bin/tierfs" umount "$mnt"

echo "== saved"
echo "  checkpoint:   $work/checkpoint ($(du -sh "$work/checkpoint" | cut -f1))"
echo "  train log:    $work/train.jsonl ($(wc -l < "$work/train.jsonl") evaluations)"
echo "  cache:        $work/cache (index and journal; a remount resumes from here)"
"$bin/dslide" eval --checkpoint "$work/checkpoint" --test "$work/data/test.txt"
