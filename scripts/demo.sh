#!/usr/bin/env bash
# The demo: packs the `fortunes` package's English text into byte-level HDF5 shards and trains
# the tiny GPT on 2 MPI ranks on CPU for a few minutes (val loss falls far below the byte
# unigram entropy printed by pack), writes checkpoints, prints a generated sample and draws the
# loss curves into runs/demo/loss.png.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

./build/mpitrain pack /usr/share/games/fortunes -o data/fortunes/fortunes --doc-separator % \
  --val-fraction 0.05
rm -rf runs/demo
mpirun -np 2 --oversubscribe ./build/mpitrain configs/demo.yaml "$@"
# The loss curves as a picture (gnuplot-nox, installed by setup.sh)
echo "loss curves (train and val): $(scripts/plot-loss.sh runs/demo/metrics.jsonl runs/demo/loss.png 'mpitrain demo: tiny GPT on fortunes, 2 ranks')"
echo "TensorBoard: tensorboard --logdir runs/demo/tensorboard; per-rank logs: runs/demo/logs/"
