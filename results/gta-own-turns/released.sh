#!/usr/bin/env bash
# issue 68: the released GTA turns' features for the same checkpoint and dtype as the own turns
# (bfloat16), for the side-by-side and the transfer of `lab.ownturns detect --released`. The
# same draw as lab/contamination.md (30 of 176 training episodes, seed 0; the test splits whole);
# each contaminated file reuses its clean twin's identical records. Resumable: run it again.
set -e
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
M=${PAIR_QWEN05B:-$HOME/.cache/pair-models/qwen2.5-0.5b}
R=${PAIR_SHARED:-../shared}/data/pair-release/gta
F=${FEATS:-feats/gta-bf16}
x() { python -m lab.study extract --model $M --dtype bfloat16 "$@"; }
x --data $R/matched_clean_test.json --out $F/matched_clean_test.safetensors
x --data $R/matched_clean_train.json --out $F/matched_clean_train.safetensors \
  --episodes 30 --episode-seed 0
x --data $R/matched_contaminated_test.json --out $F/matched_contaminated_test.safetensors \
  --reuse $F/matched_clean_test.safetensors
x --data $R/matched_contaminated_train.json --out $F/matched_contaminated_train.safetensors \
  --episodes 30 --episode-seed 0 --reuse $F/matched_clean_train.safetensors
