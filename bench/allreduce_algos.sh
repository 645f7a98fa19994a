#!/usr/bin/env bash
# What OpenMPI's own all-reduce algorithms do over slow links, 2 hosts x 2 ranks (issue 19, item
# 2: measure coll/han and the tuned/libnbc algorithm choices before writing a hierarchical
# all-reduce). The hosts are network namespaces on this machine joined by links limited to RATE
# (default 100mbit each way: tests/multihost/lib.sh, NETNS_RATE), so the 4 ranks share this
# machine's CPU; ranks 0,1 are on ar-node1, ranks 2,3 on ar-node2. All variants in the same run.
#
#     bash bench/allreduce_algos.sh [build/mpitrain]
#
# Two code paths, two tables. OpenMPI 4.1 serves the blocking MPI_Allreduce from coll/tuned (or
# coll/han when raised), but the non-blocking MPI_Iallreduce from coll/libnbc, whose algorithm
# the tuned and han settings do not touch; the trainer's gradient buckets are MPI_Iallreduce
# (MpiCommunicator::all_reduce_async, with or without comm.overlap), `mpitrain netcheck` times
# MPI_Allreduce.
#
# Table 1, MPI_Allreduce (netcheck: fp32 sum in place, the slowest rank's mean over ITERS after a
# warm-up), variants NC_VARIANTS:
#   default             coll/tuned's fixed decision rules
#   han                 --mca coll_han_priority 100 (coll/han: reduce inside the host, all-reduce
#                       between the hosts' leaders, broadcast inside the host, pipelined)
#   tuned:<algorithm>   --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm N
#                       (1 basic_linear, 2 nonoverlapping, 3 recursive_doubling, 4 ring,
#                       5 segmented_ring, here with 1 MiB segments, 6 rabenseifner)
# Sizes: 512 KiB, 4 MiB (about the demo model's single 3.2 MiB fp32 gradient bucket), 32 MiB
# (about the default comm.bucket_mb of 25). "busbw" = size / time x 2(n-1)/n, n = 4, in MB/s
# (netcheck's bus bandwidth). A flat ring moves 1.5 x size through every rank's link, and with
# this placement two of its four hops cross the hosts' links: busbw is bounded by the link rate
# (12.5 MB/s at 100mbit, less TCP/IP headers). An ideal hierarchical all-reduce of 2 hosts sends 1 x
# size over each host's link (each direction at once), so busbw up to 1.5 x the link rate.
# "32 MiB speed vs default" = default's time ÷ this variant's (above 1: faster).
#
# Table 2, MPI_Iallreduce: the demo model (configs/demo.yaml, one 3.2 MiB fp32 bucket) trained
# TRAIN_STEPS steps on 2 x 2 ranks (train.threads 1, comm.grad_dtype TRAIN_DTYPE) under each of
# TRAIN_VARIANTS; besides the names above:
#   libnbc:<algorithm>  --mca coll_libnbc_iallreduce_algorithm N (1 ring, 2 binomial, 3 rabenseifner
#                       = reduce-scatter + all-gather, 4 recursive_doubling). libnbc's default
#                       for an in-place all-reduce (the trainer's) is binomial whatever the size:
#                       reduce to rank 0, then broadcast, each moving the whole bucket.
# "ms/step", "comm share" (metrics.jsonl comm_share of rank 0) and "exposed ms" (comm_share x
# ms_per_step, the communication backward did not hide) are medians of the progress intervals after
# the first (every TRAIN_LOG_EVERY steps); "vs default" = this ÷ the default row's (below 1: less);
# "loss": the last logged train loss (the variants sum in different orders, so not bitwise equal,
# but close: a wrong sum would show here).
#
# Environment: RATE (100mbit), ITERS (2), NC_VARIANTS, TRAIN_VARIANTS (lists of the names above;
# empty skips that table), TRAIN_DTYPE (fp32), TRAIN_STEPS (15), TRAIN_LOG_EVERY (3), LIMIT
# (seconds per mpirun, 300), LOGS (a directory: every mpirun's output is copied there at the end).
# About 8 minutes on a 2-core VM. The tables go to stdout, the harness's progress to stderr.
# Everything is removed on exit, also on failure or Ctrl-C (lib.sh).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../tests/multihost/lib.sh
. "$REPO/tests/multihost/lib.sh"
# shellcheck source=table_lib.sh
. "$REPO/bench/table_lib.sh"
BIN=$(realpath -e "${1:-$REPO/build/mpitrain}" 2>/dev/null) || { echo "$0: no such file: ${1:-build/mpitrain}" >&2; exit 2; }
RATE=${RATE:-100mbit} ITERS=${ITERS:-2} TRAIN_DTYPE=${TRAIN_DTYPE:-fp32}
TRAIN_STEPS=${TRAIN_STEPS:-15} TRAIN_LOG_EVERY=${TRAIN_LOG_EVERY:-3} LIMIT=${LIMIT:-300}
NC_VARIANTS=${NC_VARIANTS-"default han tuned:basic_linear tuned:nonoverlapping tuned:recursive_doubling tuned:ring tuned:segmented_ring tuned:rabenseifner"}
TRAIN_VARIANTS=${TRAIN_VARIANTS-"default libnbc:binomial libnbc:ring libnbc:rabenseifner libnbc:recursive_doubling tuned:ring han"}
[ -z "$TRAIN_VARIANTS" ] || [ -d /usr/share/games/fortunes ] || { echo "$0: no /usr/share/games/fortunes (Debian package fortunes)" >&2; exit 2; }

NET=10.213.12                    # private subnet that exists only inside the namespaces
HOSTS=(ar-node1 ar-node2)
ID=mar$$
NETNS_TMP=/tmp/mpt-allreduce-XXXXXX
NETNS_TOOLS=(mpirun)
NETNS_RATE=$RATE
netns_begin
exec 3>&2                        # the harness's PASS/summary lines to stderr; stdout: the table
netns_setup >&2
cd "$T" || setup_fail "cd $T"
[ -z "$TRAIN_VARIANTS" ] || run_quiet "$BIN" pack /usr/share/games/fortunes -o "$T/data/f" --doc-separator %
netns_mpi_env "$REPO" >&2
printf '%s slots=2\n' "${ADDRS[@]}" > "$T/hosts"


mca_args() {  # variant -> mpirun arguments
  local algo
  case $1 in
    default) ;;
    han) echo "--mca coll_han_priority 100" ;;
    tuned:*)
      case ${1#tuned:} in
        basic_linear) algo=1 ;; nonoverlapping) algo=2 ;; recursive_doubling) algo=3 ;; ring) algo=4 ;;
        segmented_ring) algo="5 --mca coll_tuned_allreduce_algorithm_segmentsize 1048576" ;;
        rabenseifner) algo=6 ;;
        *) echo "unknown variant $1" >&2; return 1 ;;
      esac
      echo "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm $algo" ;;
    libnbc:*)
      case ${1#libnbc:} in
        ring) algo=1 ;; binomial) algo=2 ;; rabenseifner) algo=3 ;; recursive_doubling) algo=4 ;;
        *) echo "unknown variant $1" >&2; return 1 ;;
      esac
      echo "--mca coll_libnbc_iallreduce_algorithm $algo" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
  esac
}
for v in $NC_VARIANTS $TRAIN_VARIANTS; do mca_args "$v" > /dev/null || exit 2; done

mpirun_node1() {  # name, mpirun arguments... -> $T/name.out
  local name=$1
  shift
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$T/hosts" -np 4 --bind-to none "$@" > "$T/$name.out" 2>&1
}
why() { case $1 in 0) ;; 124|137) echo "timed out" ;; *) grep -q 'signal 11' "$2" && echo "crashed (SIGSEGV)" || echo "failed (exit $1)" ;; esac; }

# netcheck's all-reduce time for a size, in microseconds
ar_us() { awk -v s="$2" '/^all-reduce/ { on = 1; next } on && $1 " " $2 == s { print $3; exit }' "$1"; }

# ---- MPI_Allreduce (blocking): netcheck -------------------------------------------------------
declare -A T512 T4 T32 NCFAIL MS SHARE EXP LOSS TRFAIL
i=0
for v in $NC_VARIANTS; do
  i=$((i + 1))
  args=$(mca_args "$v")
  echo "[netcheck $i] $v ($args)" >&2
  # shellcheck disable=SC2086  # $args: MCA options, split on purpose
  mpirun_node1 "nc$i" $args "$BIN" netcheck --max-bytes 33554432 --p2p-bytes 1048576 --iters "$ITERS"
  rc=$?
  NCFAIL[$v]=$(why $rc "$T/nc$i.out")
  [ $rc -eq 0 ] || { echo "  $v: ${NCFAIL[$v]}" >&2; show_tail "$T/nc$i.out" 8 >&2; }
  T512[$v]=$(ar_us "$T/nc$i.out" "512 KiB") T4[$v]=$(ar_us "$T/nc$i.out" "4 MiB") T32[$v]=$(ar_us "$T/nc$i.out" "32 MiB")
  if [ "$v" = han ]; then  # did coll/han take the job's communicators? (its own verbose output)
    # shellcheck disable=SC2086
    mpirun_node1 han-verbose $args --mca coll_base_verbose 30 "$BIN" netcheck --max-bytes 8 --p2p-bytes 8 --iters 1
    grep -h -o 'coll:han:[a-z_]*.*' "$T/han-verbose.out" | sort | uniq -c | sort -rn | head -8 | sed 's/^/  /' >&2
  fi
done

# ---- MPI_Iallreduce (what the trainer's gradient buckets use): training ---------------------------
i=0
for v in $TRAIN_VARIANTS; do
  i=$((i + 1))
  args=$(mca_args "$v")
  echo "[train $i] $v ($args): $TRAIN_STEPS steps, $TRAIN_DTYPE" >&2
  # shellcheck disable=SC2086
  mpirun_node1 "train$i" $args "$BIN" "$REPO/configs/demo.yaml" \
    --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[]" --set "train.steps=$TRAIN_STEPS" \
    --set "optim.warmup_steps=$TRAIN_STEPS" --set train.threads=1 --set "train.out_dir=$T/run$i" \
    --set eval.every=0 --set "log.every=$TRAIN_LOG_EVERY" --set "checkpoint.dir=$T/ckpt$i" \
    --set checkpoint.every=0 --set checkpoint.keep=1 --set checkpoint.resume=none \
    --set sample.tokens=0 --set "comm.grad_dtype=$TRAIN_DTYPE"
  rc=$?
  TRFAIL[$v]=$(why $rc "$T/train$i.out")
  MS[$v]=nan SHARE[$v]=nan EXP[$v]=nan LOSS[$v]=nan
  if [ $rc -ne 0 ]; then
    echo "  $v: ${TRFAIL[$v]}" >&2; show_tail "$T/train$i.out" 8 >&2
    continue
  fi
  m=$T/run$i/metrics.jsonl
  grep '"ms_per_step"' "$m" | tail -n +2 | sed 's/.*"ms_per_step": \([0-9.]*\).*"comm_share": \([0-9.]*\).*/\1 \2/' > "$T/train$i.ms"
  MS[$v]=$(cut -d' ' -f1 "$T/train$i.ms" | median)
  SHARE[$v]=$(cut -d' ' -f2 "$T/train$i.ms" | median)
  EXP[$v]=$(awk '{ print $1 * $2 }' "$T/train$i.ms" | median)
  LOSS[$v]=$(grep '"loss"' "$m" | tail -1 | sed 's/.*"loss": \([0-9.]*\).*/\1/')
done

ms() { awk -v t="$1" 'BEGIN { if (t == "") print "-"; else printf "%.1f", t / 1000 }'; }
busbw() { awk -v t="$1" -v n="$2" 'BEGIN { if (t == "") print "-"; else printf "%.1f", n / t * 1.5 }'; }  # us, bytes -> MB/s
echo "OpenMPI all-reduce algorithms, 2 hosts x 2 ranks over $RATE links (each way), $(getconf _NPROCESSORS_ONLN) cores shared by all hosts, $(ompi_info --version 2>/dev/null | head -1), $(date -u +%F)"
if [ -n "$NC_VARIANTS" ]; then
  echo
  echo "MPI_Allreduce (blocking: coll/tuned, or coll/han), fp32 sum in place, netcheck --iters $ITERS:"
  echo
  echo "| variant | 512 KiB ms | busbw MB/s | 4 MiB ms | busbw MB/s | 32 MiB ms | busbw MB/s | 32 MiB speed vs default |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
  for v in $NC_VARIANTS; do
    printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$v${NCFAIL[$v]:+: ${NCFAIL[$v]}}" "$(ms "${T512[$v]}")" "$(busbw "${T512[$v]}" 524288)" \
      "$(ms "${T4[$v]}")" "$(busbw "${T4[$v]}" 4194304)" "$(ms "${T32[$v]}")" "$(busbw "${T32[$v]}" 33554432)" \
      "$(ratio "${T32[default]:-}" "${T32[$v]}")"
  done
fi
if [ -n "$TRAIN_VARIANTS" ]; then
  echo
  echo "MPI_Iallreduce (the trainer's gradient buckets: coll/libnbc), demo model, comm.grad_dtype $TRAIN_DTYPE, $TRAIN_STEPS steps, medians of $((TRAIN_STEPS / TRAIN_LOG_EVERY - 1)) intervals of $TRAIN_LOG_EVERY steps:"
  echo
  echo "| variant | ms/step | comm share | exposed ms | exposed vs default | step vs default | loss at step $TRAIN_STEPS |"
  echo "|---|---:|---:|---:|---:|---:|---:|"
  for v in $TRAIN_VARIANTS; do
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$v${TRFAIL[$v]:+: ${TRFAIL[$v]}}" "$(num "${MS[$v]}")" "$(pct "${SHARE[$v]}")" \
      "$(num "${EXP[$v]}")" "$(ratio "${EXP[$v]}" "${EXP[default]:-nan}")" "$(ratio "${MS[$v]}" "${MS[default]:-nan}")" "$(num "${LOSS[$v]}" %.4f)"
  done
fi
if [ -n "${LOGS:-}" ]; then mkdir -p "$LOGS" && cp "$T"/*.out "$LOGS"/; fi  # else exit 0, not the test's status
