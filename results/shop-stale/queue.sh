#!/usr/bin/env bash
# The order the shop-stale runs were trained in this session (each lab.compare resumes and skips
# finished runs): the ceiling's seeds 43 and 44, then PAIR and the confidence reward through
# outcome-turn for seeds 42 and 43. FLAGS are the ceiling's, the same for every run.
cd "$(dirname "$0")/../.."
FLAGS="--env shop-stale --temperature 1.0 --eval-samples 4 --eval-episodes 300 --val-episodes 100 --save-every 10"
earlier() {
    while pgrep -f "lab.train --reward .* --seed 43 --out results/shop-stale" >/dev/null; do sleep 20; done
    python -m lab.compare --out results/shop-stale --jobs 2 --threads 1 \
        --rewards outcome labels:advantage=outcome-turn --seeds 43 44 -- $FLAGS \
        >> results/shop-stale/compare-s43-44.log 2>&1
    python -m lab.compare --out results/shop-stale --jobs 2 --threads 1 \
        --rewards pair:advantage=outcome-turn confidence:advantage=outcome-turn --seeds 42 43 -- $FLAGS \
        >> results/shop-stale/compare-pair-confidence.log 2>&1
    # Started by hand beside the seed-43 runs above, once the own-turn extraction was stopped:
    # PAIR's third seed, then (beside the tests) the confidence reward's:
    # python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
    #     --rewards pair:advantage=outcome-turn --seeds 44 -- $FLAGS >> results/shop-stale/compare-pair-s44.log 2>&1
    # python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
    #     --rewards confidence:advantage=outcome-turn --seeds 44 -- $FLAGS >> results/shop-stale/compare-confidence-s44.log 2>&1
    # Seed 45 of the four rewards, one at a time, started at the end of the session (resumable):
    # python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 --rewards \
    #     pair:advantage=outcome-turn outcome labels:advantage=outcome-turn \
    #     confidence:advantage=outcome-turn --seeds 45 -- $FLAGS >> results/shop-stale/compare-s45.log 2>&1
}
# Session of 2026-12-06 10:55: two queues at once. Queue A: PAIR through outcome-turn with its
# head refitted every 5 steps on the policy's own turns (the stale-probe fix), seeds 43, 42, 44, then
# seed 46 of PAIR and the outcome; queue B: the rest of seed 45, then seed 46 of labels and
# confidence.
queue_a() {
    python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
        --rewards pair:advantage=outcome-turn,probe-retrain-every=5 --seeds 43 42 44 -- $FLAGS \
        >> results/shop-stale/compare-refit.log 2>&1
    python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
        --rewards pair:advantage=outcome-turn outcome --seeds 46 -- $FLAGS \
        >> results/shop-stale/compare-s46a.log 2>&1
}
queue_b() {
    python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
        --rewards outcome labels:advantage=outcome-turn confidence:advantage=outcome-turn \
        --seeds 45 -- $FLAGS >> results/shop-stale/compare-s45.log 2>&1
    python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
        --rewards labels:advantage=outcome-turn confidence:advantage=outcome-turn --seeds 46 \
        -- $FLAGS >> results/shop-stale/compare-s46b.log 2>&1
}
# Then, where queue b ended: the refit row's seeds 45 and 46 (the row at five seeds, beside
# PAIR's), then the rows of three seeds:
# PAIR, multi_attn, labels and Lookback Lens through process (the default advantage), seed-major.
queue_c() {
    python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
        --rewards pair:advantage=outcome-turn,probe-retrain-every=5 --seeds 45 46 -- $FLAGS \
        >> results/shop-stale/compare-refit.log 2>&1
    python -m lab.compare --out results/shop-stale --jobs 1 --threads 1 \
        --rewards pair multi_attn labels lookback --seeds 42 43 44 -- $FLAGS \
        >> results/shop-stale/compare-process.log 2>&1
}
# Session of 2026-12-06 13:37: the rows of three seeds again, two runs at a time beside the
# own-turn extraction (PAIR seed 42 resumes from its checkpoint 10).
queue_d() {
    python -m lab.compare --out results/shop-stale --jobs 2 --threads 1 \
        --rewards pair multi_attn labels lookback --seeds 42 43 44 -- $FLAGS \
        >> results/shop-stale/compare-process.log 2>&1
}
# bash results/shop-stale/queue.sh a (or b, c, d) runs one queue; no argument, the earlier order.
case "${1:-}" in a) queue_a ;; b) queue_b ;; c) queue_c ;; d) queue_d ;; *) earlier ;; esac
