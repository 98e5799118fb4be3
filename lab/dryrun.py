"""The paper's whole pipeline as one dry run, on random weights of a real shape: whether it fits
on this device, and how long the real run will take.

    python -m lab.dryrun --device cuda --shape qwen2.5-7b     # the paper's model on this GPU
    python -m lab.dryrun --device cpu --shape tiny             # the same path on a CPU
    python -m lab.dryrun --shape qwen2.5-7b --card-memory 80   # does it fit an 80 GiB card?

On the CPU the tiny shape takes about 20 minutes at the paper's settings (a shared 2-core
machine, one thread: most of it the 16 evaluation rollouts and the updates of 4 x 8,192 tokens
with the 152k vocabulary), a minute at --group 2 --max-turns 2 --max-new-tokens 16 --max-len
1024 --eval-batch 2 (what tests/test_dryrun.py runs).

The paper's run is four commands (lab/README.md): download the released data, extract the
features of the matched records with Qwen2.5-7B, fit the probes, train with grpo.py. The dry run
runs the last three as their own command lines, each in its own process, on

  checkpoint  random weights of --shape (lab/bench.py's shapes), written once as a downloaded
              checkpoint is: config.json, model.safetensors (in shards of 4 GiB with their
              index past that size, as the Hub's 7B) and the Qwen2.5 tokenizer; every later
              phase reads it with model.load_model;
  extract     `python -m lab.study extract --device DEVICE` on the records of --episodes
              episodes of each training file (matched_clean_train, matched_contaminated_train);
  probes      `python -m lab.study train --seeds 42` on those features;
  grpo        `python grpo.py --env gta --reward pair --probes ... --steps 2` at the paper's
              settings (grpo.PAPER_HPARAMS: G 4, 10 turns of 1,024 tokens, LoRA r 16, bfloat16;
              --max-len 8,192), whose evaluation at step 0 and at the end is one batch of
              --eval-batch test episodes (and one validation episode).

Measured: each phase's wall time and peak memory (on a GPU its allocator's peak; on the CPU the
process's peak resident set, Python and torch included); from grpo, the second step's seconds
(metrics.jsonl: the first compiles the decoding step on a GPU) and the last evaluation's test
batch (the time between its progress lines). Projected: the paper's full run on this device,
those measurements scaled to its counts: the four released matched files extracted, the probes
fitted on both training files for 3 seeds, 500 steps, an evaluation every 50 steps of every
validation and test episode. Random weights never write <|im_end|>: every turn runs to
--max-new-tokens and every rollout until the next turn would pass --max-len, the longest the
settings allow, so training and evaluation are projected at their upper bound, and the peak
memory is the worst case's.

Before anything is written the shape is priced: weights, the LoRA adapter with its gradient and
AdamW's two moments, and the larger of the KV cache (the rollouts or the evaluation batch at
--max-len) and the update's checkpointed activations. A shape that cannot fit is refused in one
line. At the end the measured peak stands against the device's memory, with the largest G and
--max-len that fit (the KV cache scaled from this run, the rest held).
"""
import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import envs
import grpo
import model as M
from lab import bench

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30
PAPER = grpo.PAPER_HPARAMS
MAX_LEN = 8192                  # grpo.py's --max-len default: a rollout's KV cache capacity
MICRO_BATCH_TOKENS = 16384      # grpo.py's --micro-batch-tokens default: tokens per update forward
STEPS = 2                       # the first compiles the decoding step on a GPU: the second counts
STUDY_SEEDS = 3                 # lab.study train's default seeds, 42 43 44
SHARD_BYTES = 4 * GiB           # the Hub's Qwen2.5-7B-Instruct: 4 shards of about 4 GB
MATCHED = ("matched_clean_train", "matched_contaminated_train", "matched_clean_test",
           "matched_contaminated_test")
TRAIN_FILES = MATCHED[:2]
USABLE = 0.9        # of the device's memory: the rest goes to fragmentation and CUDA's context
SETTINGS = ("group", "max_turns", "max_new_tokens", "max_len", "eval_batch")

# A phase's command line in a child process, run as `python -m MODULE` or `python SCRIPT` runs it;
# at exit the child writes its peak memory: the GPU allocator's and its peak resident set.
PHASE = """
import atexit, json, resource, runpy, sys

peak_file, kind, target = sys.argv[1:4]


def write_peak():
    torch = sys.modules.get("torch")
    gpu = None
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # KiB on Linux
    with open(peak_file, "w") as f:
        json.dump({"gpu": gpu, "resident": resident}, f)


atexit.register(write_peak)
sys.argv = [target] + sys.argv[4:]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


# ----------------------------------------------------------------------------------------------
# What the shape needs, and what the device has


@dataclass
class Need:
    """Bytes a run of the shape holds at least, before anything is loaded."""
    weights: int
    adapter: int        # the LoRA adapter (float32), its gradient and AdamW's two moments
    kv: int             # the KV cache of the rollouts or of an evaluation batch, whichever is more
    kv_rows: int
    update: int         # the update's activations: each block's input kept for the backward

    @property
    def total(self) -> int:
        return self.weights + self.adapter + max(self.kv, self.update)


def head_dim(config: M.Config) -> int:
    return config.head_dim or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config: M.Config, dtype: torch.dtype) -> int:
    """A key and a value per layer and key head: 2 L n_kv D bytes of the weights' dtype."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * \
        dtype.itemsize


def price(config: M.Config, dtype: torch.dtype, s) -> Need:
    """The lower bound a run of settings `s` holds (its KV cache may grow past --max-len by a
    doubling, and a forward holds more than its checkpointed inputs)."""
    with torch.device("meta"):
        net = M.Transformer(config)
    weights = sum(p.numel() for p in net.parameters()) * dtype.itemsize
    M.apply_lora(net, r=PAPER["lora_r"])
    adapter = sum(p.numel() for _, p in M.lora_parameters(net)) * 4 * 4
    rows = max(s.group * PAPER["batch"], s.eval_batch)
    kv = rows * s.max_len * kv_bytes_per_token(config, dtype)
    tokens = max(min(MICRO_BATCH_TOKENS, s.group * PAPER["batch"] * s.max_len), s.max_len)
    update = tokens * config.num_hidden_layers * config.hidden_size * dtype.itemsize
    return Need(weights, adapter, kv, rows, update)


def device_memory(device: torch.device) -> tuple[str, int, int]:
    """(the device's name, bytes free, bytes in all). A GPU is asked from a child process, so
    that this one holds no CUDA context of its own while the phases run."""
    if device.type == "cuda":
        index = device.index or 0
        code = ("import json, torch; free, total = torch.cuda.mem_get_info({i}); "
                "print(json.dumps([torch.cuda.get_device_name({i}), free, total]))")
        r = subprocess.run([sys.executable, "-c", code.format(i=index)], capture_output=True,
                           text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"dry run: cannot read the memory of cuda:{index} ({last})")
        name, free, total = json.loads(r.stdout.strip().splitlines()[-1])
        return f"cuda:{index} ({name})", free, total
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024            # kB
    return f"CPU (torch threads {torch.get_num_threads()})", info["MemAvailable"], \
        info["MemTotal"]


def gib(n: float) -> str:
    """Bytes as GiB, or as MiB under one GiB."""
    if n < GiB:
        return f"{n / 2 ** 20:.1f} MiB"
    return f"{n / GiB:.2f} GiB"


def duration(seconds: float) -> str:
    """42.0 s, 3m07s, 5h12m, 2d03h."""
    s = int(round(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


# ----------------------------------------------------------------------------------------------
# The checkpoint: random weights written as a downloaded one is


def write_checkpoint(cfg: dict, dtype: torch.dtype, tokenizer_dir: Path, tok: M.Tokenizer,
                     out: Path) -> tuple[int, int]:
    """config.json, the weights (shards with their index past SHARD_BYTES) and tokenizer.json
    in `out`; (bytes of weights, files). Tensors are drawn one at a time and each shard written
    once whole, so at most a shard is held in memory."""
    config = M.Config.from_dict(cfg)
    with torch.device("meta"):
        net = M.Transformer(config)
    tied = config.tie_word_embeddings
    sizes = {name: t.numel() * dtype.itemsize for name, t in net.state_dict().items()
             if not (tied and name == "lm_head.weight")}       # a tied head is not stored
    shard_of, shard, filled = {}, 0, 0
    for name, size in sizes.items():
        if filled and filled + size > SHARD_BYTES:
            shard += 1
            filled = 0
        shard_of[name] = shard
        filled += size
    n_shards = shard + 1
    if n_shards == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors" for k in range(n_shards)]
    out.mkdir(parents=True, exist_ok=True)
    pending = {}
    last = {shard_of[name]: name for name in sizes}     # each shard's last tensor
    for name, tensor in bench.random_weights(net, dtype, "cpu"):
        if name not in sizes:
            continue
        pending[name] = tensor
        k = shard_of[name]
        if last[k] == name:
            save_file(pending, str(out / files[k]), metadata={"format": "pt"})
            pending = {}
    if n_shards > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: files[k] for name, k in shard_of.items()}}
        (out / M.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config_json = dict(cfg, torch_dtype=str(dtype).removeprefix("torch."),
                       bos_token_id=tok.pad_id, eos_token_id=tok.im_end_id)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    shutil.copyfile(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return sum(sizes.values()), n_shards


# ----------------------------------------------------------------------------------------------
# The phases: each a command line in a child process, timed and measured


@dataclass
class Phase:
    name: str
    seconds: float
    peak: int                   # bytes
    peak_kind: str              # "GPU allocator" or "resident"
    lines: list = field(default_factory=list)      # (seconds since the start, text)
    note: str = ""

    def at(self, pattern: str) -> float | None:
        """When the child printed its first line matching `pattern` (re.search), or None."""
        return next((t for t, text in self.lines if re.search(pattern, text)), None)


def run_phase(name: str, kind: str, target: str, argv: list[str], work: Path, env: dict,
              shown: str) -> Phase:
    """`kind` "module": python -m target argv; "script": python target argv. Its output is
    passed on indented and kept with the time of each line."""
    print(f"\n[{name}] {shown} {' '.join(argv)}", flush=True)
    peak_file = work / f".peak-{re.sub(r'[^a-z0-9]+', '-', name)}.json"
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", PHASE, str(peak_file), kind, target, *argv],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1)
    lines = []
    for line in child.stdout:
        lines.append((time.perf_counter() - t0, line.rstrip("\n")))
        print(f"  | {line}", end="", flush=True)
    code = child.wait()
    seconds = time.perf_counter() - t0
    if code:
        raise SystemExit(f"dry run: the {name} phase failed (exit status {code}); its output "
                         "is above")
    peak = json.loads(peak_file.read_text())
    phase = Phase(name, seconds, peak["resident"], "resident", lines)
    if peak["gpu"] is not None:
        phase = Phase(name, seconds, peak["gpu"], "GPU allocator", lines)
    ended(phase)
    return phase


def ended(phase: Phase) -> None:
    """A phase's time and peak as soon as it ends: a dry run stopped later still says them."""
    print(f"[{phase.name}] done in {duration(phase.seconds)}, peak {gib(phase.peak)} "
          f"({phase.peak_kind})", flush=True)


def records_in(features: Path) -> int:
    with safe_open(str(features), framework="pt") as f:
        return f.get_slice("label").get_shape()[0]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
# The dry run


def find_tokenizer(given: str | None) -> Path:
    """--tokenizer, else a fetched Qwen2.5-7B-Instruct's (nothing outside the repository and the
    cache is read unless named)."""
    directory = Path(given) if given else M.cache_root() / "Qwen--Qwen2.5-7B-Instruct"
    if (directory / "tokenizer.json").is_file():
        return directory
    raise SystemExit(f"dry run: no Qwen2.5 tokenizer.json in {directory}"
                     "; pass --tokenizer DIR (e.g. a downloaded Qwen/Qwen2.5-7B-Instruct)")


def find_data(given: str | None) -> Path:
    """--data-dir, else grpo.py's default ($PAIR_DATA, else ~/.cache/pair/data)."""
    directory = Path(given) if given else envs.default_data_dir()
    needed = ["clean_train.json", "clean_test.json", *(f"{name}.json" for name in MATCHED)]
    if all((directory / "gta" / name).is_file() for name in needed):
        return directory
    raise SystemExit(f"dry run: the released GTA files ({', '.join(needed)}) are not in "
                     f"{directory / 'gta'}; fetch them with "
                     "`python -m lab.data download gta --data-dir DIR`, then pass --data-dir DIR")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help but None's: such a flag's help says what decides it."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m lab.dryrun",
                                 description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--shape", choices=tuple(bench.SHAPES),
                    help="random weights of this real shape, lab/bench.py's (default: qwen2.5-7b "
                    "on a GPU, tiny on the CPU)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="weight dtype (the paper's bfloat16)")
    ap.add_argument("--tokenizer", help="a directory with the Qwen2.5 tokenizer.json (default: "
                    "$PAIR_CACHE/Qwen--Qwen2.5-7B-Instruct)")
    ap.add_argument("--data-dir", help="the released files' root, with gta/ (default: $PAIR_DATA, "
                    "else ~/.cache/pair/data)")
    ap.add_argument("--episodes", type=int, default=2,
                    help="extraction: the records of this many episodes of each training file")
    ap.add_argument("--group", type=int, default=PAPER["group"], help="rollouts per prompt, G")
    ap.add_argument("--max-turns", type=int, default=PAPER["max_turns"],
                    help="assistant turns per rollout")
    ap.add_argument("--max-new-tokens", type=int, default=PAPER["max_new_tokens"],
                    help="generated tokens per turn")
    ap.add_argument("--max-len", type=int, default=MAX_LEN, help="KV cache capacity per rollout")
    ap.add_argument("--eval-batch", type=int, default=PAPER["eval_batch"],
                    help="test episodes of the evaluation batch (decoded together)")
    ap.add_argument("--card-memory", type=float, default=None,
                    help="GiB to judge against instead of the device's free memory (e.g. 80 to "
                    "plan for an H100 from another machine)")
    ap.add_argument("--threads", type=int, help="torch CPU threads of every phase (default: "
                    "torch's choice)")
    ap.add_argument("--workdir", help="write the checkpoint, features, probes and run here and "
                    "keep them (default: a temporary directory, removed at the end)")
    args = ap.parse_args(argv)
    grpo.check_ranges(ap, args, {**dict.fromkeys(("episodes", *SETTINGS), grpo.at_least(1)),
                                 "card_memory": ((lambda v: v > 0), "a positive number"),
                                 "threads": grpo.THREADS})
    try:
        args.device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device}: {e}")
    if args.device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: cpu, cuda or cuda:N")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    if args.shape is None:
        args.shape = "qwen2.5-7b" if args.device.type == "cuda" else "tiny"
    return args


def main(argv=None):
    args = parse_args(argv)
    dtype = M.DTYPES[args.dtype]
    cfg = bench.shape_config(args.shape)
    config = M.Config.from_dict(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    where, free, total = device_memory(args.device)
    if args.card_memory:
        free = total = int(args.card_memory * GiB)
        where += f", judged as a {args.card_memory:g} GiB device"

    need = price(config, dtype, args)          # before anything is written or loaded
    needs = (f"weights {gib(need.weights)} + LoRA with AdamW {gib(need.adapter)} + the larger "
             f"of the KV cache ({need.kv_rows} rows x {args.max_len:,} tokens: {gib(need.kv)}) "
             f"and the update's activations ({gib(need.update)})")
    if need.total > free:
        raise SystemExit(f"refused: {args.shape} needs at least {gib(need.total)} on {where}, "
                         f"which has {gib(free)} free of {gib(total)}: {needs}")
    print(f"dry run of the paper's pipeline: {args.shape} (random weights), {args.dtype}, on "
          f"{where}", flush=True)
    differ = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in SETTINGS
              if getattr(args, k) != {**PAPER, "max_len": MAX_LEN}[k]]
    whose = "the paper's (grpo.PAPER_HPARAMS)"
    if differ:
        whose = f"NOT the paper's ({', '.join(differ)}): the projection is of these settings"
    print(f"settings: G {args.group}, batch {PAPER['batch']}, {args.max_turns} turns of "
          f"{args.max_new_tokens:,} tokens, --max-len {args.max_len:,}, LoRA r "
          f"{PAPER['lora_r']}, evaluation batches of {args.eval_batch}; {whose}", flush=True)
    print(f"memory needed, at least: {needs} = {gib(need.total)}; {gib(free)} free of "
          f"{gib(total)}", flush=True)
    tokenizer_dir = find_tokenizer(args.tokenizer)
    data_dir = find_data(args.data_dir)
    tok = M.Tokenizer.from_file(tokenizer_dir)
    if tok.tok.get_vocab_size() > config.vocab_size:
        raise SystemExit(f"refused: the tokenizer in {tokenizer_dir} has "
                         f"{tok.tok.get_vocab_size():,} tokens, {args.shape} {config.vocab_size:,}")
    base = Path(args.workdir or tempfile.gettempdir()).resolve()
    if base.exists() and args.workdir and any(base.iterdir()):
        raise SystemExit(f"--workdir {base}: not empty; choose a new or empty directory")
    existing = next(d for d in (base, *base.parents) if d.exists())
    disk = shutil.disk_usage(existing).free
    if need.weights > disk:
        raise SystemExit(f"refused: the {args.shape} checkpoint takes {gib(need.weights)} and "
                         f"{existing} has {gib(disk)} of disk free (--workdir elsewhere)")
    if args.workdir:
        work = base
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="pair-dryrun-"))
    try:
        phases, report = run(args, cfg, dtype, tok, tokenizer_dir, data_dir, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    summarize(args, config, need, phases, report, data_dir, where, total)


def run(args, cfg, dtype, tok, tokenizer_dir, data_dir, work) -> tuple[list[Phase], dict]:
    """The phases, in order; and what the summary reads from them."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",       # each line timed as it is printed
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    phases, report = [], {}
    ckpt = work / "checkpoint"
    feats = work / "features"
    probes_dir = work / "probes"
    out = work / "run"
    # checkpoint
    print(f"\n[checkpoint] random weights of {args.shape} into {ckpt}", flush=True)
    t0 = time.perf_counter()
    size, files = write_checkpoint(cfg, dtype, tokenizer_dir, tok, ckpt)
    resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    phases.append(Phase("checkpoint", time.perf_counter() - t0, resident, "resident",
                        note=f"{gib(size)} of weights in {files} file(s), written once"))
    ended(phases[-1])
    extract = {}
    for name in TRAIN_FILES:
        argv = ["extract", "--model", str(ckpt), "--dtype", args.dtype, "--device",
                str(args.device), "--data", str(data_dir / "gta" / f"{name}.json"), "--out",
                str(feats / f"{name}.safetensors"), "--episodes", str(args.episodes)]
        phase = run_phase(f"extract {name}", "module", "lab.study", argv, work, env,
                          "python -m lab.study")
        # the start and load, paid once a file, and the records' loop, paid per record: from
        # the times of its first line about the records and of its last ("wrote ...")
        n = records_in(feats / f"{name}.safetensors")
        start = phase.at(r"^extract \S+: \d+ records")
        end = phase.at(r"^wrote ")
        if start is None or end is None:       # lines not found: the whole phase per record
            start = 0.0
            end = phase.seconds
        extract[name] = (n, start, (end - start) / n)
        phase.note = f"{n} records, {(end - start) / n:.2f} s each after {start:.1f} s of " \
                     "start and load"
        phases.append(phase)
    report["extract"] = extract
    # probes
    phase = run_phase("probes", "module", "lab.study",
                      ["train", "--features", str(feats), "--out", str(probes_dir),
                       "--seeds", "42"], work, env, "python -m lab.study")
    report["fit"] = phase.seconds      # the fitting alone, where its line says
    for _, text in phase.lines:
        fit = re.search(r"^seed 42: .* in ([0-9.]+)s ->", text)
        if fit:
            report["fit"] = float(fit.group(1))
    phase.note = f"PAIR and the baseline probes, 1 seed: {report['fit']:.1f} s of fitting"
    phases.append(phase)
    # grpo: the paper's settings but for those given, the probes just fitted
    argv = ["--env", "gta", "--data-dir", str(data_dir), "--model", str(ckpt), "--reward", "pair",
            "--probes", str(probes_dir / "seed42" / "pair_mixed"), "--steps", str(STEPS),
            "--out", str(out), "--devices", str(args.device), "--dtype", args.dtype,
            "--group", str(args.group), "--max-turns", str(args.max_turns),
            "--max-new-tokens", str(args.max_new_tokens), "--max-len", str(args.max_len),
            "--eval-batch", str(args.eval_batch), "--eval-episodes", str(args.eval_batch),
            "--val-episodes", "1"]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    phase = run_phase("grpo", "script", "grpo.py", argv, work, env, "python grpo.py")
    last = read_jsonl(out / "metrics.jsonl")[-1]
    report["step"] = sum(v for k, v in last.items() if k.startswith("t_"))
    report["metrics"] = last
    report["setup"] = phase.at(r"^policy ") or 0.0
    progress = []               # (when, "test" or "validation"): printed after each batch
    for t, text in phase.lines:
        match = re.search(r"evaluating: \d+/\d+ (test|validation) episodes", text)
        if match:
            progress.append((t, match.group(1)))
    batches = [t - progress[k - 1][0] for k, (t, what) in enumerate(progress)
               if what == "test" and k > 0]
    report["eval_batch"] = batches[-1] if batches else None
    parts = ", ".join(f"{k[2:]} {v:.1f}" for k, v in last.items() if k.startswith("t_"))
    phase.note = f"setup {report['setup']:.1f} s; step {STEPS}: {report['step']:.1f} s ({parts})"
    if report["eval_batch"] is not None:
        phase.note += f"; an evaluation batch: {report['eval_batch']:.1f} s"
    phases.append(phase)
    return phases, report


def summarize(args, config, need, phases, report, data_dir, where, total):
    """The phases as measured, the paper's full run projected from them, the memory verdict."""
    print("\nphases (measured):", flush=True)
    for p in phases:
        print(f"  {p.name:<36} {duration(p.seconds):>8}   peak {gib(p.peak):>10} "
              f"({p.peak_kind})   {p.note}")

    # The paper's counts. Extraction: each of the four released matched files once, its start
    # and load then its records. Probes: lab.study train's 3 seeds on both training files, each
    # fit taken as linear in the records. Training: PAPER["steps"] steps. Evaluation: at step 0,
    # every save_every steps and at the end, each of every validation and test episode in
    # batches of --eval-batch; a batch lasts as long as its longest rollout, which on random
    # weights is every rollout, so a smaller last batch is priced as a whole one.
    counts = {name: len(json.loads((data_dir / "gta" / f"{name}.json").read_text()))
              for name in MATCHED}
    extract = report["extract"]
    n_done = sum(n for n, _, _ in extract.values())
    per_record = sum(n * each for n, _, each in extract.values()) / n_done
    start = sum(s for _, s, _ in extract.values()) / len(extract)
    records = sum(counts.values())
    extraction = len(MATCHED) * start + records * per_record
    probes_phase = next(p for p in phases if p.name == "probes")
    train_records = sum(counts[name] for name in TRAIN_FILES)
    per_fit = report["fit"] * train_records / n_done
    fitting = probes_phase.seconds - report["fit"] + STUDY_SEEDS * per_fit
    steps = PAPER["steps"]
    every = PAPER["save_every"]
    training = steps * report["step"]
    evaluations = 1 + len(set(range(every, steps + 1, every)) | {steps})
    ns = SimpleNamespace(env="gta", data_dir=str(data_dir), val_episodes=None)
    train_env = envs.make_env(ns, "train")
    held, _ = envs.eval_splits(ns, train_env, envs.scorable(train_env))
    n_val = len(held["val"][1])
    n_test = len(held["test"][1])
    batches = math.ceil(n_val / args.eval_batch) + math.ceil(n_test / args.eval_batch)
    rows = [("extraction", f"{records:,} records of the 4 released matched files x "
             f"{per_record:.2f} s + 4 starts and loads x {start:.1f} s", extraction),
            ("probes", f"lab.study train on {train_records:,} records x {STUDY_SEEDS} seeds, "
             f"fitting linear in records from {n_done} ({report['fit']:.1f} s)", fitting),
            ("setup", f"grpo.py's start, load and probes, once: {report['setup']:.1f} s",
             report["setup"]),
            ("training", f"{steps} steps x {report['step']:.1f} s (step {STEPS}'s)", training)]
    if report["eval_batch"] is not None:
        rows.append(("evaluation", f"{evaluations} evaluations x {batches} batches of up to "
                     f"{args.eval_batch} ({n_test} test, {n_val} validation episodes) x "
                     f"{report['eval_batch']:.1f} s", evaluations * batches * report["eval_batch"]))
    on = where.split(", judged")[0]
    if args.device.type == "cpu":
        on = f"this {on}"
    print(f"\nprojection of the paper's full run on {on}: the measurements above x the paper's "
          "counts", flush=True)
    for name, how, seconds in rows:
        print(f"  {name:<11} {how:<88} {duration(seconds):>8}")
    print(f"  {'total':<11} {'':<88} {duration(sum(s for _, _, s in rows)):>8}")
    if report["eval_batch"] is None:
        print("  (grpo.py printed no evaluation progress to time a batch by: the evaluations are "
              "not in the total)")
    m = report["metrics"]
    if m.get("gen_turns"):
        print(f"  (random weights: the turns of step {STEPS} averaged "
              f"{m['gen_tokens'] / m['gen_turns']:,.0f} tokens of --max-new-tokens "
              f"{args.max_new_tokens:,}, {m.get('truncated', 0)} of {args.group} rollouts ended "
              "by --max-len: training and evaluation are projected at their upper bound; a "
              "policy that ends its turns is faster)")

    # Memory: the device's phases against its memory; then the KV cache scaled from this run
    measured = [p for p in phases if p.peak_kind == "GPU allocator"] or phases
    top = max(measured, key=lambda p: p.peak)
    verdict = "fits" if top.peak <= total else "does NOT fit"
    print(f"\npeak memory: {gib(top.peak)} ({top.name}, {top.peak_kind}) of {gib(total)}: "
          f"{verdict}", flush=True)
    grpo_phase = phases[-1]
    per_rollout = m.get("mem_kv_mb", 0) * 2 ** 20 / (args.group * PAPER["batch"])
    if per_rollout <= 0:
        per_rollout = need.kv / need.kv_rows
    held_rows = max(args.group * PAPER["batch"], args.eval_batch)
    room = USABLE * total - (grpo_phase.peak - per_rollout * held_rows)
    group_max = int(room // per_rollout) // PAPER["batch"]
    len_max = int(args.max_len * room / (per_rollout * held_rows))
    limit = ""
    # past --micro-batch-tokens the update's forward holds one whole rollout, growing with it:
    # what this run did not measure
    unmeasured = max(MICRO_BATCH_TOKENS, args.max_len)
    if len_max > unmeasured and unmeasured < config.max_position_embeddings:
        len_max = unmeasured
        limit = (f" (past {unmeasured:,}, a rollout's update outgrows --micro-batch-tokens "
                 f"{MICRO_BATCH_TOKENS:,}: not measured here)")
    if len_max >= config.max_position_embeddings:
        len_max = config.max_position_embeddings
        limit = " (the shape's own limit)"
    binds = f" (the evaluation batch of {args.eval_batch} rows binds)" \
        if args.eval_batch > args.group * PAPER["batch"] else ""
    if room < per_rollout * held_rows:
        print(f"largest that fit in {USABLE:.0%} of {gib(total)}: none larger than this run")
    else:
        print(f"largest that fit in {USABLE:.0%} of {gib(total)} (grpo's peak with its KV "
              f"cache, {gib(per_rollout)} a rollout at --max-len {args.max_len:,}, scaled; the "
              f"rest held): G {group_max:,} at --max-len {args.max_len:,}; --max-len "
              f"{len_max:,}{limit} at G {args.group}{binds}", flush=True)


if __name__ == "__main__":
    main()
