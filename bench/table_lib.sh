# shellcheck shell=bash
# Number formatting for the benchmark tables, and a run's tokens/s (sourced by bench/grad_comm.sh and
# bench/allreduce_algos.sh, bench/zero.sh, bench/activation_checkpointing.sh). "nan" or an empty value prints "-".
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }  # stdin, one number per line
num() { awk -v v="$1" -v f="${2:-%.0f}" 'BEGIN { if (v == "nan" || v == "") print "-"; else printf f, v }'; }  # value [printf format]
pct() { awk -v s="$1" 'BEGIN { if (s == "nan" || s == "") print "-"; else printf "%.1f%%", s * 100 }'; }  # a share as a percentage
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "nan" || b == "nan" || a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }'; }  # a / b
# A text corpus of at least BYTES bytes in FILE: 12-word sentences drawn from a dozen words with a
# fixed seed (bench/zero.sh, bench/activation_checkpointing.sh).
word_corpus() {  # BYTES FILE
  python3 - "$1" "$2" <<'PY'
import random, sys
random.seed(7)
words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "stitch", "in", "time"]
out, n = [], 0
while n < int(sys.argv[1]):
    line = " ".join(random.choice(words) for _ in range(12)) + ".\n"
    out.append(line)
    n += len(line)
open(sys.argv[2], "w").write("".join(out))
PY
}
# A training run's tokens per second: its tokens per step (from the start-up line in its console
# output) / the mean ms_per_step of its metrics.jsonl over every logged interval but the first
# (start-up); nan when it logged none (bench/diloco.sh, bench/pp_hosts.sh).
run_tokens_per_s() {  # console output file, metrics.jsonl
  local tokens ms
  tokens=$(sed -n 's/.* = \([0-9]*\) tokens per step.*/\1/p' "$1" | head -1)
  ms=$(grep '"ms_per_step"' "$2" | tail -n +2 | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/' | awk '{ s += $1; n++ } END { print n ? s / n : "nan" }')
  awk -v t="${tokens:-0}" -v ms="$ms" 'BEGIN { print (ms == "nan" || ms == 0) ? "nan" : t / ms * 1000 }'
}
