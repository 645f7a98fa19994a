#!/usr/bin/env bash
# Training over a slow network, for real: two namespace hosts whose links are limited to
# SLOW_TEST_RATE (default 100mbit, tc tbf: lib.sh NETNS_RATE), one rank each, the demo model.
# Asserted (none of it timed):
#  1. `mpitrain plan` under the training's mpirun exits 0 and recommends a setting, and weighs
#     pipeline parallelism across the hosts;
#  2. short trainings with comm.grad_dtype fp32 and bf16 exit 0;
#  3. the bytes the two hosts sent (their eth0 tx counters, before and after each training): fp32's
#     carry at least one copy of the gradients per step, and bf16's at most 0.6x fp32's. Derivation:
#     the gradient traffic G halves with 16-bit gradients while the rest F (launch over ssh, the
#     start-up broadcast of the parameters, scalar reductions) stays, so the ratio (G/2+F)/(G+F)
#     is at most 0.6 while F <= G/4; here G >= 14 steps x 3.2 MiB and F is about one 3.2 MiB
#     broadcast plus the launch;
#  4. DiLoCo with an island per host and 7 inner steps, blocking and streaming: at most 0.4x
#     fp32's bytes (derived below);
#  5. parallel.islands: auto: on the 2 hosts an island each (the link is below the floor); on 3
#     hosts, one behind a slow link, 2 islands; refused by name when the groups cannot make equal
#     islands.
# Reported, not asserted: the plan's predicted communication share against the share the trainings
# measured (metrics.jsonl, the median of the reports after the first), and the exposed
# communication time per step. The prediction and the runs share this machine's 2 cores with
# whatever else runs (in CI: the Debian 13 leg's preparation), so their timings are no test
# (bench/RESULTS-comm.md has quiet-machine figures). Usage: bash tests/multihost/slow_test.sh
# PATH/TO/mpitrain (root; exit 77 = skipped when namespaces cannot be created). Everything is
# removed on exit (lib.sh).
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

[ $# -eq 1 ] || { echo "usage: $0 PATH/TO/mpitrain" >&2; exit 2; }
BIN=$(realpath -e "$1" 2>/dev/null) || { echo "$0: no such file: $1" >&2; exit 2; }

NET=10.213.11
HOSTS=(slow-node1 slow-node2 slow-node3)  # node3 only in the last part (parallel.islands: auto)
ID=slw$$
NETNS_TMP=/tmp/mpt-slow-XXXXXX
NETNS_TOOLS=(mpirun tc)
NETNS_RATE=${SLOW_TEST_RATE:-100mbit}
LIMIT=${SLOW_TEST_MPIRUN_LIMIT:-300}

netns_begin
netns_setup
cd "$T" || setup_fail "cd $T"
[ -d /usr/share/games/fortunes ] || setup_fail "no /usr/share/games/fortunes (Debian: fortunes; scripts/setup.sh installs it)"
run_quiet "$BIN" pack /usr/share/games/fortunes -o "$T/data/f" --doc-separator % --val-fraction 0.02
netns_mpi_env "$ROOT"
for i in 0 1; do echo "${ADDRS[$i]} slots=1"; done > "$T/hosts"

common=(--set "data.train=[$T/data/f-train-*.h5]" --set "data.val=[]" --set eval.every=0 --set train.grad_accum=1
        --set train.global_batch=0 --set sample.tokens=0 --set comm.overlap=true --set optim.warmup_steps=2 --set train.threads=1)
run_on_node1() {  # name, mpitrain arguments...
  local name=$1
  shift
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$T/hosts" -np 2 --bind-to none "$BIN" "$@" > "$T/$name.out" 2>&1
}

# (the config streams: the DiLoCo table's streaming columns are its 3 fragments and overlap 2)
run_on_node1 plan plan "$ROOT/configs/demo.yaml" "${common[@]}" --iters 3 \
  --set diloco.fragments=3 --set diloco.overlap=2
rc=$?
check "mpitrain plan on 2 hosts over $NETNS_RATE links exits 0 and recommends a setting" \
  "[ $rc -eq 0 ] && grep -q '^recommendation: ' plan.out"
[ $rc -eq 0 ] || show_tail plan.out
sed -n '/^plan: /,/^recommendation/p' plan.out | sed 's/^/  /'
check "mpitrain plan on 2 hosts predicts DiLoCo with an island per host (H 10-500, fp32/bf16/int8; streaming as configured)" \
  "grep -q '^DiLoCo, parallel.islands: host.*streaming: diloco.fragments 3, diloco.overlap 2)' plan.out && grep -q '^| 500 | int8 |' plan.out"
sed -n '/^DiLoCo, parallel/,/^| 500 | int8/p' plan.out | sed 's/^/  /'
check "mpitrain plan on 2 hosts weighs pipeline parallelism across them (one stage per host, the link's activation time measured, every global batch)" \
  "grep -Eq '^pipeline parallel across the hosts \(parallel.pp: 2, one stage per host.*crosses the link in [0-9.]+ ms measured' plan.out &&
   grep -Eq '^\| 16 \| 32 \| [0-9.]+ \| [0-9.]+% \| [0-9]+ \| [0-9.]+x \| [0-9.]+x \|$' plan.out &&
   grep -Eq '^(recommendation, instead: parallel.pp: 2|pipeline parallelism across the hosts is not faster)' plan.out"
sed -n '/^pipeline parallel across/,/^| 16 | 32/p' plan.out | sed 's/^/  /'
# the predicted share with overlap (5th column) of the row "| 1 | <dtype> | ..."
predicted() { awk -F'|' -v d="$1" '$2 ~ /^ *1 *$/ && $3 ~ d { gsub(/[ %]/, "", $6); print $6 / 100; exit }' plan.out; }
# the fp32 gradients' size, from "gradient all-reduce of 3.21436 MiB over all ranks"
grad_mib=$(sed -n 's/.*gradient all-reduce of \([0-9.]*\) MiB.*/\1/p' plan.out | head -n 1)

STEPS=14
declare -A share exposed_ms ms_step wire_mib
for d in fp32 bf16; do
  before=$(netns_tx_bytes)
  run_on_node1 "train_$d" "$ROOT/configs/demo.yaml" "${common[@]}" --set train.steps=$STEPS --set log.every=2 \
    --set "train.out_dir=$T/run_$d" --set "checkpoint.dir=$T/ckpt_$d" --set checkpoint.keep=1 \
    --set checkpoint.resume=none --set "comm.grad_dtype=$d"
  rc=$?
  after=$(netns_tx_bytes)
  check "training on 2 hosts, comm.grad_dtype $d, exits 0" "[ $rc -eq 0 ]"
  [ $rc -eq 0 ] || show_tail "train_$d.out"
  wire_mib[$d]=$(awk -v a="${after:-0}" -v b="${before:-0}" 'BEGIN { printf "%.2f", (a - b) / 1048576 }')
  read -r share[$d] exposed_ms[$d] ms_step[$d] < <(/usr/bin/python3 - "$T/run_$d/metrics.jsonl" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"comm_share"' in l][1:]  # the first interval warms up
print(statistics.median(r["comm_share"] for r in rows), statistics.median(r["comm_share"] * r["ms_per_step"] for r in rows),
      statistics.median(r["ms_per_step"] for r in rows))
PYEOF
)
done
check "fp32 training sent ${wire_mib[fp32]} MiB: at least its gradients once per step ($STEPS x ${grad_mib:-?} MiB)" \
  "awk -v w='${wire_mib[fp32]}' -v g='${grad_mib:-0}' -v n=$STEPS 'BEGIN { exit !(g > 0 && w >= n * g) }'"
check "bf16 gradients halve the traffic: ${wire_mib[bf16]} MiB sent, at most 0.6x fp32's ${wire_mib[fp32]} MiB" \
  "awk -v b='${wire_mib[bf16]}' -v f='${wire_mib[fp32]}' 'BEGIN { exit !(f > 0 && b <= 0.6 * f) }'"

# DiLoCo (parallel.islands: host, one island per host): the same steps with an outer step every
# H = 7 of them. The link carries the outer all-reduce twice (after steps 7 and 14) and one start-up
# broadcast of theta_outer instead of 14 gradient all-reduces, so with F as above the bytes are
# at most (3g + F) / (14g + F) <= 0.4 of fp32's (F <= 2g); a run that all-reduced every step
# would send more than fp32's.
diloco_run() {  # name, what, exchanges, extra mpitrain arguments...: trains, checks, the bytes in wire_mib[name]
  local name=$1 what=$2 exchanges=$3 rc before after
  shift 3
  before=$(netns_tx_bytes)
  run_on_node1 "train_$name" "$ROOT/configs/demo.yaml" "${common[@]}" --set train.steps=$STEPS --set log.every=2 \
    --set "train.out_dir=$T/run_$name" --set "checkpoint.dir=$T/ckpt_$name" --set checkpoint.every=0 \
    --set checkpoint.at_end=false --set checkpoint.resume=none --set parallel.islands=host --set diloco.inner_steps=7 "$@"
  rc=$?
  after=$(netns_tx_bytes)
  wire_mib[$name]=$(awk -v a="${after:-0}" -v b="${before:-0}" 'BEGIN { printf "%.2f", (a - b) / 1048576 }')
  check "$what on 2 hosts (an island each, 7 inner steps) exits 0 after $exchanges exchanges" \
    "[ $rc -eq 0 ] && grep -q 'diloco: $exchanges outer steps' train_$name.out"
  [ $rc -eq 0 ] || show_tail "train_$name.out"
  check "$what sent ${wire_mib[$name]} MiB: at most 0.4x the fp32 data-parallel run's ${wire_mib[fp32]} MiB" \
    "awk -v d='${wire_mib[$name]}' -v f='${wire_mib[fp32]}' 'BEGIN { exit !(f > 0 && d <= 0.4 * f) }'"
}
diloco_run diloco DiLoCo 2
# Streaming DiLoCo over the same link (the demo's 4 blocks in 2 fragments, each exchange a
# non-blocking all-reduce applied 2 steps after it starts): fragment 1 after steps 3 and 10,
# fragment 0 after step 7, both after the last: 2.5 models instead of 2, so the bound above holds
# (the 2.5 models and the start-up broadcast: (3.5g + F) / (14g + F) <= 0.4 while F <= 3.5g; F <= 2g, above).
diloco_run streaming "streaming DiLoCo (2 fragments, overlap 2)" 5 --set diloco.fragments=2 --set diloco.overlap=2
# parallel.islands: auto: the one link between the hosts (100 Mbit/s) is below
# parallel.slow_link_gbit's 10: an island each (a 2-step run of a small model).
run_on_node1 auto2 "$ROOT/configs/demo.yaml" "${common[@]}" --set train.steps=2 --set model.n_layer=1 \
  --set model.n_embd=32 --set model.n_head=2 --set train.micro_batch=2 --set "train.out_dir=$T/run_auto2" \
  --set "checkpoint.dir=$T/ckpt_auto2" --set checkpoint.every=0 --set checkpoint.at_end=false \
  --set checkpoint.resume=none --set parallel.islands=auto --set diloco.inner_steps=2
rc=$?
check "parallel.islands: auto on 2 hosts over one $NETNS_RATE link: the link is slow, an island per host (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q 'parallel.islands: auto: links between hosts (Gbit/s): slow-node1-slow-node2 [0-9.e-]* (slow); 2 groups: slow-node1 | slow-node2' auto2.out \
   && grep -q 'mesh: 2 ranks = 2 islands x dp 1' auto2.out"
[ $rc -eq 0 ] || show_tail auto2.out

# parallel.islands: auto among 3 hosts: node1 and node2 now on 10 Gbit/s links, node3 still on
# $NETNS_RATE: node3's links are slow by both rules (parallel.slow_link_gbit 1 here, so the
# namespaces' veth pair between node1 and node2 counts as fast whatever this machine's speed).
# With 1 + 1 + 2 ranks: 2 islands of 2 ranks; with 1 + 1 + 1: refused by name (exit 2).
saved_rate=$NETNS_RATE
NETNS_RATE=10gbit
netns_limit_link "${NODE_NS[0]}" p1
netns_limit_link "${NODE_NS[1]}" p2
NETNS_RATE=$saved_rate
printf '%s slots=1\n%s slots=1\n%s slots=2\n' "${ADDRS[@]}" > "$T/hosts3"
printf '%s slots=1\n' "${ADDRS[@]}" > "$T/hosts3-uneven"
for h in hosts3 hosts3-uneven; do
  np=4
  [ $h = hosts3-uneven ] && np=3
  bounded "$LIMIT" nsenter --target "${SSHD_PIDS[0]}" --net --uts -- \
    mpirun --hostfile "$T/$h" -np $np --bind-to none "$BIN" "$ROOT/configs/demo.yaml" "${common[@]}" \
    --set train.steps=4 --set log.every=2 --set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 \
    --set train.micro_batch=2 --set "train.out_dir=$T/run_$h" --set "checkpoint.dir=$T/ckpt_$h" \
    --set checkpoint.every=0 --set checkpoint.at_end=false --set checkpoint.resume=none \
    --set parallel.islands=auto --set parallel.slow_link_gbit=1 --set diloco.inner_steps=2 > "$T/auto_$h.out" 2>&1
  rcs[$np]=$?
done
check "parallel.islands: auto on 3 hosts, node3 behind a slow link: 2 islands, {node1, node2} and {node3}, exit ${rcs[4]}" \
  "[ ${rcs[4]} -eq 0 ] && grep -q '2 groups: slow-node1 slow-node2 | slow-node3' auto_hosts3.out \
   && grep -q 'slow-node1-slow-node2 [0-9.e+]*, slow-node1-slow-node3 [0-9.e-]* (slow), slow-node2-slow-node3 [0-9.e-]* (slow)' auto_hosts3.out \
   && grep -q 'mesh: 4 ranks = 2 islands x dp 2' auto_hosts3.out && grep -q 'diloco: 2 outer steps' auto_hosts3.out"
[ "${rcs[4]}" -eq 0 ] || show_tail auto_hosts3.out
check "parallel.islands: auto whose groups cannot be equal islands (1 + 1 | 1 ranks): one line naming the key, exit ${rcs[3]}" \
  "[ ${rcs[3]} -eq 2 ] && [ \$(grep -c 'mpitrain: ' auto_hosts3-uneven.out) -eq 1 ] \
   && grep -q 'parallel.islands: auto: the links make 2 groups of hosts, which do not divide the world of 3 ranks' auto_hosts3-uneven.out"
[ "${rcs[3]}" -eq 2 ] || show_tail auto_hosts3-uneven.out

. "$ROOT/bench/table_lib.sh"
echo "  plan against training (timings: reported, not asserted):"
echo "  | grad_dtype | MiB sent | ms/step | exposed comm ms | vs fp32 | comm share predicted | measured | measured / predicted |"
echo "  |---|---:|---:|---:|---:|---:|---:|---:|"
for d in fp32 bf16; do
  p=$(predicted "$d")
  echo "  | $d | ${wire_mib[$d]} | $(num "${ms_step[$d]:-nan}") | $(num "${exposed_ms[$d]:-nan}") | $(ratio "${exposed_ms[$d]:-nan}" "${exposed_ms[fp32]:-nan}") | $(pct "${p:-nan}") | $(pct "${share[$d]:-nan}") | $(ratio "${share[$d]:-nan}" "${p:-nan}") |"
done
echo "  | DiLoCo, island per host, H = 7 | ${wire_mib[diloco]} | | | | | | |"
echo "  | streaming DiLoCo, H = 7, 2 fragments, overlap 2 | ${wire_mib[streaming]} | | | | | | |"
