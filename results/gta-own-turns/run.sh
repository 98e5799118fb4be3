#!/usr/bin/env bash
# issue 68: the 0.5B's own GTA turns, the train split then the test split, one thread each in turn.
# Resumable: run this file again and each extraction continues after its last shard.
set -e
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
M=${PAIR_QWEN05B:-$HOME/.cache/pair-models/qwen2.5-0.5b}
D=${PAIR_SHARED:-../shared}/data/pair-release
OUT=results/gta-own-turns
python -m lab.ownturns extract --model $M --data-dir $D --split train --out $OUT/train \
  --episodes 65 --episode-seed 0 --k 12 --max-new-tokens 128 --dtype bfloat16 --threads 1
python -m lab.ownturns extract --model $M --data-dir $D --split test --out $OUT/test \
  --k 12 --max-new-tokens 128 --dtype bfloat16 --threads 1
# The train split's other 111 episodes (none of the 65 above), to reach the issue's counts:
python -m lab.ownturns extract --model $M --data-dir $D --split train --out $OUT/train-rest \
  --besides $OUT/train --k 12 --max-new-tokens 128 --dtype bfloat16 --threads 1
