"""Speed and memory of model.py's internal signals, on any checkpoint in bfloat16 (targets set for
the real 0.5B; the built-in policy, data/shop-policy, runs in under a minute).

One 2,048-token sequence with a 256-token span (the span = its last 256 tokens):
  1. forward with attention statistics / plain forward: time and peak memory;
  2. our forward with statistics and hidden states vs transformers eager with
     output_attentions=True, output_hidden_states=True: time and peak memory;
  3. generation, sampled at T = 1, exactly n new tokens a row: --batch rows x --new-tokens, and
     GRPO's training shape on the built-in policy, 32 rows x 96 tokens: with statistics /
     without, and our tokens per second vs transformers' generate() (its sdpa attention);
     for information, our compiled decoding step against the eager one (model.compiled_step);
  4. the PAIR reward of one generated turn (its features read from the trace, both stages, the
     temperature clip and the momentum), with a PAIR fitted on this model's feature shapes,
     against the paper's ~0.2 ms per step (Table complexity).
Each ratio is printed next to its target.

Measurement: time is the best of --repeats runs (the CPU is shared, so the minimum is the least
noisy estimate). Peak memory is the highest number of bytes held by tensors allocated during the
call, read from the "Total Allocated" counter of PyTorch's CPU allocator as torch.profiler reports
it (profile_memory=True), in a separate run: weights already resident are excluded and whatever
the call returns (hidden states, attention matrices) is included. No forward computes full logits:
ours runs with logits=False and transformers with logits_to_keep=1, so the comparison is about
what the internal signals cost, not about a 2,048 x 151,936 logits matrix.

transformers is imported here only: it is the library we measure against, not a dependency.
"""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import common
import model as M
import pair
import probes
import weights

DEFAULT_MODEL = Path.home() / ".cache" / "pair-models" / "qwen2.5-0.5b"
PROMPTS = ["Explain how a hash map handles collisions.",
           "Write a short story about a lighthouse keeper.",
           "List the planets of the solar system with one fact each.",
           "What are the trade-offs between TCP and UDP?"]


def best_times(runs: dict, repeats: int) -> dict[str, float]:
    """Best wall time of each run; runs are interleaved so that a burst of load from other
    processes on the shared CPU hits all of them alike."""
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            t = time.perf_counter()
            with torch.no_grad():
                fn()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def peak_bytes(fn) -> int:
    """Peak bytes held by tensors allocated during fn (PyTorch CPU allocator, via profiler)."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    return max(totals, default=0)


def generation_bench(model, tok, hf, batch: int, n: int, args, vs_hf: float):
    """Ours with and without statistics against transformers' generate(), `batch` rows of n
    sampled tokens each; returns our generation function (stats -> traces)."""
    prompts = [tok.render([{"role": "user", "content": p}], add_generation_prompt=True)[0]
               for p in (PROMPTS * batch)[:batch]]
    capacity = max(map(len, prompts)) + n

    def ours(stats):
        return M.generate(model, model.new_cache(batch, capacity), prompts, n, temperature=1.0,
                          stop_ids=[], stats=stats, generator=torch.Generator().manual_seed(0))

    width = max(map(len, prompts))
    padded = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def theirs():
        return hf.generate(padded, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           pad_token_id=tok.pad_id)

    def eager(stats):                                 # the step not compiled (PAIR_COMPILE=0)
        compile_on, M.COMPILE = M.COMPILE, False
        try:
            return ours(stats)
        finally:
            M.COMPILE = compile_on

    for warm_up in (lambda: ours(True), lambda: ours(False), lambda: eager(True), theirs):
        warm_up()                                     # compiled graphs and kernels included
    tg = best_times({"ours, stats": lambda: ours(True), "ours, no stats": lambda: ours(False),
                     "eager, stats": lambda: eager(True), "transformers": theirs},
                    args.gen_repeats)
    print(f"\ngeneration, batch {batch}, {n} new tokens per row ({args.dtype}, sampled):")
    for k, v in tg.items():
        print(f"  {k:<14} {v:7.2f} s   {batch * n / v:7.1f} tokens/s")
    report(f"batch {batch}: (info) compiled step / eager step: tokens/s",
           tg["eager, stats"] / tg["ours, stats"], "-", True)
    ratio = tg["ours, stats"] / tg["ours, no stats"]
    report(f"batch {batch}: generation with stats / without: time", ratio, "<=1.15",
           ratio <= 1.15)
    speed = tg["transformers"] / tg["ours, stats"]
    report(f"batch {batch}: tokens/s ours (with stats) / transformers generate()", speed,
           f">={vs_hf:g}", speed >= vs_hf)
    return ours


def report(name: str, value: float, target: str, ok: bool):
    print(f"  {name:<58} {value:8.2f}x   target {target:<7} {'ok' if ok else 'MISSED'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory, e.g. "
                    "data/shop-policy (default: a Qwen2.5-0.5B checkpoint at this path)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens in the forward benchmark")
    ap.add_argument("--span", type=int, default=256, help="span length (the last tokens)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    ap.add_argument("--batch", type=int, default=4,
                    help="rows generated at once (the second generation benchmark is 32 x 96)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per forward (best kept)")
    ap.add_argument("--gen-repeats", type=int, default=1,
                    help="timed runs per generation benchmark (best kept)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice). On a CPU shared with other "
                    "busy processes, 1 thread gives far steadier ratios: no thread waits at a "
                    "barrier for a sibling that the OS has descheduled")
    ap.add_argument("--skip-generation", action="store_true", help="only the forward benchmarks")
    ap.add_argument("--dtype", choices=tuple(M.DTYPES), default="bfloat16",
                    help="weight dtype of both models (default: bfloat16)")
    args = ap.parse_args(argv)
    # no timings is min() of nothing
    common.check_ranges(ap, args, {**dict.fromkeys(("new_tokens", "batch", "repeats",
                                                    "gen_repeats"), common.at_least(1)),
                                   "threads": common.THREADS})
    if not 0 < args.span <= args.seq_len:
        ap.error("--span must be in 1..--seq-len")
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (a checkpoint directory is needed, "
                 "e.g. data/shop-policy)")
    try:
        import transformers
    except ImportError:
        raise SystemExit("bench.py compares against transformers: pip install -r "
                         "requirements-dev.txt") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    try:
        model, tok = M.load_model(args.model, dtype=M.DTYPES[args.dtype])
    except (weights.CheckpointError, OSError, ValueError) as e:     # a damaged checkpoint
        raise SystemExit(f"--model {args.model}: {e}") from None
    n_params = sum(p.numel() for p in model.parameters())
    if n_params < 100_000_000:
        print(f"{args.model} has {n_params:,} parameters: the targets are set for the 0.5B, and a "
              "forward this short is dominated by fixed costs (read the ratios as a smoke test)")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=M.DTYPES[args.dtype], attn_implementation="eager").eval()

    # ---- forward: one sequence of the tokenizer's ordinary tokens, span = its last tokens
    g = torch.Generator().manual_seed(0)
    special = set(tok.tok.get_added_tokens_decoder())
    known = min(model.config.vocab_size, tok.tok.get_vocab_size())
    ordinary = torch.tensor([i for i in range(known) if i not in special])
    ids = ordinary[torch.randint(0, len(ordinary), (1, args.seq_len), generator=g)]
    span = (args.seq_len - args.span, args.seq_len)
    runs = {
        "plain": lambda: model(ids, logits=False),
        "stats": lambda: model(ids, span=span, logits=False),
        "stats+hidden": lambda: model(ids, span=span, output_hidden_states=True, logits=False),
        "hf eager": lambda: hf(ids, output_attentions=True, output_hidden_states=True,
                               logits_to_keep=1),
    }
    with torch.no_grad():
        model(ids[:, :128], logits=False)           # warm up the kernels
        hf(ids[:, :128], logits_to_keep=1)
    t = best_times(runs, args.repeats)
    mem = {k: peak_bytes(fn) for k, fn in runs.items()}
    print(f"\n{args.model}: forward, {args.seq_len} tokens, span of {args.span} ({args.dtype}):")
    for k in runs:
        print(f"  {k:<14} {t[k]:7.2f} s   peak {mem[k] / 2**20:8.1f} MiB")
    report("forward with stats / plain: time", t["stats"] / t["plain"], "<=1.15",
           t["stats"] / t["plain"] <= 1.15)
    report("forward with stats / plain: peak memory", mem["stats"] / mem["plain"], "<=1.10",
           mem["stats"] / mem["plain"] <= 1.10)
    report("(info) stats + hidden states / plain: time", t["stats+hidden"] / t["plain"], "-",
           True)
    report("(info) stats + hidden states / plain: peak memory",
           mem["stats+hidden"] / mem["plain"], "-", True)
    report("transformers eager / ours (stats + hidden): time", t["hf eager"] / t["stats+hidden"],
           ">=3", t["hf eager"] / t["stats+hidden"] >= 3)
    report("transformers eager / ours (stats + hidden): peak memory",
           mem["hf eager"] / mem["stats+hidden"], ">=10",
           mem["hf eager"] / mem["stats+hidden"] >= 10)
    if args.skip_generation:
        return

    # ---- generation: batches of chat prompts, sampled at T = 1, exactly n new tokens (no stop);
    # the targets of each batch size: tokens/s against transformers' generate(), and the cost
    # of the statistics
    hf.config._attn_implementation = "sdpa"           # transformers' own fastest path on a CPU
    for batch, n, vs_hf in ((args.batch, args.new_tokens, 1.5), (32, 96, 4.0)):
        ours = generation_bench(model, tok, hf, batch, n, args, vs_hf)
    trace = ours(True)[0]

    # ---- the PAIR reward of one turn, from a real trace of this model
    raw = probes.raw_features(trace, coe=False)
    g = torch.Generator().manual_seed(0)
    corpus = {k: v[None] + 0.1 * torch.randn((64, *v.shape), generator=g) for k, v in raw.items()}
    y = torch.arange(64) % 2                        # any labels: only the shapes matter here
    fitted = pair.fit_pair(corpus, y)

    def reward_of_one_turn():
        one = {k: v[None] for k, v in probes.raw_features(trace, coe=False).items()}
        return pair.trajectory_rewards(fitted.scores(one)[1].tolist())
    reward_of_one_turn()
    rounds = []
    for _ in range(20):                               # this thread's CPU time, least of 20 rounds
        t0 = time.thread_time()
        for _ in range(100):
            reward_of_one_turn()
        rounds.append((time.thread_time() - t0) / 100)
    per_turn = min(rounds)
    print(f"\nPAIR reward of one turn: {1e6 * per_turn:.1f} us of CPU time")
    report("paper's ~0.2 ms per step / ours per turn", 2e-4 / per_turn, ">=1", per_turn <= 2e-4)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
