"""The recipe of the built-in policies, what `python -m lab.shop sft` runs (lab/shop.py holds
the command and the dialogs of each world): a tiny Qwen2 trained from scratch, or continued
(`--init`), on a built-in world's dialogs, deterministically.

`python -m lab.shop sft --out data/shop-policy` writes what load_model reads: config.json
(Qwen2ForCausalLM), model.safetensors (Hugging Face key names, tied embeddings) and a byte-level
BPE tokenizer.json trained on the same text, with the ChatML specials. The data are the gold
dialogs of `make-data` with a fraction replaced by their contaminated versions, so the
policy learns the format and the world but also some of the four kinds of mistakes: it solves a
fair share of held-out tasks, not all, and GRPO has something to improve. Training starts with a
synthetic copy task (InductionTask) so that the model can copy from its context at all. The loss
covers the assistant turns only (METHOD.md §3, <|im_end|> included). Same command, same bytes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save as safetensors_bytes, save_file

import envs
import grpo
import model
import probes
from lab.worlds import stale
from probes import rollout


# config.json keys of a checkpoint trained on a built-in world (`python -m lab.shop sft` writes
# them): the world's name, and the tool list and reply format it appends to a task.
WORLD_KEY = "pair_world"
TOOLS_KEY = "pair_tool_instructions"


def checkpoint_world(directory) -> tuple[str | None, str | None]:
    """(world name, its tool instructions) a checkpoint's config.json records, or (None, None)."""
    path = Path(directory) / "config.json"
    config = model.read_json(path)
    world, tools = config.get(WORLD_KEY), config.get(TOOLS_KEY)
    if world is not None and not (isinstance(world, str) and isinstance(tools, str)):
        raise model.CheckpointError(f"{path}: {WORLD_KEY} must name a world and {TOOLS_KEY} hold "
                                f"its tool instructions (got {world!r} and {type(tools).__name__})")
    return world, tools


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    # Digits one by one (a space may lead one), as Qwen's tokenizer splits them: numbers are
    # read and copied digit by digit.
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\d"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def chat_text(messages, add_generation_prompt=False) -> str:
    """The ChatML text of a chat, as the chat template writes it (the text a tokenizer is trained
    on; Tokenizer.render gives the ids, with the template's special tokens as ids)."""
    system = [] if messages and messages[0]["role"] == "system" else \
        [f"<|im_start|>system\n{model.DEFAULT_SYSTEM}<|im_end|>\n"]
    return "".join(system + [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                             for m in messages]) + \
        ("<|im_start|>assistant\n" if add_generation_prompt else "")


def sft_config(args, tok) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": tok.tok.get_vocab_size(), "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "hidden_act": "silu", "max_position_embeddings": 8192, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
            "bos_token_id": None, "eos_token_id": tok.im_end_id, "pad_token_id": tok.pad_id,
            "torch_dtype": "float32",
            # `model.py generate` renders a prompt as this world renders a task
            WORLD_KEY: "shop",
            TOOLS_KEY: envs.tool_instructions(envs.SHOP_TOOLS)}


def sft_batches(lengths: list[int], batch: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` batches of example indices: shuffled every pass, and grouped by length within
    windows of 8 batches so that little compute goes to padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(lengths), generator=g).tolist()
        for w in range(0, len(order) - batch + 1, 8 * batch):
            window = sorted(order[w:w + 8 * batch], key=lambda i: lengths[i])
            chunks = [window[i:i + batch] for i in range(0, len(window) - batch + 1, batch)]
            out += [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]
    return out[:steps]


SFT_CHECKPOINT = "sft-checkpoint"      # under --out while a run is unfinished


def sft(args, dialogs_of, world: envs.World) -> dict:
    """Train the policy that args describe on dialogs_of(args), the chat dialogs of args.world
    (lab/shop.py's sft_world_dialogs), and write it to args.out with its README; `world`: the
    built-in world it is evaluated on."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    earlier = policy_recipe(args.init) if args.init else []    # read before --out overwrites it
    if args.init:   # continue a saved policy, its tokenizer and shape (first: a bad one fails fast)
        try:
            policy, tok = model.load_model(args.init)
        except (model.CheckpointError, OSError, ValueError) as e:
            raise SystemExit(f"--init {args.init}: cannot continue this policy ({e})") from None
        policy.requires_grad_(True)             # load_model freezes a base for LoRA
        config = json.loads((Path(args.init) / "config.json").read_text())
    dialogs = dialogs_of(args)
    if not args.init:
        tok = model.Tokenizer(train_tokenizer([chat_text(m) for m in dialogs], args.vocab))
    examples = []
    for messages in dialogs:
        ids, spans = tok.render(messages)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for s, e in spans:
            mask[s:e] = True
        examples.append((torch.tensor(ids), mask))
    if not args.init:
        config = sft_config(args, tok)
        policy = model.Transformer(model.Config.from_dict(config))
        for name, p in policy.named_parameters():       # GPT-2 style init
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)
    n_params = sum(p.numel() for p in policy.parameters())
    what = f"{args.contaminated:.0%} contaminated, {args.divided:.0%} of the others dividing " \
        "by the rate" if args.world == "shop" else \
        f"{args.world}, each slip in {args.slips:.0%} of its tasks" if args.world == "shop-long" \
        else f"{args.world}, each decision misread in {args.slips:.0%} of them"
    print(f"sft: {len(examples)} dialogs ({what}), vocab "
          f"{config['vocab_size']}, {n_params / 1e6:.2f}M parameters"
          f"{', from ' + args.init if args.init else ''}; {args.induction_steps} "
          f"induction steps, then {args.steps} steps of {args.batch} dialogs", flush=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    induction = InductionTask(tok, args.seed, [x[m.nonzero()[0, 0]:] for x, m in examples],
                              args.induction_text)
    policy.train()

    def step(loss: torch.Tensor, lr: float) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    # A checkpoint every --save-every steps (both phases counted as one sequence); --resume
    # restores the weights, the optimizer, the induction rows' generator and the logged losses,
    # so a resumed run writes the same bytes as one never stopped.
    ckpt = Path(args.out) / SFT_CHECKPOINT
    done, losses, kept, earlier_seconds = 0, [], [], 0.0
    if args.resume:
        done, losses, kept, earlier_seconds = load_sft_checkpoint(ckpt, args, policy, opt,
                                                                  induction)
        print(f"sft: resumed from {ckpt} after {done} of {args.induction_steps + args.steps} "
              "steps", flush=True)

    def checkpoint(n_done: int):
        if args.save_every and n_done % args.save_every == 0 and \
                n_done < args.induction_steps + args.steps:
            save_sft_checkpoint(ckpt, args, n_done, policy, opt, induction, losses, kept,
                                earlier_seconds + time.perf_counter() - t0)

    # 1. the copy circuit first (see InductionTask): linear warmup, then constant
    t_phase, first = time.perf_counter(), done
    for i in range(done, args.induction_steps):
        losses.append(step(masked_lm_loss(policy, *induction.rows(32)),
                           args.lr * min(1.0, (i + 1) / args.warmup)))
        if (i + 1) % 250 == 0 or i + 1 == args.induction_steps:
            rate = (time.perf_counter() - t_phase) / (i + 1 - first)
            print(f"  induction {i + 1}/{args.induction_steps}  loss "
                  f"{sum(losses[-250:]) / len(losses[-250:]):.4f}"
                  f"  ETA {probes.duration(rate * (args.induction_steps - i - 1))}", flush=True)
        checkpoint(i + 1)
    if done <= args.induction_steps:
        losses = []             # the dialog phase logs its own losses
    # 2. the dialogs, with a few induction rows kept in every batch: linear warmup, cosine to 0.1
    batches = sft_batches([len(x) for x, _ in examples], args.batch, args.steps, args.seed)
    t_phase, first = time.perf_counter(), max(0, done - args.induction_steps)
    for i in range(first, args.steps):
        rows = batches[i]
        warm = min(1.0, (i + 1) / args.warmup)
        cos = 0.1 + 0.45 * (1 + math.cos(math.pi * i / max(1, args.steps - 1)))
        pad = torch.nn.utils.rnn.pad_sequence      # to the longest row: pad_id, mask False
        ids = pad([examples[r][0] for r in rows], batch_first=True, padding_value=tok.pad_id)
        mask = pad([examples[r][1] for r in rows], batch_first=True)
        loss = masked_lm_loss(policy, ids, mask)
        extra = masked_lm_loss(policy, *induction.rows(args.induction_rows)) \
            if args.induction_rows else 0.0
        step(loss + extra, args.lr * warm * cos)
        losses.append(loss.item())
        kept.append(extra.item() if torch.is_tensor(extra) else extra)
        if (i + 1) % 50 == 0 or i + 1 == args.steps:
            rate = (time.perf_counter() - t_phase) / (i + 1 - first)
            print(f"  step {i + 1}/{args.steps}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}"
                  f"  induction loss {sum(kept[-50:]) / len(kept[-50:]):.4f}"
                  f"  ETA {probes.duration(rate * (args.steps - i - 1))}", flush=True)
        checkpoint(args.induction_steps + i + 1)
    policy.eval()
    seconds = earlier_seconds + time.perf_counter() - t0
    out = Path(args.out)
    save_policy(out, policy, tok, config)
    shutil.rmtree(ckpt, ignore_errors=True)
    result = {"train_seconds": round(seconds, 1), "final_loss": round(
        sum(losses[-50:]) / len(losses[-50:]), 4), "parameters": n_params}
    if args.eval_episodes:
        result.update(sft_eval(policy, tok, args, world))
    write_policy_readme(out, args, config, result, earlier)
    print(f"sft: wrote {out} in {probes.duration(time.perf_counter() - t0)}: " + json.dumps(result),
          flush=True)
    return result


def masked_lm_loss(policy, ids, mask) -> torch.Tensor:
    """Mean cross-entropy of the tokens where mask is True (the head runs on those only)."""
    h = policy.trunk(ids)
    target = mask[:, 1:]
    return F.cross_entropy(policy.lm_head(h[:, :-1][target]).float(), ids[:, 1:][target])


class InductionTask:
    """Rows "x x": a token string x (length 8-32, the same in a batch) and its repeat, the loss on
    the repeat. Only copying by content solves it: find where the current token came before,
    emit the token that followed (an induction head). x is random tokens, or, for a fraction
    `text` of the rows, a window of a training dialog after its prompt: there the tokens repeat
    ("." and digits in every price), as in a rollout, and the copy must key on more than one
    token.

    Why: a rollout copies items, stores and prices from the task and the observations into its
    thoughts and tool calls. Trained on the dialogs alone, a model this small did not find that
    circuit within our budget (held-out loss on the digits of its turns stayed at chance, ~2.2
    nats, after 500 steps). On this task it forms after a plateau of ~1,500 steps (a fraction of
    a minute each hundred); trained first on these rows (--induction-steps), then on the dialogs
    with a few such rows kept in every batch (--induction-rows), the policy copies."""

    def __init__(self, tok, seed: int, windows: list[torch.Tensor] = (), text: float = 0.0,
                 min_len: int = 8, max_len: int = 32):
        self.vocab, self.min_len, self.max_len = tok.tok.get_vocab_size(), min_len, max_len
        self.low = len(SPECIALS)                # the specials take ids 0-2: never drawn
        self.windows = [w for w in windows if len(w) >= max_len]
        self.text = text if self.windows else 0.0
        self.g = torch.Generator().manual_seed(seed + 1)

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=self.g))
        x = torch.randint(self.low, self.vocab, (n, k), generator=self.g)
        for r in range(round(n * self.text)):
            w = self.windows[int(torch.randint(len(self.windows), (1,), generator=self.g))]
            a = int(torch.randint(len(w) - k + 1, (1,), generator=self.g))
            x[r] = w[a:a + k]
        ids = torch.cat([x, x], 1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, k + 1:] = True          # the repeat's first token cannot be known: no loss there
        return ids, mask


def _policy_tensors(policy) -> dict[str, torch.Tensor]:
    """The weights as saved: the head is tied to the embeddings (tie_word_embeddings)."""
    return {k: v.contiguous() for k, v in policy.state_dict().items() if k != "lm_head.weight"}


def save_policy(out: Path, policy, tok, config: dict):
    out.mkdir(parents=True, exist_ok=True)
    model.write_atomic(out / "model.safetensors",
                       safetensors_bytes(_policy_tensors(policy), {"format": "pt"}))
    grpo.write_json(out / "config.json", config)
    model.write_atomic(out / "tokenizer.json", tok.tok.to_str(pretty=True))


# the flags a resumed sft run must share with the run it continues (the others change nothing
# that is trained)
_SFT_FREE_FLAGS = ("out", "resume", "save_every", "eval_episodes", "command")


def _sft_flags(args) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if k not in _SFT_FREE_FLAGS}


def save_sft_checkpoint(path: Path, args, done: int, policy, opt, induction, losses, kept,
                        seconds: float):
    """OUT/sft-checkpoint after `done` steps, written whole or not at all (a temporary directory
    renamed over the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_policy_tensors(policy), tmp / "model.safetensors")
        tensors, meta = grpo.optimizer_to_tensors(opt)
        save_file(tensors, tmp / "optimizer.safetensors")
        save_file({"induction": induction.g.get_state()}, tmp / "rng.safetensors")
        grpo.write_json(tmp / "trainer.json", {"done": done, "flags": _sft_flags(args),
                                               "losses": losses, "kept": kept,
                                               "seconds": seconds, "optimizer": meta})
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:        # a full disk: the last checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"{path}: could not be written ({type(e).__name__}: {e}); free the "
                         "space and continue with --resume") from None


def load_sft_checkpoint(path: Path, args, policy, opt, induction) -> tuple:
    """Restore what save_sft_checkpoint wrote: (steps done, losses, kept, seconds so far)."""
    try:
        info = json.loads((path / "trainer.json").read_text())
        changed = [f"--{k.replace('_', '-')} {v} (was {info['flags'].get(k)})"
                   for k, v in _sft_flags(args).items() if info["flags"].get(k) != v]
        if changed:
            raise ValueError("it was trained with other flags: " + ", ".join(changed))
        state = load_file(path / "model.safetensors")
        missing, unexpected = policy.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"weights do not fit the model: missing {missing}, "
                             f"unexpected {unexpected}")
        grpo.optimizer_from_tensors(opt, load_file(path / "optimizer.safetensors"),
                                    info["optimizer"])
        induction.g.set_state(load_file(path / "rng.safetensors")["induction"])
        return int(info["done"]), info["losses"], info["kept"], float(info["seconds"])
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:
        raise SystemExit(f"{path}: cannot resume from this checkpoint ({type(e).__name__}: "
                         f"{e})") from None


@torch.no_grad()
def sft_eval(policy, tok, args, world: envs.World) -> dict:
    """Held-out success on `world`: sampled at temperature 1 (what GRPO starts from) and
    greedy."""
    env = envs.ShopEnv("test", world=world)
    n = min(args.eval_episodes, len(env))
    play = argparse.Namespace(max_turns=world.max_turns, max_new_tokens=96,
                              max_len=4096, temperature=1.0, top_p=1.0)
    result = {"eval_episodes": n}
    for name, greedy in (("success_sampled", False), ("success_greedy", True)):
        g = torch.Generator().manual_seed(args.seed)
        total = 0.0
        for i in range(0, n, 25):
            episodes = [env.episode(j) for j in range(i, min(i + 25, n))]
            total += sum(t.score for t in rollout(policy, tok, episodes, play, greedy=greedy,
                                                  generator=g, stats=False))
        result[name] = round(total / n, 4)
    return result


def policy_recipe(directory) -> list[str]:
    """The commands that rebuilt a saved policy, from the README its sft run wrote ([] if none)."""
    readme = Path(directory) / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    return m.group(1).strip().splitlines() if m else []


def write_policy_readme(out: Path, args, config: dict, result: dict, earlier: list[str]):
    """README.md of a policy that sft wrote: how to rebuild it (the commands of the policy it was
    continued from first), its size, its training and its held-out success."""
    data = f"--contaminated {args.contaminated} --divided {args.divided} " \
        if args.world == "shop" else f"--world {args.world} --slips {args.slips} "
    flags = ("steps", "batch", "lr", "warmup", "induction_steps", "induction_rows",
             "induction_text", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
             "seed", "threads")
    command = (f"python -m lab.shop sft --out {args.out} --episodes {args.episodes} {data}"
               + (f"--init {args.init} " if args.init else "")
               + " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in flags))
    about = ("A tiny Qwen2-architecture model trained from scratch, with its own byte-level BPE "
             "tokenizer (ChatML specials), on the gold dialogs of the built-in `shop` world mixed "
             "with contaminated ones (python -m lab.shop make-data), after a warm-up on a "
             "synthetic copy task that gives it induction heads (lab/policies/sft.py InductionTask). Loss "
             "on assistant tokens only.")
    if args.init:
        about += " Then continued (`--init`, the last command) on the same dialogs" + \
            ("" if args.divided else ".")
    if args.divided:     # sft_dialogs divides in the dialogs not contaminated only
        about += (f"{', where, of those' if args.init else ' Of the dialogs'} not contaminated, "
                  f"{args.divided:.0%} of the non-USD ones convert the wrong way round, dividing "
                  "the dollar total by the rate (shop.shop_divided): a fluent, self-consistent "
                  "habit, given on purpose so that GRPO has something it can unlearn within "
                  "minutes. The policy's other errors are mostly a quantity recalled wrongly "
                  "from the task text on two- and three-line tasks: a missing skill that 20 "
                  "GRPO steps do not teach (README, Results on the built-in world).")
    elif args.init and args.world == "shop":
        about += "."
    title = "# shop-policy: the built-in policy of `python grpo.py`"
    if args.world == "shop-long":
        title = ("# shop-long-policy: the built-in policy of `python grpo.py --env shop-long`")
        about = (f"The policy of the long-horizon world (shop.py, shop-long: 3-4 lines, 9-11 "
                 f"turns), continued (`--init`, the last command) from the policy of the "
                 f"commands before it on the gold shop-long dialogs, where each of three slips "
                 f"is made in {args.slips:.0%} of the tasks that have its habit, drawn on its own "
                 "(shop.LONG_SLIPS, shop.LONG_HABITS): at store A or B the first Lookup at the "
                 "next store, with 4 lines the last running total leaving out the lines before "
                 "it, in EUR or GBP the conversion dividing by the rate. Each is a fluent, "
                 "turn-local habit at its own turn, each alone fails the episode: a rollout that "
                 "fails mostly holds one wrong decision among many right turns, the case a "
                 "per-turn reward is for.")
    if args.world == "shop-copy":
        title = ("# shop-copy-policy: the policy of `python -m lab.train --env shop-copy`, the "
                 "premise world")
        about = (f"The policy of the premise world (shop.py, shop-copy: shop-long's tasks, 8-10 "
                 f"decisions), continued (`--init`, the last command) from the policy of the "
                 f"commands before it on shop-copy dialogs where each decision copies another "
                 f"value of its episode in {args.slips:.0%} of them, drawn on its own, the value "
                 "drawn among the episode's others (shop.COPY_DECISIONS, shop.copy_decisions): a "
                 "Lookup at another store, a running total with another line's quantity, the "
                 "Rate of another currency, an earlier running total converted. No slip is a "
                 "habit of some tasks: each is a minority sample, made with less confidence than "
                 "the same decision made right, and each alone fails the episode.")
    if args.world == stale.STALE_WORLD.name:
        title, about = stale.policy_readme_head(args)
    lines = [title, "", about, "",
             "Rebuilt, byte for byte, by:", "", "```bash", *earlier, command, "```", "",
             "| | |", "|---|---|",
             f"| parameters | {result['parameters']:,} (hidden {config['hidden_size']}, "
             f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, "
             f"{config['num_key_value_heads']} KV heads, vocab {config['vocab_size']}) |",
             f"| training{' (last command)' if earlier else ''} | {args.induction_steps} induction "
             f"steps, then {args.steps} steps x {args.batch} dialogs, {result['train_seconds']:.0f}"
             f" s on {args.threads} CPU threads, final loss {result['final_loss']} |"]
    if "success_sampled" in result:
        lines += [f"| held-out success, sampled (T = 1) | {result['success_sampled']:.3f} "
                  f"({args.world} test episodes 0-{result['eval_episodes'] - 1}) |",
                  f"| held-out success, greedy | {result['success_greedy']:.3f} |"]
    model.write_atomic(out / "README.md", "\n".join(lines) + "\n")
