"""Speed and memory of model.py where the training run spends them, on any device, against plain
forwards and `transformers`; every ratio is printed next to its target.

    python -m lab.bench --device cuda --shape qwen2.5-7b      # the paper's model, random weights
    python -m lab.bench --shape update-proxy --sections update --dtype float32     # its CPU proxy
    python -m lab.bench --model data/shop-policy --dtype float32 --threads 1      # a checkpoint

--shape builds random weights of a named real shape in memory (no download): qwen2.5-7b,
qwen2.5-0.5b, the built-in policies (shop-policy, shop-long-policy: their config.json),
update-proxy (width 1024, 8 layers, the real 152k vocabulary: what the 7B's update holds per
token, at a size a CPU can run) and tiny (width 64, 2 layers, the real vocabulary: lab/dryrun.py's
CPU run). --model reads a checkpoint directory instead. `transformers` gets the same weights (no
second copy) and is imported here only: it is what we measure against, not a dependency.

Each target is judged only where it was set: the forward's on widths of 896 and up (the 0.5B and
the 7B), generation's on a GPU, or on the CPU in float32 (the compiled step); elsewhere the ratio
is printed with "n/a" and the reason, not as MISSED.

Sections (--sections):
  forward     one sequence of --seq-lens tokens with a span of its last --span tokens: the forward
              with attention statistics / the plain forward, and ours with statistics and hidden
              states against transformers' eager forward with output_attentions and
              output_hidden_states (where its T x T attention maps fit the device);
  generation  --batch rows x --new-tokens sampled tokens at T = 1, and GRPO's shape of 32 x 96:
              with statistics / without, tokens per second against transformers' generate() (its
              sdpa attention, its default cache), and on a GPU one decoding step at --batch rows
              against the time it takes to read the weights once (the floor of a step);
  update      the GRPO update's model.token_logprobs forward and backward, LoRA r 16 (dropout
              0.05) on every projection, one row of each of --update-tokens tokens: peak memory
              held by the call, less the adapter's gradients, per 1,000 tokens; and the paper's
              GRPO step (G = 4 rollouts of 12,288 tokens in micro-batches of at most 16,384)
              beside the weights;
  reward      the PAIR reward of one generated turn, against the paper's ~0.2 ms per step.

Time is the best of --repeats runs (on a shared CPU the minimum is the least noisy estimate). Peak
memory is the most bytes held by tensors allocated during the call: on a GPU its allocator's
peak, on the CPU the "Total Allocated" counter of PyTorch's CPU allocator as torch.profiler reports
it; weights already resident are excluded, whatever the call returns is included. No forward
computes full logits (ours: model.trunk and lab/probing/traces.py, transformers logits_to_keep=1).
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import grpo
import model as M
import pair
import probes
from lab.probing import traces

ROOT = Path(__file__).resolve().parents[1]     # the repository
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
             rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1e6)
SHAPES = {
    "qwen2.5-7b": dict(QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(QWEN2, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "update-proxy": dict(QWEN2, vocab_size=152064, hidden_size=1024, intermediate_size=5504,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                         tie_word_embeddings=False),
    # the real vocabulary and tokenizer round a toy trunk: lab/dryrun.py's CPU run of the pipeline
    "tiny": dict(QWEN2, vocab_size=151936, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=True),
}
POLICIES = ("shop-policy", "shop-long-policy")
SECTIONS = ("forward", "generation", "update", "reward")
GiB = 2 ** 30
# The forward's targets were set on real widths (the 0.5B's 896 and up); at the built-in policy's
# 64 the statistics' fixed cost per span row outweighs a forward that costs next to nothing.
REAL_WIDTH = 896


def shape_config(name: str) -> dict:
    if name in POLICIES:
        return json.loads((ROOT / "data" / name / "config.json").read_text())
    return dict(SHAPES[name])


# ----------------------------------------------------------------------------------------------
# Measuring


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_times(runs: dict, repeats: int, device) -> dict[str, float]:
    """Best wall time of each run; runs are interleaved so that a burst of load from other
    processes hits all of them alike."""
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            sync(device)
            t = time.perf_counter()
            with torch.no_grad():
                fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def peak_bytes(fn, device, grad=False) -> int:
    """Peak bytes held by tensors allocated during fn (resident tensors excluded)."""
    with torch.set_grad_enabled(grad):
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            result = fn()
            sync(device)
            del result
            return torch.cuda.max_memory_allocated(device) - base
        from torch.profiler import ProfilerActivity, profile
        with without_profiler_lines(), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
        del result
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    return max(totals, default=0)


def report(name: str, value: float, target: str, ok: bool | None, not_here: str = ""):
    """One ratio against its target; `not_here` says why the target does not apply to this run
    (it was set for another device, dtype or size): the ratio is shown, not judged."""
    if not_here:
        verdict = f"n/a ({not_here})"
    elif ok is None:
        verdict = ""
    elif ok:
        verdict = "ok"
    else:
        verdict = "MISSED"
    print(f"  {name:<66} {value:8.2f}x  target {target:<7} {verdict}", flush=True)


def count_text(n: int) -> str:
    """A parameter count as people write it: 7.62B, 494.03M, 0.29M."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.2f}M"


@contextlib.contextmanager
def without_profiler_lines():
    """torch.profiler's C++ side writes a "USDT: ... profiler_start" and a "profiler_stop" line to
    the process's stderr (file descriptor 2, past sys.stderr) around every profile(): they go to a
    temporary file, and every other line written there meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if "profiler_start" not in line and "profiler_stop" not in line:
                    sys.stderr.write(line)
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# The models: ours, and transformers' on the same tensors


def build(args, device, dtype):
    """(our model, transformers' model or None, shape name) for --model or --shape."""
    try:
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        transformers = None
    needs_hf = set(args.sections) & {"forward", "generation"}
    if needs_hf and transformers is None:
        raise SystemExit("bench.py compares against transformers: pip install -r "
                         "requirements-dev.txt (or --sections update reward)")
    if args.model:
        try:
            model, _ = M.load_model(args.model, dtype=dtype, device=device)
        except (M.CheckpointError, OSError, ValueError) as e:     # a damaged checkpoint
            raise SystemExit(f"--model {args.model}: {e}") from None
        hf = None
        if needs_hf:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                args.model, dtype=dtype, attn_implementation="eager").to(device).eval()
        return model, hf, args.model
    cfg = shape_config(args.shape)
    config = M.Config.from_dict(cfg)
    with torch.device("meta"):
        model = M.Transformer(config)
    if needs_hf:            # transformers initialises the weights; ours adopts its tensors
        hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                         if not k.startswith("pair_")})
        hf_config._attn_implementation = "eager"
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        finally:
            torch.set_default_dtype(default)
        hf = hf.to(device, dtype).eval()
        state = hf.state_dict()
    else:
        hf = None
        state = dict(random_weights(model, dtype, device))
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False).eval()
    return model, hf, f"{args.shape} (random weights)"


def random_weights(model, dtype, device, seed=0):
    """(name, tensor) for every entry of model.state_dict(), in its order, one at a time: the
    norms' weights 1, every other tensor N(0, 0.02) from one generator on `device`."""
    g = torch.Generator(device).manual_seed(seed)
    for name, p in model.state_dict().items():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            yield name, t.fill_(1.0)
        else:
            yield name, t.normal_(0.0, 0.02, generator=g)


def random_ids(model, n: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(model.config.vocab_size, 150000), (rows, n), generator=g)


# ----------------------------------------------------------------------------------------------
# The sections


def forward_section(model, hf, args, device):
    gpu = device.type == "cuda"
    for T in args.seq_lens:
        ids = random_ids(model, T, 1, seed=T).to(device)
        span = (T - args.span, T)
        runs = {
            "plain": lambda: model.trunk(ids),
            "stats": lambda: traces.forward(model, ids, span),
            "stats+hidden": lambda: traces.forward(model, ids, span, output_hidden_states=True),
        }
        c = model.config
        maps = c.num_hidden_layers * c.num_attention_heads * T * T * ids.new_zeros(
            0, dtype=model.lm_head.weight.dtype).element_size()
        free = torch.cuda.mem_get_info(device)[0] if gpu else 16 * GiB
        if hf is not None and 2 * maps < free:
            runs["hf eager"] = lambda: hf(ids, output_attentions=True,
                                          output_hidden_states=True, logits_to_keep=1)
        with torch.no_grad():
            for fn in runs.values():
                fn()                                          # warm up the kernels
        t = best_times(runs, args.repeats, device)
        mem = {k: peak_bytes(fn, device) for k, fn in runs.items()}
        print(f"\nforward, {T} tokens, span of {args.span}:", flush=True)
        for k in runs:
            print(f"  {k:<14} {1e3 * t[k]:9.1f} ms   peak {mem[k] / 2**20:9.1f} MiB", flush=True)
        toy = ""
        if model.config.hidden_size < REAL_WIDTH:
            toy = f"set for widths of {REAL_WIDTH} and up"
        ratio = t["stats"] / t["plain"]
        report(f"{T} tokens: forward with stats / plain: time", ratio, "<=1.15", ratio <= 1.15,
               toy)
        ratio = mem["stats"] / mem["plain"]
        report(f"{T} tokens: forward with stats / plain: peak memory", ratio, "<=1.10",
               ratio <= 1.10, toy)
        report(f"{T} tokens: (info) stats + hidden states / plain: time",
               t["stats+hidden"] / t["plain"], "-", None)
        if "hf eager" in runs:
            target = 2 if gpu else 3
            ratio = t["hf eager"] / t["stats+hidden"]
            report(f"{T} tokens: transformers eager / ours (stats + hidden): time", ratio,
                   f">={target}", ratio >= target)
            ratio = mem["hf eager"] / mem["stats+hidden"]
            report(f"{T} tokens: transformers eager / ours (stats + hidden): peak memory", ratio,
                   ">=10", ratio >= 10)
        else:
            print(f"  (transformers' eager attention maps, {maps / GiB:.0f} GiB, do not fit: "
                  "not run)", flush=True)


def generation_section(model, hf, args, device) -> list:
    gpu = device.type == "cuda"
    # the CPU's targets were set on the compiled float32 step (lab/FINDINGS.md, Decoding on the
    # CPU); another dtype decodes eagerly
    not_here = ""
    if not gpu and args.dtype != "float32":
        not_here = "the CPU's are set for --dtype float32"
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation("sdpa")                 # transformers' own fastest path
    else:
        hf.config._attn_implementation = "sdpa"
    traces = []
    for batch, n, vs_hf in ((args.batch, args.new_tokens, 2.0 if gpu else 1.5),
                            (32, 96, 2.0 if gpu else 4.0)):
        prompts = random_ids(model, args.prompt_len, batch, seed=batch)

        def ours(stats):
            cache = model.new_cache(batch, args.prompt_len + n)
            gen = torch.Generator(device).manual_seed(0)
            return probes.generate(model, cache, prompts.tolist(), n, temperature=1.0, stop_ids=[],
                                   stats=stats, generator=gen)

        def theirs():
            return hf.generate(prompts.to(device), attention_mask=torch.ones_like(prompts)
                               .to(device), max_new_tokens=n, min_new_tokens=n, do_sample=True,
                               temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)

        runs = {"ours, stats": lambda: ours(True), "ours, no stats": lambda: ours(False),
                "transformers": theirs}
        if args.stats_only:
            del runs["ours, no stats"]
        for name, fn in runs.items():
            sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                fn()                                      # compiles, captures, warms up
            sync(device)
            print(f"  (first call, {name}, batch {batch}: {time.perf_counter() - t0:.1f} s)",
                  flush=True)
        tg = best_times(runs, args.gen_repeats, device)
        print(f"\ngeneration, batch {batch}, {n} new tokens per row (sampled):", flush=True)
        for k, v in tg.items():
            print(f"  {k:<14} {v:7.2f} s   {batch * n / v:8.1f} tokens/s", flush=True)
        if "ours, no stats" in tg:
            ratio = tg["ours, stats"] / tg["ours, no stats"]
            target = 1.10 if gpu else 1.15
            report(f"batch {batch}: generation with stats / without: time", ratio,
                   f"<={target:g}", ratio <= target, not_here)
        speed = tg["transformers"] / tg["ours, stats"]
        report(f"batch {batch}: tokens/s ours (with stats) / transformers generate()", speed,
               f">={vs_hf:g}", speed >= vs_hf, not_here)
        traces = ours(True)
        if gpu and batch == args.batch:
            step_section(model, args, device)
    if gpu:
        skips = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
        print(f"  (CUDA graphs skipped {skips} times; TORCH_LOGS=perf_hints says why)", flush=True)
    return traces


def step_section(model, args, device):
    """One decoding step with statistics at --batch rows against reading the weights once."""
    B = args.batch
    cache = model.new_cache(B, args.prompt_len)
    with torch.no_grad():
        probes.generate(model, cache, random_ids(model, args.prompt_len, B, 1).tolist(), 0)
        probes.reserve_slots(cache, args.new_tokens + 1)         # as a generation on a GPU does
        tokens = torch.zeros(B, dtype=torch.long, device=device)
        fed = torch.ones(B, dtype=torch.bool, device=device)
        span = cache[0].lengths.clone()
        probes.decode_one_token(model, cache, tokens, fed, span)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.new_tokens):
            probes.decode_one_token(model, cache, tokens, fed, span)
        sync(device)
    step = (time.perf_counter() - t0) / args.new_tokens
    x = torch.empty(GiB, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    bandwidth = 2 * GiB * 10 / (time.perf_counter() - t0)        # bytes read and written
    del x, y
    read = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "embed_tokens" not in n or model.config.tie_word_embeddings)
    floor = read / bandwidth
    print(f"\ndecoding step, batch {B}, with statistics: {1e3 * step:.2f} ms; the weights "
          f"({read / GiB:.1f} GiB) read once at {bandwidth / 1e12:.2f} TB/s (a copy): "
          f"{1e3 * floor:.2f} ms", flush=True)
    report(f"batch {B}: decoding step / weight-read floor", step / floor, "<=2.5",
           step / floor <= 2.5)


def update_section(model, args, device):
    lora = M.apply_lora(model, r=16, alpha=32, dropout=0.05)
    lora.train()
    adapter = sum(p.numel() * p.element_size() for _, p in M.lora_parameters(model))
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nupdate: token_logprobs forward + backward, LoRA r 16 on every projection "
          f"({adapter / 2**20:.0f} MiB of adapter), one row:", flush=True)

    def step(T, plain=False):
        ids = random_ids(model, T, 1, seed=T).to(device)
        mask = torch.ones_like(ids, dtype=torch.bool)
        if plain:       # the straightforward way: every activation kept, the logits whole
            h = model.trunk(ids)
            logits = model.lm_head(h[:, :-1][mask[:, 1:]]).float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[:, 1:][mask[:, 1:]][:, None])
        else:
            logp = M.token_logprobs(model, ids, mask)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    per_k = {}
    for T in args.update_tokens:
        for plain in (False, True) if T == min(args.update_tokens) else (False,):
            try:
                t0 = time.perf_counter()
                peak = peak_bytes(lambda: step(T, plain), device, grad=True) - adapter
                seconds = time.perf_counter() - t0
            except torch.OutOfMemoryError:
                print(f"  {T:>6} tokens{' (plain)' if plain else ''}: out of memory", flush=True)
                continue
            finally:
                model.zero_grad(set_to_none=True)
            name = "plain: all activations, whole logits" if plain else "checkpointed, chunked"
            print(f"  {T:>6} tokens, {name:<37} peak {peak / GiB:7.2f} GiB   "
                  f"{peak / GiB / T * 1000:5.2f} GiB per 1,000 tokens   {seconds:6.2f} s",
                  flush=True)
            if not plain:
                per_k[T] = peak / GiB / T * 1000
    if per_k:
        T = max(per_k)
        report(f"update at {T:,} tokens: activations, GiB per 1,000 tokens", per_k[T],
               f"<={args.update_target:g}", per_k[T] <= args.update_target)
        if len(per_k) > 1:
            a, b = sorted(per_k)[-2:]
            slope = (per_k[b] * b - per_k[a] * a) / (b - a)
            report(f"(info) each further 1,000 tokens from {a:,} to {b:,}: GiB", slope, "-",
                   None)
        total = per_k[T] * T / 1000 + weights_bytes / GiB
        print(f"  a rollout of {T:,} tokens in its own micro-batch (the paper's step: 4 such, "
              f"--micro-batch-tokens 16384 takes one at a time): {per_k[T] * T / 1000:.1f} GiB "
              f"beside {weights_bytes / GiB:.1f} GiB of weights and adapter = {total:.1f} GiB",
              flush=True)


def reward_section(model, traces):
    trace = next((t for t in traces if t is not None and t.attn_stats), None)
    if trace is None:
        with torch.no_grad():
            cache = model.new_cache(1, 64)
            trace = probes.generate(model, cache, random_ids(model, 16, 1, 0).tolist(), 16,
                                    stop_ids=[])[0]
    raw = probes.raw_features(trace)
    g = torch.Generator().manual_seed(0)
    corpus = {k: v[None] + 0.1 * torch.randn((64, *v.shape), generator=g) for k, v in raw.items()}
    fitted = pair.fit_pair(corpus, torch.arange(64) % 2)     # labels: only the shapes matter

    def reward_of_one_turn():
        one = {k: v[None] for k, v in probes.raw_features(trace).items()}
        return pair.trajectory_rewards(fitted.scores(one)[1].tolist())
    reward_of_one_turn()
    rounds = []
    for _ in range(20):                               # this thread's CPU time, least of 20 rounds
        t0 = time.thread_time()
        for _ in range(100):
            reward_of_one_turn()
        rounds.append((time.thread_time() - t0) / 100)
    per_turn = min(rounds)
    print(f"\nPAIR reward of one turn: {1e6 * per_turn:.1f} us of CPU time", flush=True)
    report("paper's ~0.2 ms per step / ours per turn", 2e-4 / per_turn, ">=1", per_turn <= 2e-4)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.bench",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--shape", choices=(*SHAPES, *POLICIES),
                      help="random weights of this real shape, built in memory (default: "
                      "qwen2.5-0.5b)")
    what.add_argument("--model", help="a checkpoint directory instead, e.g. data/shop-policy")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--dtype", choices=tuple(M.DTYPES), default="bfloat16",
                    help="weight dtype of both models (default: bfloat16)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to measure (default: all)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None,
                    help="forward lengths (default: 2048 4096 8192 on a GPU, 2048 on the CPU)")
    ap.add_argument("--span", type=int, default=256, help="span length (the last tokens)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    ap.add_argument("--batch", type=int, default=4,
                    help="rows generated at once (the second generation benchmark is 32 x 96)")
    ap.add_argument("--update-tokens", type=int, nargs="+", default=None,
                    help="row lengths of the update (default: 1024 4096 12288 on a GPU, 1024)")
    ap.add_argument("--update-target", type=float, default=None,
                    help="GiB per 1,000 tokens (default: 0.6 on a GPU, the 7B; 0.5 on the CPU, "
                    "the proxy)")
    ap.add_argument("--stats-only", action="store_true",
                    help="generation with statistics only (no run, and no compile, without)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per forward (best kept)")
    ap.add_argument("--gen-repeats", type=int, default=1,
                    help="timed runs per generation benchmark (best kept)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice). On a CPU shared with other "
                    "busy processes, 1 thread gives far steadier ratios")
    args = ap.parse_args(argv)
    grpo.check_ranges(ap, args, {**dict.fromkeys(("new_tokens", "batch", "repeats",
                                                  "gen_repeats", "prompt_len"),
                                                 grpo.at_least(1)),
                                 "threads": grpo.THREADS})
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    gpu = device.type == "cuda"
    args.seq_lens = args.seq_lens or ([2048, 4096, 8192] if gpu else [2048])
    args.update_tokens = args.update_tokens or ([1024, 4096, 12288] if gpu else [1024])
    args.update_target = args.update_target or (0.6 if gpu else 0.5)
    if not 0 < args.span <= min(args.seq_lens) or min(args.seq_lens + args.update_tokens) < 2:
        ap.error("--span must be in 1..the shortest --seq-lens, and every length >= 2")
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (a checkpoint directory is needed, "
                 "e.g. data/shop-policy)")
    if not args.model and not args.shape:
        args.shape = "qwen2.5-0.5b"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = M.DTYPES[args.dtype]

    where = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    t0 = time.perf_counter()
    model, hf, name = build(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {count_text(n_params)} parameters, {args.dtype}, built in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    traces = []
    if "forward" in args.sections:
        forward_section(model, hf, args, device)
    if "generation" in args.sections:
        traces = generation_section(model, hf, args, device)
    del hf
    if "update" in args.sections:
        update_section(model, args, device)
    if "reward" in args.sections:
        reward_section(model, traces)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}",
          flush=True)


if __name__ == "__main__":
    main()
