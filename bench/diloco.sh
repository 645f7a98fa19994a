#!/usr/bin/env bash
# DiLoCo between two "hosts" joined by a slow link: tokens/s and the validation loss at equal
# tokens of 2 islands (parallel.islands: host, an outer step every H steps) against one host
# alone, plain data parallelism over both (fp32 gradients every step) and PowerSGD over both, on
# links of each RATE, all in one run. The hosts are network namespaces on this machine with their
# own sshds (tests/multihost/lib.sh; a tc token-bucket filter on both ends of every node's link),
# one rank each with one torch thread: a 2-core machine runs the two hosts on its two cores, so
# "2 hosts" has twice one host's compute, as on real machines (anything else running takes from it).
#
#     bash bench/diloco.sh [build/mpitrain]
#
# The model: a GPT-2 block of LAYERS x EMBD (4 x 256: 3.2M parameters, a 12.6 MiB fp32 gradient),
# seq_len 128, micro-batch MICRO per rank, on the fortunes corpus (packed into a temporary
# directory), STEPS steps with a cosine schedule (lr 3e-3, warm-up STEPS/10), AdamW inside each island
# (DiLoCo's inner optimizer), diloco.outer_lr 0.7 and momentum 0.9 (the paper's), validation at
# the last step on the same 8 x MICRO windows for every run. "1 host" trains MICRO sequences per
# step, every 2-host run 2 x MICRO: at equal steps the 2-host runs have seen equal tokens, twice
# the one host's.
#
# Columns:
#   run           what trains; "DiLoCo H" = parallel.islands: host, diloco.inner_steps H, WIRE on the wire;
#                 "streaming" adds diloco.fragments FRAGS and diloco.overlap OVERLAP (diloco.mix 0.5)
#   tok/s         tokens per second: tokens per step / the mean step time over every logged interval
#                 but the first (start-up), outer steps included (they run inside their step)
#   vs 1 host     tok/s ÷ the one host's
#   MiB sent      what the two hosts' eth0 sent during the run (tx counters), launch included
#   val loss      at the last step; "gap vs DP" = val loss - data parallelism's at the same rate
# (DiLoCo H below: parallel.islands: host, diloco.inner_steps H.)
# Environment: RATES ("1gbit 100mbit"), RUNS ("dp psgd diloco"; "stream": streaming DiLoCo), HS
# (inner steps, "50": a DiLoCo run for each), FRAGS (3) and OVERLAP (5) for the streaming runs, WIRE
# (diloco.dtype, fp32), STEPS (300), MICRO (8), LAYERS (4), EMBD (256), LIMIT (seconds per mpirun,
# 1800). Needs root, iproute2, openssh, util-linux, openmpi-bin, the
# fortunes package. About 15 minutes on a 2-core VM at the defaults. The table goes to stdout, the
# harness's progress to stderr. Everything is removed on exit, also on failure or Ctrl-C (lib.sh).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../tests/multihost/lib.sh
. "$REPO/tests/multihost/lib.sh"
# shellcheck source=table_lib.sh
. "$REPO/bench/table_lib.sh"
BIN=$(realpath -e "${1:-$REPO/build/mpitrain}" 2>/dev/null) || { echo "$0: no such file: ${1:-build/mpitrain}" >&2; exit 2; }
RATES=${RATES:-"1gbit 100mbit"} RUNS=${RUNS:-"dp psgd diloco"} HS=${HS:-50} WIRE=${WIRE:-fp32} STEPS=${STEPS:-300}
FRAGS=${FRAGS:-3} OVERLAP=${OVERLAP:-5}
MICRO=${MICRO:-8} LAYERS=${LAYERS:-4} EMBD=${EMBD:-256}
LIMIT=${LIMIT:-1800}
[ -d /usr/share/games/fortunes ] || { echo "$0: no /usr/share/games/fortunes (Debian package fortunes)" >&2; exit 2; }

NET=10.213.17
HOSTS=(dl-node1 dl-node2)
ID=mdl$$
NETNS_TMP=/tmp/mpt-diloco-XXXXXX
NETNS_TOOLS=(mpirun tc)
netns_bench_hosts "$BIN" "$RATES" "$REPO"


warmup=$((STEPS / 10))
train() {  # name hostfile np extra-args... -> "tok_s mib val" in $T/name.row
  local name=$1 hosts=$2 np=$3 rc before after
  shift 3
  echo "training $name..." >&2
  before=$(netns_tx_bytes)
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$hosts" -np "$np" --bind-to none "$BIN" "$REPO/configs/demo.yaml" \
    --set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[$T/data/f-val-*.h5]" \
    --set model.n_layer="$LAYERS" --set model.n_head=$((EMBD / 64)) --set model.n_embd="$EMBD" \
    --set train.micro_batch="$MICRO" --set train.grad_accum=1 --set train.global_batch=0 \
    --set "train.steps=$STEPS" --set "optim.warmup_steps=$warmup" --set train.threads=1 \
    --set "train.out_dir=$T/run-$name" --set "eval.every=$STEPS" --set eval.batches=8 --set log.every=10 \
    --set "checkpoint.dir=$T/ckpt-$name" --set checkpoint.every=0 --set checkpoint.at_end=false \
    --set checkpoint.resume=none --set sample.tokens=0 "$@" > "$T/$name.out" 2>&1
  rc=$?
  after=$(netns_tx_bytes)
  if [ $rc -ne 0 ]; then
    echo "  $name failed (exit $rc)" >&2
    show_tail "$T/$name.out" >&2
    echo "nan nan nan" > "$T/$name.row"
    return
  fi
  local m=$T/run-$name/metrics.jsonl val
  val=$(grep '"val_loss"' "$m" | tail -1 | sed 's/.*"val_loss": \([0-9.]*\).*/\1/')
  echo "$(run_tokens_per_s "$T/$name.out" "$m") \
$(awk -v a="$after" -v b="$before" 'BEGIN { printf "%.1f", (a - b) / 1048576 }') ${val:-nan}" > "$T/$name.row"
}

declare -A TOK MIB VAL
train one "$T/hosts-1" 1
read -r "TOK[one]" "MIB[one]" "VAL[one]" < "$T/one.row"
KEYS=()
for run in $RUNS; do
  case $run in diloco | stream) for h in $HS; do KEYS+=("$run$h"); done ;; *) KEYS+=("$run") ;; esac
done
for rate in $RATES; do
  netns_set_rate "$rate" >&2
  for k in "${KEYS[@]}"; do
    case $k in
      dp) train "$k-$rate" "$T/hosts-2" 2 ;;
      psgd) train "$k-$rate" "$T/hosts-2" 2 --set comm.compress=powersgd --set comm.powersgd_start=0 ;;
      diloco*) train "$k-$rate" "$T/hosts-2" 2 --set parallel.islands=host --set "diloco.inner_steps=${k#diloco}" \
                 --set "diloco.dtype=$WIRE" ;;
      stream*) train "$k-$rate" "$T/hosts-2" 2 --set parallel.islands=host --set "diloco.inner_steps=${k#stream}" \
                 --set "diloco.dtype=$WIRE" --set "diloco.fragments=$FRAGS" --set "diloco.overlap=$OVERLAP" ;;
    esac
    read -r "TOK[$k-$rate]" "MIB[$k-$rate]" "VAL[$k-$rate]" < "$T/$k-$rate.row"
  done
done

params=$(sed -n 's/.*model: gpt2, \([0-9]*\) parameters.*/\1/p' "$T/one.out" | head -1)
echo "DiLoCo over slow links: GPT-2 $LAYERS x $EMBD (${params:-?} parameters), micro-batch $MICRO x 128 per rank, $STEPS steps, outer lr 0.7, momentum 0.9, $WIRE on the wire, $(getconf _NPROCESSORS_ONLN) cores (one per host), $(date -u +%F)"
echo
echo "| link | run | tok/s | vs 1 host | MiB sent | val loss | gap vs DP |"
echo "|---|---|---:|---:|---:|---:|---:|"
printf '| - | 1 host (half the tokens) | %s | 1.00 | %s | %s | - |\n' "$(num "${TOK[one]}")" "$(num "${MIB[one]}" '%.1f')" "$(num "${VAL[one]}" '%.4f')"
for rate in $RATES; do
  for k in "${KEYS[@]}"; do
    case $k in dp) what="data parallel, fp32 every step" ;; psgd) what="PowerSGD rank 4 every step" ;; diloco*) what="DiLoCo H ${k#diloco}, $WIRE outer steps" ;;
      stream*) what="streaming DiLoCo H ${k#stream}, $FRAGS fragments, overlap $OVERLAP" ;; esac
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$rate" "$what" "$(num "${TOK[$k-$rate]}")" \
      "$(ratio "${TOK[$k-$rate]}" "${TOK[one]}")" "$(num "${MIB[$k-$rate]}" '%.1f')" "$(num "${VAL[$k-$rate]}" '%.4f')" \
      "$(awk -v a="${VAL[$k-$rate]}" -v b="${VAL[dp-$rate]:-nan}" 'BEGIN { if (a == "nan" || b == "nan" || a == "" || b == "") print "-"; else printf "%+.4f", a - b }')"
  done
done
