#!/usr/bin/env bash
# Pipeline parallelism between two "hosts" joined by an ordinary link: tokens/s and memory per rank
# of pp 2 across the hosts against data parallelism (ZeRO 0), ZeRO-3 and DiLoCo islands over the
# same link, and one host alone, on links of each RATE, all in one run. The hosts are network
# namespaces on this machine with their own sshds (tests/multihost/lib.sh; a tc token-bucket filter
# on both ends of every node's link), one rank each with one torch thread: the 2-core machine runs
# the two hosts on its two cores, so "2 hosts" has twice one host's compute.
#
#     bash bench/pp_hosts.sh [build/mpitrain]
#
# Every run trains the same global batch per step, GLOBAL sequences of 128 bytes (micro-batch
# MICRO): one host in GLOBAL / MICRO accumulation steps; dp, ZeRO-3 and DiLoCo with each host
# taking half of them; pp 2 as GLOBAL / MICRO micro-batches through the two stages (1f1b). So every
# run computes the same numbers per step, and dp, ZeRO-3 and pp give the one host's losses within
# the reorder tolerance (the "loss" column: the training loss at the last step).
#
# Columns:
#   run         what trains over the two hosts
#   tok/s       tokens per step / the mean step time over every logged interval but the first
#   vs 1 host   tok/s / the one host's
#   MiB sent    what the two hosts' eth0 sent during the run (tx counters), launch included
#   MiB/step    that / the steps
#   peak RSS    the largest peak resident size of the run's ranks (GNU time), and its ratio to the
#               one host's
#   loss        the training loss at the last step
# Then at each rate `mpitrain plan` of the dp run's configuration on the two hosts: its predicted
# tokens/s of data parallelism (fp32, overlapped) and of pipeline parallelism across the hosts at
# the same global batch, beside what the runs measured, and what it recommends.
# Environment: VERBOSE (1: plan's whole output to stderr), RATES ("1gbit 10gbit"), LAYERS (8), EMBD (768: 8 x 768 is 56.8M parameters), MICRO
# (4), GLOBAL (16), STEPS (8), H (DiLoCo's inner steps, 4), LIMIT (seconds per mpirun, 1800). Needs
# root, iproute2, openssh, util-linux, openmpi-bin, GNU time, the fortunes package. About 25
# minutes on a 2-core VM at the defaults. The table goes to stdout, the progress to stderr.
# Everything is removed on exit, also on failure or Ctrl-C (lib.sh).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../tests/multihost/lib.sh
. "$REPO/tests/multihost/lib.sh"
# shellcheck source=table_lib.sh
. "$REPO/bench/table_lib.sh"
BIN=$(realpath -e "${1:-$REPO/build/mpitrain}" 2>/dev/null) || { echo "$0: no such file: ${1:-build/mpitrain}" >&2; exit 2; }
RATES=${RATES:-"1gbit 10gbit"} LAYERS=${LAYERS:-8} EMBD=${EMBD:-768} MICRO=${MICRO:-4} GLOBAL=${GLOBAL:-16}
STEPS=${STEPS:-8} H=${H:-4} LIMIT=${LIMIT:-1800}
[ -d /usr/share/games/fortunes ] || { echo "$0: no /usr/share/games/fortunes (Debian package fortunes)" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "$0: no /usr/bin/time (Debian package time)" >&2; exit 2; }
[ $((GLOBAL % (2 * MICRO))) -eq 0 ] || { echo "$0: GLOBAL ($GLOBAL) must be a multiple of 2 x MICRO ($MICRO)" >&2; exit 2; }

NET=10.213.19
HOSTS=(pp-node1 pp-node2)
ID=mpp$$
NETNS_TMP=/tmp/mpt-pphosts-XXXXXX
NETNS_TOOLS=(mpirun tc)
netns_bench_hosts "$BIN" "$RATES" "$REPO"

train() {  # name hostfile np grad_accum extra-args... -> "tok_s mib rss_mib loss" in $T/name.row
  local name=$1 hosts=$2 np=$3 accum=$4 rc before after
  shift 4
  echo "training $name..." >&2
  before=$(netns_tx_bytes)
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$hosts" -np "$np" --bind-to none \
    bash -c 'exec /usr/bin/time -o "$0.rss.$OMPI_COMM_WORLD_RANK" -f %M "$@"' "$T/$name" "$BIN" "$REPO/configs/demo.yaml" \
    --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[$T/data/f-val-*.h5]" \
    --set model.n_layer="$LAYERS" --set model.n_head=$((EMBD / 64)) --set model.n_embd="$EMBD" \
    --set train.micro_batch="$MICRO" --set "train.grad_accum=$accum" --set train.global_batch=0 \
    --set "train.steps=$STEPS" --set optim.warmup_steps=2 --set train.threads=1 \
    --set "train.out_dir=$T/run-$name" --set eval.every=0 --set log.every=1 \
    --set "checkpoint.dir=$T/ckpt-$name" --set checkpoint.every=0 --set checkpoint.at_end=false \
    --set checkpoint.resume=none --set sample.tokens=0 "$@" > "$T/$name.out" 2>&1
  rc=$?
  after=$(netns_tx_bytes)
  if [ $rc -ne 0 ]; then
    echo "  $name failed (exit $rc)" >&2
    show_tail "$T/$name.out" >&2
    echo "nan nan nan nan" > "$T/$name.row"
    return
  fi
  local m=$T/run-$name/metrics.jsonl rss loss
  loss=$(grep '"loss"' "$m" | tail -1 | sed 's/.*"loss": \([0-9.]*\).*/\1/')
  rss=$(cat "$T/$name".rss.* 2>/dev/null | sort -n | tail -1 | awk '{ printf "%.0f", $1 / 1024 }')
  echo "$(run_tokens_per_s "$T/$name.out" "$m") \
$(awk -v a="$after" -v b="$before" 'BEGIN { printf "%.1f", (a - b) / 1048576 }') ${rss:-nan} ${loss:-nan}" > "$T/$name.row"
}

# plan NAME: `mpitrain plan` of the dp run's configuration on the two hosts -> "dp_tok_s pp_tok_s" in
# $T/NAME.row (its data-parallel fp32 row and its pipeline-across-the-hosts row at the same global
# batch) and its recommendation in $T/NAME.rec
plan() {
  local name=$1
  echo "plan $name..." >&2
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$T/hosts-2" -np 2 --bind-to none "$BIN" plan "$REPO/configs/demo.yaml" --iters 3 \
    --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[$T/data/f-val-*.h5]" \
    --set model.n_layer="$LAYERS" --set model.n_head=$((EMBD / 64)) --set model.n_embd="$EMBD" \
    --set train.micro_batch="$MICRO" --set "train.grad_accum=$half" --set train.global_batch=0 --set train.threads=1 \
    --set "train.out_dir=$T/run-$name" --set "checkpoint.dir=$T/ckpt-$name" > "$T/$name.out" 2>&1 ||
    { echo "  plan $name failed" >&2; show_tail "$T/$name.out" >&2; }
  [ -z "${VERBOSE:-}" ] || cat "$T/$name.out" >&2
  local dp pp
  dp=$(awk -F'|' -v a="$half" '$2 + 0 == a && $3 ~ /^ fp32 $/ { gsub(/ /, "", $7); print $7; exit }' "$T/$name.out")
  pp=$(awk -F'|' -v a="$half" -v m=$((2 * half)) '$2 + 0 == a && $3 + 0 == m { gsub(/ /, "", $6); print $6; exit }' "$T/$name.out")
  echo "${dp:-nan} ${pp:-nan}" > "$T/$name.row"
  grep -m1 '^recommendation, instead\|^pipeline parallelism across the hosts is not faster' "$T/$name.out" | cut -c1-120 > "$T/$name.rec"
  [ -s "$T/$name.rec" ] || grep -m1 '^recommendation' "$T/$name.out" | cut -c1-120 > "$T/$name.rec"
}

declare -A TOK MIB RSS LOSS PLAN_DP PLAN_PP
rows() { read -r "TOK[$1]" "MIB[$1]" "RSS[$1]" "LOSS[$1]" < "$T/$1.row"; }
half=$((GLOBAL / MICRO / 2))
train one "$T/hosts-1" 1 $((2 * half))
rows one
KEYS=(dp zero3 diloco pp)
for rate in $RATES; do
  netns_set_rate "$rate" >&2
  train "dp-$rate" "$T/hosts-2" 2 "$half"
  train "zero3-$rate" "$T/hosts-2" 2 "$half" --set optim.zero=3
  train "diloco-$rate" "$T/hosts-2" 2 "$half" --set parallel.islands=host --set "diloco.inner_steps=$H"
  train "pp-$rate" "$T/hosts-2" 2 $((2 * half)) --set parallel.pp=2
  for k in "${KEYS[@]}"; do rows "$k-$rate"; done
  plan "plan-$rate"
  read -r "PLAN_DP[$rate]" "PLAN_PP[$rate]" < "$T/plan-$rate.row"
done

params=$(sed -n 's/.*model: gpt2, \([0-9]*\) parameters.*/\1/p' "$T/one.out" | head -1)
echo "Two hosts over one link: GPT-2 $LAYERS x $EMBD (${params:-?} parameters), $GLOBAL sequences of 128 bytes per step (micro-batch $MICRO), $STEPS steps, $(getconf _NPROCESSORS_ONLN) cores (one per host), $(date -u +%F)"
echo
echo "| link | run | tok/s | vs 1 host | MiB sent | MiB/step | peak RSS/rank (MiB) | RSS vs 1 host | loss at step $STEPS |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
printf '| - | 1 host | %s | 1.00 | %s | - | %s | 1.00 | %s |\n' "$(num "${TOK[one]}")" "$(num "${MIB[one]}" '%.1f')" \
  "$(num "${RSS[one]}")" "$(num "${LOSS[one]}" '%.4f')"
for rate in $RATES; do
  for k in "${KEYS[@]}"; do
    case $k in dp) what="data parallel (ZeRO 0)" ;; zero3) what="ZeRO-3" ;; diloco) what="DiLoCo islands, H $H" ;;
      pp) what="pipeline parallel pp 2 (1f1b)" ;; esac
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$rate" "$what" "$(num "${TOK[$k-$rate]}")" \
      "$(ratio "${TOK[$k-$rate]}" "${TOK[one]}")" "$(num "${MIB[$k-$rate]}" '%.1f')" \
      "$(awk -v m="${MIB[$k-$rate]}" -v s="$STEPS" 'BEGIN { if (m == "nan") print "-"; else printf "%.1f", m / s }')" \
      "$(num "${RSS[$k-$rate]}")" "$(ratio "${RSS[$k-$rate]}" "${RSS[one]}")" "$(num "${LOSS[$k-$rate]}" '%.4f')"
  done
done
echo
echo "plan's prediction (\`mpitrain plan\` on the two hosts, the dp run's configuration) against the runs above:"
echo
echo "| link | dp fp32: plan tok/s | measured | plan / measured | pp 2 across the hosts: plan tok/s | measured | plan / measured | plan says |"
echo "|---|---:|---:|---:|---:|---:|---:|---|"
for rate in $RATES; do
  printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$rate" "$(num "${PLAN_DP[$rate]}")" "$(num "${TOK[dp-$rate]}")" \
    "$(ratio "${PLAN_DP[$rate]}" "${TOK[dp-$rate]}")" "$(num "${PLAN_PP[$rate]}")" "$(num "${TOK[pp-$rate]}")" \
    "$(ratio "${PLAN_PP[$rate]}" "${TOK[pp-$rate]}")" "$(sed 's/|/\\|/g' "$T/plan-$rate.rec")"
done
