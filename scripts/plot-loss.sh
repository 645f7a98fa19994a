#!/usr/bin/env bash
# The loss curves of a run as a PNG: train loss (every log.every steps) and validation loss from
# its metrics.jsonl, drawn by gnuplot (Debian's gnuplot-nox).
# Usage: scripts/plot-loss.sh METRICS.jsonl OUT.png [TITLE]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 METRICS.jsonl OUT.png [TITLE]" >&2; exit 2; }
metrics=$1 out=$2 title=${3:-$1}
[ -r "$metrics" ] || { echo "$0: cannot read '$metrics'" >&2; exit 2; }
command -v gnuplot >/dev/null || { echo "$0: gnuplot is not installed (Debian: gnuplot-nox)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# "step": S ... "loss": L  /  "step": S, "val_loss": V  -> two columns each. A resumed run appends
# to metrics.jsonl: the last value logged for a step wins.
sed -n 's/.*"step": \([0-9]*\), "loss": \([-0-9.e+]*\).*/\1 \2/p' "$metrics" | awk '{v[$1]=$2} END {for (s in v) print s, v[s]}' | sort -n > "$tmp/train"
sed -n 's/.*"step": \([0-9]*\), "val_loss": \([-0-9.e+]*\).*/\1 \2/p' "$metrics" | awk '{v[$1]=$2} END {for (s in v) print s, v[s]}' | sort -n > "$tmp/val"
[ -s "$tmp/train" ] || { echo "$0: no train losses in '$metrics'" >&2; exit 2; }
plots="'$tmp/train' using 1:2 with lines lw 2 title 'train loss'"
[ -s "$tmp/val" ] && plots+=", '$tmp/val' using 1:2 with linespoints lw 2 pt 7 title 'val loss'"
gnuplot <<GP
set terminal pngcairo size 900,540 font ",11"
set output '$out'
set title "${title//\"/}" noenhanced
set xlabel 'step'
set ylabel 'loss (nats per token)'
set grid
set key top right
plot $plots
GP
echo "$out"
