"""A hand-written Qwen2-family decoder that reports its own hidden states and attention statistics,
and what it needs around it: loading a checkpoint, a tokenizer, generation, LoRA, a layer split.

PAIR reads its reward from the policy's internals (METHOD.md §4); this model returns them natively:
  * `hidden_states`: L+1 tensors in the Hugging Face convention (embedding output, the output of
    blocks 1..L-1, then the final-normed output of block L);
  * `attn_stats`: for every layer l and query head h, six statistics of the softmax row p_i of
    every query row i of the evaluation-turn span [span_start, span_end), averaged over those
    rows (keys j <= i are the causal keys; a sliding window's masked keys count as zeros):
        max      = max_j p_ij
        std      = population std of p_i0..p_ii
        prefix   = sum_{j < span_start} p_ij
        self     = sum_{span_start <= j <= i} p_ij
        entropy  = -log sum_j p_ij^2                     (Renyi-2, the Head Entropy baseline)
        lookback = m_ctx / (m_ctx + m_new), m_ctx = mean_{j<span_start} p_ij,
                   m_new = mean_{span_start<=j<=i} p_ij  (Lookback Lens; 0 when span_start = 0)
    All six follow from three numbers per row: max_j p_ij, sum_j p_ij^2 and the prefix mass
    (sum_j p_ij = 1, so self = 1 - prefix, and std^2 = sum_j p_ij^2 / (i+1) - 1/(i+1)^2);
    the code carries self as a fourth (`stats_from`). They are computed only for the
    span rows (a block of span rows x keys per head, in float32), never as a T x T matrix, in a
    teacher-forced forward and while generating with the KV cache. Without a span the forward is
    a plain forward.

Architectures: Qwen2ForCausalLM (QKV bias, GQA, tied or untied embeddings), LlamaForCausalLM and
MistralForCausalLM (no bias; Mistral's sliding window). Modules carry the Hugging Face weight
names, so loading a checkpoint (a local directory, or a Hub name downloaded once into
$PAIR_CACHE) is a strict `load_state_dict` after every file, tensor and shape is checked.

Positions are explicit and every attention mask is built from them: key slot j is visible to the
query at position p iff j <= p (and p - j < window). The KV cache is indexed by absolute position,
so several rows can append ragged blocks of tokens, each at its own offset (multi-turn rollouts
append observations mid-conversation). Pad queries of a ragged append get positions past the row's
real tokens; their cache slots hold garbage that no real query can see (slot <= position) until the
row's next real token overwrites it.

Generation follows gpt-fast's small functions (`prefill`, `decode_one_token`, `sample`). Every
generated token, the final <|im_end|> included, is fed through the model once: the cache holds it,
and `accumulate` adds its statistics and hidden states to its turn's running sums (`TurnStats`),
so no second forward pass is run. The decoding step runs compiled (`torch.compile`) where that
pays: a small model on the CPU, and any model on one GPU, where it is also captured as a CUDA
graph (compiled_step). The GRPO update's log-probabilities (`token_logprobs`) recompute each block
and the head in chunks, so that a long rollout's update holds little more than one (T, d) tensor
per block.
Departure from the authors' release (METHOD.md §4): std is over the i+1 causal keys, not the whole
padded row, and the statistics come from the generation pass instead of a second eager forward.

Top to bottom: the config and loading a checkpoint (local or from the Hub), RoPE, the KV cache,
the span statistics, the transformer, its compiled decoding step, the tokenizer and the chat
format, generation and teacher-forced traces, LoRA and its adapter files (PEFT's layout), the
layer split across devices, and the file helpers the whole project writes with.
"""
import contextlib
import hashlib
import inspect
import json
import math
import os
import re
import struct
import sys
import tempfile
import time
from bisect import bisect_right
from dataclasses import dataclass, field, fields, MISSING
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import requests
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn, Tensor

STATS = ("max", "std", "prefix", "self", "entropy", "lookback")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# --dtype of every script takes these names, torch's, and only these
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------
# The config and loading a checkpoint: a local directory or a Hugging Face Hub name


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM"}      # model_type -> architecture

# transformers < 5 saves only the keys that differ from its class defaults; these defaults of
# the config classes differ from the dataclass defaults below.
ARCH_DEFAULTS = {"Qwen2ForCausalLM": {"max_window_layers": 28},
                 "MistralForCausalLM": {"sliding_window": 4096}}

# (config.json key, largest value, may be absent): sizes a config may ask for; every released
# model is far below these (the largest has ~126 layers and a 256K vocabulary).
INT_LIMITS = (("vocab_size", 1 << 22, False), ("hidden_size", 1 << 16, False),
              ("intermediate_size", 1 << 18, False), ("num_hidden_layers", 1024, False),
              ("num_attention_heads", 1024, False), ("num_key_value_heads", 1024, True),
              ("head_dim", 4096, True), ("max_position_embeddings", 1 << 24, False),
              ("sliding_window", 1 << 24, True))


class CheckpointError(Exception):
    """A checkpoint directory that cannot be loaded exactly; the message names file and tensor."""


@dataclass
class Config:
    """The config.json of a checkpoint; field names are its keys, unknown keys are dropped."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    architectures: list[str] = field(default_factory=lambda: ["Qwen2ForCausalLM"])
    model_type: str | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float | None = None         # transformers < 5 writes the RoPE base here,
    rope_parameters: dict | None = None     # transformers >= 5 writes {"rope_theta", "rope_type"}
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Llama's switch; Qwen2 always has a QKV bias
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False        # Qwen2: windows only when set, from max_window_layers
    max_window_layers: int = 0
    layer_types: list[str] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        if not isinstance(d, dict):
            raise ValueError(f"must be a JSON object, not {type(d).__name__}")
        d = dict(d)
        arch = d.get("architectures")
        if arch is not None and not (isinstance(arch, list) and
                                     all(isinstance(a, str) for a in arch)):
            raise ValueError(f"architectures must be a list of names, got {arch!r}")
        if not d.get("architectures"):
            if d.get("model_type") not in ARCHITECTURES:
                raise ValueError("no architectures entry and no known model_type")
            d["architectures"] = [ARCHITECTURES[d["model_type"]]]
        arch = d["architectures"][0]
        d = {**ARCH_DEFAULTS.get(arch, {}), **d}
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in d
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"no {', '.join(missing)} (a model's config.json has them)")
        cfg = cls(**{k: v for k, v in d.items() if k in known})
        cfg.validate()
        return cfg

    def validate(self):
        """Types and ranges first, before anything is built from them: a config.json is input,
        and num_hidden_layers = 10**6 would take minutes and gigabytes to build before any weight
        is read. The limits are far above every released model."""
        def bad(key, want):
            return ValueError(f"{key} must be {want}, got {getattr(self, key)!r}")
        for key, hi, optional in INT_LIMITS:
            v = getattr(self, key)
            if v is None and optional:
                continue
            if type(v) is not int or not 1 <= v <= hi:
                raise bad(key, f"an integer in 1..{hi}")
        if type(self.max_window_layers) is not int or self.max_window_layers < 0:
            raise bad("max_window_layers", "an integer >= 0")
        for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
            v = getattr(self, key)
            ids = v if isinstance(v, list) else [v]
            if v is not None and not all(type(i) is int and 0 <= i < self.vocab_size
                                         for i in ids):   # an eos never drawn: no stop
                raise bad(key, f"a token id below vocab_size {self.vocab_size} (or, for "
                               "eos_token_id, a list of them)")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "true or false")
        if type(self.rms_norm_eps) not in (int, float) or not 0 < self.rms_norm_eps < 1:
            raise bad("rms_norm_eps", "a number between 0 and 1")
        for key in ("rope_parameters", "rope_scaling"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), dict):
                raise bad(key, "a JSON object")
        for key, theta in (("rope_theta", self.rope_theta),
                           ("rope_parameters.rope_theta",
                            (self.rope_parameters or {}).get("rope_theta"))):
            if theta is not None and (type(theta) not in (int, float) or
                                      not 0 < theta < math.inf):
                raise ValueError(f"{key} must be a positive number, got {theta!r}")
        if not isinstance(self.hidden_act, str):
            raise bad("hidden_act", "a name")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads} (and no head_dim)")
        if self.layer_types is not None and (
                not isinstance(self.layer_types, list) or
                len(self.layer_types) != self.num_hidden_layers or
                not all(isinstance(t, str) for t in self.layer_types)):
            raise bad("layer_types", f"a list of {self.num_hidden_layers} names")
        if self.arch not in ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {self.architectures!r} "
                             f"(supported: {', '.join(ARCHITECTURES.values())})")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (only silu)")
        for scaling in (self.rope_parameters, self.rope_scaling):
            kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
            if kind != "default":
                raise ValueError(f"unsupported RoPE type {kind!r} (only default RoPE)")
        if self.num_attention_heads % self.n_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def arch(self) -> str:
        return (self.architectures or ["?"])[0]

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_base(self) -> float:
        if self.rope_parameters and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return float(self.rope_theta if self.rope_theta is not None else 10000.0)

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "Qwen2ForCausalLM" or self.attention_bias

    def window(self, layer: int) -> int | None:
        """Sliding-window size of one layer (None = full causal attention), as transformers does."""
        if self.arch == "MistralForCausalLM":
            return self.sliding_window
        if self.arch == "Qwen2ForCausalLM" and self.use_sliding_window and self.sliding_window:
            if self.layer_types is not None:
                sliding = self.layer_types[layer] == "sliding_attention"
            else:
                sliding = layer >= self.max_window_layers
            return self.sliding_window if sliding else None
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, ValueError, RecursionError) as e:    # deep nesting: RecursionError
        raise CheckpointError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None


def read_config(directory) -> Config:
    path = Path(directory) / "config.json"
    try:
        return Config.from_dict(read_json(path))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


# config.json keys of a checkpoint trained on a built-in world (`python -m lab.shop sft` writes
# them): the world's name, and the tool list and reply format it appends to a task in the first
# user message, so that a prompt can be shown to the model as it saw tasks in training.
WORLD_KEY = "pair_world"

TOOLS_KEY = "pair_tool_instructions"


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except Exception as e:      # safetensors raises its own error for truncated or corrupt files
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({e})") from None


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """{file name: tensor names it must hold}; an empty list means 'whatever it holds'."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        index_json = read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            # a shard is a plain file beside the index: "../x.safetensors" or "/etc/x" would
            # read whatever the index points at
            if not (isinstance(file, str) and file == Path(file).name and
                    file.endswith(".safetensors") and not file.startswith(".")):
                raise CheckpointError(f"{index}: tensor {name} is mapped to {file!r}, not a "
                                      "safetensors file beside the index")
            files.setdefault(file, []).append(name)
        return files
    if (directory / "model.safetensors").is_file():
        return {"model.safetensors": []}
    raise CheckpointError(f"{directory}: neither model.safetensors nor "
                          "model.safetensors.index.json")


def read_state_dict(directory, expected: dict[str, tuple], config: Config, dtype,
                    device) -> dict:
    """Every tensor of `expected` (name -> shape: what the model built from `config` holds),
    checked for presence, extras and shape, as `dtype` on `device`."""
    directory = Path(directory)
    expected = dict(expected)
    tied = config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight")          # tied heads are not stored (or ignored if they are)
    state, where = {}, {}
    for file, listed in _weight_files(directory).items():
        path = directory / file
        with _open_safetensors(path) as f:
            names = set(f.keys())
            for name in listed:
                if name not in names:
                    raise CheckpointError(f"{path}: missing tensor {name} (listed in the index)")
            for name in sorted(names):
                if listed and name not in listed:
                    raise CheckpointError(f"{path}: unexpected tensor {name} (not in the index)")
                if tied and name == "lm_head.weight":
                    continue
                if name not in expected:
                    raise CheckpointError(f"{path}: unexpected tensor {name} for "
                                          f"{config.arch}")
                if name in where:
                    raise CheckpointError(f"{path}: tensor {name} also in {where[name]}")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, "
                                          f"expected {list(expected[name])}")
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{path}: cannot read tensor {name} ({e})") from None
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    # a model with a NaN weight loads and generates a stop token forever
                    raise CheckpointError(f"{path}: tensor {name} holds NaN or infinite values")
                state[name], where[name] = tensor.to(device=device, dtype=dtype), path
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return state


FINGERPRINT_WHOLE = 64 << 20     # files up to this size are hashed whole

FINGERPRINT_BLOCK = 4096         # bytes read at each end of every tensor of a larger file


def checkpoint_sha256(directory) -> str:
    """A sha256 of what a checkpoint directory computes with, to key what is made from it
    (features, probes, resumed extractions) by content: a copy changes mtime, and a swapped file
    of the same size can keep it.

    config.json, tokenizer.json, the index and any weights file up to 64 MiB are hashed whole; a
    larger safetensors file gives its size, its header and the first and last 4 KiB of every
    tensor: under a second for a 7B model, not minutes on a network disk. Fine-tuning or merging
    changes every tensor it touches, ends included; only an edit inside a tensor goes unseen."""
    directory = Path(directory)
    h = hashlib.sha256(b"checkpoint/1")
    names = ["config.json", "tokenizer.json"]
    if (directory / "model.safetensors.index.json").is_file():
        names.append("model.safetensors.index.json")
    for name in names + sorted(_weight_files(directory)):
        path = directory / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                if size <= FINGERPRINT_WHOLE or not name.endswith(".safetensors"):
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                    continue
                n = struct.unpack("<Q", f.read(8))[0]
                header = f.read(min(n, size))
                h.update(header)
                for key, entry in sorted(json.loads(header).items()):
                    if key == "__metadata__":
                        continue
                    start, end = (8 + n + int(o) for o in entry["data_offsets"])
                    for at in sorted({start, max(start, end - FINGERPRINT_BLOCK)}):
                        f.seek(at)
                        h.update(f.read(min(FINGERPRINT_BLOCK, end - at)))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file "
                                  f"({type(e).__name__}: {e})") from None
    return h.hexdigest()


def resolve(path_or_repo) -> Path:
    """A checkpoint directory, or the local copy of a Hub model name (fetched once)."""
    directory = Path(path_or_repo)
    if directory.is_dir():
        return directory
    if directory.exists():
        raise CheckpointError(f"{directory}: not a checkpoint directory (a file)")
    if not HUB_NAME.fullmatch(str(path_or_repo)):
        raise CheckpointError(f"{directory}: no such directory (nor a Hub model name like "
                              "Qwen/Qwen2.5-7B-Instruct)")
    # <org>/<name> where <org> is a local directory names a path (data/shop-policy misspelt),
    # not a model to fetch: it fails here, before anything is written to the cache
    first = directory.parts[0]
    if Path(first).is_dir():
        raise CheckpointError(f"{directory}: no such directory ({first}/ is a local directory, "
                              "so this is a path, not a Hub model name)")
    return fetch_from_hub(str(path_or_repo))


HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")    # <org>/<name>

HUB_MANIFEST = ".pair-complete.json"

HUB_TIMEOUT = (10, 60)          # (connect, read) seconds

HUB_RETRIES = 5                 # attempts per file; each one resumes where the last one stopped

HUB_RETRY_WAIT = 2.0            # seconds, times the attempt number
NETWORK_ERRORS = (requests.ConnectionError, requests.Timeout,
                  requests.exceptions.ChunkedEncodingError)


class HubError(CheckpointError):
    """A model name that could not be fetched from the Hub (or found complete in the cache)."""


def hub_cache_dir(repo_id: str) -> Path:
    return cache_root() / repo_id.replace("/", "--")


def _cached_copy(folder: Path) -> bool:
    # Complete only when the manifest exists and every file it lists has the listed size.
    try:
        files = json.loads((folder / HUB_MANIFEST).read_text())["files"]
        for name in files:
            _check_hub_name(name, folder, folder.name)
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, HubError):
        return False


def fetch_from_hub(repo_id: str, revision: str = "main") -> Path:
    """Download what load_model needs from `repo_id` (e.g. "Qwen/Qwen2.5-7B-Instruct")."""
    folder = hub_cache_dir(repo_id)
    if _cached_copy(folder):
        return folder
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    offline = (f"cannot fetch model {repo_id!r} from {endpoint}: {{}}; no complete copy in "
               f"{folder} (copy the files there, or give a local directory instead)")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubError(offline.format("HF_HUB_OFFLINE is set"))
    import fcntl                    # POSIX only, so imported where it is needed
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        # torchrun starts one process per GPU: the first one downloads, the others wait here
        # and then find the copy complete.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _cached_copy(folder):
            return folder
        try:
            files = _fetch_files(folder, repo_id, revision, endpoint)
        except NETWORK_ERRORS as e:
            raise HubError(offline.format(f"network unreachable or connection lost "
                                          f"({type(e).__name__})")) from e
        manifest = {"repo": repo_id, "revision": revision, "endpoint": endpoint, "files": files}
        write_atomic(folder / HUB_MANIFEST, json.dumps(manifest, indent=1).encode())
    return folder


def _fetch_files(folder: Path, repo_id, revision, endpoint) -> dict[str, int]:
    """config, tokenizer and weights (one file, or the index and its shards) -> {name: size}."""
    session = requests.Session()
    if os.environ.get("HF_TOKEN"):
        # requests drops this header when the Hub redirects a download to its CDN (other host),
        # which is what we want: the CDN URL is signed.
        session.headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"
    listing = _hub_tree(session, endpoint, repo_id, revision)
    files = {}

    def fetch(name):
        _check_hub_name(name, folder, repo_id)
        if name not in listing:
            raise HubError(f"{repo_id}@{revision} on {endpoint} has no file {name!r}")
        size, digest = listing[name]
        url = f"{endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(name)}"
        _download(session, url, folder / name, size, digest, f"{repo_id}/{name}")
        files[name] = size

    fetch("config.json")
    _check_hub_json(folder / "config.json", "a JSON object")
    fetch("tokenizer.json")
    _check_hub_json(folder / "tokenizer.json", "a JSON object with a \"model\" entry",
                    lambda d: isinstance(d.get("model"), dict))
    if "model.safetensors.index.json" not in listing:
        fetch("model.safetensors")
        return files
    fetch("model.safetensors.index.json")
    index = _check_hub_json(
        folder / "model.safetensors.index.json", "a safetensors index: {\"weight_map\": "
        "{tensor name: shard file name}}",
        lambda d: isinstance(d.get("weight_map"), dict) and d["weight_map"] and
        all(isinstance(v, str) and v.endswith(".safetensors") for v in d["weight_map"].values()))
    for shard in sorted(set(index["weight_map"].values())):
        fetch(shard)
    return files


def _check_hub_name(name: str, folder: Path, repo_id: str):
    """A file name from the Hub (the listing or an index) is joined to the cache folder: it
    must name a plain file inside it. A hostile endpoint could otherwise write anywhere
    ("../../.bashrc", "/etc/x") or over our own bookkeeping (".pair-complete.json")."""
    plain = (isinstance(name, str) and name and name == Path(name).name and
             not name.startswith(".") and "\\" not in name and "\0" not in name and
             (folder / name).resolve().parent == folder.resolve())
    if not plain:
        raise HubError(f"{repo_id}: refusing the file name {name!r} from the Hub (not a plain "
                       f"file name inside {folder})")


def _check_hub_json(path: Path, shape: str, check=None) -> dict:
    # A JSON file is read by load_model only later: a wrong one is removed now, so that a
    # retry fetches it again instead of finding it complete.
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or (check is not None and not check(data)):
            raise ValueError(f"expected {shape}")
    except (OSError, ValueError) as e:
        path.unlink(missing_ok=True)
        raise HubError(f"{path}: not {shape} ({e}); removed it") from None
    return data


def _hub_tree(session, endpoint, repo_id, revision) -> dict[str, tuple[int, tuple | None]]:
    # GET /api/models/{repo}/tree/{revision}: [{"type", "path", "size", "oid", "lfs"?}, ...],
    # paginated through the Link header. For LFS files lfs.oid is the sha256 of the content;
    # for the others oid is the git blob id of the content. -> {path: (size, (kind, hex))}
    url = f"{endpoint}/api/models/{repo_id}/tree/{quote(revision, safe='')}"
    listing = {}
    while url:
        r = session.get(url, timeout=HUB_TIMEOUT)
        _check_status(r, f"model {repo_id!r} at revision {revision!r}")
        try:
            for entry in r.json():
                if entry["type"] == "file":
                    lfs = entry.get("lfs") or {}
                    digest = ("sha256", lfs["oid"]) if lfs.get("oid") else \
                        ("git blob id", entry["oid"]) if not lfs and entry.get("oid") else None
                    listing[entry["path"]] = (int(lfs.get("size", entry["size"])), digest)
        except (ValueError, KeyError, TypeError) as e:
            raise HubError(f"{url}: unexpected answer from the Hub API ({e!r})") from e
        url = r.links.get("next", {}).get("url")
    return listing


def _check_status(r, what):
    if r.status_code in (401, 403):
        raise HubError(f"{r.url}: HTTP {r.status_code}: access to {what} denied (private or "
                       "gated?); set HF_TOKEN to a token that has access")
    if r.status_code == 404:
        raise HubError(f"{r.url}: HTTP 404: {what} not found")
    if r.status_code >= 400:
        raise HubError(f"{r.url}: HTTP {r.status_code} {r.reason}")


def _download(session, url, dest: Path, size: int, digest: tuple | None, label: str):
    if dest.is_file() and dest.stat().st_size == size:
        return                                  # finished by an earlier, interrupted fetch
    part = dest.with_name(dest.name + ".part")
    for attempt in range(1, HUB_RETRIES + 1):
        have = part.stat().st_size if part.exists() else 0
        if part.exists() and have >= size:
            break                               # whole (or too long: the size check says so)
        try:
            with session.get(url, headers={"Range": f"bytes={have}-"} if have else {},
                             stream=True, timeout=HUB_TIMEOUT) as r:
                _check_status(r, label)
                if have and r.status_code != 206:
                    have = 0                    # the server ignored Range: start over
                with open(part, "ab" if have else "wb") as f:
                    progress = _Progress(label, size, have)
                    # Small chunks: what was read before a dropped connection is on disk.
                    for chunk in r.iter_content(chunk_size=1 << 16):
                        f.write(chunk)
                        progress.update(len(chunk))
                        if progress.done > size:
                            break
                    progress.show(end="\n")
            break
        except NETWORK_ERRORS as e:
            if attempt == HUB_RETRIES:
                raise
            got = part.stat().st_size if part.exists() else 0
            print(f"\n{label}: connection lost at {got} bytes ({type(e).__name__}), resuming",
                  file=sys.stderr)
            time.sleep(HUB_RETRY_WAIT * attempt)
    got = part.stat().st_size if part.exists() else 0
    if got != size:
        part.unlink(missing_ok=True)
        raise HubError(f"{url}: downloaded {got} bytes but the Hub lists {size}; removed {part}, "
                       "try again")
    if digest is not None and _digest(part, digest[0], size) != str(digest[1]).lower():
        part.unlink()
        raise HubError(f"{url}: {digest[0]} differs from the Hub's ({digest[1]}); removed "
                       f"{part}, try again")
    os.replace(part, dest)


def _digest(path: Path, kind: str, size: int) -> str:
    if kind == "sha256":
        h = hashlib.sha256()
    else:                   # git's blob id: sha1 of the header "blob <size>\0", then the content
        h = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


class _Progress:
    """A download's progress on stderr: name, bytes, percent, speed. On a terminal one line,
    rewritten twice a second; in a log, a new line when the Pacer says so."""

    def __init__(self, label, total, done):
        self.label, self.total, self.done, self.start_done = label, total, done, done
        self.t0, self.pacer = time.monotonic(), Pacer(total, sys.stderr, every=0.5)

    def update(self, n):
        self.done += n
        if self.done < self.total and self.pacer.due(self.done):
            self.show()

    def show(self, end=""):
        rate = (self.done - self.start_done) / max(time.monotonic() - self.t0, 1e-9) / 1e6
        pct = 100.0 * self.done / max(self.total, 1)
        print(f"{chr(13) if self.pacer.tty else ''}{self.label}: {self.done / 1e6:.1f}/"
              f"{self.total / 1e6:.1f} MB ({pct:.0f}%) {rate:.1f} MB/s",
              end=end if self.pacer.tty else "\n", file=sys.stderr, flush=True)


def load_model(path_or_repo, dtype=torch.float32, devices=None) -> tuple["Transformer",
                                                                         "Tokenizer"]:
    """A checkpoint directory (config.json, safetensors, tokenizer.json) or a Hugging Face Hub
    name such as "Qwen/Qwen2.5-7B-Instruct" (fetched once into $PAIR_CACHE) -> (model, tokenizer).
    devices: one device, or several to split the layers over (split_model)."""
    directory = resolve(path_or_repo)
    devices = [torch.device(d) for d in (devices or ["cpu"])]
    if not devices:
        raise ValueError("devices: empty list")
    config = read_config(directory)
    if not (directory / "tokenizer.json").is_file():
        raise CheckpointError(f"{directory / 'tokenizer.json'}: file not found")
    # Build without allocating, then adopt the loaded tensors (assign=True): one copy in memory.
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = read_state_dict(directory, expected, config, dtype, devices[0])
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight   # assign=True broke the tie
    # The base weights are never trained here (GRPO trains LoRA adapters beside them).
    model.requires_grad_(False).eval()
    model.name_or_path = str(path_or_repo)        # recorded in saved adapters' configs
    model.checkpoint_dir = directory              # what checkpoint_sha256 reads
    if len(devices) > 1:
        # Loaded on the first device, then spread: the blocks move to their devices one by one.
        split_model(model, devices)
    return model, Tokenizer.from_file(directory)


def input_device(model: "Transformer") -> torch.device:
    """Where input ids go: the embedding's device (the first one of a split model)."""
    return model.model.embed_tokens.weight.device


# ----------------------------------------------------------------------------------------------
# RoPE, written as Hugging Face writes it for Qwen (rotate_half), so no weight permutation


def rope_inv_freq(config: Config) -> Tensor:
    d = config.head_size
    # Explicit CPU device: the model may be built under torch.device("meta") for loading.
    return 1.0 / config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d)


def rope_tables(inv_freq: Tensor, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    freqs = positions[..., None].float() * inv_freq.to(positions.device)   # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                 # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = cos[:, None], sin[:, None]                                   # (B, 1, T, D)
    return x * cos + rotate_half(x) * sin


def attention_mask(positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """(B, 1, T, S) bool: key j is visible to query t iff kpos_j <= pos_t (and within window)."""
    q, k = positions[:, :, None], key_positions[:, None, :]
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return mask[:, None]


# ----------------------------------------------------------------------------------------------
# KV cache: one per layer, on that layer's device, slot index = absolute position


def static_address(t: Tensor) -> Tensor:
    """t, marked as a tensor a CUDA graph may write into in place: the compiled decoding step is
    replayed with the addresses it was captured with, and torch.compile captures no graph that
    mutates an input unless that input keeps its address."""
    if t.is_cuda:
        torch._dynamo.mark_static_address(t, guard=False)
    return t


class KVCache:
    def __init__(self, batch_size, n_kv_heads, head_dim, capacity, dtype, device):
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.k = static_address(torch.zeros(shape, dtype=dtype, device=device))
        self.v = static_address(torch.zeros(shape, dtype=dtype, device=device))
        # Number of real tokens per row, kept on the CPU: where each row's next token goes (the
        # trunk's default positions, the decoding step's positions and the key slots it reads).
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def grow(self, size: int):
        if size <= self.capacity:
            return
        # Double (rounded to 256) so that decoding one token at a time reallocates rarely.
        new = (max(size, 2 * self.capacity) + 255) // 256 * 256
        for name in ("k", "v"):
            old = getattr(self, name)
            t = old.new_zeros(old.shape[0], old.shape[1], new, old.shape[3])
            t[:, :, :old.shape[2]] = old
            setattr(self, name, static_address(t))

    def write(self, k: Tensor, v: Tensor, positions: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """Store k, v (B, KV, T, D) at slots `positions` (B, T); return slots [0, size)."""
        self.grow(size)
        positions = positions.to(self.k.device)
        rows = torch.arange(k.shape[0], device=self.k.device)[:, None]
        self.k[rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)   # (B, T, KV, D)
        self.v[rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[:, :, :size], self.v[:, :, :size]


def set_lengths(cache: list[KVCache], lengths: Tensor):
    """Declare how many real tokens each row holds (slots past them are free to overwrite)."""
    for layer_cache in cache:
        layer_cache.lengths = lengths.detach().to("cpu", torch.long).clone()


# ----------------------------------------------------------------------------------------------
# Attention statistics of the span rows (METHOD.md §4)

# Span rows are scored in chunks of at most this many float32 scores (8 MB): the few temporaries
# of a chunk stay below what the MLP of the same block holds anyway, so peak memory is unchanged.
STATS_CHUNK = 1 << 21
# On a GPU the chunk's launches cost more than its memory: 256 MB of scores, a 256-row span over
# 8,192 keys of the 7B's 28 heads in one product per layer.
STATS_CHUNK_GPU = 1 << 26


@dataclass
class SpanRows:
    """Which query rows of one forward call lie in the span, and where each row's span starts."""
    lo: int                 # query indices [lo, hi) cover every span row of the batch
    hi: int
    is_row: Tensor          # (B, hi - lo) bool
    start: Tensor           # (B,) span_start per row (absolute position)
    count: Tensor           # (B,) number of span rows per row

    def to(self, device) -> "SpanRows":
        return SpanRows(self.lo, self.hi, self.is_row.to(device), self.start.to(device),
                        self.count.to(device))


def span_rows(span, positions: Tensor) -> SpanRows:
    """span: (start, end) for every row, or one (start, end) per row; positions: (B, T)."""
    B = positions.shape[0]
    bounds = torch.as_tensor(span, dtype=torch.long, device=positions.device)
    bounds = bounds.expand(B, 2) if bounds.dim() == 1 else bounds
    start, end = bounds[:, 0], bounds[:, 1]
    is_row = (positions >= start[:, None]) & (positions < end[:, None])    # (B, T)
    hit = is_row.any(0).nonzero()
    lo, hi = (int(hit[0]), int(hit[-1]) + 1) if len(hit) else (0, 0)
    return SpanRows(lo, hi, is_row[:, lo:hi], start, is_row.sum(1))


def attention_probs(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) in float32 for a few query rows: (B,H,c,D), (B,KV,S,D) -> (B,H,c,S)"""
    B, H, c, D = q.shape
    kv = k.shape[1]
    # Query head h uses key head h // (H/KV): group the query heads instead of repeating keys.
    # Scale the few queries rather than the many scores; mask in place: one (B,H,c,S) temporary.
    q = (q.float() * scale).reshape(B, kv, (H // kv) * c, D)
    scores = (q @ k.float().transpose(-1, -2)).view(B, H, c, -1)
    return torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)


def masses_matrix(key_pos: Tensor, start: Tensor) -> Tensor:
    """(B, 1, S, 2): for each key slot, [j < span_start, j >= span_start]; key_pos (B, S) or
    (S,), start (B,). A row of probabilities times it gives the prefix and the self mass at once:
    masked keys j > i hold p = 0, so "not before" is exactly span_start <= j <= i."""
    before = (key_pos < start[:, None]).float()                 # (B, S) keys j < span_start
    return torch.stack((before, 1 - before), -1)[:, None]


def row_stats(p: Tensor, pos: Tensor, key_pos: Tensor, start: Tensor) -> dict[str, Tensor]:
    """The six statistics of each row of p (B,H,c,S); pos (B,c), key_pos (B,S), start (B,)."""
    masses = p @ masses_matrix(key_pos, start)                  # (B, H, c, 2)
    return stats_from(p.amax(-1), torch.linalg.vecdot(p, p), *masses.unbind(-1),
                      pos[:, None], start[:, None, None])


def stats_from(mx, sum_sq, prefix, self_, pos, start) -> dict[str, Tensor]:
    """The six statistics from the four numbers of each softmax row (its max, its sum of squares,
    its prefix and self masses); pos (the row's position) and start broadcast against them."""
    n = (pos + 1).float()                                       # causal keys j <= i
    s0 = start.float()
    m_ctx = prefix / s0.clamp(min=1)
    m_new = self_ / (pos - start + 1).float()
    return {
        "max": mx,
        "std": (sum_sq / n - 1 / n.square()).clamp(min=0).sqrt(),
        "prefix": prefix,
        "self": self_,
        "entropy": -sum_sq.log(),
        "lookback": torch.where(s0 > 0, m_ctx / (m_ctx + m_new), torch.zeros_like(m_ctx)),
    }


def add_row_stats(sums: Tensor, p, pos, key_pos, rows: SpanRows, a: int, b: int):
    """Add the statistics of query rows [a, b) that lie in the span to sums (B, H, len(STATS))."""
    stats = row_stats(p, pos, key_pos, rows.start)
    values = torch.stack([stats[name] for name in STATS], -1)   # (B, H, c, 6)
    keep = rows.is_row[:, None, a - rows.lo:b - rows.lo, None]  # (B, 1, c, 1)
    # where, not multiply: rows outside the span may hold inf/nan (e.g. m_new of i < start).
    sums += torch.where(keep, values, 0.0).sum(2)


# ----------------------------------------------------------------------------------------------
# The transformer; module names are the Hugging Face weight keys


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        # Normalise in float32 and cast back before the weight, in Hugging Face's order.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d, H, KV, D = (config.hidden_size, config.num_attention_heads, config.n_kv_heads,
                       config.head_size)
        self.n_heads, self.n_kv_heads, self.head_dim = H, KV, D
        self.scale = D ** -0.5
        self.q_proj = nn.Linear(d, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, KV * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, KV * D, bias=config.qkv_bias)
        # Llama's attention_bias also puts a bias on o_proj; Qwen2's QKV bias does not.
        self.o_proj = nn.Linear(H * D, d, bias=config.attention_bias)

    def forward(self, x, cos, sin, mask, positions, key_pos, cache=None, rows=None):
        """x (B,T,d) -> (B,T,d) and, when rows is given, the per-head sums of the span-row
        statistics (B, H, len(STATS)) in STATS order."""
        B, T, _ = x.shape
        dev = x.device                              # the block may live on any device
        cos, sin = cos.to(dev), sin.to(dev)
        mask = mask.to(dev) if mask is not None else None     # None: plain causal (see trunk)
        positions, key_pos = positions.to(dev), key_pos.to(dev)
        rows = rows.to(dev) if rows is not None else None
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B,H,T,D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(k, v, positions, mask.shape[-1])   # (B, KV, S, D)

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)
        sums = None
        if rows is not None and rows.hi > rows.lo:
            sums = x.new_zeros(B, self.n_heads, len(STATS), dtype=torch.float32)
            self.span_stats(sums, q, k, mask, positions, key_pos, rows)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out), sums

    def decode(self, x, cos, sin, bias, pos, kv, before=None, w=None):
        """One new token per row, x (B, 1, d) at positions pos (B,), its k and v written at
        slots pos of this layer's cache tensors kv = (k, v) (B, KV, capacity, D): the attention
        output and, given before (B, 1, 1, S) (1 on the key slots before each row's span), the
        four numbers of each head's softmax row for stats_from, each (B, H, 1) (a row sums to 1,
        so self = 1 - prefix). By hand, in float32 (its probabilities are the statistics), over
        key slots [0, S), query heads grouped per key head; bias (B, 1, 1, S) is 0 on visible
        slots, -inf elsewhere. w: the fused projections (Block.decode_weights) or None."""
        B, H, KV, D = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        if w is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = apply_rope(q.view(B, 1, H, D).transpose(1, 2), cos, sin)   # (B, H, 1, D)
            k = apply_rope(k.view(B, 1, KV, D).transpose(1, 2), cos, sin)
        else:       # q and k side by side from one matmul: rotated together, in one pass
            qk, v = F.linear(x, *w.qkv).split(((H + KV) * D, KV * D), -1)
            q, k = apply_rope(qk.view(B, 1, H + KV, D).transpose(1, 2), cos, sin).split((H, KV), 1)
        k_cache, v_cache = kv
        rows = torch.arange(B, device=pos.device)
        k_cache[rows, :, pos] = k[:, :, 0].to(k_cache.dtype)                 # (B, KV, D)
        v_cache[rows, :, pos] = v.view(B, KV, D).to(v_cache.dtype)
        S = bias.shape[-1]
        k, v = k_cache[:, :, :S], v_cache[:, :, :S]                         # (B, KV, S, D)
        q = (q.float() * self.scale).reshape(B, KV, H // KV, D)             # (B, KV, G, D)
        p = torch.softmax(q @ k.float().transpose(-1, -2) + bias, dim=-1)  # (B, KV, G, S)
        out = (p @ v.float()).view(B, 1, H * D).to(x.dtype)
        numbers = None
        if before is not None:
            p = p.view(B, H, 1, -1)                                         # (B, H, 1, S)
            prefix = torch.linalg.vecdot(p, before)
            numbers = (p.amax(-1), torch.linalg.vecdot(p, p), prefix, 1 - prefix)
        return (self.o_proj(out) if w is None else F.linear(out, *w.o)), numbers

    def span_stats(self, sums, q, k, mask, positions, key_pos, rows: SpanRows):
        """Recompute q k^T for the span rows only, a chunk of rows at a time: (B, H, c, S).
        mask None: the plain causal forward, whose span rows' masks are built here."""
        B, H, _, _ = q.shape
        k = k.float()
        budget = STATS_CHUNK if q.device.type == "cpu" else STATS_CHUNK_GPU
        step = max(1, budget // (B * H * k.shape[2]))
        for a in range(rows.lo, rows.hi, step):
            b = min(a + step, rows.hi)
            m = attention_mask(positions[:, a:b], key_pos, None) if mask is None \
                else mask[:, :, a:b]
            p = attention_probs(q[:, :, a:b], k, m, self.scale)
            add_row_stats(sums, p, positions[:, a:b], key_pos, rows, a, b)


class FusedWeights(NamedTuple):     # a block's projections as decoding applies them
    qkv: tuple[Tensor, Tensor | None]       # (weight, bias) of q, k and v side by side
    o: tuple[Tensor, Tensor | None]
    gate_up: tuple[Tensor, Tensor | None]   # gate and up side by side
    down: tuple[Tensor, Tensor | None]


class Block(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, positions, key_pos, cache=None, rows=None,
                mlp_chunk=None):
        """mlp_chunk: the MLP over at most this many tokens at a time, each chunk recomputed in
        the backward pass (the update of a long rollout: its (T, intermediate) activations,
        most of what a recomputed block holds, then never exist for the whole sequence)."""
        a, sums = self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, key_pos,
                                 cache, rows)
        x = x + a
        h = self.post_attention_layernorm(x)
        if mlp_chunk is None or x.shape[1] <= mlp_chunk:
            return x + self.mlp(h), sums
        return x + torch.cat([torch.utils.checkpoint.checkpoint(
            self.mlp, h[:, i:i + mlp_chunk], use_reentrant=False)
            for i in range(0, x.shape[1], mlp_chunk)], 1), sums

    def decode(self, x, cos, sin, bias, pos, kv, before=None, w=None):
        """forward for one new token per row (Attention.decode): (B, 1, d) -> (B, 1, d).
        w: decode_weights(), or None for the modules."""
        a, numbers = self.self_attn.decode(self.input_layernorm(x), cos, sin, bias, pos, kv,
                                           before, w)
        x = x + a
        h = self.post_attention_layernorm(x)
        if w is None:
            return x + self.mlp(h), numbers
        gate, up = F.linear(h, *w.gate_up).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, *w.down), numbers

    def decode_weights(self) -> FusedWeights | None:
        """(weight, bias) of q/k/v, o, gate/up and down as decoding applies them, an enabled
        adapter merged in: four matmuls a token instead of seven (21 with adapters), each costing
        its call, not its arithmetic, at a small model's size. Rebuilt when a tensor's version
        changes or an adapter is switched. None (use the modules) where merging would change the
        numbers (not float32; adapter dropout on), where a gradient is wanted (the fused weights
        are detached), or where a second copy buys nothing (a block over FUSE_MAX_ELEMENTS)."""
        a, m = self.self_attn, self.mlp
        groups = ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj),
                  (m.down_proj,))
        linears = [lin for group in groups for lin in group]
        if torch.is_grad_enabled() or sum(lin.weight.numel() for lin in linears) > \
                FUSE_MAX_ELEMENTS or any(
                lin.weight.dtype != torch.float32 or getattr(lin, "dropout", 0) and lin.training
                for lin in linears):
            return None
        key = [(id(t), t.data_ptr(), t._version) for lin in linears for t in _lora_reads(lin)]
        if getattr(self, "_fused", (None,))[0] != key:
            with torch.no_grad():
                self._fused = key, FusedWeights(*[_fuse(group) for group in groups])
        return self._fused[1]


def _fuse(linears) -> tuple[Tensor, Tensor | None]:
    """One (weight, bias) applying the given projections side by side (a missing bias is 0)."""
    weight = torch.cat([merged_weight(lin) for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    return weight, torch.cat([lin.bias if lin.bias is not None else
                              lin.weight.new_zeros(lin.out_features) for lin in linears])


FUSE_MAX_ELEMENTS = 1 << 22       # 16 MB of float32 per block: the built-in policy, not 0.5B


class Decoder(nn.Module):
    """The `model.` prefix of the checkpoint keys."""
    def __init__(self, config: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Output:
    logits: Tensor | None                       # (B, T, V) float32; None when logits=False
    hidden_states: tuple[Tensor, ...] | None    # L+1 x (B, T, d), Hugging Face convention
    attn_stats: dict[str, Tensor] | None        # STATS -> (B, L, H), span rows averaged


class Transformer(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = rope_inv_freq(config)   # a plain tensor: not a weight of the checkpoint
        self.windows = [config.window(i) for i in range(config.num_hidden_layers)]

    def new_cache(self, batch_size: int, capacity: int = 256) -> list[KVCache]:
        """One empty KV cache per layer, on that layer's device and in its dtype."""
        c = self.config
        return [KVCache(batch_size, c.n_kv_heads, c.head_size, capacity,
                        layer.input_layernorm.weight.dtype, layer.input_layernorm.weight.device)
                for layer in self.model.layers]

    def forward(self, input_ids, positions=None, cache=None, span=None,
                output_hidden_states=False, logits=True) -> Output:
        h, hidden_states, attn_stats = self.trunk(input_ids, positions, cache, span,
                                                  output_hidden_states)
        return Output(self.lm_head(h).float() if logits else None, hidden_states, attn_stats)

    def trunk(self, input_ids, positions=None, cache=None, span=None, output_hidden_states=False,
              recompute=False):
        """Everything up to the final norm: (B,T,d) normed output, hidden states, span stats.

        input_ids (B, T); positions (B, T) absolute positions (default: right after the cache's
        tokens, else 0..T-1); span (start, end) or one per row, in absolute positions. With a
        cache, K/V are written at `positions` and each row's length grows to cover them.
        recompute: where a gradient is wanted, each block keeps only its input and runs again in
        the backward pass, its MLP in chunks of MLP_CHUNK tokens (a long rollout's update)."""
        B, T = input_ids.shape
        dev = self.model.embed_tokens.weight.device
        # A causal forward from position 0 (the GRPO update, teacher-forced traces) lets
        # PyTorch's fused causal kernel skip the mask: upper-left causal is right there, and in a
        # right-padded batch no real token sees a pad. The span rows' statistics build their own.
        fused_causal = (positions is None and cache is None and T > 1
                        and all(w is None for w in self.windows))
        if positions is None:
            start = cache[0].lengths if cache is not None else torch.zeros(B, dtype=torch.long)
            positions = start[:, None] + torch.arange(T)
        positions = positions.to(dev)
        if cache is not None:
            size = int(positions.max()) + 1             # keys are slots [0, size) of the cache
            key_pos = torch.arange(size, device=dev).expand(B, size)
        else:
            key_pos = positions
        masks = {w: None if fused_causal else attention_mask(positions, key_pos, w)
                 for w in set(self.windows)}
        cos, sin = rope_tables(self.inv_freq, positions, self.model.embed_tokens.weight.dtype)
        rows = span_rows(span, positions) if span is not None else None

        x = self.model.embed_tokens(input_ids.to(dev))                          # (B, T, d)
        hidden_states = [x] if output_hidden_states else None
        layer_sums = []
        for i, layer in enumerate(self.model.layers):
            inputs = (x, cos, sin, masks[self.windows[i]], positions, key_pos,
                      cache[i] if cache is not None else None, rows)
            if recompute and torch.is_grad_enabled():
                x, sums = torch.utils.checkpoint.checkpoint(
                    layer, *inputs, mlp_chunk=max(1, MLP_CHUNK // B), use_reentrant=False)
            else:
                x, sums = layer(*inputs)
            layer_sums.append(sums)
            if output_hidden_states and i < len(self.model.layers) - 1:
                hidden_states.append(x)
        x = self.model.norm(x)
        if output_hidden_states:
            hidden_states.append(x)        # Hugging Face: the last hidden state is after the norm
        if cache is not None:
            set_lengths(cache, torch.maximum(cache[0].lengths, positions.max(1).values.cpu() + 1))

        attn_stats = None
        if rows is not None:
            H = self.config.num_attention_heads
            per_layer = [s.to(dev) if s is not None else torch.zeros(B, H, len(STATS), device=dev)
                         for s in layer_sums]
            count = rows.count.to(dev).float()[:, None, None, None]      # 0 span rows -> nan
            means = torch.stack(per_layer, 1) / count                     # (B, L, H, 6)
            attn_stats = dict(zip(STATS, means.unbind(-1)))
        return x, tuple(hidden_states) if output_hidden_states else None, attn_stats

    def decode(self, tokens, cache, span_start=None, w=None):
        """One token per row, tokens (B,), at each row's cache length (the caller advances the
        lengths) -> the logits (B, V) in float32 and, given span_start (B,) (where each row's turn
        began), the token's hidden states (L+1, B, d) and six statistics (B, L, H, 6), all on the
        head's device. w: self.decode_weights(), read once by a caller decoding many tokens
        (checking that they are current costs a fair part of a small model's step).

        The step runs compiled where it can (compiled_step): a small model's step on the CPU
        costs its number of operations, and a GPU's waits on the CPU to launch each kernel. The
        compiled step attends over the slots in use rounded up to whole KEY_BLOCKs (at most the
        capacity), later slots masked, so its shapes change once every KEY_BLOCK tokens."""
        lengths = cache[0].lengths                          # (B,) on the CPU: no device sync
        size = int(lengths.max()) + 1                       # key slots [0, size) are in use
        for layer_cache in cache:
            layer_cache.grow(size)
        w = self.decode_weights() if w is None else w
        args = (tokens, lengths, span_start, [c.k for c in cache], [c.v for c in cache], w)
        step = compiled_step(w, cache)
        if step is not None:
            try:
                blocks = min(cache[0].capacity, -(-size // KEY_BLOCK) * KEY_BLOCK)
                if not cache[0].k.is_cuda:
                    return step(self, *args, blocks)
                # A CUDA graph reads device tensors only, and its outputs live in memory that its
                # next replay overwrites: the caller gets copies.
                dev = cache[0].k.device
                self.inv_freq = self.inv_freq.to(dev)
                on_dev = [None if t is None else t.to(dev) for t in args[:3]]
                torch.compiler.cudagraph_mark_step_begin()
                out = step(self, *on_dev, *args[3:], blocks)
                return tuple(None if t is None else t.clone() for t in out)
            except compile_errors() as e:
                compile_failed(e)
        return self.decode_step(*args, size)

    def decode_weights(self) -> list:
        """Each block's decode_weights(), current for the weights as they are now."""
        return [layer.decode_weights() for layer in self.model.layers]

    def decode_step(self, tokens, lengths, span_start, ks, vs, w, size):
        """decode on the cache tensors ks, vs (one (B, KV, capacity, D) each per layer),
        attending over key slots [0, size); w: each block's decode_weights(). The counterpart of
        trunk with nothing per layer that depends on a row's length: the masks, RoPE tables and
        before-span vector are built once per step, every layer's statistics derived at the end."""
        dev = self.model.embed_tokens.weight.device
        pos = lengths.to(dev)
        key_pos = torch.arange(size, device=dev)
        visible = key_pos <= pos[:, None]                                   # (B, S)
        bias = {win: torch.where(visible if win is None else
                                 visible & (pos[:, None] - key_pos < win),
                                 0.0, float("-inf"))[:, None, None] for win in set(self.windows)}
        cos, sin = rope_tables(self.inv_freq, pos[:, None], self.model.embed_tokens.weight.dtype)
        start = None if span_start is None else span_start.to(dev)
        before = None if start is None else \
            (key_pos < start[:, None]).float()[:, None, None]              # (B, 1, 1, S)
        x = self.model.embed_tokens(tokens.to(dev)[:, None])                # (B, 1, d)
        hidden, numbers, moved = [x], [], {}
        for i, layer in enumerate(self.model.layers):
            # a split model: each device gets the step's tables once
            key = (ks[i].device, self.windows[i])
            if key not in moved:
                moved[key] = [t.to(key[0]) if t is not None else None
                              for t in (cos, sin, bias[key[1]], pos, before)]
            cos_i, sin_i, bias_i, pos_i, before_i = moved[key]
            x, n = layer.decode(x.to(key[0]), cos_i, sin_i, bias_i, pos_i, (ks[i], vs[i]),
                                before_i, w[i])
            numbers.append(n)
            if i < len(self.model.layers) - 1:
                hidden.append(x)
        x = self.model.norm(x)                  # on the head's device (a split model's hooks)
        logits = self.lm_head(x[:, 0]).float()
        if start is None:
            return logits, None, None
        out = logits.device                     # where the caller accumulates (TurnStats)
        hidden.append(x)
        four = [torch.cat([n[k].to(out) for n in numbers], -1) for k in range(4)]   # (B, H, L)
        stats = stats_from(*(t.transpose(1, 2) for t in four), pos.to(out)[:, None, None],
                           start.to(out)[:, None, None])                    # (B, L, H) each
        return (logits, torch.cat([h.to(out) for h in hidden], 1).transpose(0, 1),
                torch.stack([stats[name] for name in STATS], -1))


# ----------------------------------------------------------------------------------------------
# The compiled decoding step

# PAIR_COMPILE=0 decodes eagerly everywhere (the test suite does, but where it compares the two).
COMPILE = os.environ.get("PAIR_COMPILE", "1") != "0"
# The compiled step attends over key slots in blocks of this many, not over the whole capacity:
# a cache made for several turns, doubling as it grows, would up to double the attention's work.
KEY_BLOCK = 128
# torch specializes a graph on the relations among its sizes (span_start given or not, one row
# or more, the slots attended filling the cache or not): 8 graphs once every size is symbolic,
# after the first call's static graph and one more at the first change of each size. Up to 11,
# over torch's default limit of 8, past which the step would decode eagerly for good.
RECOMPILE_LIMIT = 32
# a CUDA graph per step, every size symbolic from the first compile (compiled_step)
COMPILE_OPTIONS = {"cpu": {}, "cuda": {"mode": "reduce-overhead", "dynamic": True}}
_compiled = {}          # device kind: Transformer.decode_step compiled; "failed": why given up


def compile_errors() -> tuple:
    """Compiling failed: no working C++ compiler, or past the limit (FailOnCacheLimitHit before
    torch 2.7), which fullgraph=True raises. Imported here, not with this module: torch's
    compiler is seconds of every command's start, `--help` included."""
    exc = torch._dynamo.exc
    return (exc.TorchDynamoException, *(getattr(exc, name) for name in (
        "FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, name)))


def compiled_step(w: list, cache: list[KVCache]):
    """Transformer.decode_step compiled (called with the model first), or None where compiling
    does not pay or is not wanted: PAIR_COMPILE=0, an earlier failure, a model split over several
    devices, or on the CPU a block decoding with its modules (Block.decode_weights).

    On the CPU inductor compiles it for the shapes of its first call and, at the first change,
    once more with the changed sizes symbolic (batch, key slots, capacity), once per relation
    among them (RECOMPILE_LIMIT). On a GPU it is also captured as a CUDA graph (gpt-fast's
    recipe): one launch instead of thousands of kernels, writing the cache in place at the
    addresses it was captured with (static_address; generate reserves its slots first); every
    size is symbolic from the first call, one compile serving each batch and key-slot count."""
    if not COMPILE or "failed" in _compiled or len({c.k.device for c in cache}) > 1:
        return None
    kind = cache[0].k.device.type
    if kind == "cpu" and any(x is None for x in w) or kind not in ("cpu", "cuda"):
        return None
    if kind not in _compiled:
        print("model.py: compiling the decoding step (under a minute the first time on a machine, "
              "seconds later; PAIR_COMPILE=0 decodes eagerly)", file=sys.stderr, flush=True)
        limit = {}
        if "recompile_limit" in inspect.signature(torch.compile).parameters:
            limit["recompile_limit"] = RECOMPILE_LIMIT          # this function's own
        else:               # older torch: the process's, named cache_size_limit before 2.7
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        if COMPILE_OPTIONS[kind].get("dynamic"):
            # Every size symbolic, each its own symbol: "duck" sizing would take two sizes equal
            # at the first call (4 rows, 4 key heads) for one, and compile again when they part.
            torch.fx.experimental._config.use_duck_shape = False
        _compiled[kind] = torch.compile(Transformer.decode_step, fullgraph=True, **limit,
                                        **COMPILE_OPTIONS[kind])
    return _compiled[kind]


def compile_failed(error: Exception):
    """Decode eagerly from now on, and say so once."""
    _compiled["failed"] = error
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    print(f"model.py: decoding eagerly, torch.compile failed: {type(error).__name__}: {first}",
          file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Tokenizer and the chat format (METHOD.md §2, §3); text kept encodable


class Tokenizer:
    """A tokenizers.Tokenizer and the ChatML template around it.

    Untrusted text stays text: every string (a task, a tool's observation, a dataset record, the
    policy's own reply) is encoded with special-token text treated as ordinary characters, so
    an observation that writes "<|im_end|>\n<|im_start|>system" is those characters, not a new
    turn. Only the template puts the special tokens <|im_start|> and <|im_end|>, as ids."""

    def __init__(self, tok):
        self.tok = tok
        tok.encode_special_tokens = True        # an attribute of the instance: never saved
        self.im_start_id = self._special("<|im_start|>")
        self.im_end_id = self._special("<|im_end|>")
        self.pad_id = self._special("<|endoftext|>")

    def _special(self, text) -> int:
        i = self.tok.token_to_id(text)
        if i is None:
            raise ValueError(f"tokenizer has no {text} token (not a Qwen2.5 tokenizer?)")
        return i

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer.json not found")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:      # the library's own error names no file
            raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                  ) from None

    def encode(self, text: str) -> list[int]:
        """The ids of text as text: special-token text in it is encoded as ordinary characters."""
        return self.tok.encode(without_surrogates(text), add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @staticmethod
    def _check(messages):
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise ValueError(f"message {i}: role must be system, user or assistant")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i}: content must be a string")

    def chat_text(self, messages, add_generation_prompt=False) -> str:
        self._check(messages)
        return chat_text(messages, add_generation_prompt)

    def render(self, messages, add_generation_prompt=False) -> tuple[list[int], list[tuple]]:
        """Token ids of the chat and, per assistant message, its span [start, end) (METHOD.md §3):
        start = first token of the content, end = its closing <|im_end|> + 1.

        The template's special tokens are inserted as ids and the text between them is encoded as
        text, piece by piece: the ids a tokenizer gives the whole ChatML string (special tokens
        split it into these same pieces), except that a message cannot open or close a turn."""
        self._check(messages)
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
        ids, spans = [], []
        for m in messages:
            head = f"{m['role']}\n"
            enc = self.tok.encode(without_surrogates(head + m["content"]),
                                  add_special_tokens=False)
            ids.append(self.im_start_id)
            if m["role"] == "assistant":        # first token reaching past the head
                start = len(ids) + bisect_right([e for _, e in enc.offsets], len(head))
                spans.append((start, len(ids) + len(enc.ids) + 1))
            ids += enc.ids + [self.im_end_id] + self.encode("\n")
        if add_generation_prompt:
            ids += [self.im_start_id] + self.encode("assistant\n")
        return ids, spans


def chat_text(messages, add_generation_prompt=False) -> str:
    """The ChatML text of a chat, as the chat template writes it (the text a tokenizer is trained
    on; Tokenizer.render gives the ids, with the template's special tokens as ids)."""
    system = [] if messages and messages[0]["role"] == "system" else \
        [f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"]
    return "".join(system + [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                             for m in messages]) + \
        ("<|im_start|>assistant\n" if add_generation_prompt else "")


# A code point in U+D800..U+DFFF left in a str is half of a UTF-16 pair (a JSON "\ud800"
# escape decodes to one): no UTF-8 text can hold it and the tokenizer refuses it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def holds_lone_surrogate(value) -> bool:
    """Whether a JSON value holds one anywhere, in a key or a string."""
    return bool(LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False)))


def without_surrogates(text: str) -> str:
    """text with every unpaired surrogate replaced by U+FFFD (same length): whatever a policy or
    a data file wrote stays encodable."""
    return LONE_SURROGATE.sub("\ufffd", text)


# ----------------------------------------------------------------------------------------------
# Generation (gpt-fast style small functions) and teacher-forced traces


@dataclass
class TurnTrace:
    """Everything a reward needs from one assistant turn (CPU, float32)."""
    tokens: list[int]                   # the turn's tokens (ends with a stop token when finished)
    span: tuple[int, int]               # absolute positions [start, end) in the sequence
    attn: dict[str, Tensor]             # STATS -> (L, H), averaged over span rows ({} if no stats)
    h_last: Tensor | None               # (L+1, d) hidden_states[l] at the last span token
    h_mean: Tensor | None               # (L+1, d) mean over span rows of hidden_states[l]
    finished: bool                      # stopped on a stop token (vs max_new_tokens)
    # log pi(token) of each sampled token at the sampling temperature (T = 1 when greedy), from
    # the logits it was drawn from; empty for teacher-forced traces
    logprobs: list[float] = field(default_factory=list)


@torch.no_grad()
def trace_forward(model: Transformer, ids: list[int], span, stop_ids=None) -> TurnTrace:
    """The TurnTrace of tokens ids[start:end] of one sequence, teacher-forced."""
    return trace_batch(model, [ids], [span], stop_ids)[0]


@torch.no_grad()
def trace_batch(model: Transformer, seqs: list[list[int]], spans, stop_ids=None,
                rows_per_forward: int = 16) -> list[TurnTrace]:
    """trace_forward of many (sequence, span) pairs, a few rows per forward.

    Rows are right-padded: a real token never attends to a pad after it, so each row's trace is
    the one its sequence gives alone. Only the span tokens' hidden states are kept."""
    stop_ids = model.config.stop_ids if stop_ids is None else tuple(stop_ids)
    for ids, (start, end) in zip(seqs, spans):
        if not 0 <= start < end <= len(ids):
            raise ValueError(f"span {(start, end)} is not inside a sequence of {len(ids)} tokens")
    # rows of similar length share a forward (less padding); traces come back in input order
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    traces = [None] * len(seqs)
    for a in range(0, len(order), rows_per_forward):
        chunk = order[a:a + rows_per_forward]
        T = max(len(seqs[i]) for i in chunk)
        batch = torch.tensor([list(seqs[i]) + [0] * (T - len(seqs[i])) for i in chunk])  # (b, T)
        _, hidden, stats = model.trunk(batch, span=[tuple(spans[i]) for i in chunk],
                                       output_hidden_states=True)
        for r, i in enumerate(chunk):
            (start, end), ids = spans[i], seqs[i]
            h = torch.stack([hs[r, start:end].float().cpu() for hs in hidden])  # (L+1, n, d)
            traces[i] = TurnTrace(tokens=list(ids[start:end]), span=(start, end),
                                  attn={k: v[r].float().cpu() for k, v in stats.items()},
                                  h_last=h[:, -1], h_mean=h.mean(1),
                                  finished=ids[end - 1] in stop_ids)
    return traces


# A recomputed block runs its MLP over at most this many tokens (rows x positions) at a time.
MLP_CHUNK = 4096
# The head's float32 logits over a 152k vocabulary take 0.58 GiB per 1,000 tokens, and the update
# would hold several such copies (the logits, / T, the log-softmax, their gradients): it scores
# at most this many logits at a time (64 MB), and scores them again in the backward pass.
LOGITS_CHUNK = 1 << 24


def token_logprobs(policy, ids: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_j | x_<j) at the masked positions j, in row-major order -> (N,) float32.

    Sized for the update of a long multi-turn rollout: the head runs only on the N positions
    that count, LOGITS_CHUNK // V at a time, and where a gradient is wanted each block, each
    MLP_CHUNK tokens of its MLP and each chunk of the head are recomputed in the backward pass,
    so the call holds about one (T, d) input per block: neither the (N, V) logits nor the MLPs'
    (T, intermediate) activations ever exist for the whole rollout."""
    h, _, _ = policy.trunk(ids, recompute=True)                 # (B, T, d) after the final norm
    h = h[:, :-1]                                               # position j predicts x_{j+1}
    target = mask[:, 1:].to(h.device)
    h, labels = h[target], ids[:, 1:].to(h.device)[target]      # (N, d), (N,)
    n = max(1, LOGITS_CHUNK // policy.config.vocab_size)
    parts = []
    for a in range(0, len(labels), n):
        inputs = (policy.lm_head, h[a:a + n], labels[a:a + n], temperature)
        parts.append(torch.utils.checkpoint.checkpoint(head_logprobs, *inputs, use_reentrant=False)
                     if torch.is_grad_enabled() else head_logprobs(*inputs))
    return torch.cat(parts) if parts else torch.zeros(0, device=h.device)


def head_logprobs(lm_head: nn.Module, h: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """log softmax(lm_head(h) / T)[label] of each row: (n, d), (n,) -> (n,) float32."""
    logits = lm_head(h).float()                                 # (n, V)
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


# The smallest sampling temperature: below it sampling is greedy decoding in all but name, and far
# below it logits / T overflows float32 and the softmax turns to NaN (use 0 for greedy).
MIN_TEMPERATURE = 1e-3


def valid_temperature(t: float) -> bool:
    """0 (greedy), or a finite temperature of at least MIN_TEMPERATURE (nan is neither)."""
    return t == 0 or MIN_TEMPERATURE <= t < math.inf


def sample(logits: Tensor, temperature: float, top_p: float, generator=None) -> Tensor:
    """(B, V) float32 logits -> (B,) token ids; temperature 0 is greedy.

    Sampled by the inverse of each row's cumulative distribution at one uniform number: the
    draw torch.multinomial makes for a single sample costs one random number per vocabulary
    entry, which at a small model's size is most of a decoding step."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        # Nucleus: keep the most likely tokens until their mass reaches top_p (at least one).
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)                                                  # (B, V)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)
    # strictly below the total, so a token of probability 0 at the end is never drawn
    u = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0]


def prefill(model: Transformer, cache, new_tokens: list[list[int]]) -> Tensor | None:
    """Append each row's new tokens at that row's own offset; logits (B, V) after its last one
    (rows with no new tokens get zeros). Pads sit past each row's real tokens (see the top)."""
    n = torch.tensor([len(t) for t in new_tokens])
    if not len(n) or n.max() == 0:
        return None
    h = prefill_last(model, cache, new_tokens)
    rows = (n > 0).nonzero().squeeze(-1).to(h.device)
    logits = torch.zeros(len(new_tokens), model.config.vocab_size, device=h.device)
    logits[rows] = model.lm_head(h[rows]).float()
    return logits


def prefill_last(model: Transformer, cache, new_tokens: list[list[int]]) -> Tensor:
    """prefill up to the head: the final-normed hidden state of each row's last new token (B, d)
    (garbage in a row with none).

    An empty cache whose rows start alike (GRPO's group: G copies of one prompt) computes each
    distinct prompt once and copies its keys, values and last state to the rows that repeat it:
    a row's numbers do not depend on the rows beside it, so the copies are what computing them
    would give, to the bit (the head is then applied to every row, as it would be)."""
    lengths = cache[0].lengths.clone()
    n = torch.tensor([len(t) for t in new_tokens])
    T = int(n.max())
    if not lengths.any():
        first = {}                                      # tokens -> their row in `once`
        index = torch.tensor([first.setdefault(tuple(t), len(first)) for t in new_tokens])
        if len(first) < len(new_tokens):
            once = model.new_cache(len(first), capacity=T)
            h = prefill_last(model, once, [list(t) for t in first])
            for c, o in zip(cache, once):
                c.grow(T)
                i = index.to(c.k.device)
                c.k[:, :, :T], c.v[:, :, :T] = o.k[i, :, :T], o.v[i, :, :T]
            set_lengths(cache, n)
            return h[index.to(h.device)]
    ids = torch.tensor([list(t) + [0] * (T - len(t)) for t in new_tokens])     # (B, T)
    positions = lengths[:, None] + torch.arange(T)
    h, _, _ = model.trunk(ids, positions, cache)
    set_lengths(cache, lengths + n)
    return h[torch.arange(len(n), device=h.device), (n - 1).clamp_min(0).to(h.device)]


def decode_one_token(model: Transformer, cache, tokens: Tensor, fed: Tensor,
                     span_start: Tensor | None, w=None):
    """Feed tokens (B,) of the rows where fed (B,) is True, each at its row's length; (logits
    (B, V), hidden states, statistics), the last two given span_start (Transformer.decode).
    A row not fed gets a pad in its first free slot, which stays free."""
    lengths = cache[0].lengths.clone()
    out = model.decode(torch.where(fed, tokens, 0), cache, span_start, w)
    set_lengths(cache, lengths + fed.long().cpu())
    return out


@dataclass
class TurnStats:
    """Per row, the running sums of the statistics of the turn being decoded (float32, on the
    model's device until the turn ends)."""
    attn: Tensor                        # (B, L, H, len(STATS)) summed over the turn's tokens
    h_sum: Tensor                       # (L+1, B, d) hidden states summed over the turn's tokens
    h_last: Tensor                      # (L+1, B, d) hidden states of the latest token

    @classmethod
    def zeros(cls, config: Config, B: int, device=None) -> "TurnStats":
        L, H, d = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        return cls(torch.zeros(B, L, H, len(STATS), device=device),
                   torch.zeros(L + 1, B, d, device=device), torch.zeros(L + 1, B, d, device=device))

    def means(self, r: int, n: int) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """Row r's turn of n tokens: attention statistics (STATS -> (L, H)), h_last, h_mean."""
        return (dict(zip(STATS, (self.attn[r] / n).unbind(-1))), self.h_last[:, r].clone(),
                self.h_sum[:, r] / n)


def accumulate(acc: TurnStats, attn: Tensor, hidden: Tensor, fed: Tensor):
    """Add one decoded token's statistics (B, L, H, 6) and hidden states (L+1, B, d) to the
    rows that fed a real token (fed (B,) bool). The other rows' numbers are garbage (they were
    fed a pad): where, not a multiply."""
    acc.attn += torch.where(fed[:, None, None, None], attn, 0.0)
    hidden = hidden.float()
    acc.h_sum += torch.where(fed[None, :, None], hidden, 0.0)
    acc.h_last = torch.where(fed[None, :, None], hidden, acc.h_last)


def reserve_slots(cache: list[KVCache], steps: int):
    """Room for `steps` more tokens a row, and past the last block of key slots a decoding step
    attends over, reserved before a generation on a GPU: the captured step then writes at the
    same addresses to its end, and its key slots never fill the cache, a relation between the
    sizes that torch would compile a graph of its own for (at 7B, a minute and more)."""
    need = -(-(int(cache[0].lengths.max()) + steps) // KEY_BLOCK) * KEY_BLOCK + 1
    for c in cache:
        c.grow(need)


@torch.no_grad()
def generate(model: Transformer, cache, new_tokens: list[list[int]], max_new_tokens: int,
             temperature=1.0, top_p=1.0, stop_ids=None, generator=None,
             stats=True, active=None) -> list[TurnTrace | None]:
    """Append each row's new tokens to the cache, then sample up to max_new_tokens per row.

    A row with no new tokens generates nothing (empty trace); a row with active[i] False (an
    episode that has ended) gets nothing appended and None as its trace; max_new_tokens=0 only
    appends. Every sampled token, the stop token included, is fed through the model, so the
    cache holds it and (stats=True) its statistics and hidden states are accumulated: the traces
    cover exactly the generated tokens. Idle rows ride along as pads (decoding is bound by
    reading the weights). The loop keeps every row's state in tensors on the model's device."""
    B = len(new_tokens)
    if B != cache[0].k.shape[0]:
        raise ValueError(f"{B} rows of new tokens for a cache of batch size {cache[0].k.shape[0]}")
    if active is not None and len(active) != B:
        raise ValueError(f"active has {len(active)} entries for {B} rows")
    if not valid_temperature(temperature):
        raise ValueError(f"temperature {temperature}: 0 (greedy) or in [{MIN_TEMPERATURE}, inf)")
    alive = [True] * B if active is None else [bool(a) for a in active]
    new_tokens = [list(t) if a else [] for t, a in zip(new_tokens, alive)]
    stop_ids = sorted(set(model.config.stop_ids if stop_ids is None else stop_ids))

    logits = prefill(model, cache, new_tokens)
    span_start = cache[0].lengths.clone()                                    # (B,)
    running = torch.tensor([len(t) > 0 and max_new_tokens > 0 for t in new_tokens])
    dev = logits.device if logits is not None else input_device(model)
    steps = max_new_tokens if running.any() else 0
    running = running.to(dev)
    tokens = torch.zeros(B, max(steps, 1), dtype=torch.long, device=dev)
    logps = torch.zeros(B, max(steps, 1), device=dev)
    count = torch.zeros(B, dtype=torch.long, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    acc = TurnStats.zeros(model.config, B, dev) if stats else None
    if cache[0].k.is_cuda and steps:
        reserve_slots(cache, steps)
    w = model.decode_weights()                  # no_grad: the weights cannot change in the loop
    for t in range(steps):
        token = sample(logits, temperature, top_p, generator)                # (B,)
        # log pi at the sampling temperature, before top_p's truncation: the policy's own
        # probability of the token, as token_logprobs computes it for the update
        logp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, token[:, None])
        tokens[:, t], logps[:, t] = token, logp[:, 0]
        fed = running
        count += fed
        stopped = torch.isin(token, stop) & fed
        finished |= stopped
        running = fed & ~stopped
        logits, hidden, attn = decode_one_token(model, cache, token, fed,
                                                span_start if stats else None, w)
        if stats:
            accumulate(acc, attn, hidden, fed)
        if not running.any():
            break
    return turn_traces(tokens, logps, count, finished, span_start, acc, alive)


def turn_traces(tokens, logps, count, finished, span_start, acc, alive) -> list[TurnTrace | None]:
    """generate's traces, read back from its tensors at once: row r sampled tokens[r, :count[r]]
    from span_start[r] on; acc: its TurnStats, or None without statistics."""
    tokens, logps = tokens.cpu().tolist(), logps.cpu().tolist()
    count, finished = count.cpu().tolist(), finished.cpu().tolist()
    if acc is not None:
        acc = TurnStats(acc.attn.cpu(), acc.h_sum.cpu(), acc.h_last.cpu())
    traces = []
    for r, s in enumerate(span_start.tolist()):
        n = count[r]
        trace = TurnTrace(tokens=tokens[r][:n], span=(s, s + n), attn={}, h_last=None,
                          h_mean=None, finished=finished[r], logprobs=logps[r][:n])
        if acc is not None and n > 0:
            trace.attn, trace.h_last, trace.h_mean = acc.means(r, n)
        traces.append(trace if alive[r] else None)
    return traces


# ----------------------------------------------------------------------------------------------
# LoRA (Hu et al., 2021), by hand, laid out as PEFT lays it out

# A targeted nn.Linear becomes a LoRALinear that keeps the base Parameters under their own keys
# (`q_proj.weight`, `q_proj.bias`) and adds `q_proj.lora_A.weight` (r, d_in) and
# `q_proj.lora_B.weight` (d_out, r) beside them:   y = x W^T + b + (alpha / r) * B A dropout(x).
# B starts at zero, so a fresh adapter leaves the model unchanged. The adapter is kept in float32
# (as PEFT does by default) even when the base weights are bfloat16: the updates are tiny.

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSettings:
    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    use_rslora: bool = False    # PEFT's rank-stabilized variant: scaling alpha / sqrt(r)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, s: LoraSettings, dtype=torch.float32):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight                        # (d_out, d_in), frozen
        self.register_parameter("bias", base.bias)       # None for o/gate/up/down in Qwen2
        self.scaling = s.alpha / (math.sqrt(s.r) if s.use_rslora else s.r)
        self.dropout = s.dropout
        self.lora_dropout = nn.Dropout(s.dropout) if s.dropout > 0 else nn.Identity()
        kw = dict(bias=False, device=base.weight.device, dtype=dtype)
        self.lora_A = nn.Linear(self.in_features, s.r, **kw)     # (r, d_in)
        self.lora_B = nn.Linear(s.r, self.out_features, **kw)    # (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.enabled = True         # False: the base model (the GRPO reference policy)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        # lora_A and lora_B are applied as functions, not called as modules: decoding calls this
        # once per projection per token, where a module call costs more than its tiny matmul
        x = x.to(self.lora_A.weight.dtype)
        if self.dropout > 0:
            x = self.lora_dropout(x)
        a = F.linear(x, self.lora_A.weight)                                    # (..., r)
        return y + (F.linear(a, self.lora_B.weight) * self.scaling).to(y.dtype)

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, r={self.lora_A.out_features}, "
                f"scaling={self.scaling:g}")


def merged_weight(linear: nn.Module) -> Tensor:
    """The weight an nn.Linear or LoRALinear applies now: W + scaling * B A with its adapter
    enabled (float32 throughout; without dropout, forward computes exactly this map)."""
    if isinstance(linear, LoRALinear) and linear.enabled:
        return linear.weight + linear.scaling * (linear.lora_B.weight @ linear.lora_A.weight)
    return linear.weight


def _lora_reads(linear: nn.Module) -> list[Tensor]:
    """The tensors merged_weight and the bias read now (the adapter's only while enabled)."""
    out = [linear.weight] + ([linear.bias] if linear.bias is not None else [])
    if isinstance(linear, LoRALinear) and linear.enabled:
        out += [linear.lora_A.weight, linear.lora_B.weight]
    return out


def apply_lora(model: nn.Module, r=16, alpha=32.0, dropout=0.05, targets=LORA_TARGETS,
               use_rslora=False, dtype=torch.float32) -> nn.Module:
    """Freeze `model` and wrap every nn.Linear child named in `targets` with a LoRA adapter."""
    if not (isinstance(r, int) and r > 0) or alpha <= 0 or not 0 <= dropout < 1:
        raise ValueError(f"LoRA needs an integer r > 0, alpha > 0 and 0 <= dropout < 1; got "
                         f"r={r!r}, alpha={alpha!r}, dropout={dropout!r}")
    if getattr(model, "lora_settings", None) is not None:
        raise ValueError(f"the model already has a LoRA adapter ({model.lora_settings})")
    s = LoraSettings(r, float(alpha), float(dropout), tuple(targets), bool(use_rslora))
    sites = [(module, name, child) for module in model.modules()
             for name, child in module.named_children()
             if name in s.targets and type(child) is nn.Linear]
    if missing := sorted(set(s.targets) - {name for _, name, _ in sites}):
        raise ValueError(f"LoRA targets {missing} match no nn.Linear module of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for module, name, child in sites:
        # A new module starts in training mode; keep the model's mode (dropout off in eval).
        setattr(module, name, LoRALinear(child, s, dtype).train(child.training))
    model.lora_settings = s
    return model


def lora_modules(model):
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def lora_parameters(model):
    """(name, Parameter) of every adapter weight, names as in model.state_dict()."""
    return ((n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)


@contextlib.contextmanager
def lora_disabled(model):
    """`with lora_disabled(model):` runs the base model (GRPO's pi_ref) without copying weights."""
    was = {name: m.enabled for name, m in lora_modules(model)}
    for _, m in lora_modules(model):
        m.enabled = False
    try:
        yield model
    finally:
        for name, m in lora_modules(model):
            m.enabled = was[name]


def lora_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(policy)}


def load_lora_state(policy, state: dict[str, torch.Tensor]):
    with torch.no_grad():
        for n, p in lora_parameters(policy):
            p.copy_(state[n])


# Adapter files in PEFT's layout, which checkpoints save and PEFT reads as they are
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def save_adapter(model, path, base_model_name_or_path=None):
    """Write the model's adapter to the folder `path`: its config and its float32 weights."""
    s = getattr(model, "lora_settings", None)
    if s is None:
        raise ValueError("save_adapter: the model has no LoRA adapter (call apply_lora first)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + n: p.detach().to("cpu").contiguous()
               for n, p in lora_parameters(model)}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or getattr(model, "name_or_path", None),
        "revision": None, "inference_mode": True,
        "r": s.r, "lora_alpha": int(s.alpha) if s.alpha.is_integer() else s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": sorted(s.targets), "use_rslora": s.use_rslora,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "use_dora": False, "lora_bias": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    write_atomic(folder / ADAPTER_WEIGHTS, safetensors_bytes(tensors, {"format": "pt"}))
    write_atomic(folder / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())


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
        if name.rsplit(".", 1)[-1] in s.targets and type(m) in (nn.Linear, LoRALinear):
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
        apply_lora(model, s.r, s.alpha, s.dropout, s.targets, s.use_rslora)
    load_lora_state(model, {key[len(PEFT_PREFIX):]: t for key, t in tensors.items()})
    return model


# ----------------------------------------------------------------------------------------------
# Layers split across devices (pipeline placement, no pipelining), applied to a built model

# The model code stays single-device. split_model moves contiguous ranges of blocks to the given
# devices and adds a forward pre-hook to each block that moves its tensor inputs there. Only one
# device computes at a time (placement, not pipelining): the point is memory, as a 7B policy with
# its LoRA state and KV caches does not fit on one 48 GB GPU. Embeddings sit on the first device,
# the final norm and lm_head on the last; new_cache puts each block's KV cache on its device.

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


def _n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _move_inputs(device):
    def to(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)     # blocking: a copy to the CPU must have landed
        if isinstance(x, (tuple, list)):
            return type(x)(to(v) for v in x)
        if isinstance(x, dict):
            return {k: to(v) for k, v in x.items()}
        return x            # caches and flags stay as they are: a block's cache lives with it

    def hook(module, args, kwargs):
        return to(args), to(kwargs)
    return hook


def parse_devices(text: str) -> list[torch.device]:
    """A --devices value ("cuda:0,cuda:1", "cpu") -> the devices; a ValueError whose message is
    the command line's one line for a value that is not a list of this machine's devices."""
    try:
        devices = [torch.device(d.strip()) for d in text.split(",")]
    except RuntimeError:                                # "", "foo", "cuda:x"
        devices = []
    if not devices or any(d.type not in ("cpu", "cuda") for d in devices):
        raise ValueError(f"--devices {text!r}: a comma-separated list of devices such as "
                         "cuda:0,cuda:1 (or cpu)")
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        raise ValueError(f"--devices {text}: this PyTorch sees no CUDA device (a CPU build, or no "
                         "GPU visible); leave --devices out to run on the CPU")
    missing = [str(d) for d in devices if d.type == "cuda" and d.index is not None
               and d.index >= torch.cuda.device_count()]
    if missing:
        raise ValueError(f"--devices {text}: no {', '.join(missing)} here (this machine has "
                         f"{torch.cuda.device_count()} GPUs)")
    return devices


def split_model(model, devices, layer_counts=None):
    """Place model.model.layers on `devices` (e.g. ["cuda:0", "cuda:1"]) in contiguous ranges.

    layer_counts: layers per device (sums to the number of layers); default balances parameters.
    """
    if hasattr(model, "layer_devices"):
        raise ValueError(f"the model is already split over {sorted(set(model.layer_devices))}")
    devices = [torch.device(d) for d in devices]
    inner, layers = model.model, model.model.layers
    head = model.lm_head
    tied = head.weight is inner.embed_tokens.weight
    if layer_counts is None:
        layer_counts = balance_layers([_n_params(b) for b in layers], len(devices),
                                      first_extra=_n_params(inner.embed_tokens),
                                      last_extra=_n_params(inner.norm) + head.weight.numel())
    layer_counts = [int(n) for n in layer_counts]
    if (len(layer_counts) != len(devices) or min(layer_counts) < 1
            or sum(layer_counts) != len(layers)):
        raise ValueError(f"layer_counts={layer_counts}: need one count >= 1 per device "
                         f"({len(devices)}) summing to the model's {len(layers)} layers")
    if tied and devices[0] != devices[-1]:
        # The head needs the embedding matrix on the last device: a second copy, which stays
        # equal to the first only while it is not trained (true under LoRA).
        if inner.embed_tokens.weight.requires_grad:
            raise ValueError("tied embeddings are copied to the last device; freeze them first "
                             "(apply_lora does) or split over one device")
        head.weight = nn.Parameter(inner.embed_tokens.weight.detach().to(devices[-1]),
                                   requires_grad=False)
    inner.embed_tokens.to(devices[0])
    inner.embed_tokens.register_forward_pre_hook(_move_inputs(devices[0]), with_kwargs=True)
    first = 0
    for device, n in zip(devices, layer_counts):
        for block in layers[first:first + n]:
            block.to(device)
            block.register_forward_pre_hook(_move_inputs(device), with_kwargs=True)
        first += n
    for module in (inner.norm, head):
        module.to(devices[-1])
        module.register_forward_pre_hook(_move_inputs(devices[-1]), with_kwargs=True)
    model.layer_devices = [d for d, n in zip(devices, layer_counts) for _ in range(n)]
    return model


# ----------------------------------------------------------------------------------------------
# File helpers: where fetched and fitted files live, atomic writes, progress lines, optimizer state


def cache_root() -> Path:
    """Where everything fetched or fitted once is kept: Hub checkpoints, the released data, LLM
    judgments, the built-in policy's probes and base evaluations. $PAIR_CACHE, else
    ~/.cache/pair."""
    return Path(os.environ.get("PAIR_CACHE") or Path.home() / ".cache" / "pair").expanduser()


# The process's umask, read once at import: os.umask can only be read by setting it, and setting
# it while another thread creates a file would give that file the wrong mode.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path: Path, data: bytes | str) -> None:
    """The one way this project writes a file: a unique temporary file beside it, then
    os.replace, so a reader (or a run killed mid-write) sees the old file or the new one."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; the result gets the mode open() would have given it
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Pacer:
    """When the next progress line is due. On a terminal: every `every` seconds. Into a file or
    a pipe (a log, read later): at most one line per 30 s and per 10% of the work, so that an
    hour of work is a dozen lines, not hundreds. The end of the work is always due."""

    def __init__(self, total: float, stream, every: float = 5.0, clock=time.monotonic):
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.total, self.clock = total, clock
        self.every, self.least = (every, 0.0) if self.tty else (30.0, total / 10)
        self.last_time, self.last_done = clock(), 0.0

    def due(self, done: float) -> bool:
        now = self.clock()
        if done >= self.total or (now - self.last_time >= self.every
                                  and done - self.last_done >= self.least):
            self.last_time, self.last_done = now, done
            return True
        return False


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s"
