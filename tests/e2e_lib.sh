# shellcheck shell=bash
# Shared start of the end-to-end script tests (observe_test.sh, hf_export_test.sh; sourced):
# mpirun as root and oversubscribed, a work directory removed on exit (KEEP=1 keeps it), the
# PASS/FAIL counters, val_loss (a run's printed validation loss), and (unless E2E_NO_CORPUS is
# set) a small corpus packed into byte-level shards data/c-{train,val}-*.h5.
# Needs BIN (the mpitrain binary) set by the caller; ends with `cd $WORK`.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
       PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
PY=/usr/bin/python3
WORK=$(mktemp -d "/tmp/mpitrain-${E2E_NAME:-e2e}-XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$WORK"' EXIT
cd "$WORK" || exit 1
passed=0 failed=0
ok()   { echo "PASS: $1"; passed=$((passed + 1)); }
bad()  { echo "FAIL: $1"; failed=$((failed + 1)); }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
summary() { echo "$passed passed, $failed failed"; [ "$failed" -eq 0 ]; }

# The validation loss a run printed at step STEP (its first such line; `tail` for the last).
val_loss() {  # STEP FILE [head|tail]
  sed -n "s/.*step $1 | val loss \([0-9.]*\).*/\1/p" "$2" | "${3:-head}" -1
}

# The Python modules a test reads its files with: missing ones fail the test (scripts/test.sh installs them).
need_python() {  # "import ..." statement, Debian package names
  $PY -c "$1" 2>/dev/null || { echo "FAIL: $PY cannot '$1' (Debian: $2; scripts/test.sh installs them)"; exit 1; }
}

[ -n "${E2E_NO_CORPUS:-}" ] && return 0
mkdir corpus
for i in $(seq 1 80); do
  printf 'The quick brown fox %d jumps over the lazy dog.\n%%\nA stitch in time saves %d.\n%%\n' "$i" "$i" >> corpus/a.txt
done
"$BIN" pack corpus -o data/c --doc-separator % --val-fraction 0.2 > pack.out 2>&1 || { cat pack.out; exit 1; }
