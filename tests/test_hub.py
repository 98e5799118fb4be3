"""Hub download against a fake Hub on 127.0.0.1: the files fetched, cache, offline, token."""
import hashlib
import http.server
import json
import posixpath
import socket
import threading

import pytest
import torch

import model as M


REPO = "tiny-org/tiny-model"


class FakeHub:
    """Serves the two Hub endpoints fetch_from_hub uses, and records every request."""

    def __init__(self, files, lfs=("model.safetensors",), token=None):
        self.files = dict(files)               # path -> bytes actually served
        self.listed = {n: len(b) for n, b in files.items()}   # path -> size the API reports
        self.lfs = set(lfs)
        self.token = token                      # when set, requests without it get 401
        self.drop_first = set()                 # paths whose first GET is cut in half
        self.requests = []                      # (method, path, headers)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.requests.append(("GET", self.path, dict(self.headers)))
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self.reply(401, b"unauthorized")
                tree = f"/api/models/{REPO}/tree/main"
                resolve = f"/{REPO}/resolve/main/"
                if self.path == tree:
                    return self.reply(200, json.dumps(hub.tree()).encode())
                if self.path.startswith(resolve) and self.path[len(resolve):] in hub.files:
                    return self.send_file(self.path[len(resolve):])
                for name in hub.files:      # a hostile name, as the client normalized its URL
                    if posixpath.normpath(resolve + name) == posixpath.normpath(self.path):
                        return self.send_file(name)
                self.reply(404, b"not found")

            def reply(self, code, body, headers=()):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def send_file(self, name):
                data, start = hub.files[name], 0
                if "Range" in self.headers:
                    start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
                body = data[start:]
                if name in hub.drop_first:
                    hub.drop_first.discard(name)
                    # Promise the whole body, send half of it, hang up.
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if start:
                    self.reply(206, body, [("Content-Range",
                                            f"bytes {start}-{len(data) - 1}/{len(data)}")])
                else:
                    self.reply(200, body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def tree(self):
        out = []
        for name, size in self.listed.items():
            data = self.files.get(name, b"")      # what the Hub holds: git's blob id of it
            entry = {"type": "file", "path": name, "size": size,
                     "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if name in self.lfs:
                sha = hashlib.sha256(self.files[name]).hexdigest()
                entry["lfs"] = {"oid": sha, "size": size, "pointerSize": 134}
            out.append(entry)
        out.append({"type": "directory", "path": "onnx", "size": 0, "oid": "1" * 40})
        return out

    def gets(self, name):
        return [h for m, p, h in self.requests if p == f"/{REPO}/resolve/main/{name}"]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def cache_dir():
    return M.cache_root() / "tiny-org--tiny-model"


def checkpoint_files(sharded=False):
    blob = bytes(range(256)) * 1200             # ~300 KB of "weights"
    files = {"config.json": b'{"model_type": "qwen2"}',
             "tokenizer.json": b'{"version": "1.0", "model": {}}',
             "tokenizer_config.json": b"{}", "README.md": b"# tiny",
             "pytorch_model.bin": b"x" * 5000}
    if sharded:
        files["model-00001-of-00002.safetensors"] = blob[:1000]
        files["model-00002-of-00002.safetensors"] = blob[1000:]
        files["model.safetensors.index.json"] = json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors"}}).encode()
    else:
        files["model.safetensors"] = blob
    return files


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hubs = []

    def start(files=None, **kw):
        hub = FakeHub(files or checkpoint_files(kw.pop("sharded", False)), **kw)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hubs.append(hub)
        return hub

    yield start
    for hub in hubs:
        hub.close()


def test_fetches_only_needed_files_with_token(env, monkeypatch):
    hub = env(token="secret")
    monkeypatch.setenv("HF_TOKEN", "secret")
    folder = M.fetch_from_hub(REPO)
    assert folder == cache_dir()
    fetched = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert fetched == ["config.json", "model.safetensors", "tokenizer.json"]
    for name in fetched:
        assert (folder / name).read_bytes() == hub.files[name]
        assert len(hub.gets(name)) == 1
    assert not hub.gets("README.md") and not hub.gets("pytorch_model.bin")
    assert not hub.gets("tokenizer_config.json")                # nothing here reads it
    assert all(h["Authorization"] == "Bearer secret" for _, _, h in hub.requests)


def test_gated_model_without_token_names_hf_token(env):
    env(token="secret")
    with pytest.raises(M.CheckpointError, match="HF_TOKEN"):
        M.fetch_from_hub(REPO)


def test_sharded_checkpoint_fetches_index_and_every_shard(env):
    hub = env(sharded=True, lfs=("model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors"))
    folder = M.fetch_from_hub(REPO)
    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"):
        assert (folder / name).read_bytes() == hub.files[name]
    assert not (folder / "model.safetensors").exists()


def test_interrupted_fetch_is_one_line_and_finishes_in_a_later_call(env):
    hub = env()
    hub.drop_first.add("model.safetensors")
    with pytest.raises(M.CheckpointError, match="tiny-org/tiny-model") as err:
        M.fetch_from_hub(REPO)
    assert "connection lost" in str(err.value) and "\n" not in str(err.value)
    assert not (cache_dir() / "model.safetensors.part").exists()
    folder = M.fetch_from_hub(REPO)
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    # Files finished by the first call are not fetched again.
    assert len(hub.gets("config.json")) == 1


def test_concurrent_fetches_download_once(env):
    # Two torchrun ranks loading the same name: one downloads, the other waits for the copy.
    hub = env()
    folders, errors = [], []

    def load():
        try:
            folders.append(M.fetch_from_hub(REPO))
        except Exception as e:      # surfaced below: an assert in a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(folders) == 2
    assert len(hub.gets("model.safetensors")) == 1
    assert (folders[0] / "model.safetensors").read_bytes() == hub.files["model.safetensors"]


@pytest.mark.parametrize("shard", ["../../escape.safetensors", "{tmp}/escape.safetensors",
                                   "sub/../../escape.safetensors", ".pair-complete.json",
                                   "..\\escape.safetensors"])
def test_hostile_shard_names_are_refused(env, tmp_path, shard):
    # A hostile endpoint names the shards: none may land outside the cache folder (or on our
    # own bookkeeping files in it).
    shard = shard.format(tmp=tmp_path)             # an absolute path
    files = checkpoint_files(sharded=True)
    files[shard] = b"x" * 64
    files["model.safetensors.index.json"] = json.dumps({"weight_map": {"a": shard}}).encode()
    hub = env(files=files, lfs=())
    with pytest.raises(M.CheckpointError, match="not a safetensors file beside the index"):
        M.fetch_from_hub(REPO)
    folder = cache_dir()
    assert not hub.gets(shard)
    written = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert all(folder in p.parents for p in written), written
    assert not (folder / M.HUB_MANIFEST).exists()


@pytest.mark.parametrize("body", [b'{"a": 1}', b'{"weight_map": {"a": 7}}',
                                  b'{"weight_map": {"a": "tokenizer.json"}}'])
def test_an_index_of_the_wrong_shape_is_refused(env, body):
    files = checkpoint_files(sharded=True)
    files["model.safetensors.index.json"] = body
    env(files=files, lfs=())
    with pytest.raises(M.CheckpointError, match=r"model\.safetensors\.index\.json"):
        M.fetch_from_hub(REPO)
    assert not (cache_dir() / M.HUB_MANIFEST).exists()


def test_complete_cache_makes_no_request(env):
    hub = env()
    folder = M.fetch_from_hub(REPO)
    n = len(hub.requests)
    assert M.fetch_from_hub(REPO) == folder
    assert len(hub.requests) == n


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_error_names_model_and_cache(env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(M.CheckpointError) as err:
        M.fetch_from_hub(REPO)
    msg = str(err.value)
    assert REPO in msg and str(cache_dir()) in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(M.CheckpointError, match="HF_HUB_OFFLINE"):
        M.fetch_from_hub(REPO)


def test_offline_with_complete_cache_works(env, monkeypatch):
    env()
    folder = M.fetch_from_hub(REPO)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert M.fetch_from_hub(REPO) == folder


def test_unknown_repo_is_a_clear_404(env):
    env()
    with pytest.raises(M.CheckpointError, match="not found"):
        M.fetch_from_hub("tiny-org/missing")


def test_load_model_fetches_a_name_and_then_uses_the_cache(env, tmp_path):
    # A real tiny checkpoint, written by hand: config.json, model.safetensors, tokenizer.json.
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    cfg = dict(architectures=["Qwen2ForCausalLM"], vocab_size=16, hidden_size=16,
               intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1)
    torch.manual_seed(0)
    ref = M.Transformer(M.Config.from_dict(cfg))
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    vocab = {f"w{i}": i for i in range(13)}
    vocab.update({"<|endoftext|>": 13, "<|im_start|>": 14, "<|im_end|>": 15})
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(src / "tokenizer.json"))
    hub = env(files={p.name: p.read_bytes() for p in src.iterdir()})

    ours, tok = M.load_model(REPO)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(ours(ids), ref.eval()(ids))
    assert tok.im_end_id == 15 and ours.name_or_path == REPO
    n = len(hub.requests)
    again = M.split_model(M.load_model(REPO)[0], ["cpu", "cpu"])
    assert len(hub.requests) == n                              # the cache, no network
    assert all(b._forward_pre_hooks for b in again.model.layers)   # and split as asked
    with pytest.raises(M.CheckpointError, match="no such directory"):
        M.load_model(str(tmp_path / "no" / "such" / "dir"))
