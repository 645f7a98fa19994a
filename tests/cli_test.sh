#!/usr/bin/env bash
# End-to-end tests of the mpitrain binary: singleton and mpirun runs, pack/inspect/sample,
# stop-and-resume through the CLI, and bad input (exit code 2, one line, printed once).
# Usage: cli_test.sh PATH/TO/mpitrain [mpirun]
set -u
BIN=$(realpath "$1")
HERE=$(cd "$(dirname "$0")" && pwd)
MPIRUN=${2:-mpirun}
# The MPI family the binary is built against (CMake's MPITRAIN_MPI), as `mpitrain --version` says:
# the launcher-specific checks differ (another family's launcher, how signals reach the ranks).
VERSION_TEXT=$("$BIN" --version 2>&1)
FAMILY=$(sed -n 's/^mpi: \([a-z]*\) .*/\1/p' <<< "$VERSION_TEXT")
case $FAMILY in
  openmpi|mpich) echo "binary: $FAMILY build, launcher $MPIRUN" ;;
  *) echo "FAIL: '$BIN --version' names no MPI family (openmpi or mpich): $VERSION_TEXT"; exit 1 ;;
esac
E2E_NAME=cli
E2E_NO_CORPUS=1  # its own corpus: pack is among what it tests
# shellcheck source=e2e_lib.sh
. "$HERE/e2e_lib.sh"

# ---- which MPI: --version against the libraries the binary links (ldd) ----
LINKED=openmpi
ldd "$BIN" | grep -q 'libmpich' && LINKED=mpich
check "--version names the MPI family the binary links ($LINKED) and the library it loaded" \
  "[ $FAMILY = $LINKED ] && grep -Eq '^mpi: [a-z]+ \\(built against (Open MPI|MPICH) [0-9]+\\.[0-9]+.*; loaded: (Open MPI v|MPICH )[0-9]' <<< \"\$VERSION_TEXT\""
# ATen's CPU kernels as its dispatch reports them (tests/kernel_paths_test.sh reads the line):
# ATEN_CPU_CAPABILITY=default must turn them to "NO AVX", so the line is no constant.
check "--version names libtorch and its CPU kernels, and ATEN_CPU_CAPABILITY=default changes them to NO AVX" \
  "grep -Eq '^torch: [0-9]+\\.[0-9]+.* \\(CPU kernels: [A-Z0-9 ]+\\)\$' <<< \"\$VERSION_TEXT\" &&
   ATEN_CPU_CAPABILITY=default \"\$BIN\" --version | grep -q '^torch: .*(CPU kernels: NO AVX)\$'"

# ---- a small corpus ----
mkdir corpus
for i in $(seq 1 60); do
  printf 'The quick brown fox %d jumps over the lazy dog.\n%%\nA stitch in time saves %d.\n%%\n' $i $i >> corpus/a.txt
done
"$BIN" pack corpus -o data/c --doc-separator % --val-fraction 0.2 --shard-tokens 3000 > pack.out 2>&1
check "pack writes train and val shards" "ls data/c-train-00000.h5 data/c-val-00000.h5 >/dev/null 2>&1"
check "pack reports counts" "grep -q 'packed 120 documents' pack.out"
"$BIN" inspect data/c-train-00000.h5 > inspect.out 2>&1
check "inspect shows the shard format" "grep -q \"@format = 'mpitrain-tokens'\" inspect.out && grep -q '/tokens  uint16' inspect.out"

cat > cfg.yaml <<'YAML'
model: {preset: custom, n_layer: 1, n_head: 2, n_embd: 16, seq_len: 32}
data: {train: [data/c-train-*.h5], val: [data/c-val-*.h5]}
train: {micro_batch: 2, steps: 6, threads: 1, out_dir: run}
optim: {warmup_steps: 2}
eval: {every: 3, batches: 1}
log: {every: 1}
checkpoint: {dir: ckpt, every: 3, keep: 2}
sample: {tokens: 20, prompt: "The "}
YAML

# ---- singleton: no mpirun ----
"$BIN" cfg.yaml --set checkpoint.dir=ckpt1 --set train.out_dir=run1 > single.out 2>&1
rc=$?
check "singleton run exits 0" "[ $rc -eq 0 ]"
check "singleton host map" "grep -q '1 rank on 1 host' single.out"
check "singleton writes final checkpoint" "[ -f ckpt1/ckpt-00000006.h5 ] && grep -qx ckpt-00000006.h5 ckpt1/latest"

# ---- mpirun -np 2 ----
"$MPIRUN" -np 2 "$BIN" cfg.yaml > mpi.out 2>&1
rc=$?
check "mpirun -np 2 exits 0" "[ $rc -eq 0 ]"
check "host map names 2 ranks" "grep -q '2 ranks on 1 host' mpi.out"
check "effective batch logged" "grep -q 'batch: 2 micro x 2 ranks x 1 accum = 4 sequences' mpi.out"
check "progress printed once per step (rank 0 only)" "[ \$(grep -c 'step     6/6' mpi.out) -eq 1 ]"
check "keep-last-2 checkpoints" "[ -f ckpt/ckpt-00000006.h5 ] && [ -f ckpt/ckpt-00000003.h5 ]"
check "metrics.jsonl has every step and val" "[ \$(grep -c '\"loss\"' run/metrics.jsonl) -eq 6 ] && grep -q val_loss run/metrics.jsonl"
check "sample printed" "grep -q 'sample:' mpi.out"
check "each rank's peak of libtorch's CPU memory printed once" \
  "[ \$(grep -c 'peak CPU memory (allocated by libtorch, MiB): rank 0 [0-9.]*, rank 1 [0-9.]*$' mpi.out) -eq 1 ]"
check "and each rank's peak at start-up, once" \
  "[ \$(grep -c 'peak CPU memory at start-up (allocated by libtorch, MiB): rank 0 [0-9.]*, rank 1 [0-9.]*$' mpi.out) -eq 1 ]"
"$BIN" inspect ckpt/ckpt-00000006.h5 > ickpt.out 2>&1
check "inspect shows a checkpoint" "grep -q \"@format = 'mpitrain-checkpoint'\" ickpt.out && grep -q '@step = 6' ickpt.out"
"$BIN" sample ckpt/ckpt-00000006.h5 --prompt "The " --tokens 30 > sample.out 2>&1
check "sample command generates text" "[ \$? -eq 0 ] && [ \$(wc -c < sample.out) -gt 30 ]"
"$BIN" sample ckpt/ckpt-00000006.h5 --prompt "The " --tokens 30 --stream > sample-stream.out 2>&1
check "sample --stream (one block in memory at a time) generates the same text" "cmp -s sample.out sample-stream.out"

# ---- stop and resume through the CLI ----
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt2 --set train.out_dir=run2 --stop-after 4 > stop.out 2>&1
check "--stop-after leaves a checkpoint at step 4" "[ -f ckpt2/ckpt-00000004.h5 ] && ! grep -q 'step     5/6' stop.out"
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt2 --set train.out_dir=run2 > resume.out 2>&1
check "resume: auto continues at step 4" "grep -q 'resumed from ckpt2/ckpt-00000004.h5 at step 4' resume.out && grep -q 'step     6/6' resume.out && ! grep -q 'step     4/6' resume.out"
check "resumed losses equal the straight run's" \
  "[ \"\$(grep -o 'step     6/6 | loss [0-9.]*' resume.out)\" = \"\$(grep -o 'step     6/6 | loss [0-9.]*' mpi.out)\" ]"

# ---- netcheck ----
"$MPIRUN" -np 2 "$BIN" netcheck --max-bytes 65536 --p2p-bytes 65536 --iters 2 > netcheck.out 2>&1
rc=$?
check "netcheck exits 0 and reports the host and links" \
  "[ $rc -eq 0 ] && grep -q 'netcheck: OK (1 host, 2 ranks)' netcheck.out && grep -q 'busbw' netcheck.out"

# ---- plan for a Llama: the same model as train builds ----
# 1 layer, 2 heads / 1 kv head of 8, SwiGLU 32, tied, 257 byte tokens: wte 257 x 16 = 4112; q and
# o 16 x 16 each, k and v 8 x 16 each, gate/up/down 32 x 16 each, two RMSNorms of 16 = 2336; the
# final RMSNorm 16: 6464 parameters.
llama_model=(--set model.arch=llama --set model.n_kv_head=1 --set model.intermediate_size=32)
"$MPIRUN" -np 2 "$BIN" plan cfg.yaml "${llama_model[@]}" --iters 2 --memory 1 > plan-llama.out 2>&1
rc=$?
check "plan measures a Llama under mpirun -np 2 (exit $rc) and recommends a setting" \
  "[ $rc -eq 0 ] && grep -q ' model 6464 parameters' plan-llama.out && grep -q '^recommendation: ' plan-llama.out"
# Its memory table: zero 0-3 x none/selective/full, the 6464 parameters' state counted (zero 0: 4 bytes each
# of weights, gradients and flat buckets = 0.0247 MiB, 8 of AdamW moments = 0.0493; zero 1: the
# moments over 2 ranks, the received shard beside the buckets = 0.037), the activations measured
# (a fully checkpointed block keeps less than a selective one, which keeps less than a block), and
# what fits 1 GiB: the fastest layout.
act_block=$(sed -n 's/.*as measured: \([0-9.e+-]*\) MiB per block, \([0-9.e+-]*\) MiB per selectively checkpointed block, \([0-9.e+-]*\) MiB per fully checkpointed block.*/\1 \2 \3/p' plan-llama.out)
check "plan: memory per rank for zero 0-3 x none/selective/full, the model state counted, activations measured ($act_block)" \
  "[ \$(grep -c -E '^\\| [0-3] \\| (none|selective|full) \\|' plan-llama.out) -eq 12 ] && grep -q '^| 0 | none | 0.0247 | 0.0247 | 0.0247 | 0.0493 |' plan-llama.out \
   && grep -q '^| 1 | none | 0.0247 | 0.0247 | 0.037 | 0.0247 |' plan-llama.out \
   && grep -q '^| 3 | full |' plan-llama.out \
   && awk -v a='$act_block' 'BEGIN { split(a, v, \" \"); exit !(v[1] > 0 && v[3] > 0 && v[3] < v[2] && v[2] < v[1]) }'"
check "plan --memory 1: the fastest layout fits, named" \
  "grep -q 'memory recommendation (--memory: 1 GiB): optim.zero: 0, train.activation_checkpointing: none .*the fastest layout fits' plan-llama.out"
"$MPIRUN" -np 2 "$BIN" plan cfg.yaml "${llama_model[@]}" --memory-only --memory 0.0000001 > plan-small.out 2>&1
rc=$?
check "plan --memory smaller than any layout: exit 0, says none fits and why, zero 3 included (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q 'no layout fits: zero 0 + none needs .* (largest: ' plan-small.out \
   && grep -q 'zero 3 + full needs' plan-small.out"
# (the state's columns; the activations are measured again, so may differ by an allocation)
check "plan --memory-only: the same memory table, no timing" \
  "! grep -q '^measured: ' plan-small.out && ! grep -q '^recommendation: ' plan-small.out \
   && grep -q '^plan: model 6464 parameters; micro-batch 2 x 32 tokens; fp32; dp 2' plan-small.out \
   && [ \"\$(grep -E '^\\| [0-3] \\| (none|selective|full) \\|' plan-small.out | cut -d'|' -f2-7)\" = \"\$(grep -E '^\\| [0-3] \\| (none|selective|full) \\|' plan-llama.out | cut -d'|' -f2-7)\" ] \
   && [ \$(grep -c -E '^\\| [0-3]' plan-small.out) -eq 12 ]"
# Under parallel.tp 2 (2 ranks: dp 1): the memory table of that layout, each rank's tp shards
# counted and its activations measured on tensor-parallel probe models (every rank takes part);
# the step-time model is data parallelism's, so no timing table, said.
"$MPIRUN" -np 2 "$BIN" plan cfg.yaml --set parallel.tp=2 --iters 2 > plan-tp.out 2>&1
rc=$?
tp_counts=$(sed -n 's/^plan: model \([0-9]*\) parameters per rank (its tp shards of \([0-9]*\)).*/\1 \2/p' plan-tp.out)
check "plan under parallel.tp 2: the tp layout's memory per rank, its shards counted ($tp_counts), no timing (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q 'the step-time model covers data parallelism only (parallel.tp: 2)' plan-tp.out \
   && grep -q '; dp 1 x tp 2' plan-tp.out && ! grep -q '^measured: ' plan-tp.out \
   && [ \$(grep -c -E '^\\| [0-3] \\| (none|selective|full) \\|' plan-tp.out) -eq 12 ] \
   && awk -v c='$tp_counts' 'BEGIN { split(c, v, \" \"); exit !(v[1] > 0 && v[1] < v[2]) }'"
"$MPIRUN" -np 2 "$BIN" cfg.yaml "${llama_model[@]}" --set train.steps=2 --set checkpoint.dir=ckpt-llama \
  --set train.out_dir=run-llama > train-llama.out 2>&1
rc=$?
check "the Llama plan measured is the model train builds (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q 'model: llama, 6464 parameters' train-llama.out"

# ---- the singleton guard: another MPI family's launcher ----
# An Open MPI binary started by MPICH's hydra (PMI_SIZE=2 in each task's environment), or an MPICH
# binary started by Open MPI's mpirun (OMPI_COMM_WORLD_SIZE=2), initialises as 2 singletons (world
# size 1): each task exits 2 naming the variable and the launch to use, instead of 2 separate
# trainings. (Each is its own world, so each prints, unless the launcher ends the other first;
# nothing is written.)
if [ $FAMILY = openmpi ]; then other=mpiexec.hydra var=PMI_SIZE; else other=mpirun.openmpi var=OMPI_COMM_WORLD_SIZE; fi
if command -v $other > /dev/null; then
  timeout 120 $other -n 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt-other --set train.out_dir=run-other > other.out 2>&1
  rc=$?
  n=$(grep -c "^mpitrain: launch: $var=2 says .* started 2 tasks, but MPI made a world of 1 rank" other.out)
  check "$other -n 2 of an $FAMILY binary: exit 2, the tasks name $var=2 and the launch to use (rc $rc, $n lines)" \
    "[ $rc -eq 2 ] && [ $n -ge 1 ] && [ ! -e ckpt-other ]"
else
  bad "$other not installed (Debian: mpich and openmpi-bin; scripts/test.sh installs them)"
fi

# ---- pre-flight: every rank's record compared before any communicator is built ----
# One rank's record changed as another installation would (the test hook): exit 2, one line
# naming the field, the rank and host, nothing written; `netcheck` shows it in its table.
MPITRAIN_TEST_PREFLIGHT="1:nccl=2.99.0" "$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt-pf \
  --set train.out_dir=run-pf > pf.out 2>&1
rc=$?
check "pre-flight: another NCCL on rank 1 is exit 2, printed once, naming rank and host, nothing written (rc $rc)" \
  "[ $rc -eq 2 ] && [ \$(grep -c '^mpitrain: preflight: NCCL 2.99.0 on host [^ ]* (rank 1) differs from rank 0.s (none)' pf.out) -eq 1 ] && [ ! -e ckpt-pf ]"
check "pre-flight: an agreeing run logs one line naming the build and the MPI library" \
  "grep -q 'preflight: 2 ranks on 1 host agree: mpitrain [0-9.]* (build [0-9a-f]*), libtorch [0-9.]*, MPI library' mpi.out"
MPITRAIN_TEST_PREFLIGHT="1:nccl=2.99.0" "$MPIRUN" -np 2 "$BIN" netcheck --max-bytes 1024 --iters 1 > pfnet.out 2>&1
rc=$?
check "netcheck: the pre-flight table shows both NCCL values with their ranks; exit 1 (rc $rc)" \
  "[ $rc -eq 1 ] && grep -Eq '^  NCCL +2.99.0 +host [^ ]* \\(rank 1\\)' pfnet.out && grep -Eq '^  NCCL +- +host [^ ]* \\(rank 0\\)' pfnet.out && grep -q '^INCONSISTENT: preflight: NCCL' pfnet.out"
# The launcher's local rank against MPI's host split: hydra's MPI_LOCALRANKID with
# MPIR_CVAR_NOLOCAL=1 (MPICH then puts every rank on a node of its own); for Open MPI, a rank's
# record says what such a launcher would.
if [ $FAMILY = mpich ]; then
  MPIR_CVAR_NOLOCAL=1 "$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt-nl --set train.out_dir=run-nl > nl.out 2>&1
else
  MPITRAIN_TEST_PREFLIGHT="1:local_rank=MPI_LOCALRANKID=0" "$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt-nl \
    --set train.out_dir=run-nl > nl.out 2>&1
fi
rc=$?
check "a launcher's local rank that disagrees with MPI's host split is one warning naming the rank (rc $rc)" \
  "[ $rc -eq 0 ] && [ \$(grep -c \"launch: the launcher's local rank differs from MPI's host split on host [^ ]* (rank 1): rank 1 has MPI_LOCALRANKID=\" nl.out) -eq 1 ]"

# ---- SIGUSR1 (Slurm's pre-preemption warning): checkpoint, exit 75, resume ----
MPITRAIN_EXIT_FILE=$WORK/exit-usr1 "$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt3 --set train.out_dir=run3 \
  --set train.steps=100000 --set eval.every=0 --set 'data.val=[]' > usr1.out 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q 'step    10/' usr1.out 2>/dev/null && break; sleep 0.1; done
kill -USR1 $pid
wait $pid
rc=$?
# (hydra's mpiexec of MPICH 4.0.2 may return 0 after the ranks exited 75: for it, rank 0's own
# exit code, which MPITRAIN_EXIT_FILE records, is checked; see stop_case below)
[ $FAMILY = mpich ] && rc=$(cat exit-usr1 2>/dev/null)
check "SIGUSR1 to the launcher: exit code 75 (was ${rc:-none})" "[ \"$rc\" = 75 ]"
check "SIGUSR1: checkpoint written and logged" "grep -q 'stopped by signal 10' usr1.out && [ -s ckpt3/latest ]"
stopped=$(sed 's/ckpt-0*\([0-9]*\).h5/\1/' ckpt3/latest 2>/dev/null)
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt3 --set train.out_dir=run3 --set train.steps=$((stopped + 3)) \
  --set eval.every=0 --set 'data.val=[]' > usr1b.out 2>&1
check "resume after SIGUSR1 continues from its checkpoint" "grep -q \"at step $stopped \" usr1b.out"
check "resume with the same layout says nothing about the global batch" "! grep -q 'global batch on resume' usr1b.out"
# A changed global batch on resume is allowed and said (here: 2 ranks -> 1).
"$BIN" cfg.yaml --set checkpoint.dir=ckpt3 --set train.out_dir=run3 --set train.steps=$((stopped + 5)) \
  --set eval.every=0 --set 'data.val=[]' > usr1c.out 2>&1
check "resume on 1 rank of a 2-rank checkpoint logs the global batch change" \
  "grep -q 'global batch on resume: the checkpoint.s run used [0-9]* sequences per step ([0-9]* micro x 2 data-parallel ranks' usr1c.out && grep -q 'data order continues at sample' usr1c.out"

# ---- resume on another world size and layout: 4 ranks (ZeRO-1) -> 2 ranks (plain) -> 3 ranks
# (ZeRO-3: parameters sharded too), global batch 12 throughout. The chain's loss at step 9 continues the curve of a
# straight 4-rank run (they differ only in rounding: other micro-batch shapes and reduction
# orders; AdamW runs that differ so agree in their mean loss to well within 1e-3, see
# tests/test_train.cpp), and the windows every rank logged (log.level debug) cover 0..107 once
# each, step by step: no sample repeated or skipped across the layout changes.
layout() {  # np zero micro ckpt out [args...]
  local np=$1 zero=$2 micro=$3 ck=$4 out=$5
  shift 5
  "$MPIRUN" -np "$np" "$BIN" cfg.yaml --set checkpoint.dir=$ck --set train.out_dir=$out --set optim.zero=$zero \
    --set train.micro_batch=$micro --set train.global_batch=12 --set train.steps=9 --set eval.every=0 \
    --set 'data.val=[]' --set sample.tokens=0 --set log.level=debug "$@"
}
layout 4 1 1 ckL runL --stop-after 3 > lay1.out 2>&1
layout 2 0 2 ckL runL --stop-after 6 > lay2.out 2>&1
layout 3 3 2 ckL runL > lay3.out 2>&1
rc=$?
layout 4 1 1 ckS runS > layS.out 2>&1
check "4 ranks ZeRO-1 -> 2 ranks -> 3 ranks ZeRO-3: each resumes and the chain finishes" \
  "[ $rc -eq 0 ] && grep -q 'resumed from ckL/ckpt-00000003.h5 at step 3' lay2.out && grep -q 'resumed from ckL/ckpt-00000006.h5 at step 6' lay3.out && grep -q 'step     9/9' lay3.out"
check "the start-up logs say the layout: mesh and ZeRO-1/3 state per rank" \
  "grep -q 'mesh: 4 ranks = dp 4' lay1.out && grep -q 'ZeRO-1: sharded over 4 data-parallel ranks' lay1.out && grep -q 'optimizer state: .* (replicated)' lay2.out && grep -q 'ZeRO-3: sharded over 3 .*parameters sharded too' lay3.out"
loss_at() { grep "\"step\": $2, \"loss\"" "$1/metrics.jsonl" | tail -1 | sed 's/.*"loss": \([0-9.]*\).*/\1/'; }
chain=$(loss_at runL 9) straight=$(loss_at runS 9)
check "the loss curve continues across layouts (step 9: chain $chain, straight 4-rank run $straight)" \
  "[ -n \"$chain\" ] && [ -n \"$straight\" ] && awk -v a=$chain -v b=$straight 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-3) }'"
cat lay1.out lay2.out lay3.out | grep -o 'data: step [0-9]* micro [0-9]* windows [0-9]*-[0-9]*' \
  | awk '{ split($7, w, "-"); for (i = w[1]; i <= w[2]; ++i) print $3, i }' > windows.txt
check "data order across layouts: windows 0..107 each read once, in step order" \
  "[ \$(wc -l < windows.txt) -eq 108 ] && [ \$(cut -d' ' -f2 windows.txt | sort -n | uniq | wc -l) -eq 108 ] && [ \$(cut -d' ' -f2 windows.txt | sort -n | head -1) -eq 0 ] && [ \$(cut -d' ' -f2 windows.txt | sort -n | tail -1) -eq 107 ] && awk '{ if (\$2 < (\$1 - 1) * 12 || \$2 >= \$1 * 12) exit 1 }' windows.txt"

# ---- scripts/mpitrain-run: the ways users stop a job keep the documented exit codes ----
# SIGTERM/SIGHUP (kill, a scheduler) -> 75 and Ctrl-C (SIGINT) -> 130, each after a checkpoint.
# (Open MPI's plain mpirun answers SIGTERM by killing the ranks about a second later and exits 1,
# docs/operations.md; hydra forwards every signal to the ranks as it is, so under hydra the plain
# launcher is tested too, and a second SIGTERM, as sbatch and the launcher both forwarding it
# deliver, changes nothing.) `env --default-signal`: a background job of this script starts with
# SIGINT ignored, which a terminal's Ctrl-C target does not.
RUNNER=$HERE/../scripts/mpitrain-run
stop_case() {  # stop_case NAME SIGNAL EXIT-CODE TIMES CHECKED launcher words...
  # CHECKED: "launcher" asserts the launcher's exit code; "ranks" the code rank 0 exited with
  # (MPITRAIN_EXIT_FILE), for plain hydra, whose mpiexec (MPICH 4.0.2) may return 0 after the ranks
  # exited 75 (pmodels/mpich#7057; mpitrain-run and the sbatch wrapper read the file instead).
  # STOP_ARGS: more mpitrain arguments (unquoted words).
  local name=$1 sig=$2 want=$3 times=$4 checked=$5 pid rc at got
  shift 5
  # shellcheck disable=SC2086
  MPITRAIN_EXIT_FILE=$WORK/exit-$name env --default-signal=INT "$@" -np 2 "$BIN" cfg.yaml \
    --set checkpoint.dir=ckpt-$name --set train.out_dir=run-$name --set train.steps=100000 \
    --set eval.every=0 --set 'data.val=[]' ${STOP_ARGS:-} > run-$name.out 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -q 'step    10/' run-$name.out 2>/dev/null && break; sleep 0.1; done
  for _ in $(seq 1 "$times"); do kill -$sig $pid; done
  wait $pid
  rc=$?
  got=$rc
  [ "$checked" = ranks ] && got=$(cat "$WORK/exit-$name" 2>/dev/null)
  at=$(grep -Eo 'stopped by signal [0-9]+ after step [0-9]+' run-$name.out | grep -Eo '[0-9]+$')
  check "$name: SIG$sig x$times, $checked exit $want (was ${got:-none}; launcher $rc) after the checkpoint of step ${at:-?}" \
    "[ \"$got\" = $want ] && [ -n \"$at\" ] && [ \"\$(cat ckpt-$name/latest)\" = ckpt-\$(printf %08d $at).h5 ]"
}
for sig_rc in TERM:75 HUP:75 INT:130; do
  stop_case "mpitrain-run-${sig_rc%:*}" "${sig_rc%:*}" "${sig_rc#*:}" 1 launcher env MPITRAIN_MPIRUN="$MPIRUN" bash "$RUNNER"
done
# With DiLoCo's islands the ranks agree on a signal a step later (no world all-reduce per step):
# still one step for all, its checkpoint written (a rank stopping a step apart would leave the
# others in the checkpoint's collectives: no exit 75, no checkpoint).
STOP_ARGS="--set parallel.islands=2 --set diloco.inner_steps=3 --set diloco.fragments=1" \
  stop_case "islands-TERM" TERM 75 1 launcher env MPITRAIN_MPIRUN="$MPIRUN" bash "$RUNNER"
if [ $FAMILY = mpich ]; then
  stop_case hydra-TERM TERM 75 1 ranks "$MPIRUN"
  stop_case hydra-TERM-twice TERM 75 2 ranks "$MPIRUN"
  stop_case hydra-USR1 USR1 75 1 ranks "$MPIRUN"
  stop_case hydra-INT INT 130 1 ranks "$MPIRUN"
fi

# ---- bad input: exit 2, one line naming file and key, printed once, nothing overwritten ----
# (expect_usage NAME WANT COMMAND...: tests/e2e_lib.sh; expect_own_usage: a refusal by mpitrain's
# own checks alike on every rank, which the MPICH run and the Debian 13 leg leave to this one's
# Debian 12 Open MPI run; every refusal through the launcher, one rank, yaml-cpp, HDF5 or libtorch
# runs everywhere)
printf 'train: {micro_bach: 2}\n' > typo.yaml
expect_usage "unknown key under mpirun -np 2" "typo.yaml: unknown key 'train.micro_bach' (did you mean 'train.micro_batch'?)" \
  "$MPIRUN" -np 2 "$BIN" typo.yaml
expect_own_usage "out-of-range value" "cfg.yaml: train.micro_batch must be > 0, got -4" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set train.micro_batch=-4
expect_own_usage "inconsistent global batch" "train.global_batch" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set train.global_batch=7
expect_own_usage "missing config file" "nope.yaml: cannot read config file" "$MPIRUN" -np 2 "$BIN" nope.yaml
expect_own_usage "a mistyped command names the nearest one" "command line: unknown command 'trian' (did you mean 'train'?)" \
  "$MPIRUN" -np 2 "$BIN" trian cfg.yaml
expect_own_usage "a word that is no command and no file" "command line: unknown command 'frobnicate';" "$BIN" frobnicate
expect_own_usage "no shard matches" "data.train: no shard matches" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set 'data.train=[data/none-*.h5]'
printf 'not hdf5' > data/c-train-99999.h5
expect_usage "non-HDF5 shard" "data/c-train-99999.h5: not an HDF5 file" "$MPIRUN" -np 2 "$BIN" cfg.yaml
rm data/c-train-99999.h5
expect_own_usage "singleton bad key" "unknown key" "$BIN" typo.yaml
expect_own_usage "bad command-line flag" "command line" "$BIN" cfg.yaml --bogus
# model.init_from: rank 0 reads the directory; its error ends every rank (resume none: ckpt/ has
# checkpoints, and a resumed run does not read init_from).
expect_usage "model.init_from: no such directory" "cfg.yaml: model.init_from: no such directory 'nowhere'" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.init_from=nowhere --set checkpoint.resume=none
mkdir initw && printf 'junk' > initw/wte.weight.npy && printf 'junk' > initw/lm_head.weight.npy
expect_own_usage "model.init_from: missing and extra .npy files" \
  "cfg.yaml: model.init_from: missing initw/wpe.weight.npy, initw/h.0.ln_1.weight.npy, initw/h.0.ln_1.bias.npy and 12 more (one <parameter name>.npy per model parameter); initw/lm_head.weight.npy matches no model parameter" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.init_from=initw --set checkpoint.resume=none
# The layout (parallel.tp) and ZeRO (optim.zero) keys.
expect_own_usage "parallel.tp that does not divide the world" "cfg.yaml: parallel.tp: 2 does not divide the world size 3" \
  "$MPIRUN" -np 3 "$BIN" cfg.yaml --set parallel.tp=2
expect_own_usage "parallel.islands that do not divide the world" \
  "cfg.yaml: parallel.islands: 2 does not divide the world size 3 (world = islands x pp x dp x tp; every island as many ranks)" \
  "$MPIRUN" -np 3 "$BIN" cfg.yaml --set parallel.islands=2
expect_own_usage "parallel.islands that would split a tp group" \
  "cfg.yaml: parallel.islands: 2 islands of 1 ranks would split a tp group of parallel.tp 2 (an island is a whole number of tp groups)" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set parallel.islands=2 --set parallel.tp=2
expect_own_usage "diloco.inner_steps 0" "cfg.yaml: diloco.inner_steps must be >= 1" "$BIN" cfg.yaml --set diloco.inner_steps=0
expect_own_usage "parallel.tp: an explicit vocabulary the tp ranks cannot split (the data's 257 bytes + end-of-text)" \
  "cfg.yaml: model.vocab_size: 257 must be a multiple of parallel.tp (2): the vocabulary is split over the tp ranks; set a padded size such as 258, or leave model.vocab_size unset (automatic padding)" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set parallel.tp=2 --set model.vocab_size=257
expect_own_usage "parallel.tp: heads the tp ranks cannot split" \
  "cfg.yaml: parallel.tp: 2 must divide model.n_head (1): each tp rank computes whole attention heads" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set parallel.tp=2 --set model.n_head=1
# A tensor-parallel run (tp 2 x dp 1) on the 257-token byte vocabulary, no model.vocab_size: padded
# to 258 rows automatically; it writes a whole-shape checkpoint that a tp 1 run resumes.
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set parallel.tp=2 --set checkpoint.dir=ckpt-tp \
  --set train.out_dir=run-tp --set checkpoint.resume=none > tp.out 2>&1
rc=$?
check "tensor parallel: tp 2 trains (exit $rc), the mesh says dp 1 x tp 2, both tp ranks write their shards" \
  "[ $rc -eq 0 ] && grep -q 'mesh: 2 ranks = dp 1 x tp 2' tp.out && grep -q 'step *6/6' tp.out && grep -q 'write their tensor-parallel shards (2 writers' tp.out"
check "tensor parallel: the byte vocabulary padded for tp 2, said at start-up" \
  "grep -q 'vocab 258 = 257 tokens + 1 padding rows outside the loss' tp.out"
# The padding row is outside the loss: no gradient, so AdamW leaves it at its initial zero.
h5dump -y -w 0 -d /model/wte.weight -s 257,0 -c 1,16 ckpt-tp/ckpt-00000006.h5 > pad_row.txt 2>&1
pad_values=$(sed -n '/DATA {/,/}/{p;/}/q}' pad_row.txt | grep -v '[{}]' | tr ', ' '\n\n' | grep -v '^$' | sort -u | tr '\n' ' ')
check "tensor parallel: the padding row is still zero after 6 steps (its values: ${pad_values:-none})" \
  "[ '$pad_values' = '0 ' ]"
check "tensor parallel: its checkpoint holds whole tensors (mpitrain sample loads it)" \
  "'$BIN' sample ckpt-tp/ckpt-00000006.h5 --tokens 3 > /dev/null 2>&1"
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckpt-tp --set train.out_dir=run-tp1 --set train.steps=8 > tp1.out 2>&1
rc=$?
check "tensor parallel: a tp 1 run resumes the tp 2 checkpoint, keeping its 258 rows (exit $rc)" \
  "[ $rc -eq 0 ] && grep -q 'resumed from ckpt-tp/ckpt-00000006.h5 at step 6' tp1.out && grep -q 'step *8/8' tp1.out && grep -q 'vocabulary rows 258 as the checkpoint has them' tp1.out"
# DiLoCo: 2 islands of one rank, an outer step every 2 steps, stopped after step 3 (mid-round) and
# resumed: each rank's state lies beside the checkpoint, the outer steps count on, metrics.jsonl
# carries them.
stop_and_resume() {  # name, stop step, mpitrain arguments...: <name>1.out, <name>2.out, rc1, rc2
  local name=$1 stop=$2
  shift 2
  "$MPIRUN" -np 2 "$BIN" cfg.yaml "$@" --set checkpoint.resume=none --stop-after "$stop" > "${name}1.out" 2>&1
  rc1=$?
  "$MPIRUN" -np 2 "$BIN" cfg.yaml "$@" > "${name}2.out" 2>&1
  rc2=$?
}
stop_and_resume dl 3 --set parallel.islands=2 --set diloco.inner_steps=2 --set checkpoint.dir=ckpt-dl --set train.out_dir=run-dl
check "DiLoCo: 2 islands train to step 3 (exit $rc1) with each rank's state beside the checkpoint, then resume to 6 (exit $rc2)" \
  "[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && grep -q 'mesh: 2 ranks = 2 islands x dp 1; islands' dl1.out \
   && [ -f ckpt-dl/ckpt-00000003.diloco/rank-00000.h5 ] && [ -f ckpt-dl/ckpt-00000003.diloco/rank-00001.h5 ] \
   && grep -q 'resumed from ckpt-dl/ckpt-00000003.h5 at step 3' dl2.out && grep -q 'diloco: 3 outer steps' dl2.out \
   && [ \$(grep -c '\"outer_step\"' run-dl/metrics.jsonl) -eq 3 ]"
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] || tail -n 20 dl1.out dl2.out
# Streaming DiLoCo on a 2-block model: 2 fragments, each exchange applied a step after it starts;
# stopped after step 2 with fragment 0's exchange in flight (due after step 3) and resumed.
stop_and_resume ds 2 --set parallel.islands=2 --set diloco.inner_steps=2 --set diloco.fragments=2 \
  --set diloco.overlap=1 --set model.n_layer=2 --set checkpoint.dir=ckpt-ds --set train.out_dir=run-ds
check "streaming DiLoCo: 2 fragments, overlap 1: stopped after step 2 (exit $rc1) and resumed to 6 (exit $rc2), 7 exchanges" \
  "[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && grep -q 'streaming: 2 fragments (blocks L mod 2), one synced every 1 steps, each applied 1 steps after it starts' ds1.out \
   && grep -q 'resumed from ckpt-ds/ckpt-00000002.h5 at step 2' ds2.out && grep -q 'diloco: 7 outer steps' ds2.out"
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] || tail -n 20 ds1.out ds2.out
expect_own_usage "diloco.fragments over the model's blocks" \
  "cfg.yaml: diloco.fragments must be <= the model's 1 blocks" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set parallel.islands=2 --set diloco.fragments=2
expect_own_usage "optim.zero out of range" "cfg.yaml: optim.zero must be 0 (off), 1 (ZeRO-1" "$BIN" cfg.yaml --set optim.zero=4
expect_own_usage "optim.zero 3 with PowerSGD: refused by name" \
  "cfg.yaml: comm.compress must be none with optim.zero: 3" "$BIN" cfg.yaml --set optim.zero=3 --set comm.compress=powersgd
expect_own_usage "comm.param_dtype without ZeRO-3: refused by name" \
  "cfg.yaml: comm.param_dtype must be fp32 with optim.zero: 2" "$BIN" cfg.yaml --set optim.zero=2 --set comm.param_dtype=bf16
expect_own_usage "model.attention unknown" "cfg.yaml: model.attention must be one of auto|flash|cudnn|efficient|math" \
  "$BIN" cfg.yaml --set model.attention=fast
# cuDNN attention does not exist on the CPU (libtorch >= 2.3 cannot choose it; older libtorch has none)
expect_usage "model.attention: a kernel this device lacks, under mpirun -np 2" "cfg.yaml: model.attention: cudnn" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.attention=cudnn --set checkpoint.resume=none
expect_own_usage "log.profile_steps out of range" "cfg.yaml: log.profile_steps must be > 0" \
  "$BIN" cfg.yaml --set log.profile_steps=0
# Command-line errors: printed once under mpirun -np 2, exit 2, every numeric option range-checked.
expect_usage "unknown flag, printed once under -np 2" "command line" "$MPIRUN" -np 2 "$BIN" cfg.yaml --bogus
expect_own_usage "--set without a value, printed once under -np 2" "command line" "$MPIRUN" -np 2 "$BIN" cfg.yaml --set
expect_own_usage "unconvertible value, printed once under -np 2" "command line" "$MPIRUN" -np 2 "$BIN" cfg.yaml --stop-after x
expect_own_usage "--stop-after -5" "command line: --stop-after must be >= 1" "$MPIRUN" -np 2 "$BIN" cfg.yaml --stop-after -5
expect_own_usage "--stop-after at a step the resumed run is already past" \
  "command line: --stop-after 3: the run resumes at step 6" "$MPIRUN" -np 2 "$BIN" cfg.yaml --stop-after 3
expect_own_usage "sample --tokens -1" "command line: --tokens must be >= 1" "$BIN" sample ckpt/ckpt-00000006.h5 --tokens -1
expect_own_usage "sample --top-k -3" "command line: --top-k must be >= 0" "$BIN" sample ckpt/ckpt-00000006.h5 --top-k -3
expect_own_usage "sample --temperature 0" "command line: --temperature must be a number > 0" \
  "$BIN" sample ckpt/ckpt-00000006.h5 --temperature 0
expect_own_usage "sample --temperature nan" "command line: --temperature must be a number > 0" \
  "$BIN" sample ckpt/ckpt-00000006.h5 --temperature nan
expect_own_usage "plan --memory -1" "command line: --memory must be GiB per rank, > 0" "$BIN" plan cfg.yaml --memory -1
expect_own_usage "netcheck --iters -1" "command line: --iters must be >= 1" "$MPIRUN" -np 2 "$BIN" netcheck --iters -1
expect_own_usage "netcheck --max-bytes 0" "command line: --max-bytes must be >= 4" "$MPIRUN" -np 2 "$BIN" netcheck --max-bytes 0
shards_before=$(md5sum data/c-*.h5)
expect_own_usage "pack --shard-tokens -1" "command line: --shard-tokens must be >= 1" \
  "$MPIRUN" -np 2 "$BIN" pack corpus -o data/c --doc-separator % --shard-tokens -1
expect_own_usage "pack --val-fraction 1" "command line: --val-fraction must be in" \
  "$BIN" pack corpus -o data/c --doc-separator % --val-fraction 1
# A directory where one new shard's file goes: that write fails after the others succeeded.
mkdir -p data/c-train-00003.h5.partial.tmp/x
expect_usage "pack failing while writing its shards" "data/c-train-00003.h5.partial" \
  "$MPIRUN" -np 2 "$BIN" pack corpus -o data/c --doc-separator % --shard-tokens 500
rm -r data/c-train-00003.h5.partial.tmp
check "failed and refused packs left the earlier shards as they were, and no partial files" \
  "[ \"\$(md5sum data/c-*.h5)\" = \"$shards_before\" ] && ! ls data/*.partial >/dev/null 2>&1"

# Errors name the key; bad input changes nothing in the run directory; a config that never ends
# (a device, a FIFO) fails at once.
touch afile
expect_own_usage "checkpoint.dir naming a file: refused at start-up" "cfg.yaml: checkpoint.dir: 'afile' exists and is not a directory" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=afile
expect_usage "YAML syntax error in --set names the key and the --set" \
  "--set 'train.micro_batch=\[1,': the value of train.micro_batch: YAML syntax error" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set 'train.micro_batch=[1,'
mkdir -p runK mdir && printf 'kept\n' > runK/config.yaml
expect_own_usage "log.metrics naming a directory" "cfg.yaml: log.metrics: cannot write 'mdir'" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set log.metrics=mdir --set train.out_dir=runK --set checkpoint.dir=ckptK &&
  check "a config error left out_dir/config.yaml as it was" "[ \"\$(cat runK/config.yaml)\" = kept ]"
# Bad data found by both ranks at once (tokens outside the vocabulary in every window): one
# message, the lowest rank's, exit 2 on every rank; and the run, failing before its first
# checkpoint, leaves out_dir/config.yaml (the record of the run that owns out_dir) as it was.
mkdir -p bad runOOV && printf 'kept\n' > runOOV/config.yaml
cp data/c-train-00000.h5 bad/b-train-00000.h5
/usr/bin/python3 -c "
import h5py
with h5py.File('bad/b-train-00000.h5', 'r+') as f:
    t = f['tokens']
    for i in range(5, t.shape[0], 20): t[i] = 300
"
expect_usage "bad data on both ranks: printed once" \
  "bad/b-train-00000.h5: token 300 at position [0-9]* of dataset 'tokens' is outside the vocabulary" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set "data.train=[bad/b-train-*.h5]" --set train.out_dir=runOOV --set checkpoint.dir=ckptOOV
check "the failed run left out_dir/config.yaml as it was" "[ \"\$(cat runOOV/config.yaml)\" = kept ]"
# Bad data in one island only, its window read at step 3 (data.shuffle false: window w is tokens
# 32w..32w+32; step s reads windows (s-1)*2*ranks onwards, micro_batch 2 per rank): with islands
# the island agrees at once and the world a step later, so the failing island stops before its
# step and the other after its own. Printed once, by the failing rank, exit 2, well before the
# 60 s timeout. -np 2: window 10 is rank 1's (island 1); -np 4, 2 islands of 2: window 22 is
# rank 3's (island 1's second rank).
for case in 2:10 4:22; do
  cp data/c-train-00000.h5 "bad/i${case%:*}-train-00000.h5"
  /usr/bin/python3 -c "
import h5py
with h5py.File('bad/i${case%:*}-train-00000.h5', 'r+') as f:
    f['tokens'][${case#*:} * 32 + 1] = 300
"
  expect_usage "bad data in one island (-np ${case%:*}, window ${case#*:}): printed once, every rank ends" \
    "bad/i${case%:*}-train-00000.h5: token 300 at position $((${case#*:} * 32 + 1)) of dataset 'tokens' is outside the vocabulary" \
    timeout 60 "$MPIRUN" -np "${case%:*}" "$BIN" cfg.yaml --set "data.train=[bad/i${case%:*}-train-*.h5]" --set data.shuffle=false \
    --set parallel.islands=2 --set diloco.inner_steps=2 --set train.out_dir=runI --set checkpoint.dir=ckptI
done
check "bad data in one island: no checkpoint written (it fails at step 3, checkpoints every 3)" "! ls ckptI/ckpt-*.h5 >/dev/null 2>&1"
mkfifo cfg.fifo
t0=$(date +%s)
expect_own_usage "config path that is a FIFO: fails at once" "cfg.fifo: cannot read config file (not a regular file)" \
  timeout 20 "$MPIRUN" -np 2 "$BIN" cfg.fifo
expect_own_usage "config path /dev/zero: fails at once" "/dev/zero: cannot read config file (not a regular file)" \
  timeout 20 "$MPIRUN" -np 2 "$BIN" /dev/zero &&
  check "both within 15 s" "[ \$(( \$(date +%s) - $t0 )) -lt 15 ]"

# A diverging run (lr 1e30, no clipping) stops naming the step, printed once, exit 2, and never
# saves a NaN state: caught at a logged step, and between log steps before a checkpoint.
expect_usage "diverged run: stops at a logged step" "step [0-9]*: the loss is .*nan.*training diverged" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set optim.lr=1e30 --set optim.min_lr=0 --set optim.grad_clip=0 \
  --set checkpoint.dir=ckptN --set train.out_dir=runN --set log.every=1
check "diverged run: no checkpoint written" "! ls ckptN/ckpt-*.h5 >/dev/null 2>&1"
expect_usage "diverged run: caught before a checkpoint between log steps" \
  "step 2: a parameter is NaN or infinite (fp32): training diverged; this state is not saved, the newest checkpoint stays ckptM/ckpt-00000001.h5" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set optim.lr=1e30 --set optim.min_lr=0 --set optim.grad_clip=0 \
  --set checkpoint.dir=ckptM --set train.out_dir=runM --set log.every=6 --set checkpoint.every=1 --set eval.every=0
check "diverged run: the newest checkpoint is the last finite one" \
  "grep -qx ckpt-00000001.h5 ckptM/latest && ! ls ckptM/ckpt-00000002.h5 >/dev/null 2>&1"
# The divergence verdict is every rank's. A step that fp16 skipped (an overflow: its gradient norm
# is not finite by definition) is no divergence; a non-finite norm on one island's rank only
# (DiLoCo: the norm is the island's) ends every rank at that step, printed once, instead of one
# island stopping while the other waits for it until the watchdog; so does a NaN parameter in one
# island found before a checkpoint. fp16 runs only on a GPU, so the test fault
# MPITRAIN_TEST_NONFINITE=STEP:RANK|all:skipped|norm|param makes them.
MPITRAIN_TEST_NONFINITE=2:all:skipped timeout 60 "$MPIRUN" -np 2 "$BIN" cfg.yaml \
  --set checkpoint.dir=ckptSkip --set train.out_dir=runSkip > skipped.out 2>&1
rc=$?
check "a skipped step (fp16 overflow, non-finite gradient norm) is no divergence: the run ends 0" \
  "[ $rc -eq 0 ] && grep -q 'step 2: fp16 gradients overflowed' skipped.out && ! grep -q diverged skipped.out \
   && [ \$(grep -c '\"loss\"' runSkip/metrics.jsonl) -eq 6 ]"
check "metrics.jsonl stays JSON: the skipped step's gradient norm is null" \
  "/usr/bin/python3 -c 'import json, sys; r = [json.loads(l, parse_constant=sys.exit) for l in open(\"runSkip/metrics.jsonl\")]; assert [x[\"grad_norm\"] for x in r if x[\"step\"] == 2 and \"loss\" in x] == [None]'"
[ $rc -eq 0 ] || tail -n 5 skipped.out
expect_usage "a non-finite gradient norm in one island only: every rank ends at that step, printed once" \
  "step 3: the loss is .* and the gradient norm .* here, not finite on another rank (fp32): training diverged" \
  timeout 60 env MPITRAIN_TEST_NONFINITE=3:1:norm "$MPIRUN" -np 2 "$BIN" cfg.yaml \
  --set parallel.islands=2 --set diloco.inner_steps=2 --set checkpoint.dir=ckptD --set train.out_dir=runD
expect_usage "a NaN parameter in one island only (between outer steps): every rank ends before the checkpoint" \
  "step 2: a parameter is NaN or infinite (fp32): training diverged; this state is not saved, the newest checkpoint stays ckptP/ckpt-00000001.h5" \
  timeout 60 env MPITRAIN_TEST_NONFINITE=2:1:param "$MPIRUN" -np 2 "$BIN" cfg.yaml \
  --set parallel.islands=2 --set diloco.inner_steps=4 --set checkpoint.dir=ckptP --set train.out_dir=runP \
  --set log.every=6 --set checkpoint.every=1 --set eval.every=0

# sample prints the prompt once: greedy decoding of P for 6 tokens = P + c1..c6, and decoding
# P + c1 for 5 tokens must give the same text (a prompt printed twice would not).
"$BIN" sample ckpt/ckpt-00000006.h5 --prompt "The " --tokens 6 --top-k 1 > greedy6.out 2>&1
p1=$(head -c 5 greedy6.out)
"$BIN" sample ckpt/ckpt-00000006.h5 --prompt "$p1" --tokens 5 --top-k 1 > greedy5.out 2>&1
check "sample --prompt prints the prompt once, then its continuation" \
  "[ \"\$(head -c 4 greedy6.out)\" = 'The ' ] && cmp -s greedy6.out greedy5.out"
cmp -s greedy6.out greedy5.out || { echo "  6 tokens: '$(cat greedy6.out)'"; echo "  5 tokens after '$p1': '$(cat greedy5.out)'"; }

before=$(md5sum ckpt/ckpt-00000006.h5)
expect_usage "another architecture on resume, named" "ckpt/ckpt-00000006.h5: the checkpoint's model has n_embd 16, the configured one 32 (model.n_embd)" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.n_embd=32
expect_own_usage "another n_head on resume (equal shapes), named" "ckpt/ckpt-00000006.h5: the checkpoint's model has n_head 2, the configured one 4 (model.n_head)" \
  "$MPIRUN" -np 2 "$BIN" cfg.yaml --set model.n_head=4
check "nothing on disk overwritten by a failed run" "[ \"\$(md5sum ckpt/ckpt-00000006.h5)\" = \"$before\" ]"

# ==== BEGIN checkpoint.async (asynchronous checkpoint save) ===================================
# Same run as "mpirun -np 2" above with the writes on a background thread: the same checkpoint
# contents, stop-and-resume with the same losses, and a failed background write ends the job
# with exit 2 and leaves no checkpoint.
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckptA --set train.out_dir=runA \
  --set checkpoint.async=true > async.out 2>&1
rc=$?
check "async: mpirun -np 2 exits 0, logs snapshot and background write" \
  "[ $rc -eq 0 ] && grep -q 'checkpoint step 3: snapshot [0-9]* ms (async write started)' async.out && grep -q 'ckptA/ckpt-00000006.h5 written in [0-9]* ms (background)' async.out"
check "async: checkpoints and latest as with sync saves" \
  "[ -f ckptA/ckpt-00000003.h5 ] && [ -f ckptA/ckpt-00000006.h5 ] && grep -qx ckpt-00000006.h5 ckptA/latest && ! ls ckptA/*.tmp >/dev/null 2>&1"
check "async: model, AdamW moments, train state and CRCs equal the sync run's" \
  "h5diff ckpt/ckpt-00000006.h5 ckptA/ckpt-00000006.h5 /model /model && h5diff ckpt/ckpt-00000006.h5 ckptA/ckpt-00000006.h5 /optim /optim && h5diff ckpt/ckpt-00000006.h5 ckptA/ckpt-00000006.h5 /train /train"
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckptB --set train.out_dir=runB \
  --set checkpoint.async=true --stop-after 4 > astop.out 2>&1
rc=$?
check "async: --stop-after 4 waits for its checkpoint" "[ $rc -eq 0 ] && [ -f ckptB/ckpt-00000004.h5 ] && grep -qx ckpt-00000004.h5 ckptB/latest"
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckptB --set train.out_dir=runB \
  --set checkpoint.async=true > aresume.out 2>&1
check "async: resume continues at step 4 with the straight run's losses" \
  "grep -q 'resumed from ckptB/ckpt-00000004.h5 at step 4' aresume.out && [ \"\$(grep -o 'step     6/6 | loss [0-9.]*' aresume.out)\" = \"\$(grep -o 'step     6/6 | loss [0-9.]*' mpi.out)\" ] && [ \"\$(grep -o 'step     5/6 | loss [0-9.]*' aresume.out)\" = \"\$(grep -o 'step     5/6 | loss [0-9.]*' mpi.out)\" ]"
# A directory (not removable) where step 3's .tmp file goes: the background write fails.
mkdir -p ckptC/ckpt-00000003.h5.tmp/x
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckptC --set train.out_dir=runC \
  --set checkpoint.async=true > afail.out 2>&1
rc=$?
check "async: a failed background write ends the job with exit 2, printed once" \
  "[ $rc -eq 2 ] && [ \$(grep -c 'mpitrain: ckptC/ckpt-00000003.h5.tmp: cannot write checkpoint' afail.out) -eq 1 ]"
check "async: after the failed write no checkpoint and no latest" \
  "! ls ckptC/ckpt-*.h5 >/dev/null 2>&1 && [ ! -e ckptC/latest ]"
# checkpoint.at_end false: every 4 of 6 steps writes step 4's and nothing after the last step.
"$MPIRUN" -np 2 "$BIN" cfg.yaml --set checkpoint.dir=ckptD --set train.out_dir=runD \
  --set checkpoint.every=4 --set checkpoint.at_end=false > noend.out 2>&1
rc=$?
check "checkpoint.at_end false: step 4's checkpoint, none at the end" \
  "[ $rc -eq 0 ] && [ -f ckptD/ckpt-00000004.h5 ] && [ ! -e ckptD/ckpt-00000006.h5 ] && grep -qx ckpt-00000004.h5 ckptD/latest && grep -q 'step     6/6' noend.out"
# ==== END checkpoint.async ===================================================================

summary
