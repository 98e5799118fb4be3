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
# 24 more samples (seed 1, no greedy turn) where 12 were too few: the prefixes above holding a
# right turn whose samples do not hold both classes; detect pools them with those prefixes.
python -m lab.ownturns extract --model $M --data-dir $D --split train --out $OUT/train-raised \
  --raise-k $OUT/train $OUT/train-rest --seed 1 --k 24 --max-new-tokens 128 --dtype bfloat16 \
  --threads 1
python -m lab.ownturns extract --model $M --data-dir $D --split test --out $OUT/test-raised \
  --raise-k $OUT/test --seed 1 --k 24 --max-new-tokens 128 --dtype bfloat16 --threads 1
# and 24 more again (seed 2) where those still hold no right sample
python -m lab.ownturns extract --model $M --data-dir $D --split train --out $OUT/train-raised2 \
  --raise-k $OUT/train $OUT/train-rest $OUT/train-raised --seed 2 --k 24 --max-new-tokens 128 \
  --dtype bfloat16 --threads 1
python -m lab.ownturns extract --model $M --data-dir $D --split test --out $OUT/test-raised2 \
  --raise-k $OUT/test $OUT/test-raised --seed 2 --k 24 --max-new-tokens 128 --dtype bfloat16 \
  --threads 1
