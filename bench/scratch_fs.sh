#!/bin/sh
# A file system of its own for the CPU benches (root): a fresh ext4 with its
# journal, in an image file, loop-mounted at $1 (default /mnt/skilltrain-bench).
#
# Why: on an ext4 without a journal (this project's VMs' root), creating a
# file skips every inode deleted in the last minutes and reads each one
# (ext4's recently_deleted): after a few bench runs, each of which deletes
# its workspace, a file create cost ~700 us of CPU instead of ~25 us, about
# 2.5 ms a loss job (3.5 new files). bench/RESULTS.md, issue 36.
#
#   sudo bench/scratch_fs.sh /mnt/skilltrain-bench
#   .venv/bin/python bench/llm_bench.py cpu --base /mnt/skilltrain-bench
set -eu
mount_point=${1:-/mnt/skilltrain-bench}
image=${IMAGE:-/var/tmp/skilltrain-bench.ext4}
if mountpoint -q "$mount_point"; then
    echo "$mount_point is mounted already"; exit 0
fi
truncate -s 4G "$image"
mkfs.ext4 -q -F "$image"
mkdir -p "$mount_point"
mount -o loop "$image" "$mount_point"
df -T "$mount_point"
