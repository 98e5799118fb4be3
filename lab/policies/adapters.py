"""Loading an arbitrary PEFT LoRA adapter (ours or PEFT's) into a model: options that would
change the math are refused, and everything is checked before the model is touched. A run
restores its own checkpoints with model.load_adapter_weights."""
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

import model as M
from model import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoraSettings


def read_adapter_config(path) -> LoraSettings:
    file = Path(path) / ADAPTER_CONFIG
    try:
        c = json.loads(file.read_text())
    except OSError as e:
        raise FileNotFoundError(f"{file}: cannot read the adapter config ({e})") from e
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{file}: not valid JSON ({type(e).__name__}: {e})") from None

    def bad(field, why):
        return ValueError(f"{file}: {field}={c.get(field)!r}: {why}")

    if c.get("peft_type") != "LORA":
        raise bad("peft_type", "only LoRA adapters are supported")
    # PEFT options that change the math: refuse them rather than load a different model.
    for key, plain in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False),
                       ("lora_bias", False), ("modules_to_save", None),
                       ("layers_to_transform", None), ("rank_pattern", {}),
                       ("alpha_pattern", {})):
        if c.get(key, plain) not in (plain, None, [], {}):
            raise bad(key, f"not supported (only {plain!r})")
    targets = c.get("target_modules")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise bad("target_modules", "must be a list of module names (regex strings and "
                                    "'all-linear' are not supported)")
    if not isinstance(c.get("r"), int) or c["r"] <= 0:
        raise bad("r", "must be a positive integer")
    if not isinstance(c.get("lora_alpha"), (int, float)) or c["lora_alpha"] <= 0:
        raise bad("lora_alpha", "must be a positive number")
    return LoraSettings(c["r"], float(c["lora_alpha"]), float(c.get("lora_dropout", 0.0)),
                        tuple(targets), bool(c.get("use_rslora", False)))


def _same_shape(s: LoraSettings):
    return s.r, s.alpha, set(s.targets), s.use_rslora       # dropout may differ


def _adapter_shapes(model, s: LoraSettings) -> dict[str, tuple[int, int]]:
    """PEFT key -> shape of every adapter weight `s` puts on `model` (applied or not yet)."""
    shapes = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in s.targets and type(m) in (nn.Linear, M.LoRALinear):
            shapes[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (s.r, m.in_features)
            shapes[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (m.out_features, s.r)
    return shapes


def load_adapter(model, path):
    """Load a PEFT LoRA adapter (ours or PEFT's) into `model`, applying LoRA first if needed.
    Everything is checked before the model is touched."""
    s = read_adapter_config(path)
    if getattr(model, "lora_settings", None) is not None and \
            _same_shape(model.lora_settings) != _same_shape(s):
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG}: {s} does not match the model's "
                         f"adapter {model.lora_settings}")
    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing (only safetensors adapters are read)")
    shapes = _adapter_shapes(model, s)
    with safe_open(str(file), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    if missing := sorted(shapes.keys() - tensors.keys()):
        raise ValueError(f"{file}: {len(missing)} adapter weights missing, e.g. {missing[0]}")
    if unexpected := sorted(tensors.keys() - shapes.keys()):
        raise ValueError(f"{file}: {len(unexpected)} unexpected tensors, e.g. {unexpected[0]}")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{file}: {key} has shape {tuple(tensors[key].shape)}, the model "
                             f"expects {shape}")
        if not torch.isfinite(tensors[key]).all():
            raise ValueError(f"{file}: {key} holds NaN or infinite values")
    if getattr(model, "lora_settings", None) is None:
        M.apply_lora(model, s.r, s.alpha, s.dropout, s.targets, s.use_rslora)
    M.load_lora_state(model, {key[len(PEFT_PREFIX):]: t for key, t in tensors.items()})
    return model
