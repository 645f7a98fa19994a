#!/usr/bin/env bash
# The slowest tests of a CTest run, with each one's time budget (its TIMEOUT in
# tests/CMakeLists.txt) and the share of the budget it used: scripts/test.sh prints it at the end
# of every CTest run, so a test that creeps towards its budget is seen before it fails.
#
#   scripts/slowest-tests.sh BUILD_DIR CTEST_OUTPUT [N]     (N: how many, default 10)
#
# CTEST_OUTPUT is what ctest printed ("  3/47 Test  #3: test_config ....   Passed    1.23 sec").
set -uo pipefail
build=$1 log=$2 n=${3:-10}
[ -f "$log" ] || { echo "slowest-tests: no CTest output at $log"; exit 0; }
budgets=$(mktemp "${TMPDIR:-/tmp}/mpitrain-budgets.XXXXXX")
# Each test's TIMEOUT from CTest's own description of the tests (name<TAB>seconds). That ctest call
# rewrites Testing/Temporary/LastTest.log (the run's whole output, which the README points to):
# it is kept aside and put back.
last=$build/Testing/Temporary/LastTest.log kept=
if [ -f "$last" ]; then kept=$(mktemp "${TMPDIR:-/tmp}/mpitrain-lasttest.XXXXXX") && cp -p "$last" "$kept"; fi
trap 'rm -f "$budgets"; [ -z "$kept" ] || mv -f "$kept" "$last"' EXIT
(cd "$build" && ctest --show-only=json-v1 2>/dev/null) | python3 -c '
import json, sys
try:
    doc = json.load(sys.stdin)
except ValueError:
    sys.exit(0)
for t in doc.get("tests", []):
    budget = next((p["value"] for p in t.get("properties", []) if p.get("name") == "TIMEOUT"), None)
    print("%s\t%s" % (t.get("name", "?"), budget if budget is not None else "-"))
' > "$budgets" 2>/dev/null || true
awk -v n="$n" -v budgets="$budgets" '
  BEGIN { FS = "\t"; while ((getline line < budgets) > 0) { split(line, f, "\t"); b[f[1]] = f[2] } FS = " " }
  /Test +#[0-9]+: / && / sec *$/ {
    name = ""; for (i = 1; i <= NF; ++i) if ($i ~ /^#[0-9]+:$/) { name = $(i + 1); break }
    secs = $(NF - 1); status = $0; sub(/^.*\.\.\.* */, "", status); sub(/ +[0-9.]+ sec *$/, "", status)
    if (name != "") { t[name] = secs + 0; st[name] = status; total += secs }
  }
  END {
    count = 0; for (k in t) order[++count] = k
    for (i = 2; i <= count; ++i) { k = order[i]; j = i - 1; while (j > 0 && t[order[j]] < t[k]) { order[j + 1] = order[j]; --j } order[j + 1] = k }
    if (count == 0) { print "slowest tests: none ran"; exit }
    printf "slowest tests (%d of %d, %.0f s of test time in all):\n", (count < n ? count : n), count, total
    printf "  %-28s %9s %8s %6s  %s\n", "test", "seconds", "budget", "used", "result"
    for (i = 1; i <= count && i <= n; ++i) {
      k = order[i]; bud = (k in b) ? b[k] : "-"
      used = (bud != "-" && bud + 0 > 0) ? sprintf("%5.0f%%", 100 * t[k] / bud) : "     -"
      printf "  %-28s %9.1f %8s %6s  %s\n", k, t[k], bud, used, st[k]
    }
  }' "$log"
