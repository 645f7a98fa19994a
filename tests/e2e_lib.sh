# shellcheck shell=bash
# Shared start of the end-to-end script tests (cli, fault, lock, observe, hf_export, h5py,
# llama_hf, grad_comm, gpu_check_rehearsal; sourced): mpirun as root and oversubscribed, a work
# directory removed on exit (KEEP=1 keeps it; a function e2e_on_exit, if the test defines one, runs
# first: its own processes and mounts), the PASS/FAIL counters, expect_usage (a refused command),
# val_loss (a run's printed validation loss), and (unless E2E_NO_CORPUS is set) a small corpus
# packed into byte-level shards data/c-{train,val}-*.h5.
# Needs BIN (the mpitrain binary) set by the caller; ends with `cd $WORK`.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
       PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
PY=/usr/bin/python3
WORK=$(mktemp -d "/tmp/mpitrain-${E2E_NAME:-e2e}-XXXXXX")
e2e_exit() {
  if declare -F e2e_on_exit > /dev/null; then e2e_on_exit; fi
  [ -n "${KEEP:-}" ] || rm -rf "$WORK"
}
trap e2e_exit EXIT
cd "$WORK" || exit 1
passed=0 failed=0 elsewhere=0
ok()   { echo "PASS: $1"; passed=$((passed + 1)); }
bad()  { echo "FAIL: $1"; failed=$((failed + 1)); }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
summary() {
  echo "$passed passed, $failed failed$([ $elsewhere -gt 0 ] && echo "; $elsewhere not run here (MPITRAIN_TEST_OWN_CHECKS=elsewhere: run in the Debian 12 Open MPI leg)")"
  [ "$failed" -eq 0 ]
}
# expect_usage NAME WANT COMMAND...: the command is refused as bad input must be: exit 2 and
# exactly one "mpitrain: " line, holding WANT (its output, indented, when not).
expect_usage() {
  local name=$1 want=$2 rc n
  shift 2
  "$@" > err.out 2>&1
  rc=$?
  n=$(grep -c "mpitrain: " err.out)
  if [ $rc -eq 2 ] && [ "$n" -eq 1 ] && grep -q -- "$want" err.out; then ok "$name"
  else bad "$name (rc=$rc, error lines=$n)"; sed 's/^/  | /' err.out; fi
}
# expect_own_usage NAME WANT COMMAND...: expect_usage for a refusal that mpitrain's own checks make
# alike on every rank, through no library that differs between MPI families or Debian releases (a
# key's range or combination, a command-line number, a layout that does not divide the world): the
# path every rank exits 2 on, rank 0 printing, is the one the refusals through the launcher,
# yaml-cpp, HDF5 or libtorch take, and those run everywhere. MPITRAIN_TEST_OWN_CHECKS=elsewhere
# (scripts/test.sh's MPICH run, scripts/test-debian13.sh) lists it as "run elsewhere", never as
# passed, and returns 1, so that a check on what the refused run left runs only with it.
expect_own_usage() {
  if [ "${MPITRAIN_TEST_OWN_CHECKS:-here}" = elsewhere ]; then
    echo "ELSEWHERE: $1"
    elsewhere=$((elsewhere + 1))
    return 1
  fi
  expect_usage "$@"
  return 0
}

# The validation loss a run printed at step STEP (its first such line; `tail` for the last).
val_loss() {  # STEP FILE [head|tail]
  sed -n "s/.*step $1 | val loss \([0-9.]*\).*/\1/p" "$2" | "${3:-head}" -1
}

# The Python modules a test reads its files with: missing ones fail the test (scripts/test.sh installs them).
need_python() {  # "import ..." statement, Debian package names
  $PY -c "$1" 2>/dev/null || { echo "FAIL: $PY cannot '$1' (Debian: $2; scripts/test.sh installs them)"; exit 1; }
}

# ref_parity METRICS REFERENCE-OUTPUT: mpitrain's 20 losses (metrics.jsonl) against a run of
# tests/llama_reference.py train (its last line's "losses"): within 1e-4 and learning (exit 0), else 1.
ref_parity() {
  "$PY" - "$1" "$2" <<'PYEOF'
import json, sys
ours = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
ref = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])["losses"]
d = max(abs(a - b) for a, b in zip(ours, ref))
print(f"  20 steps: mpitrain {ours[0]:.6f} .. {ours[-1]:.6f}, reference {ref[0]:.6f} .. {ref[-1]:.6f}; max |delta| {d:.2e}")
sys.exit(0 if len(ours) == len(ref) == 20 and d <= 1e-4 and ours[-1] < ours[0] - 0.1 else 1)
PYEOF
}

[ -n "${E2E_NO_CORPUS:-}" ] && return 0
mkdir corpus
for i in $(seq 1 80); do
  printf 'The quick brown fox %d jumps over the lazy dog.\n%%\nA stitch in time saves %d.\n%%\n' "$i" "$i" >> corpus/a.txt
done
"$BIN" pack corpus -o data/c --doc-separator % --val-fraction 0.2 > pack.out 2>&1 || { cat pack.out; exit 1; }
