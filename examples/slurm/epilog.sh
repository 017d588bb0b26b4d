#!/bin/bash
# Slurm Epilog for tierfs jobs (slurm.conf: Epilog=/etc/slurm/tierfs-epilog.sh), run as root on every node of a
# job once its processes are gone, however it ended (done, failed, scancel, a node's daemon killed): unmounts
# what the job left at $TIERFS_MNT_BASE/$SLURM_JOB_ID (train.sbatch's mount point) and removes the directory.
# The cache stays for the next job.  Set TIERFS_MNT_BASE as the job script does (default /tmp/tierfs).
mnt=${TIERFS_MNT_BASE:-/tmp/tierfs}/${SLURM_JOB_ID:?not run by slurmd}
if grep -q " $mnt fuse" /proc/self/mounts; then
    # (a daemon still serving writes its index and exits; a dead mount is detached)
    tierfs umount --timeout 30 "$mnt" || tierfs umount --lazy "$mnt" || fusermount3 -uz "$mnt"
fi
rmdir "$mnt" 2>/dev/null
exit 0
