#!/usr/bin/env bash
# On the lent GPU host, after tests/gpu/README.md's install: one call's worth of
# make bench-gpu or make bench-writer. Results gather in /tmp/br (gpu.json merges
# models across calls); gpu.json, gpu.md and a tarball of every log go to $OUT,
# and the output's tail carries the summary too.
#   bash benchmarks/device_bench.sh LABEL gpu --model llama-1b --parts prefill,native
#   bash benchmarks/device_bench.sh LABEL writer --samples 256
set -u
source tests/gpu/device.sh vars
label=$1 kind=$2
shift 2
mkdir -p /tmp/br "${OUT:-/tmp/out}"
start=$(date +%s)
case $kind in
writer) timeout 560 python3 benchmarks/writer_bench.py --results "/tmp/br/$label" "$@" > "/tmp/br/$label.txt" 2>&1 ;;
gpu) timeout 570 python3 benchmarks/gpu_bench.py --results /tmp/br/results "$@" > "/tmp/br/$label.txt" 2>&1 ;;
*) echo "usage: device_bench.sh LABEL gpu|writer ARGS..."; exit 2 ;;
esac
echo "rc=$? wall=$(( $(date +%s) - start ))s"
# Only 8 files come back from $OUT, none named with @: the results, and the
# logs in one tarball.
cp /tmp/br/results/gpu.json /tmp/br/results/gpu.md "${OUT:-/tmp/out}/" 2>/dev/null
tar -czf "${OUT:-/tmp/out}/logs-$label.tgz" -C /tmp/br . 2>/dev/null
grep -v -i "warn" "/tmp/br/$label.txt" | tail -n 70
