"""Layers split across devices (placement, no pipelining): one device computes at a time, the
point is memory (a 7B policy with its LoRA state and caches exceeds one 48 GB GPU).

    python -m lab.train --devices cuda:0,cuda:1 ...

`split_model` places contiguous ranges of blocks, each with a pre-hook moving its inputs to its
device; the core's decoding step already moves its per-layer tensors to each block's device.
"""
from __future__ import annotations

import torch
from torch import nn, Tensor

import grpo


def balance_layers(block_sizes: list[int], n_devices: int, first_extra=0, last_extra=0):
    """Layers per device: contiguous ranges whose loads (parameter counts, with the embedding on
    the first device and the head on the last) come closest to an even share each."""
    n_layers = len(block_sizes)
    if not 1 <= n_devices <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_devices} devices")
    total = first_extra + sum(block_sizes) + last_extra
    load_before = [first_extra + sum(block_sizes[:b]) for b in range(n_layers + 1)]
    cuts = [0]
    for k in range(1, n_devices):
        # Cut k where the load so far is nearest k/n of the total, leaving every device a layer.
        lo, hi = cuts[-1] + 1, n_layers - (n_devices - k)
        share = k * total / n_devices
        cuts.append(min(range(lo, hi + 1), key=lambda b: abs(load_before[b] - share)))
    cuts.append(n_layers)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def split_model(model, devices, layer_counts=None):
    """Place model.model.layers on `devices` (e.g. ["cuda:0", "cuda:1"]) in contiguous ranges,
    each block with a pre-hook moving its inputs there; the embedding on the first device, norm
    and head on the last (new_cache puts each block's cache with it). layer_counts: layers per
    device (summing to the number of layers); by default balance_layers on parameter counts."""
    devices = [torch.device(d) for d in devices]
    inner, layers, head = model.model, model.model.layers, model.lm_head
    if layer_counts is None:
        def n_params(module):
            return sum(p.numel() for p in module.parameters())
        layer_counts = balance_layers([n_params(b) for b in layers], len(devices),
                                      first_extra=n_params(inner.embed_tokens),
                                      last_extra=n_params(inner.norm) + head.weight.numel())
    layer_counts = [int(n) for n in layer_counts]
    if (len(layer_counts) != len(devices) or min(layer_counts) < 1
            or sum(layer_counts) != len(layers)):
        raise ValueError(f"layer_counts={layer_counts}: need one count >= 1 per device "
                         f"({len(devices)}) summing to the model's {len(layers)} layers")
    if head.weight is inner.embed_tokens.weight and devices[0] != devices[-1]:
        # the head's copy of the embedding stays equal to it only while it is frozen (LoRA)
        if inner.embed_tokens.weight.requires_grad:
            raise ValueError("tied embeddings are copied to the last device; freeze them first "
                             "(apply_lora does) or split over one device")
        head.weight = nn.Parameter(inner.embed_tokens.weight.detach().to(devices[-1]),
                                   requires_grad=False)

    def to(device, x):      # tensors moved; caches and flags stay (a block's cache lives with it)
        if isinstance(x, (tuple, list)):
            return type(x)(to(device, v) for v in x)
        return x.to(device) if isinstance(x, Tensor) else x   # blocking: a copy must have landed

    model.layer_devices = [d for d, n in zip(devices, layer_counts) for _ in range(n)]
    for module, device in [(inner.embed_tokens, devices[0]), *zip(layers, model.layer_devices),
                           (inner.norm, devices[-1]), (head, devices[-1])]:
        module.to(device)
        module.register_forward_pre_hook(lambda _, args, kwargs, device=device: (
            to(device, args), {k: to(device, v) for k, v in kwargs.items()}), with_kwargs=True)
    return model


def register() -> None:
    """Plug the split into grpo.py's --devices (lab/train.py does, once)."""
    if split_model not in grpo.HOOKS["split"]:
        grpo.HOOKS["split"].append(split_model)
