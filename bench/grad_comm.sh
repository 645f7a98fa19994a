#!/usr/bin/env bash
# Gradient communication over slow links: comm.grad_dtype fp32 / bf16 / fp16 on two "hosts" whose
# links are limited to RATE (default 100mbit, each direction), against the same layouts on one
# host, all in one run. The hosts are network namespaces on this machine with their own sshds
# (tests/multihost/lib.sh, NETNS_RATE: a tc token-bucket filter on both ends of every node's
# link), so the CPU is shared: a "second host" adds no cores, only a network between the ranks.
#
#     bash bench/grad_comm.sh [build/mpitrain]
#
# The model: configs/demo.yaml (4 layers x 128, 0.84M parameters: one 3.2 MiB fp32 gradient
# bucket), micro-batch 16 x 128 bytes per rank, train.threads 1 per rank (so that "2 hosts x 1
# rank" uses the same cores as "1 host x 2 ranks"), the fortunes corpus packed into a temporary
# directory, STEPS steps logged every LOG_EVERY, no evaluation, no sample, one checkpoint at the
# end (outside the timed intervals). mpirun runs on node 1 with a hostfile, as on a cluster.
#
# Columns:
#   layout        hosts x ranks per host; "1 host" rows are the baselines (shared memory, no network)
#   grad_dtype    comm.grad_dtype ("-": one rank, nothing to communicate)
#   MiB/rank/step the start-up line `gradient communication: X MiB per rank per step`
#   ms/step       median of the progress intervals' ms/step, the first interval left out (start-up)
#   comm share    median of the intervals' `comm` (metrics.jsonl comm_share): the share of rank 0's
#                 step spent waiting for gradient communication that backward did not hide
#   exposed ms    median over the same intervals of comm_share x ms_per_step
#   step ratio    ms/step ÷ the fp32 row's of the same layout (below 1: faster than fp32)
#   exposed ratio exposed ms ÷ the fp32 row's of the same layout
#   tok/s vs 1 host  tokens per second ÷ the 1-host baseline's with the same ranks per host (the
#                 2-host job trains twice the tokens per step); on this machine the second host
#                 brings no CPU, so this shows what the network costs, not a real scaling
# Above the table: the link as measured through it (netcheck's point-to-point ping-pong between the
# two hosts, and `dd | ssh` of 16 MiB, which also pays ssh's encryption) against RATE.
#
# Environment: RATE (100mbit; a number with bit, kbit, mbit or gbit), STEPS (30), LOG_EVERY (5),
# DTYPES ("fp32 bf16 fp16 powersgd"; powersgd = comm.compress: powersgd, rank 4, from step 1), LIMIT (seconds per mpirun, 300). OMPI_MCA_* variables reach every
# rank (e.g. OMPI_MCA_coll_libnbc_iallreduce_algorithm=1, bench/allreduce_algos.sh); the title
# line names the coll ones set. Needs root, iproute2 (ip, tc),
# openssh-server/-client, util-linux, openmpi-bin, the fortunes package. About 5 minutes on a
# 2-core VM at the defaults. The table goes to stdout, the harness's progress to stderr.
# Everything is removed on exit, also on failure or Ctrl-C (lib.sh): sshds, processes in the
# namespaces, the namespaces with their veths, bridge and qdiscs, the temporary directory.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../tests/multihost/lib.sh
. "$REPO/tests/multihost/lib.sh"
# shellcheck source=table_lib.sh
. "$REPO/bench/table_lib.sh"
BIN=$(realpath -e "${1:-$REPO/build/mpitrain}" 2>/dev/null) || { echo "$0: no such file: ${1:-build/mpitrain}" >&2; exit 2; }
RATE=${RATE:-100mbit} STEPS=${STEPS:-30} LOG_EVERY=${LOG_EVERY:-5} LIMIT=${LIMIT:-300}
DTYPES=${DTYPES:-"fp32 bf16 fp16 powersgd"}
[ -d /usr/share/games/fortunes ] || { echo "$0: no /usr/share/games/fortunes (Debian package fortunes)" >&2; exit 2; }

NET=10.213.13                    # private subnet that exists only inside the namespaces
HOSTS=(gc-node1 gc-node2)
ID=mgc$$
NETNS_TMP=/tmp/mpt-gradcomm-XXXXXX
NETNS_TOOLS=(mpirun)
NETNS_RATE=$RATE
netns_begin
exec 3>&2                        # the harness's PASS/summary lines to stderr; stdout: the table
netns_setup >&2
cd "$T" || setup_fail "cd $T"
run_quiet "$BIN" pack /usr/share/games/fortunes -o "$T/data/f" --doc-separator %
netns_mpi_env "$REPO" >&2
for r in 1 2; do  # hostfiles hosts-<hosts>x<ranks per host>
  echo "${ADDRS[0]} slots=$r" > "$T/hosts-1x$r"
  printf "%s slots=$r\n" "${ADDRS[@]}" > "$T/hosts-2x$r"
done


mpirun_node1() {  # name hostfile np args... -> $T/name.out
  local name=$1 hosts=$2 np=$3
  shift 3
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$hosts" -np "$np" --bind-to none "$@" > "$T/$name.out" 2>&1
}

# ---- the link, measured ---------------------------------------------------------------------------
echo "measuring the link ($RATE configured)..." >&2
mpirun_node1 netcheck "$T/hosts-2x1" 2 "$BIN" netcheck --p2p-bytes 4194304 --iters 3 --max-bytes 4194304
p2p=$(awk '/^point-to-point/ { on = 1; next } on && /\[/ { print $4; exit }' "$T/netcheck.out")
[ -n "$p2p" ] || { show_tail "$T/netcheck.out" >&2; p2p=nan; }
t0=$(date +%s%N)
on_node1 bash -c "dd if=/dev/zero bs=1M count=16 status=none | ssh -F '$T/ssh_config' ${ADDRS[1]} 'cat > /dev/null'"
t1=$(date +%s%N)
ddmbit=$(awk -v ns=$((t1 - t0)) 'BEGIN { printf "%.1f", 16 * 1048576 * 8 / (ns / 1e9) / 1e6 }')

# ---- trainings ---------------------------------------------------------------------------------
warmup=30; [ "$STEPS" -lt 30 ] && warmup=$STEPS
train() {  # name hostfile np dtype -> "mib ms share exposed tok_s" in $T/name.row
  # (not in a command substitution: the shell must stay free to run its INT/TERM traps)
  local name=$1 hosts=$2 np=$3 dtype=$4 rc comm_sets
  # "powersgd": comm.compress: powersgd (rank 4) from the first step, fp32 factors
  if [ "$dtype" = powersgd ]; then comm_sets=(--set comm.compress=powersgd --set comm.powersgd_start=0)
  else comm_sets=(--set "comm.grad_dtype=$dtype"); fi
  echo "training $name ($np ranks, $dtype)..." >&2
  mpirun_node1 "$name" "$hosts" "$np" "$BIN" "$REPO/configs/demo.yaml" \
    --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[]" --set "train.steps=$STEPS" \
    --set "optim.warmup_steps=$warmup" --set train.threads=1 --set "train.out_dir=$T/run-$name" \
    --set eval.every=0 --set "log.every=$LOG_EVERY" --set "checkpoint.dir=$T/ckpt-$name" \
    --set checkpoint.every=0 --set checkpoint.keep=1 --set checkpoint.resume=none \
    --set sample.tokens=0 "${comm_sets[@]}"
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "  $name failed (exit $rc)" >&2
    show_tail "$T/$name.out" >&2
    echo "nan nan nan nan nan" > "$T/$name.row"
    return
  fi
  local m=$T/run-$name/metrics.jsonl mib
  grep -o '[0-9]* ranks\{0,1\} on [0-9]* hosts\{0,1\}: .*' "$T/$name.out" | sed 's/^/  /' >&2
  mib=$(sed -n 's/.*gradient communication: \([0-9.]*\) MiB per rank per step.*/\1/p' "$T/$name.out" | head -1)
  [ "$dtype" = powersgd ] && mib=$(sed -n 's/.*PowerSGD rank [0-9]* from step [0-9]*: \([0-9.]*\) MiB.*/\1/p' "$T/$name.out" | head -1)
  # every interval after the first: ms, share (0 without communication)
  grep '"ms_per_step"' "$m" | tail -n +2 | sed 's/.*"tokens_per_s": \([0-9.]*\), "ms_per_step": \([0-9.]*\).*/\2 \1/' > "$T/$name.ms"
  grep '"ms_per_step"' "$m" | tail -n +2 | sed -n 's/.*"comm_share": \([0-9.]*\).*/\1/p' > "$T/$name.share"
  local ms tok share exposed
  ms=$(cut -d' ' -f1 "$T/$name.ms" | median)
  tok=$(cut -d' ' -f2 "$T/$name.ms" | median)
  if [ -s "$T/$name.share" ]; then
    share=$(median < "$T/$name.share")
    exposed=$(paste -d' ' "$T/$name.ms" "$T/$name.share" | awk '{ print $1 * $3 }' | median)
  else
    share=nan exposed=nan
  fi
  echo "${mib:-nan} $ms $share $exposed $tok" > "$T/$name.row"
}

declare -A MIB MS SHARE EXPOSED TOK
for rph in 1 2; do
  train "1x$rph" "$T/hosts-1x$rph" "$rph" fp32
  read -r "MIB[1x$rph]" "MS[1x$rph]" "SHARE[1x$rph]" "EXPOSED[1x$rph]" "TOK[1x$rph]" < "$T/1x$rph.row"
  for d in $DTYPES; do
    k=2x$rph-$d
    train "$k" "$T/hosts-2x$rph" $((2 * rph)) "$d"
    read -r "MIB[$k]" "MS[$k]" "SHARE[$k]" "EXPOSED[$k]" "TOK[$k]" < "$T/$k.row"
  done
done

# ---- the table -----------------------------------------------------------------------------------
row() {  # layout dtype key fp32-key baseline-key
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$1" "$2" "$(num "${MIB[$3]}" '%.2f')" \
    "$(num "${MS[$3]}" '%.0f')" "$(pct "${SHARE[$3]}")" "$(num "${EXPOSED[$3]}" '%.0f')" \
    "$(ratio "${MS[$3]}" "${MS[$4]:-nan}")" "$(ratio "${EXPOSED[$3]}" "${EXPOSED[$4]:-nan}")" "$(ratio "${TOK[$3]}" "${TOK[$5]}")"
}
intervals=$((STEPS / LOG_EVERY - 1))
coll=$(env | sed -n 's/^OMPI_MCA_\(coll_[a-z_]*=.*\)/\1/p' | sort | tr '\n' ' ')
echo "comm.grad_dtype over $RATE links: demo model, $STEPS steps (medians of $intervals intervals of $LOG_EVERY steps), $(getconf _NPROCESSORS_ONLN) cores shared by all hosts, $(date -u +%F)${coll:+; MCA: $coll}"
echo "link: configured $RATE each way; measured $(awk -v g="$p2p" 'BEGIN { if (g == "nan") print "-"; else printf "%.1f", g * 8000 }') Mbit/s (netcheck, 4 MiB ping-pong between the hosts), $ddmbit Mbit/s (dd | ssh, 16 MiB)"
echo
echo "| layout | grad_dtype | MiB/rank/step | ms/step | comm share | exposed ms | step ratio vs fp32 | exposed ratio vs fp32 | tok/s vs 1 host |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
row "1 host x 1 rank" - 1x1 none 1x1
for d in $DTYPES; do row "2 hosts x 1 rank" "$d" "2x1-$d" 2x1-fp32 1x1; done
row "1 host x 2 ranks" fp32 1x2 none 1x2
for d in $DTYPES; do row "2 hosts x 2 ranks" "$d" "2x2-$d" 2x2-fp32 1x2; done
