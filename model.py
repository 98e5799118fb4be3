"""The policy: a hand-written Qwen2-family decoder that reports its own hidden
states and attention statistics, and what it needs around it: loading, KV cache,
decoding, tokenizer, LoRA, layer split.

PAIR reads its reward from the policy's internals (METHOD.md §4). Each decoding
step returns, besides the logits, the L+1 hidden states (the embedding, blocks
1..L-1, the final-normed block L) and, for every layer and query head, the six
statistics of its softmax row over the causal keys (STATS; their equations are
stats_from's): no second forward pass. Departure from the authors' release: std
is over the i+1 causal keys of row i, not the whole padded row.

Modules carry the Hugging Face weight names (Qwen2, Llama, Mistral): loading a
checkpoint is a strict load_state_dict once every file, tensor and shape is
checked. Masks come from explicit positions. The model is written for one
device; split_model, at the bottom, places a built model's layers over several
(as gpt-fast's tp.py): a 7B policy, LoRA and KV caches exceed 48 GB."""
import contextlib
import hashlib
import json
import math
import os
import re
import struct
import sys
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import requests
import urllib3
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn, Tensor

# The six attention statistics of a softmax row (stats_from), in the order of
# the last axis of the statistics tensor a decoding step returns.
STATS = ("max", "std", "prefix", "self", "entropy", "lookback")
# The values --dtype takes in every script: torch's names, and only these.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- The config, and loading a checkpoint: a local directory or a Hub model name -------
# config.json's model_type -> architecture, for an old config that names no
# architectures.
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM"}
# Keys transformers < 5 leaves out of config.json when they equal its defaults,
# which are not ours.
ARCH_DEFAULTS = {"Qwen2ForCausalLM": {"max_window_layers": 28},
                 "MistralForCausalLM": {"sliding_window": 4096}}
# The config keys that must be positive integers.
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "sliding_window")
# A sharded checkpoint's index: its weight_map names each tensor's file.
INDEX = "model.safetensors.index.json"
# A fetched model's manifest, written last: each file checked, its size and hash.
HUB_MANIFEST = ".pair-complete.json"
HUB_STALL = 60          # s without a byte: a transfer has failed (and is resumed)
HUB_RATE = 1 << 20    # bytes/s: a file's deadline is HUB_STALL s + its size at this rate
HUB_TRIES = 4           # transfers of one file at most, 0, 1, 3, 7 s apart


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded exactly; the message names file and tensor."""


@dataclass
class Config:
    """A checkpoint's config.json: its keys are the field names (unknown keys are
    dropped), the sizes those the shapes name (V, d, f, L, H, KV, D). A field whose
    default is None may be null in the file; from_dict builds and validates one."""
    vocab_size: int                         # V
    hidden_size: int                        # d
    intermediate_size: int                  # f, the MLP's width
    num_hidden_layers: int                  # L
    num_attention_heads: int                # H, the query heads
    num_key_value_heads: int | None = None  # KV; None: as many as the query heads
    head_dim: int | None = None             # D; None: hidden_size / num_attention_heads
    architectures: list[str] = field(default_factory=lambda: ["Qwen2ForCausalLM"])
    hidden_act: str = "silu"                # the MLP's activation
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768    # the context, in tokens
    # RoPE's base: transformers < 5 writes rope_theta, transformers >= 5 writes
    # rope_parameters = {"rope_theta", "rope_type"}
    rope_theta: float | None = None
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None        # only the default RoPE is supported
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Llama's switch; Qwen2 always has a QKV bias
    mlp_bias: bool = False
    sliding_window: int | None = None       # in tokens
    use_sliding_window: bool = False        # Qwen2: windows only when set
    max_window_layers: int = 0              # Qwen2: the first layers without a window
    layer_types: list[str] | None = None    # "sliding_attention" or not, per layer
    eos_token_id: int | list[int] | None = None     # one stop token id, or several

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """config.json's object -> a validated Config (an old one names only its
        model_type, and gets the architecture ARCHITECTURES maps it to)."""
        arch = d.get("architectures") or [ARCHITECTURES.get(d.get("model_type"))]
        if not (isinstance(arch, list) and arch[0] in ARCHITECTURES.values()):
            raise ValueError(f"architectures {arch!r}: unsupported (supported: "
                             f"{', '.join(ARCHITECTURES.values())})")
        d = {**ARCH_DEFAULTS.get(arch[0], {}), **d, "architectures": arch}
        # a required key missing: TypeError
        cfg = cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        cfg.validate()
        return cfg

    def validate(self):
        """A ValueError naming the key for a value that would break the build or run
        wrong silently: a config.json is input."""
        def number(v):
            return type(v) in (int, float) and 0 < v < math.inf

        # an eos id past the vocabulary is never drawn: a turn would never stop
        def token_ids(v):
            ids = v if isinstance(v, list) else [v]
            return all(type(i) is int and 0 <= i < self.vocab_size for i in ids)
        # (keys, test of a value, what it must be), checked in order: a check
        # may read the keys before it
        checks = [
            (SIZES, lambda v: type(v) is int and v >= 1, "a positive integer"),
            (("eos_token_id",), token_ids,
             f"a token id below vocab_size {self.vocab_size}, or a list of them"),
            (("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
             lambda v: isinstance(v, bool), "true or false"),
            (("rms_norm_eps", "rope_theta"), number, "a positive number"),
            (("rope_parameters", "rope_scaling"), lambda v: isinstance(v, dict)
             and (v.get("rope_theta") is None or number(v["rope_theta"]))
             and v.get("rope_type", v.get("type", "default")) == "default",
             "a JSON object of default RoPE with a positive rope_theta"),
            (("hidden_act",), lambda v: v == "silu", "silu (the only activation here)"),
            (("layer_types",), lambda v: isinstance(v, list) and len(v) == self.num_hidden_layers
             and all(isinstance(t, str) for t in v), f"a list of {self.num_hidden_layers} names"),
            (("hidden_size",), lambda v: self.head_dim or v % self.num_attention_heads == 0,
             "a multiple of num_attention_heads (or head_dim given)"),
            (("num_attention_heads",), lambda v: v % self.n_kv_heads == 0,
             "a multiple of num_key_value_heads")]
        nullable = {f.name for f in fields(self) if f.default is None}
        for keys, ok, want in checks:
            for key in keys:
                v = getattr(self, key)
                if v is None and key in nullable:
                    continue
                if not ok(v):
                    raise ValueError(f"{key} must be {want}, got {v!r}")

    @property
    def arch(self) -> str:
        """The architecture, one of ARCHITECTURES' values."""
        return self.architectures[0]

    @property
    def n_kv_heads(self) -> int:
        """KV, the key/value heads: as many as the query heads if config.json has none."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """D, the width of a head: head_dim, else hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_base(self) -> float:
        """RoPE's base: rope_parameters', else rope_theta, else transformers' 10000."""
        default = 10000.0 if self.rope_theta is None else self.rope_theta
        return float((self.rope_parameters or {}).get("rope_theta", default))

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens as transformers reads the config;
        None: full causal attention."""
        if self.arch == "MistralForCausalLM":     # every layer
            return self.sliding_window
        # Qwen2: the layers layer_types marks, else those from max_window_layers on
        if self.arch == "Qwen2ForCausalLM" and self.use_sliding_window and self.sliding_window:
            if self.layer_types is not None:
                sliding = self.layer_types[layer] == "sliding_attention"
            else:
                sliding = layer >= self.max_window_layers
            if sliding:
                return self.sliding_window
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a turn: eos_token_id's (one id, a list, or null)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (eos,)


def read_json(path: Path) -> dict:
    """A JSON file's value; a failure to read it is a CheckpointError naming the file."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:    # deep nesting: RecursionError
        raise CheckpointError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None


def read_config(directory) -> Config:
    """directory/config.json as a validated Config, or a CheckpointError naming it."""
    path = Path(directory) / "config.json"
    try:
        return Config.from_dict(read_json(path))
    except (TypeError, ValueError, AttributeError) as e:  # AttributeError: not an object
        raise CheckpointError(f"{path}: {e}") from None


def weight_files(directory: Path) -> list[str]:
    """The names of a checkpoint's safetensors files: model.safetensors, or the
    shards the index's weight_map names, each a plain file beside the index (a
    Hub's index is input)."""
    index = directory / INDEX
    if not index.is_file():
        return ["model.safetensors"]
    content = read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map")
    for file in weight_map.values():    # beside the index: no "../x", no "/etc/x"
        if not (isinstance(file, str) and file == Path(file).name and
                file.endswith(".safetensors") and not file.startswith(".")):
            raise CheckpointError(f"{index}: {file!r} is not a safetensors file beside the index")
    return sorted(set(weight_map.values()))


def read_state_dict(directory: Path, expected: dict, tied: bool, dtype, device) -> dict:
    """Every tensor of `expected` (name -> shape) from the safetensors files, as
    dtype on device, or a CheckpointError naming file and tensor: each present
    once over the shards, none unexpected (another architecture or size), each
    shape (the header's, before the data) the expected one, no NaN or infinity
    in a float tensor (NaN logits: a stop token drawn forever)."""
    state = {}
    for file in weight_files(directory):
        path = directory / file
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:      # safetensors' own error names no file
            raise CheckpointError(f"{path}: missing, truncated or corrupt safetensors file "
                                  f"({e})") from None
        # tied: a stored lm_head.weight is ignored (the head is the embedding)
        with f:
            for name in sorted(k for k in f.keys() if not (tied and k == "lm_head.weight")):
                if name not in expected or name in state:
                    raise CheckpointError(f"{path}: unexpected tensor {name} (or twice)")
                shape = tuple(f.get_slice(name).get_shape())     # the header's
                if shape != expected[name]:
                    raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, "
                                          f"expected {list(expected[name])}")
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise CheckpointError(f"{path}: tensor {name} holds NaN or infinite values")
                state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]} ({len(missing)} missing)")
    return state


def checkpoint_sha256(directory) -> str:
    """A sha256 of what a checkpoint computes with, keying what is made from it
    (fitted probes). A safetensors file over 64 MiB gives its size, header and each
    tensor's first and last 4 KiB: under a second at 7B, not 15 GB read;
    fine-tuning or merging an adapter changes those ends."""
    directory = Path(directory)
    block = 4096                             # bytes hashed at each end of a large tensor
    h = hashlib.sha256(b"checkpoint/1")      # the scheme's version: a change re-keys all
    names = ["config.json", "tokenizer.json"]
    if (directory / INDEX).is_file():
        names.append(INDEX)
    # each file's name and size, then its bytes: all of a small one, the ends of each
    # tensor of a large safetensors file
    for name in names + weight_files(directory):
        path = directory / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                if size <= 64 << 20 or not name.endswith(".safetensors"):     # 64 MiB
                    h.update(f.read())                          # hashed whole
                    continue
                # a safetensors file: 8 bytes of n, an n-byte JSON header, then the data
                n = struct.unpack("<Q", f.read(8))[0]
                header = f.read(min(n, size))
                h.update(header)
                for key, entry in sorted(json.loads(header).items()):
                    if key != "__metadata__":
                        start, end = (8 + n + int(o) for o in entry["data_offsets"])
                        # the first and the last block of the tensor (one if it is short)
                        for at in sorted({start, max(start, end - block)}):
                            f.seek(at)
                            h.update(f.read(min(block, end - at)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise CheckpointError(f"{path}: missing, truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from None
    return h.hexdigest()


def resolve(path_or_repo) -> Path:
    """A local directory as given, or the local copy of a Hub model <org>/<name>
    (fetched once); a CheckpointError for a path that is neither."""
    directory = Path(path_or_repo)
    if directory.is_dir():
        return directory
    if directory.exists() or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*",
                                              str(path_or_repo)):
        raise CheckpointError(f"{directory}: no such directory (nor a Hub model name like "
                              "Qwen/Qwen2.5-7B-Instruct)")
    first = directory.parts[0]
    if Path(first).is_dir():                            # a misspelt path, not a Hub name
        raise CheckpointError(f"{directory}: no such directory ({first}/ is a local directory)")
    return fetch_from_hub(str(path_or_repo))


def fetch_from_hub(repo_id: str) -> Path:
    """Hub model files, fetched once, each checked against the size and hash the Hub's
    tree API lists for it; HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE as huggingface_hub."""
    folder = cache_root() / repo_id.replace("/", "--")     # $PAIR_CACHE/<org>--<name>
    if _complete(folder):
        return folder
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise CheckpointError(f"cannot fetch model {repo_id!r}: HF_HUB_OFFLINE is set; no "
                              f"complete copy in {folder} (copy the files there, or give a "
                              "local directory)")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN")      # requests drops it on the redirect to the CDN
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    import fcntl                        # POSIX only, so imported where it is needed
    folder.mkdir(parents=True, exist_ok=True)
    # torchrun's ranks: one downloads, the others wait for it
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # the Hub's list of the files with their sizes and hashes; then the config, the
            # tokenizer and the index if sharded, then the weight files the index names;
            # the manifest last, so that a copy stopped halfway is fetched again
            if not _complete(folder):
                r = requests.get(f"{endpoint}/api/models/{repo_id}/tree/main", headers=headers,
                                 timeout=(10, HUB_STALL))
                r.raise_for_status()
                listed = {e["path"]: e for e in r.json() if e["type"] == "file"}
                base = f"{endpoint}/{repo_id}/resolve/main/"
                for name in ("config.json", "tokenizer.json", INDEX):
                    if name != INDEX or name in listed:         # an index if sharded
                        _download(base, folder / name, listed[name], headers)
                if not isinstance(read_json(folder / "config.json"), dict):
                    raise CheckpointError(f"{folder / 'config.json'}: not a JSON object")
                for name in weight_files(folder):
                    _download(base, folder / name, listed[name], headers)
                files = {p.name: listed[p.name] for p in folder.iterdir() if p.name in listed}
                write_atomic(folder / HUB_MANIFEST, json.dumps({"repo": repo_id, "files": files}))
        except (requests.RequestException, urllib3.exceptions.HTTPError, KeyError) as e:
            why = f"{type(e).__name__}: {e}"
            if isinstance(e, KeyError):
                why = f"the Hub lists no file {e} for it"
            if isinstance(e, requests.HTTPError) and e.response.status_code in (401, 403):
                why += " (private or gated? set HF_TOKEN to a token that has access)"
            raise CheckpointError(f"cannot fetch {repo_id!r}: {why}; no complete copy in "
                                  f"{folder}") from None
    return folder


def _complete(folder: Path) -> bool:
    """Whether folder holds a finished fetch: its manifest, and each file the
    manifest names still of the size checked then (nothing is hashed again)."""
    try:
        files = json.loads((folder / HUB_MANIFEST).read_text())["files"]
        return all((folder / name).stat().st_size == e["size"] for name, e in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _download(base: str, dest: Path, entry: dict, headers: dict):
    """base + dest.name into dest through a .part file (a copy found is checked,
    a short one resumed by byte range), renamed once its size and hash are those
    the Hub lists (entry)."""
    url = base + quote(dest.name)
    part = dest.with_name(dest.name + ".part")
    # a copy an earlier call left is checked, not trusted
    found = part.exists() or dest.is_file()
    part.touch()
    if dest.is_file():
        os.replace(dest, part)
    # up to HUB_TRIES transfers, each asking for the bytes the .part still lacks
    deadline = time.monotonic() + HUB_STALL + entry["size"] / HUB_RATE
    for attempt in range(HUB_TRIES):
        have = part.stat().st_size
        if have >= entry["size"]:
            break
        time.sleep(2 ** attempt - 1)                            # 0, 1, 3, 7 s
        # the bytes as the Hub hashed them, not compressed
        ask = {**headers, "Range": f"bytes={have}-", "Accept-Encoding": "identity"}
        try:
            with requests.get(url, headers=ask, stream=True, timeout=(10, HUB_STALL)) as r:
                r.raise_for_status()
                # 206: the rest, appended; 200: the whole file again
                with open(part, "ab" if r.status_code == 206 else "wb") as f:
                    for chunk in iter(lambda: r.raw.read1(1 << 20), b""):   # <= 1 MiB
                        f.write(chunk)
                        if time.monotonic() > deadline:
                            raise CheckpointError(f"{url}: past its deadline ({HUB_RATE} B/s)")
        except (requests.ConnectionError, requests.Timeout, urllib3.exceptions.HTTPError):
            if attempt == HUB_TRIES - 1:
                raise                       # the .part is kept: the next call resumes it
    # kept only with the listed size and hash; a bad copy an earlier call left is
    # fetched again once, from byte 0
    size = part.stat().st_size
    # an LFS file is listed with its sha256, any other with git's blob id
    h = hashlib.sha256() if entry.get("lfs") else hashlib.sha1(b"blob %d\0" % size)
    with open(part, "rb") as f:
        digest = hashlib.file_digest(f, lambda: h).hexdigest()
    oid = (entry.get("lfs") or entry)["oid"]
    if size != entry["size"] or digest != oid:
        part.unlink()
        if found:
            return _download(base, dest, entry, headers)
        raise CheckpointError(f"{url}: size or hash mismatch: {size} bytes, {h.name} {digest}; "
                              f"the Hub lists {entry['size']} bytes, {oid}; the copy is deleted")
    os.replace(part, dest)


def load_model(path_or_repo, dtype=torch.float32,
               device="cpu") -> tuple["Transformer", "Tokenizer"]:
    """A checkpoint (a directory or a Hub name) -> (model, tokenizer): the
    weights checked and loaded as dtype on device, frozen (GRPO trains LoRA
    adapters beside them), in eval mode."""
    directory = resolve(path_or_repo)
    config = read_config(directory)
    tokenizer = Tokenizer.from_file(directory)
    # built on "meta" without memory, then given the loaded tensors (assign=True)
    with torch.device("meta"):
        model = Transformer(config)
    tied = config.tie_word_embeddings
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()
                if not (tied and name == "lm_head.weight")}
    state = read_state_dict(directory, expected, tied, dtype, torch.device(device))
    model.load_state_dict(state, strict=not tied, assign=True)    # names checked as read
    if tied:
        # assign=True broke the tie: the head is the embedding again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False).eval()
    model.name_or_path = str(path_or_repo)        # recorded in saved adapters' configs
    model.checkpoint_dir = directory              # what checkpoint_sha256 reads
    return model, tokenizer


def input_device(model: "Transformer") -> torch.device:
    """Where input ids go: the embedding's device (a split model's first)."""
    return model.model.embed_tokens.weight.device


# ---- The transformer, in nanoGPT's order: RoPE, masks, the KV cache, the modules ------
# A block's projections are fused for decoding up to this many weights (16 MB of
# float32): the built-in policy's blocks, not a 0.5B's.
FUSE_MAX_ELEMENTS = 1 << 22
MLP_CHUNK = 4096      # tokens (rows x positions) a recomputed block's MLP runs at a time
# logits computed at a time (64 MB): 152k float32 logits are 0.58 GiB for 1k tokens
LOGITS_CHUNK = 1 << 24


def rope_tables(inv_freq: Tensor, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of p theta_k at positions p (B, T) -> (B, T, D) each, in dtype;
    inv_freq: theta_k = base^(-2k/D), k < D/2."""
    # (B, T, D/2), float32
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)            # (B, T, D): both halves of a head
    return emb.cos().to(dtype), emb.sin().to(dtype)   # (B, T, D) each, the model's dtype


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x (B, H, T, D) as Hugging Face writes it for Qwen, x = (x1, x2)
    its halves:
        x' = x * cos + rotate_half(x) * sin,   rotate_half(x) = (-x2, x1),
    each pair (x1_k, x2_k) rotated by p theta_k: the checkpoints' pairing, no
    weight permuted."""
    x1, x2 = x.chunk(2, dim=-1)                                             # rotate_half
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]  # (B, 1, T, D)


def attention_mask(positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """(B, 1, T, S) bool: key j is visible to query t iff kpos_j <= pos_t (and is
    within the window); positions (B, T), key_positions (B, S)."""
    q, k = positions[:, :, None], key_positions[:, None, :]        # (B, T, 1), (B, 1, S)
    mask = k <= q                                                           # (B, T, S)
    if window is not None:
        mask &= q - k < window
    return mask[:, None]                          # (B, 1, T, S): one mask for every head


def static_address(t: Tensor) -> Tensor:
    """t, marked (on a GPU) as a tensor a CUDA graph writes in place: the KV cache
    is written at its own address every step, not copied into the graph's memory."""
    if t.is_cuda:
        torch._dynamo.mark_static_address(t, guard=False)
    return t


class KVCache:
    """One layer's keys and values, on that layer's device and in its dtype. The layout:
        k, v     (B, KV, capacity, D): slot j of row b holds K (RoPE applied) and V
                 of absolute position j
        lengths  (B,) int64 on the CPU (no device sync): each row's real tokens, so
                 its next slot
    Ragged rows: a slot at or past a row's length holds a pad or old values,
    masked till written."""
    def __init__(self, batch_size, n_kv_heads, head_dim, capacity, dtype, device):
        shape = (batch_size, n_kv_heads, capacity, head_dim)       # (B, KV, capacity, D)
        self.k = static_address(torch.zeros(shape, dtype=dtype, device=device))
        self.v = static_address(torch.zeros(shape, dtype=dtype, device=device))
        self.lengths = torch.zeros(batch_size, dtype=torch.long)        # (B,) on the CPU

    def grow(self, size: int):
        """Make room for at least `size` slots, keeping the old ones: the capacity
        at least doubles, to a multiple of 256 (few sizes, so few compiled graphs)."""
        if size <= self.k.shape[2]:
            return
        new = (max(size, 2 * self.k.shape[2]) + 255) // 256 * 256
        B, KV, old, D = self.k.shape
        self.k = static_address(torch.cat((self.k, self.k.new_zeros(B, KV, new - old, D)), 2))
        self.v = static_address(torch.cat((self.v, self.v.new_zeros(B, KV, new - old, D)), 2))

    def write(self, k: Tensor, v: Tensor, positions: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """Write k, v (B, KV, T, D) to the slots `positions` (B, T) -> the keys
        and values of slots [0, size), (B, KV, size, D) each, the cache grown to
        hold them first."""
        self.grow(size)
        rows = torch.arange(k.shape[0], device=self.k.device)[:, None]      # (B, 1)
        self.k[rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)   # (B, T, KV, D)
        self.v[rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)   # (B, T, KV, D)
        return self.k[:, :, :size], self.v[:, :, :size]           # (B, KV, size, D) each


def set_lengths(cache: list[KVCache], lengths: Tensor):
    """Set every layer's row lengths (B,), each row's real tokens: its slots
    past them are free. Each layer keeps its own CPU copy."""
    for layer_cache in cache:
        layer_cache.lengths = lengths.detach().to("cpu", torch.long).clone()


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean_k x_k^2 + eps) over the last axis, computed in float32."""
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))                          # w (d,)
        self.eps = eps

    def forward(self, x):
        """x (..., d) -> (..., d), in x's dtype."""
        xf = x.float()             # cast back before the weight, in Hugging Face's order
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # x / rms(x)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), (..., d) -> (..., d) through width f."""
    def __init__(self, config: Config):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x):
        """x (..., d) -> (..., d)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (..., d)


class Attention(nn.Module):
    """Grouped-query attention: H query heads share KV key/value heads, G = H /
    KV each. This is the forward over many tokens (prefill, the update); a
    decoding step is decode_block's."""
    def __init__(self, config: Config):
        super().__init__()
        d, H, KV, D = (config.hidden_size, config.num_attention_heads, config.n_kv_heads,
                       config.head_size)
        self.n_heads = H
        self.n_kv_heads = KV
        self.head_dim = D
        self.scale = D ** -0.5                                              # 1 / sqrt(D)
        bias = config.arch == "Qwen2ForCausalLM" or config.attention_bias   # Qwen2: always
        self.q_proj = nn.Linear(d, H * D, bias=bias)
        self.k_proj = nn.Linear(d, KV * D, bias=bias)
        self.v_proj = nn.Linear(d, KV * D, bias=bias)
        self.o_proj = nn.Linear(H * D, d, bias=config.attention_bias)

    def forward(self, x, cos, sin, mask, positions, cache=None):
        """x (B, T, d) -> (B, T, d); mask (B, 1, T, S) bool, or None: causal
        from position 0, where SDPA's fused kernel (its upper-left mask) is
        right: no token sees a right pad."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)                          # the values are not rotated
        if cache is not None:
            # (B, KV, S, D), slots [0, S)
            k, v = cache.write(k, v, positions, mask.shape[-1])
        # enable_gqa: G query heads per KV head, the keys and values not repeated
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FusedWeights(NamedTuple):
    """A block's projections as a decoding step applies them: (weight, bias)
    pairs, the bias None where no projection of the group has one."""
    qkv: tuple[Tensor, Tensor | None]       # q, k and v side by side
    o: tuple[Tensor, Tensor | None]         # o_proj
    gate_up: tuple[Tensor, Tensor | None]   # gate and up side by side
    down: tuple[Tensor, Tensor | None]      # down_proj


class Block(nn.Module):
    """A pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x))."""
    def __init__(self, config: Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, positions, cache=None, mlp_chunk=None):
        """x (B, T, d) -> (B, T, d). mlp_chunk: the MLP that many positions at a
        time, never all (B, T, f) activations, each chunk recomputed in backward."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, cache)
        h = self.post_attention_layernorm(x)
        if mlp_chunk is None or x.shape[1] <= mlp_chunk:
            return x + self.mlp(h)                                          # (B, T, d)
        # each (B, mlp_chunk, d), recomputed in backward
        chunks = [torch.utils.checkpoint.checkpoint(self.mlp, h[:, i:i + mlp_chunk],
                                                    use_reentrant=False)
                  for i in range(0, x.shape[1], mlp_chunk)]
        return x + torch.cat(chunks, 1)                                     # (B, T, d)

    def decode_weights(self) -> FusedWeights | None:
        """The projections fused, an enabled adapter merged in: 4 matmuls a
        token instead of 7 (21 with adapters): a token's matmuls are small,
        their launches dominate. None where fusing would drop a gradient, cost
        memory (a large block) or change the numbers (weights not float32, or
        dropout on): decode_block then applies the modules."""
        a = self.self_attn
        m = self.mlp
        groups = ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj),
                  (m.down_proj,))
        linears = [lin for group in groups for lin in group]  # the block's 7 projections
        big = sum(lin.weight.numel() for lin in linears) > FUSE_MAX_ELEMENTS
        inexact = any(lin.weight.dtype != torch.float32 or getattr(lin, "dropout", 0)
                      and lin.training for lin in linears)
        if torch.is_grad_enabled() or big or inexact:
            return None
        # kept until a tensor is replaced, moved or updated in place, or LoRA is switched
        key = []
        for lin in linears:
            tensors = [(id(t), t.data_ptr(), t._version) for t in lin.parameters()]
            key.append((getattr(lin, "enabled", None), tensors))
        fused = getattr(self, "_fused", None)     # (key, FusedWeights) of the last build
        if fused is None or fused[0] != key:
            with torch.no_grad():
                self._fused = (key, FusedWeights(*[_fuse(group) for group in groups]))
        return self._fused[1]


def _fuse(linears) -> tuple[Tensor, Tensor | None]:
    """Linear layers side by side -> (weight, bias), each enabled adapter merged
    into its weight, W' = W + (alpha / r) B A; a missing bias is zeros, and no
    bias at all is None."""
    weights = []
    for lin in linears:
        if isinstance(lin, LoRALinear) and lin.enabled:
            weights.append(lin.weight + lin.scaling * (lin.lora_B.weight @ lin.lora_A.weight))
        else:
            weights.append(lin.weight)
    weight = torch.cat(weights)                         # (sum of d_out, d_in)
    if all(lin.bias is None for lin in linears):
        return weight, None
    biases = [lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias
              for lin in linears]
    return weight, torch.cat(biases)                                    # (sum of d_out,)


class Transformer(nn.Module):
    """The decoder: embed_tokens, L blocks, the final norm and lm_head (tied:
    the embedding), under the checkpoint's names. forward and trunk run many
    tokens a row (prefill, the update); decode runs one token a row and reports
    the hidden states and attention statistics."""
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = nn.Module()        # the `model.` prefix of the checkpoint keys
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight    # tied: one Parameter
        # RoPE's theta_k = base^(-2k/D), on the CPU (not on "meta")
        d = config.head_size
        self.inv_freq = 1.0 / config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                                device="cpu") / d)
        # each layer's sliding window, None: full causal attention
        self.windows = [config.window(i) for i in range(config.num_hidden_layers)]

    def new_cache(self, batch_size: int, capacity: int = 256) -> list[KVCache]:
        """An empty KV cache per layer, on that layer's device and in its dtype."""
        c = self.config
        return [KVCache(batch_size, c.n_kv_heads, c.head_size, capacity,
                        layer.input_layernorm.weight.dtype, layer.input_layernorm.weight.device)
                for layer in self.model.layers]

    def forward(self, input_ids, positions=None, cache=None) -> Tensor:
        """input_ids (B, T) -> logits (B, T, V) float32; positions, cache: trunk's."""
        return self.lm_head(self.trunk(input_ids, positions, cache)).float()

    def trunk(self, input_ids, positions=None, cache=None, recompute=False) -> Tensor:
        """Up to the final norm: (B, T) -> (B, T, d). positions (B, T): absolute
        (default: after the cache's tokens, else 0..T-1); a cache gets K/V at
        them and its lengths cover them. recompute (under grad): each block
        again in backward, not its activations kept."""
        B, T = input_ids.shape
        dev = self.model.embed_tokens.weight.device        # a split model's first device
        # no positions, no cache, no window: the mask None, for SDPA's causal kernel
        fused_causal = (positions is None and cache is None and T > 1
                        and all(w is None for w in self.windows))
        # the queries' absolute positions, and the keys': the queries themselves without a
        # cache, else every cache slot up to the last position written
        if positions is None:
            start = cache[0].lengths if cache is not None else torch.zeros(B, dtype=torch.long)
            positions = start[:, None] + torch.arange(T)                        # (B, T)
        positions = positions.to(dev)                                   # (B, T) absolute
        if cache is None:
            key_pos = positions                        # the keys are the queries' tokens
        else:
            # the cache's slots [0, S), S = the last position + 1: (B, S)
            key_pos = torch.arange(int(positions.max()) + 1, device=dev).expand(B, -1)
        masks = {w: None for w in set(self.windows)}     # window -> (B, 1, T, S) or None
        if not fused_causal:
            masks = {w: attention_mask(positions, key_pos, w) for w in set(self.windows)}
        cos, sin = rope_tables(self.inv_freq, positions, self.model.embed_tokens.weight.dtype)
        x = self.model.embed_tokens(input_ids.to(dev))                        # (B, T, d)
        # each block on its own device (split_model), its inputs moved there
        for i, layer in enumerate(self.model.layers):
            on = layer.input_layernorm.weight.device        # the block's device
            mask = masks[self.windows[i]]
            layer_cache = cache[i] if cache is not None else None
            inputs = (x.to(on), cos.to(on), sin.to(on), None if mask is None else mask.to(on),
                      positions.to(on), layer_cache)
            if recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    layer, *inputs, mlp_chunk=max(1, MLP_CHUNK // B), use_reentrant=False)
            else:
                x = layer(*inputs)
        if cache is not None:
            set_lengths(cache, torch.maximum(cache[0].lengths, positions.max(1).values.cpu() + 1))
        return self.model.norm(x)                                           # (B, T, d)

    def decode_weights(self) -> list:
        """Block.decode_weights of every block: fused projections, or None (modules)."""
        return [layer.decode_weights() for layer in self.model.layers]

    def decode(self, tokens, lengths, span_start, ks, vs, w, size):
        """One decoding step: tokens (B,) at positions i = lengths (B,), each row's cache
        length, attending over key slots [0, size) of the caches ks, vs (the caller grows
        them and then advances lengths); w: decode_weights() -> on the head's device
            logits (B, V) float32,
            hidden (L+1, B, d): the embedding, blocks 1..L-1, the final-normed block L,
            attn_stats (B, L, H, 6): stats_from's statistics of every layer and query
                head, in STATS order, for the span from span_start (B,), each row's
                turn's first position;
        hidden and attn_stats None without span_start. Only tensors go in: this is
        the function compiled_decode compiles. Masks, RoPE tables and the prefix
        mask are built once a step, and stats_from runs once for all layers."""
        dev = self.model.embed_tokens.weight.device        # a split model's first device
        pos = lengths.to(dev)                                          # (B,) positions i
        key_pos = torch.arange(size, device=dev)                           # (S,) slots j
        visible = key_pos <= pos[:, None]                                   # (B, S)
        # window -> an additive mask (B, 1, 1, S): 0 on the visible slots, -inf elsewhere
        bias = {}
        for win in set(self.windows):
            allowed = visible if win is None else visible & (pos[:, None] - key_pos < win)
            bias[win] = torch.where(allowed, 0.0, float("-inf"))[:, None, None]
        cos, sin = rope_tables(self.inv_freq, pos[:, None], self.model.embed_tokens.weight.dtype)
        # the turn's first position, and a mask 1 on the keys before it (the prefix)
        start = None
        prefix_mask = None
        if span_start is not None:
            start = span_start.to(dev)                                      # (B,)
            prefix_mask = (key_pos < start[:, None]).float()[:, None, None]   # (B, 1, 1, S)
        # every block on the new token, on its own device: its output is a hidden state,
        # and its softmax rows are reduced to four numbers per head
        x = self.model.embed_tokens(tokens.to(dev)[:, None])                # (B, 1, d)
        hidden = [x]                            # the embedding, then each block's output
        reduced = []                             # per layer: (max, sum_sq, prefix, self)
        for i, layer in enumerate(self.model.layers):
            on = ks[i].device           # the block's device (several if split_model ran)
            prefix_i = prefix_mask if prefix_mask is None else prefix_mask.to(on)
            x, r = decode_block(layer, x.to(on), cos.to(on), sin.to(on),
                                bias[self.windows[i]].to(on), pos.to(on), (ks[i], vs[i]),
                                prefix_i, w[i])
            reduced.append(r)
            if i < len(self.model.layers) - 1:
                hidden.append(x)                    # blocks 1..L-1; the L-th goes normed
        x = self.model.norm(x)                  # the last block's device: the head's too
        logits = self.lm_head(x[:, 0]).float()                              # (B, V)
        if start is None:
            return logits, None, None
        # the statistics of every layer and head at once, on the head's device
        out = logits.device             # where the caller accumulates (probes.TurnStats)
        hidden.append(x)                                       # the final-normed block L
        # each of the four numbers of every layer: (B, H, L)
        four = [torch.cat([r[k].to(out) for r in reduced], -1) for k in range(4)]
        mx, sum_sq, prefix, self_ = [t.transpose(1, 2) for t in four]    # (B, L, H) each
        attn_stats = stats_from(mx, sum_sq, prefix, self_, pos.to(out)[:, None, None],
                                start.to(out)[:, None, None])            # (B, L, H) each
        hidden = torch.cat([h.to(out) for h in hidden], 1).transpose(0, 1)  # (L+1, B, d)
        return logits, hidden, torch.stack([attn_stats[name] for name in STATS], -1)


# ---- Collection: a block on one token, and the statistics of its softmax rows ---------
# Transformer.decode runs every block on the new token with decode_block, which computes
# the attention by hand to see its probabilities p and reduces each softmax row to four
# numbers; stats_from turns those into the six statistics (STATS) once for all layers.

def decode_block(block: Block, x, cos, sin, bias, pos, kv, prefix_mask=None, w=None):
    """The block on one token per row, x (B, 1, d) at positions i = pos (B,) ->
    (x, reduced). k, v go to slots pos of kv = (k cache, v cache); the query
    attends over slots [0, S):
        p_ij = softmax_j(q_i . k_j / sqrt(D) + bias_j)   (bias (B, 1, 1, S): 0 or -inf)
    By hand in float32, not SDPA, because p gives the statistics: reduced =
    (max_j p_ij, sum_j p_ij^2, prefix = sum_j p_ij prefix_mask_j, self = 1 -
    prefix), each (B, H, 1); None without prefix_mask (B, 1, 1, S), 1 on the
    keys before the turn. w: the block's FusedWeights, or None: its modules."""
    a = block.self_attn
    h = block.input_layernorm(x)
    B, H, KV, D = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
    if w is None:
        q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)    # (B, 1, H * D or KV * D)
        q = apply_rope(q.view(B, 1, H, D).transpose(1, 2), cos, sin)   # (B, H, 1, D)
        k = apply_rope(k.view(B, 1, KV, D).transpose(1, 2), cos, sin)  # (B, KV, 1, D)
    else:
        # q and k side by side from one matmul, (B, 1, (H + KV) D): rotated together
        qk, v = F.linear(h, *w.qkv).split(((H + KV) * D, KV * D), -1)
        qk = apply_rope(qk.view(B, 1, H + KV, D).transpose(1, 2), cos, sin)
        q, k = qk.split((H, KV), 1)                                 # (B, H | KV, 1, D)
    k_cache, v_cache = kv                                     # (B, KV, capacity, D) each
    rows = torch.arange(B, device=pos.device)                   # row b writes slot pos_b
    k_cache[rows, :, pos] = k[:, :, 0].to(k_cache.dtype)                 # (B, KV, D)
    v_cache[rows, :, pos] = v.view(B, KV, D).to(v_cache.dtype)          # (B, KV, D)
    S = bias.shape[-1]                                               # key slots attended
    k, v = k_cache[:, :, :S], v_cache[:, :, :S]                         # (B, KV, S, D)
    q = (q.float() * a.scale).reshape(B, KV, H // KV, D)                # (B, KV, G, D)
    p = torch.softmax(q @ k.float().transpose(-1, -2) + bias, dim=-1)  # (B, KV, G, S)
    out = (p @ v.float()).view(B, 1, H * D).to(h.dtype)                # (B, 1, H * D)
    reduced = None
    if prefix_mask is not None:
        p = p.view(B, H, 1, -1)                 # (B, H, 1, S): head h = group h // G
        prefix = torch.linalg.vecdot(p, prefix_mask)                    # (B, H, 1)
        # p sums to 1 over the slots, so the span's mass is what the prefix leaves
        reduced = (p.amax(-1), torch.linalg.vecdot(p, p), prefix, 1 - prefix)
    if w is None:
        x = x + a.o_proj(out)                                           # (B, 1, d)
        return x + block.mlp(block.post_attention_layernorm(x)), reduced  # (B, 1, d)
    x = x + F.linear(out, *w.o)                                         # (B, 1, d)
    gate_up = F.linear(block.post_attention_layernorm(x), *w.gate_up)   # (B, 1, 2f)
    gate, up = gate_up.chunk(2, -1)                                     # (B, 1, f) each
    return x + F.linear(F.silu(gate) * up, *w.down), reduced            # (B, 1, d)


def stats_from(mx, sum_sq, prefix, self_, pos, start) -> dict[str, Tensor]:
    """The six statistics (METHOD.md §4) of softmax rows p_i over the causal
    keys j <= i, i = pos, start the turn's first position (all broadcast), from
    four numbers each row is reduced to:
        mx = max_j p_ij,   sum_sq = sum_j p_ij^2,
        prefix = sum_{j < start} p_ij,   self_ = sum_{start <= j <= i} p_ij.
    max, prefix and self are those given; with n = i + 1 and sum_j p_ij = 1 (so a
    mean of 1/n):
        std = sqrt(sum_sq / n - 1 / n^2)        (the population std of the n weights)
        entropy = -log sum_sq                    (Renyi-2; the Head Entropy baseline)
        lookback = m_ctx / (m_ctx + m_new)       (Lookback Lens; 0 where start = 0)
        m_ctx = prefix / start,   m_new = self_ / (i - start + 1)
    (the mean weight of a context key and of a span key) -> STATS name -> a tensor of
    the broadcast shape."""
    n = (pos + 1).float()                                       # causal keys j <= i
    s0 = start.float()                                          # context keys j < start
    m_ctx = prefix / s0.clamp(min=1)                   # clamp: start = 0 is masked below
    m_new = self_ / (pos - start + 1).float()                 # span keys start <= j <= i
    return {"max": mx,
            "std": (sum_sq / n - 1 / n.square()).clamp(min=0).sqrt(),   # clamp: rounding
            "prefix": prefix,
            "self": self_,
            "entropy": -sum_sq.log(),                                   # Renyi-2
            "lookback": torch.where(s0 > 0, m_ctx / (m_ctx + m_new), torch.zeros_like(m_ctx))}


# ---- The decoding step compiled: the call site's, as gpt-fast's generate.py -----------
# compiled_decode is what generation calls for each token: Transformer.decode
# compiled once per kind of device (on a GPU with every size symbolic and
# captured as a CUDA graph), or run eagerly where compiling does not pay, is
# switched off (PAIR_COMPILE=0) or has failed.
COMPILE = os.environ.get("PAIR_COMPILE", "1") != "0"     # 0: decode eagerly everywhere
KEY_BLOCK = 128       # key slots attended in blocks of this many, not the whole capacity
# a graph per relation among the sizes: up to 11, over torch's default 8
RECOMPILE_LIMIT = 32
# on a GPU, CUDA graphs ("reduce-overhead") with every size symbolic
COMPILE_OPTIONS = {"cpu": {}, "cuda": {"mode": "reduce-overhead", "dynamic": True}}
COMPILE_NOTICE_S = 2.0  # seconds: a first call this long was compiling, and says so
_compiled = {}        # device kind: a CompiledStep; "failed": the exception that gave up


def compiled_decode(model: Transformer, tokens, cache, span_start=None, w=None):
    """model.decode of tokens (B,) at each row's cache length (the caller advances
    it), the caches grown first to hold them -> (logits (B, V), hidden (L+1, B,
    d), attn_stats (B, L, H, 6)), hidden and attn_stats None without span_start
    (B,). w: model.decode_weights(), fetched here when None. Compiled where
    compiled_step says it pays, attending over whole KEY_BLOCKs of slots; once
    compiling fails it says so and decodes eagerly for the rest of the process."""
    lengths = cache[0].lengths                          # (B,) on the CPU: no device sync
    size = int(lengths.max()) + 1                       # key slots [0, size) are in use
    for layer_cache in cache:
        layer_cache.grow(size)                          # before a step reads the caches
    if w is None:
        w = model.decode_weights()                      # per block: fused, or None
    ks = [c.k for c in cache]                           # (B, KV, capacity, D) each
    vs = [c.v for c in cache]                           # (B, KV, capacity, D) each
    step = compiled_step(w, cache)                    # None where compiling does not pay
    if step is not None:
        try:
            # the slots in use rounded up to whole KEY_BLOCKs: few shapes to compile
            blocks = min(cache[0].k.shape[2], -(-size // KEY_BLOCK) * KEY_BLOCK)
            if not cache[0].k.is_cuda:
                return step(model, tokens, lengths, span_start, ks, vs, w, blocks)
            # a CUDA graph reads device tensors only, and its next replay overwrites its
            # outputs: they are cloned
            dev = cache[0].k.device
            model.inv_freq = model.inv_freq.to(dev)
            on_dev = [tokens.to(dev), lengths.to(dev), None]
            if span_start is not None:
                on_dev[2] = span_start.to(dev)
            torch.compiler.cudagraph_mark_step_begin()
            logits, hidden, attn_stats = step(model, *on_dev, ks, vs, w, blocks)
            if hidden is None:
                return logits.clone(), None, None
            return logits.clone(), hidden.clone(), attn_stats.clone()
        # no C++ compiler, or a limit: eager from now on
        except (torch._dynamo.exc.TorchDynamoException,
                torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            _compiled["failed"] = e
            why = (str(e).strip().splitlines() or [""])[0]              # its first line
            print(f"model.py: decoding eagerly, torch.compile failed: {type(e).__name__}: "
                  f"{why}", file=sys.stderr, flush=True)
    return model.decode(tokens, lengths, span_start, ks, vs, w, size)


def compiled_step(w: list, cache: list[KVCache]):
    """The CompiledStep of the caches' device kind, built at its first use, or
    None where it does not pay: compiling off or failed, a model split over
    devices (a graph runs on one), a device other than CPU and CUDA, or on the
    CPU any block decoding through its modules."""
    if not COMPILE or "failed" in _compiled or len({c.k.device for c in cache}) > 1:
        return None
    kind = cache[0].k.device.type
    if kind not in ("cpu", "cuda") or kind == "cpu" and any(x is None for x in w):
        return None
    if kind not in _compiled:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        # each size its own symbol: "duck" sizing merges the sizes equal at the first call
        if COMPILE_OPTIONS[kind].get("dynamic"):
            torch.fx.experimental._config.use_duck_shape = False
        _compiled[kind] = CompiledStep(kind)
    return _compiled[kind]


class CompiledStep:
    """Transformer.decode compiled for one kind of device (on a GPU: one graph
    launch a token, not thousands of kernels); a first call long enough to have
    been compiling says how long."""
    def __init__(self, kind: str):
        self.step = torch.compile(Transformer.decode, fullgraph=True, **COMPILE_OPTIONS[kind])
        # the first call compiles (a minute) or loads torch's cache (seconds)
        self.first = True

    def __call__(self, *args):
        started = time.perf_counter()
        out = self.step(*args)
        seconds = time.perf_counter() - started
        if self.first and seconds > COMPILE_NOTICE_S:
            print(f"model.py: compiling the decoding step took {seconds:.0f} s (torch caches it "
                  "for later runs; PAIR_COMPILE=0 decodes eagerly)", file=sys.stderr, flush=True)
        self.first = False
        return out


# ---- The update's log-probabilities ---------------------------------------------------
def token_logprobs(policy, ids: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(x_j | x_<j) at the masked positions j, row-major -> (N,) float32,
    in logits chunks. ids, mask (B, T); the trunk recomputes each block in
    backward, and each chunk's logits too."""
    h = policy.trunk(ids, recompute=True)[:, :-1]           # position j predicts x_{j+1}
    target = mask[:, 1:].to(h.device)                       # (B, T-1): the tokens scored
    h, labels = h[target], ids[:, 1:].to(h.device)[target]      # (N, d), (N,)
    n = max(1, LOGITS_CHUNK // policy.config.vocab_size)        # rows of logits a chunk
    parts = []
    for a in range(0, len(labels), n):
        inputs = (policy.lm_head, h[a:a + n], labels[a:a + n], temperature)
        # under grad the chunk's (n, V) logits are computed again in backward, not kept
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(head_logprobs, *inputs,
                                                           use_reentrant=False))
        else:
            parts.append(head_logprobs(*inputs))
    return torch.cat(parts) if parts else torch.zeros(0, device=h.device)     # (N,)


def head_logprobs(lm_head: nn.Module, h: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """log softmax(lm_head(h) / T)[label] -> (n,) float32; h (n, d), labels (n,); T = 0: 1."""
    logits = lm_head(h).float()                                 # (n, V)
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


# ---- Tokenizer and the chat format (METHOD.md §2, §3); text kept encodable ------------
# What Qwen2.5's own chat template puts first when a chat has no system message.
DEFAULT_SYSTEM = ("You are Qwen, created by Alibaba Cloud. "
                  "You are a helpful assistant.")
# Half a UTF-16 pair: not UTF-8, so text holding one cannot be encoded.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """A tokenizers.Tokenizer with ChatML around it: only the template puts
    special tokens (text that spells one is encoded as ordinary characters).
    Knows im_start_id, im_end_id, pad_id."""
    def __init__(self, tok):
        self.tok = tok
        tok.encode_special_tokens = True      # an attribute of the instance: never saved
        for name, text in (("im_start_id", "<|im_start|>"), ("im_end_id", "<|im_end|>"),
                           ("pad_id", "<|endoftext|>")):
            token_id = tok.token_to_id(text)
            if token_id is None:
                raise ValueError(f"tokenizer has no {text} token (not a Qwen2.5 tokenizer?)")
            setattr(self, name, token_id)

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        """A tokenizer.json, or the one in a directory; unreadable: a CheckpointError naming it."""
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:      # the library's own error names no file
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"{path}: not a readable tokenizer ({why})") from None

    def encode(self, text: str) -> list[int]:
        """The ids of text as text: special-token text in it is encoded as ordinary characters."""
        return self.tok.encode(without_surrogates(text), add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        """The text of token ids."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render(self, messages, add_generation_prompt=False) -> tuple[list[int], list[tuple]]:
        """A chat (messages with role and content) -> its ChatML ids and each assistant
        message's span [start, end) (METHOD.md §3); a system message first if it has none.
        add_generation_prompt: the header of the assistant's next turn appended."""
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
        # each message "<|im_start|>{role}\n{content}<|im_end|>\n", its text encoded as text
        ids, spans = [], []
        for m in messages:
            head = f"{m['role']}\n"
            text = without_surrogates(head + m["content"])
            enc = self.tok.encode(text, add_special_tokens=False)
            ids.append(self.im_start_id)
            # an assistant span: from the first token reaching past the head
            # "assistant\n" to its <|im_end|>, included
            if m["role"] == "assistant":
                start = len(ids) + bisect_right([e for _, e in enc.offsets], len(head))
                spans.append((start, len(ids) + len(enc.ids) + 1))
            ids += enc.ids + [self.im_end_id] + self.encode("\n")
        if add_generation_prompt:
            ids += [self.im_start_id] + self.encode("assistant\n")
        return ids, spans


def holds_lone_surrogate(value) -> bool:
    """Whether a JSON-able value holds a lone surrogate anywhere, its keys included."""
    return bool(LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False)))


def without_surrogates(text: str) -> str:
    """text with each lone surrogate replaced by U+FFFD: the same length, and encodable."""
    return LONE_SURROGATE.sub("\ufffd", text)


# ---- LoRA (Hu et al., 2021) in PEFT's layout: q_proj gains lora_A and lora_B ----------
#     y = x W^T + b + (alpha / r) B A dropout(x),   A (r, d_in), B (d_out, r) = 0 at first;
# float32 (PEFT's default) under bfloat16 weights: the adapter's updates are tiny.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."     # PEFT's prefix of the wrapped model's weight names


@dataclass
class LoraSettings:
    """An adapter's hyper-parameters, as PEFT's LoraConfig names them (alpha: lora_alpha)."""
    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    use_rslora: bool = False    # PEFT's rank-stabilized variant: scaling alpha / sqrt(r)


class LoRALinear(nn.Module):
    """A frozen nn.Linear with an adapter beside it, under the base's keys (weight, bias)
    and PEFT's (lora_A, lora_B): y = x W^T + b + scaling B A dropout(x), (..., d_in) ->
    (..., d_out). enabled False: the base layer alone (GRPO's reference policy)."""
    def __init__(self, base: nn.Linear, s: LoraSettings, dtype=torch.float32):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight                        # (d_out, d_in), frozen
        self.register_parameter("bias", base.bias)     # None for o/gate/up/down in Qwen2
        # alpha / r, or alpha / sqrt(r) for rsLoRA
        self.scaling = s.alpha / (math.sqrt(s.r) if s.use_rslora else s.r)
        self.dropout = s.dropout                         # on the adapter's input only
        self.lora_dropout = nn.Dropout(s.dropout) if s.dropout > 0 else nn.Identity()
        kw = dict(bias=False, device=base.weight.device, dtype=dtype)   # float32 by default
        self.lora_A = nn.Linear(self.in_features, s.r, **kw)     # (r, d_in)
        self.lora_B = nn.Linear(s.r, self.out_features, **kw)    # (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))    # PEFT's init
        nn.init.zeros_(self.lora_B.weight)          # B = 0: the model unchanged at first
        self.enabled = True

    def forward(self, x):
        """x (..., in) -> (..., out): the base layer's output, plus the adapter's when enabled."""
        y = F.linear(x, self.weight, self.bias)                             # x W^T + b
        if not self.enabled:
            return y
        # F.linear, not the modules: a module call costs more than these small matmuls
        x = x.to(self.lora_A.weight.dtype)
        if self.dropout > 0:
            x = self.lora_dropout(x)
        a = F.linear(x, self.lora_A.weight)                                    # (..., r)
        return y + (F.linear(a, self.lora_B.weight) * self.scaling).to(y.dtype)


def apply_lora(model: nn.Module, r=16, alpha=32.0, dropout=0.05, targets=LORA_TARGETS,
               use_rslora=False, dtype=torch.float32) -> nn.Module:
    """Freeze `model` and wrap every nn.Linear child named in `targets` in a LoRALinear,
    in place -> the model, its lora_settings recorded (save_adapter writes them)."""
    s = LoraSettings(r, float(alpha), float(dropout), tuple(targets), bool(use_rslora))
    sites = [(module, name, child) for module in model.modules()
             for name, child in module.named_children()
             if name in s.targets and type(child) is nn.Linear]
    missing = sorted(set(s.targets) - {name for _, name, _ in sites})
    if missing:
        raise ValueError(f"LoRA targets {missing} match no nn.Linear module of the model")
    model.requires_grad_(False)                                 # only the adapters train
    for module, name, child in sites:
        setattr(module, name, LoRALinear(child, s, dtype).train(child.training))
    model.lora_settings = s
    return model


def lora_parameters(model):
    """(name, Parameter) of every adapter weight, names as in model.state_dict()."""
    return ((n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)


@contextlib.contextmanager
def lora_disabled(model):
    """`with lora_disabled(model):` runs the base model (GRPO's pi_ref) without copying weights."""
    was = {m: m.enabled for m in model.modules() if isinstance(m, LoRALinear)}
    for m in was:
        m.enabled = False
    try:
        yield model
    finally:
        for m, enabled in was.items():
            m.enabled = enabled


@torch.no_grad()
def load_lora_state(policy, state: dict[str, torch.Tensor]):
    """Copy the adapter weights of state (name -> tensor) into policy's, in
    place: an optimizer holding them keeps its tensors."""
    for n, p in lora_parameters(policy):
        p.copy_(state[n])


def save_adapter(model, path, base_model_name_or_path=None):
    """Write the model's adapter to the folder `path`: its config and its float32 weights."""
    s, folder = model.lora_settings, Path(path)             # (write_atomic creates it)
    tensors = {PEFT_PREFIX + n: p.detach().to("cpu").contiguous()
               for n, p in lora_parameters(model)}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path":
              base_model_name_or_path or getattr(model, "name_or_path", None),
              "revision": None, "inference_mode": True, "r": s.r,
              "lora_alpha": int(s.alpha) if s.alpha.is_integer() else s.alpha,
              "lora_dropout": s.dropout, "target_modules": sorted(s.targets),
              "use_rslora": s.use_rslora, "bias": "none", "fan_in_fan_out": False,
              "init_lora_weights": True, "use_dora": False, "lora_bias": False,
              "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    write_atomic(folder / ADAPTER_WEIGHTS, safetensors_bytes(tensors, {"format": "pt"}))
    write_atomic(folder / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())


def load_adapter_weights(policy, directory):
    """Load policy's LoRA weights from save_adapter's `directory`, checked against the
    policy's settings, names and shapes (lab/policies/adapters.py reads any PEFT adapter)."""
    config, file, s = (Path(directory) / ADAPTER_CONFIG, Path(directory) / ADAPTER_WEIGHTS,
                       policy.lora_settings)
    c = json.loads(config.read_text())
    if not isinstance(c, dict) or (s.r, s.alpha, s.use_rslora, set(s.targets)) != (
            c.get("r"), c.get("lora_alpha"), c.get("use_rslora"),
            set(c.get("target_modules", ()))):
        raise ValueError(f"{config}: not an adapter with the settings of the model's ({s})")
    with safe_open(str(file), framework="pt") as f:
        tensors = {key[len(PEFT_PREFIX):]: f.get_tensor(key) for key in f.keys()}
    for name, p in lora_parameters(policy):
        if name not in tensors or tensors[name].shape != p.shape \
                or not torch.isfinite(tensors[name]).all():
            raise ValueError(f"{file}: {name} is missing, not of shape {list(p.shape)}, or holds "
                             "NaN or infinite values")
    load_lora_state(policy, tensors)
    return policy


# ---- Files (where fetched and fitted ones live, atomic writes) and --devices ----------
def cache_root() -> Path:
    """Where everything fetched or fitted once is kept: $PAIR_CACHE, else ~/.cache/pair."""
    return Path(os.environ.get("PAIR_CACHE") or Path.home() / ".cache" / "pair").expanduser()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write data to path through a temporary file os.replace'd over it: a
    reader sees the old file or the new one, whole. Leftovers of killed writes
    to the same path are removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary file is .NAME.<pid>.<tid>.tmp
    leftover = re.compile(rf"\.{re.escape(path.name)}\.\d+\.\d+\.tmp")
    for name in [n for n in os.listdir(path.parent) if leftover.fullmatch(n)]:
        # signal 0 only asks whether the pid lives: a dead one's file is a killed
        # write's leftover; a live one's may be a write under way
        # (PermissionError: another user's)
        try:
            os.kill(int(name.split(".")[-3]), 0)
        except ProcessLookupError:
            (path.parent / name).unlink(missing_ok=True)
        except (PermissionError, OverflowError):
            pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parse_devices(text: str) -> list[torch.device]:
    """--devices "cuda:0,cuda:1" or "cpu" -> the devices, or a one-line ValueError."""
    try:
        devices = [torch.device(d.strip()) for d in text.split(",")]
    except RuntimeError:                                # "", "foo", "cuda:x"
        devices = []
    if not devices or any(d.type not in ("cpu", "cuda") for d in devices):
        raise ValueError(f"--devices {text!r}: not a list of devices like cuda:0,cuda:1 or cpu")
    n_gpus = torch.cuda.device_count()
    if any(d.type == "cuda" and (d.index or 0) >= n_gpus for d in devices):
        raise ValueError(f"--devices {text}: this PyTorch sees {n_gpus or 'no'} CUDA device(s)")
    return devices


# ---- The layers split over the devices --devices names (placement, no pipelining) -----
def balance_layers(block_sizes: list[int], n_devices: int, first_extra=0, last_extra=0):
    """Layers per device: contiguous ranges whose loads come closest to an even share each."""
    n_layers = len(block_sizes)
    if not 1 <= n_devices <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_devices} devices")
    # parameters: the embedding's on the first device, the head's on the last
    total = first_extra + sum(block_sizes) + last_extra
    load_before = [first_extra + sum(block_sizes[:b]) for b in range(n_layers + 1)]
    cuts = [0]
    for k in range(1, n_devices):
        lo = cuts[-1] + 1                   # a layer for each device before the cut
        hi = n_layers - (n_devices - k)     # and one for each device after it
        # cut k: where the load before it comes nearest k/n of the total
        share = k * total / n_devices
        cuts.append(min(range(lo, hi + 1), key=lambda b: abs(load_before[b] - share)))
    cuts.append(n_layers)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def split_model(model, devices, layer_counts=None):
    """Place model.model.layers on `devices` in contiguous ranges of
    layer_counts; the embedding on the first device, norm and head on the last
    (new_cache puts each block's cache with it). The forward passes (trunk,
    Transformer.decode) move the activations to each block's device as they go.
    layer_counts None: balanced on parameter counts (balance_layers)."""
    devices = [torch.device(d) for d in devices]
    inner = model.model
    layers = model.model.layers
    head = model.lm_head
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
    # a tied head sits on the last device, the embedding on the first: the head becomes a
    # frozen copy, which stays equal to the embedding only while both are frozen
    if head.weight is inner.embed_tokens.weight and devices[0] != devices[-1]:
        if inner.embed_tokens.weight.requires_grad:
            raise ValueError("tied embeddings are copied to the last device; freeze them first "
                             "(apply_lora does) or split over one device")
        head.weight = nn.Parameter(inner.embed_tokens.weight.detach().to(devices[-1]),
                                   requires_grad=False)
    model.layer_devices = [d for d, n in zip(devices, layer_counts) for _ in range(n)]
    placement = [(inner.embed_tokens, devices[0]), *zip(layers, model.layer_devices),
                 (inner.norm, devices[-1]), (head, devices[-1])]
    for module, device in placement:
        module.to(device)
    return model
