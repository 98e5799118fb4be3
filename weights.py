"""Hugging Face checkpoint directories, read strictly, and fetched from the Hub when named.

A checkpoint directory holds config.json, model.safetensors (or an index and its shards) and
tokenizer.json. This file reads what model.py builds a model from, and refuses anything it
cannot read exactly, naming the file and the tensor:
  * `Config`: config.json, its keys as field names (unknown keys are dropped), every value
    checked for type and range before anything is built from it;
  * `read_state_dict`: every tensor a model expects, checked for presence, extras and shape;
  * `checkpoint_sha256`: a fingerprint of what a checkpoint computes with, which keys every file
    made from it (features, probes, resumed extractions) by content rather than by path;
  * `optimizer_to_tensors` / `optimizer_from_tensors`: an optimizer's state as tensors and JSON,
    which the checkpoints of GRPO and of the policy's training are written in;
  * `fetch_from_hub`: a name such as "Qwen/Qwen2.5-7B-Instruct" is downloaded once, with
    `requests`, into $PAIR_CACHE (resumable, size- and sha256-checked).
model.py's `load_model` puts these together.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import sys
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from urllib.parse import quote

import requests
import torch
from safetensors import safe_open

import common

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


# ----------------------------------------------------------------------------------------------
# config.json

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
        self.check_values()
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

    def check_values(self):
        """Types and ranges, before anything is built from them: a config.json is input, and
        num_hidden_layers = 10**6 would take minutes and gigabytes to build before any weight
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


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, ValueError, RecursionError) as e:    # deep nesting: RecursionError
        raise CheckpointError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None


def read_config(directory) -> Config:
    path = Path(directory) / "config.json"
    try:
        return Config.from_dict(_read_json(path))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


# config.json keys of a checkpoint trained on a built-in world (written by `shop.py sft`): the
# world's name, and the tool list and reply format it appends to a task in the first user
# message, so that `model.py generate` can show a prompt as the model saw tasks in training.
WORLD_KEY = "pair_world"
TOOLS_KEY = "pair_tool_instructions"


def checkpoint_world(directory) -> tuple[str | None, str | None]:
    """(world name, its tool instructions) a checkpoint's config.json records, or (None, None)."""
    path = Path(directory) / "config.json"
    config = _read_json(path)
    world, tools = config.get(WORLD_KEY), config.get(TOOLS_KEY)
    if world is not None and not (isinstance(world, str) and isinstance(tools, str)):
        raise CheckpointError(f"{path}: {WORLD_KEY} must name a world and {TOOLS_KEY} hold its "
                              f"tool instructions (got {world!r} and {type(tools).__name__})")
    return world, tools


# ----------------------------------------------------------------------------------------------
# Weights

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
        index_json = _read_json(index)
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
    """A sha256 of what a checkpoint directory computes with, for keying what is made from it
    (features, probes, resumed extractions) by content rather than by path.

    config.json, tokenizer.json, the index and any weights file up to 64 MiB are hashed whole.
    A larger safetensors file contributes its size, its header (every tensor's name, dtype,
    shape and offsets) and the first and last 4 KiB of every tensor: under a second for a 7B
    model, where hashing 15 GB would take minutes on a network disk at every extract and run.
    Fine-tuning, merging an adapter, or another checkpoint of the same shape changes every tensor
    it touches, ends included; only an edit confined to the middle of a tensor goes unseen.
    Size and mtime are not enough: a copy changes mtime (false mismatch), and a swapped file of
    the same size written within the clock's resolution, or copied with its mtime, keeps both."""
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


# ----------------------------------------------------------------------------------------------
# Optimizer state, for the checkpoints of long runs: safetensors holds its tensors and JSON the
# rest, so that resuming reads no pickle

def optimizer_to_tensors(optimizer) -> tuple[dict, dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer, tensors: dict, meta: dict):
    state: dict[int, dict] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ----------------------------------------------------------------------------------------------
# Weights from the Hugging Face Hub

# A model name that is not a directory is fetched over HTTPS into $PAIR_CACHE/<org>--<name>/.
# Only the files load_model reads are fetched: the Hub API's tree listing gives each file's size
# and its hash (an LFS file's sha256; a small file's git blob id, a sha1 of "blob <size>\0" and
# the content), so a transfer can be resumed with an HTTP Range request and checked when it
# ends. A manifest written last marks the copy complete, so later loads need no
# network at all.

HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")    # <org>/<name>


HUB_MANIFEST = ".pair-complete.json"


HUB_TIMEOUT = (10, 60)          # (connect, read) seconds


HUB_RETRIES = 5                 # attempts per file; each one resumes where the last one stopped


HUB_RETRY_WAIT = 2.0            # seconds, times the attempt number


class HubError(CheckpointError):
    """A model name that could not be fetched from the Hub (or found complete in the cache)."""


def hub_cache_dir(repo_id: str) -> Path:
    return common.cache_root() / repo_id.replace("/", "--")


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
        except (requests.ConnectionError, requests.Timeout,
                requests.exceptions.ChunkedEncodingError) as e:
            raise HubError(offline.format(f"network unreachable or connection lost "
                                          f"({type(e).__name__})")) from e
        manifest = {"repo": repo_id, "revision": revision, "endpoint": endpoint, "files": files}
        common.write_atomic(folder / HUB_MANIFEST, json.dumps(manifest, indent=1).encode())
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
                    progress.close()
            break
        except (requests.ConnectionError, requests.Timeout,
                requests.exceptions.ChunkedEncodingError) as e:
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
        self.t0 = time.monotonic()
        self.pacer = common.Pacer(total, sys.stderr, every=0.5)

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

    def close(self):
        self.show(end="\n")


