#!/bin/sh
# The refault bench on a larger machine: rates against
# threads up to every CPU, the tenant's loss and the daemon's
# responsiveness, as JSON under $OUT (the `device` tool's output folder).
#
# Needs: root (huge pages reserved through sysfs), target/release/hugemem-bench
# built beforehand (`cargo build --release -p hugemem-bench`, carried to the
# machine), about 10 GiB of free memory; nothing from the network.
# Each run has its own timeout, so a stuck one still leaves the others.
set -u
OUT=${OUT:-/tmp/hugemem-device}
mkdir -p "$OUT"
BENCH=${BENCH:-target/release/hugemem-bench}
{
    nproc
    lscpu | grep -E 'Model name|Socket|NUMA node'
    uname -r
    grep -i huge /proc/meminfo
} > "$OUT/machine.txt" 2>&1
# 8 GiB on 2 MiB pages: rates for 1, 2, 4, 8, 16 threads.
timeout 240 "$BENCH" refault --size 8G --page-size 2M --reps 2 --tenant-ms 500 --json \
    > "$OUT/refault-device-2m.json" 2> "$OUT/refault-device-2m.err"
echo "2M: exit $?" >> "$OUT/machine.txt"
# 4 GiB on 1 GiB pages, where the kernel can have 4 of them.
timeout 180 "$BENCH" refault --size 4G --page-size 1G --reps 2 --tenant-ms 500 --json \
    > "$OUT/refault-device-1g.json" 2> "$OUT/refault-device-1g.err"
echo "1G: exit $?" >> "$OUT/machine.txt"
