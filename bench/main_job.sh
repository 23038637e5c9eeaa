#!/usr/bin/env bash
# The README's main job, timed: `bash bench/main_job.sh` from the repository root.
# Prints wall time, peak RSS of the driver, the test accuracy and the machine; the numbers go to
# bench/RESULTS.md by hand, with the date.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
log=$(mktemp)
start=$(date +%s)
make run 2>&1 | tee "$log" | grep -E "test accuracy|run id|artifacts:|report:|epoch [0-9]+ step [0-9]+:"
end=$(date +%s)
echo "wall time: $((end - start)) s"
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
