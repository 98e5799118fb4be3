"""`python -m lab.generate`: chat-format a prompt and print the model's reply (greedy by default).

A checkpoint trained on a built-in world records in its config.json (WORLD_KEY,
TOOLS_KEY) the tool list and reply format that world appends to a task, so that a prompt
is rendered as the model saw tasks in training.
"""
from __future__ import annotations

import argparse
import sys

import torch

import model as M
import probes
from lab.policies import adapters
from lab.policies.sft import TOOLS_KEY, WORLD_KEY, checkpoint_world


def prompt_messages(prompt: str, system: str | None, tools: str | None) -> list[dict]:
    """The chat `generate` renders: the prompt as the user message or, for a model trained on a
    world, as that world renders a task: the task, a blank line, then the tool list and the
    reply format the checkpoint records (checkpoint_world), exactly what the model saw
    in training and sees in rollouts."""
    content = f"{prompt.strip()}\n\n{tools}" if tools else prompt
    return ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]


def main(argv=None):
    g = ap = argparse.ArgumentParser(prog="python -m lab.generate",
                                     description="chat-format a prompt and print the model's reply")
    g.add_argument("--model", required=True, help="checkpoint directory (config.json, "
                   "model.safetensors[.index.json], tokenizer.json) or a Hugging Face Hub name "
                   "such as Qwen/Qwen2.5-7B-Instruct (downloaded once into $PAIR_CACHE)")
    g.add_argument("--adapter", default=None, metavar="DIR",
                   help="a LoRA adapter to play the model with: a run's RUN/checkpoint-<step>/"
                   "adapter, or any PEFT adapter of this model (default: none, the model alone)")
    g.add_argument("--devices", default="cpu", help="comma-separated devices to split the "
                   "layers over, e.g. cuda:0,cuda:1 (default: cpu)")
    g.add_argument("--prompt", required=True,
                   help="the user message; for a model trained on a world, the task (--world)")
    g.add_argument("--world", default="auto", choices=("auto", "none", "shop"),
                   help="how the prompt is rendered: shop = as the shop world renders a task "
                   "(the task, then the tool list and the reply format: what the built-in "
                   "policy is trained and rolled out on; the checkpoint's config.json records "
                   f"them, {WORLD_KEY} and {TOOLS_KEY}, written by `shop.py "
                   "sft`); none = the prompt alone; auto (default) = the world the checkpoint "
                   "records, else none")
    g.add_argument("--system", default=None, help="system message (default: Qwen's default, "
                   "which the built-in policy is trained with too)")
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="most tokens to generate (default: 256)")
    g.add_argument("--dtype", choices=tuple(M.DTYPES), default="float32",
                   help="weight dtype (default: float32)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) decodes greedily")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass (default: 1, all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    args = ap.parse_args(argv)

    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be at least 1")
    if not probes.valid_temperature(args.temperature):
        ap.error("--temperature must be 0 (greedy) or a finite number >= "
                 f"{probes.MIN_TEMPERATURE}, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not -2**63 <= args.seed < 2**64:                 # what torch.Generator takes
        ap.error(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    try:
        devices = M.parse_devices(args.devices)
    except ValueError as e:
        ap.error(str(e))
    try:
        model, tok = M.load_model(args.model, dtype=M.DTYPES[args.dtype], device=devices[0])
        world, tools = checkpoint_world(model.checkpoint_dir)
    except (M.CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"--model: {e}")
    if args.adapter is not None:
        try:
            adapters.load_adapter(model, args.adapter)      # checked before the model is touched
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"--adapter: {e}")
    if len(devices) > 1:        # after the adapter, so that its weights split with their layers
        try:
            M.split_model(model, devices)
        except ValueError as e:
            sys.exit(f"--model: {e}")
    if args.world == "none":
        world, tools = None, None
    elif args.world != "auto" and world != args.world:
        sys.exit(f"--world {args.world}: {args.model} records no {args.world} task rendering "
                 f"(its config.json has {WORLD_KEY} {world!r})")
    ids, _ = tok.render(prompt_messages(args.prompt, args.system, tools),
                        add_generation_prompt=True)
    context = model.config.max_position_embeddings     # the cache is made for all of it at once
    if len(ids) + args.max_new_tokens > context:
        sys.exit(f"--max-new-tokens {args.max_new_tokens}: with the prompt's {len(ids)} tokens "
                 f"that is past the model's context, {context} tokens (max_position_embeddings)")
    mode = "greedy" if args.temperature == 0 else \
        f"sampled (temperature {args.temperature}, top-p {args.top_p}, seed {args.seed})"
    print(f"[{mode} decoding, {args.dtype}; the prompt rendered "
          f"{f'as a {world} task, with its tool list' if world else 'as the user message'}, "
          f"{len(ids)} tokens]", file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    cache = model.new_cache(1, capacity=len(ids) + args.max_new_tokens)
    trace = probes.generate(model, cache, [ids],
                            args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            stop_ids=[tok.im_end_id], generator=gen, stats=False)[0]
    tokens = trace.tokens[:-1] if trace.finished else trace.tokens
    print(tok.decode(tokens))


if __name__ == "__main__":
    main()
