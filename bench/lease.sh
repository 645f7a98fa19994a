#!/usr/bin/env bash
# One device call (issue 40): bench/gpu_check.sh with the given stages in WORK (default
# /tmp/mpitrain-lease), then what comes back to the developer's machine under $OUT, which returns at
# most 8 files (16 MiB each):
#   check.log     everything gpu_check printed
#   summary.md    the table of checks
#   logs.tgz      every log, metrics file, trace and table of WORK (no shards, corpora or checkpoints)
#   handoff.tgz   the train stage's mid-run GPU checkpoint and shards, for a resume on a CPU machine
# From the repository root, after `bash bench/device-kit.sh`:
#   device run, carry [".device-kit"], timeout_s 540:  bash bench/lease.sh env build test train llama
# Prints the end of check.log; exit status gpu_check's.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:?"lease.sh: OUT (the folder that comes back) is not set"}
work=${WORK:-/tmp/mpitrain-lease}
mkdir -p "$work" "$out"
echo "lease: $(date -u +%FT%TZ) $(nproc) cores, stages: ${*:-all}" > "$out/check.log"
# Inside the call's own limit (LEASE_S, default 510 s for a 540 s call), so that what ran is
# packed and comes back even when a stage overruns.
timeout --kill-after=5 "${LEASE_S:-510}" bash "$root/bench/gpu_check.sh" "$work" "$@" >> "$out/check.log" 2>&1
rc=$?
[ $rc -eq 124 ] && echo "lease: gpu_check stopped at LEASE_S=${LEASE_S:-510} s" >> "$out/check.log"
cp "$work/summary.md" "$out/" 2>/dev/null
tar -czf "$out/logs.tgz" -C "$work" --exclude=shards --exclude=corpus --exclude=handoff --exclude=ckpt \
  --exclude='*.h5' --exclude='*.npy' --exclude='*.o' . 2>/dev/null
[ -d "$work/handoff" ] && tar -czf "$out/handoff.tgz" -C "$work" handoff
tail -n 70 "$out/check.log"
exit $rc
