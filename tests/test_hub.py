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
        self.listed = {}                        # path -> another size than its bytes' to list
        self.lfs = set(lfs)
        self.token = token                      # when set, requests without it get 401
        self.served = {}                        # path -> other bytes served than the API lists
        self.drop = {}                          # path -> how many GETs to cut in half
        self.quirks = {}                        # path -> a misbehaviour (see send_file)
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
                data, start = hub.served.get(name, hub.files[name]), 0
                quirk = hub.quirks.get(name, "")
                if quirk.endswith("-once"):
                    quirk = hub.quirks.pop(name).removesuffix("-once")
                if "Range" in self.headers and quirk != "no-ranges":
                    start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
                body = data[start:]
                if quirk.startswith("status-"):
                    return self.reply(int(quirk[7:]), b"busy")
                if quirk == "redirect-loop":
                    return self.reply(302, b"", [("Location", self.path)])
                if quirk in ("big-header", "many-headers"):
                    self.send_response(200)
                    if quirk == "big-header":
                        self.send_header("X-Big", "x" * 200_000)
                    for i in range(500 * (quirk == "many-headers")):
                        self.send_header(f"X-H{i}", "1")
                    self.end_headers()
                    return
                if quirk in ("short-length", "no-length"):
                    # Claim 4,096 bytes too few and send those; or no length, half, and hang up.
                    self.send_response(206 if start else 200)
                    if quirk == "short-length":
                        body = body[:-4096]
                        self.send_header("Content-Length", str(len(body)))
                    else:
                        body = body[: len(body) // 2]
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if quirk in ("trickle", "stall"):
                    # A byte every 50 ms for 3 s; or half the body, 2 s of silence, the rest.
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    cut = 60 if quirk == "trickle" else len(body) // 2
                    for i in range(cut):
                        if quirk == "trickle":
                            threading.Event().wait(0.05)
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                    threading.Event().wait(2 * (quirk == "stall"))
                    self.wfile.write(body[cut:])
                    return
                if hub.drop.get(name):
                    hub.drop[name] -= 1
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
        for name, data in self.files.items():     # what the Hub holds: git's blob id of it
            size = self.listed.get(name, len(data))
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
    sleeps = []                                 # the backoff, recorded instead of slept
    monkeypatch.setattr(M.time, "sleep", sleeps.append)

    def start(files=None, **kw):
        hub = FakeHub(files or checkpoint_files(kw.pop("sharded", False)), **kw)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hubs.append(hub)
        return hub

    start.sleeps = sleeps
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


def test_a_broken_transfer_resumes_by_byte_range(env):
    hub = env()
    hub.drop["model.safetensors"] = 1
    folder = M.fetch_from_hub(REPO)
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    first, second = hub.gets("model.safetensors")
    half = len(hub.files["model.safetensors"]) // 2
    assert first["Range"] == "bytes=0-" and second["Range"] == f"bytes={half}-"
    assert [t for t in env.sleeps if t] == [1]          # the backoff before the retry


def test_retries_are_bounded_and_the_next_call_resumes(env):
    hub = env()
    hub.drop["model.safetensors"] = 99
    with pytest.raises(M.CheckpointError, match="tiny-org/tiny-model") as err:
        M.fetch_from_hub(REPO)
    assert "IncompleteRead" in str(err.value) and "\n" not in str(err.value)
    assert len(hub.gets("model.safetensors")) == M.HUB_TRIES
    assert [t for t in env.sleeps if t] == [1, 3, 7]
    kept = (cache_dir() / "model.safetensors.part").stat().st_size
    assert 0 < kept < len(hub.files["model.safetensors"])
    hub.drop.clear()
    folder = M.fetch_from_hub(REPO)
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert hub.gets("model.safetensors")[-1]["Range"] == f"bytes={kept}-"
    assert len(hub.gets("config.json")) == 1        # files checked by the first call are kept


def test_a_server_ignoring_ranges_sends_the_whole_file_again(env):
    hub = env()
    hub.drop["model.safetensors"] = 1
    hub.quirks["model.safetensors"] = "no-ranges"
    folder = M.fetch_from_hub(REPO)
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert len(hub.gets("model.safetensors")) == 2


def corrupted(data: bytes) -> bytes:
    # 1 in 64 float32 values changed (a bit of each), the size kept.
    out = bytearray(data)
    for i in range(0, len(out) - 4, 64 * 4):
        out[i] ^= 1
    return bytes(out)


@pytest.mark.parametrize("name,algo", [("model.safetensors", "sha256"), ("tokenizer.json", "sha1")])
def test_a_damaged_file_is_refused_and_never_kept(env, name, algo):
    hub = env()
    hub.served[name] = corrupted(hub.files[name])
    with pytest.raises(M.CheckpointError, match=f"size or hash mismatch: .* {algo} ") as err:
        M.fetch_from_hub(REPO)
    assert len(hub.served[name]) == len(hub.files[name])
    assert str(len(hub.files[name])) in str(err.value)
    assert not (cache_dir() / name).exists() and not (cache_dir() / (name + ".part")).exists()
    assert not (cache_dir() / M.HUB_MANIFEST).exists()
    del hub.served[name]
    folder = M.fetch_from_hub(REPO)                 # the next call fetches it again
    assert (folder / name).read_bytes() == hub.files[name]


@pytest.mark.parametrize("how", ["4096 more", "4096 fewer", "short-length", "no-length"])
def test_a_wrong_size_is_refused_and_never_kept(env, how):
    hub = env()
    data = hub.files["model.safetensors"]
    if how == "4096 more":
        hub.served["model.safetensors"] = data + bytes(4096)
    elif how == "4096 fewer":
        hub.served["model.safetensors"] = data[:-4096]
    else:
        hub.quirks["model.safetensors"] = how
    with pytest.raises(M.CheckpointError, match=f"size or hash mismatch: .*lists {len(data)} "):
        M.fetch_from_hub(REPO)
    assert not (cache_dir() / "model.safetensors").exists()
    assert not (cache_dir() / M.HUB_MANIFEST).exists()


def test_a_short_body_once_is_resumed(env):
    files = checkpoint_files()
    files["tokenizer.json"] = bytes(range(256)) * 40        # over the 4,096 bytes held back
    hub = env(files=files)
    hub.quirks["model.safetensors"] = "no-length-once"
    hub.quirks["tokenizer.json"] = "short-length-once"
    folder = M.fetch_from_hub(REPO)
    for name, resumed_at in (("model.safetensors", len(files["model.safetensors"]) // 2),
                             ("tokenizer.json", len(files["tokenizer.json"]) - 4096)):
        assert (folder / name).read_bytes() == files[name]
        assert [h["Range"] for h in hub.gets(name)] == ["bytes=0-", f"bytes={resumed_at}-"]


def test_a_stalled_transfer_is_named(env, monkeypatch):
    monkeypatch.setattr(M, "HUB_STALL", 0.5)
    monkeypatch.setattr(M, "HUB_RATE", 1000)                    # the deadline: minutes away
    hub = env()
    hub.quirks["model.safetensors"] = "stall"
    with pytest.raises(M.CheckpointError, match="timed out"):
        M.fetch_from_hub(REPO)
    assert len(hub.gets("model.safetensors")) == M.HUB_TRIES


def test_a_trickle_meets_the_overall_deadline(env, monkeypatch):
    monkeypatch.setattr(M, "HUB_STALL", 1)          # a byte every 50 ms never stalls
    monkeypatch.setattr(M, "HUB_RATE", 1e12)        # the deadline: 1 s from the first byte
    hub = env()
    hub.quirks["model.safetensors"] = "trickle"
    with pytest.raises(M.CheckpointError, match="past its deadline"):
        M.fetch_from_hub(REPO)
    assert len(hub.gets("model.safetensors")) == 1                 # not retried


@pytest.mark.parametrize("quirk,named", [
    ("redirect-loop", "TooManyRedirects: Exceeded 30 redirects"),
    ("big-header", "got more than 65536 bytes when reading header line"),
    ("many-headers", "got more than 100 headers"),
    ("status-503", "HTTPError: 503 Server Error")])
def test_each_failure_is_named(env, quirk, named):
    hub = env()
    hub.quirks["config.json"] = quirk
    with pytest.raises(M.CheckpointError) as err:
        M.fetch_from_hub(REPO)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert "network unreachable" not in str(err.value)


def test_a_config_that_is_not_an_object_is_not_marked_complete(env):
    hub = env()
    hub.files["config.json"] = b"[1, 2]"
    with pytest.raises(M.CheckpointError, match="config.json: not a JSON object"):
        M.fetch_from_hub(REPO)
    assert not (cache_dir() / M.HUB_MANIFEST).exists()
    hub.files["config.json"] = b'{"model_type": "qwen2"}'       # the Hub fixed: fetched again
    folder = M.fetch_from_hub(REPO)
    assert (folder / "config.json").read_bytes() == hub.files["config.json"]


def test_the_marker_records_what_was_checked_and_is_trusted_while_sizes_match(env, monkeypatch):
    hub = env()
    folder = M.fetch_from_hub(REPO)
    data = hub.files["model.safetensors"]
    marker = json.loads((folder / M.HUB_MANIFEST).read_text())
    assert marker["files"]["model.safetensors"]["lfs"]["oid"] == hashlib.sha256(data).hexdigest()
    assert sorted(marker["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]
    with open(folder / "model.safetensors", "r+b") as f:          # damaged after the marker
        f.truncate(len(data) - 4096)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(M.CheckpointError, match=f"no complete copy in {folder}"):
        M.fetch_from_hub(REPO)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert M.fetch_from_hub(REPO) == folder
    assert (folder / "model.safetensors").read_bytes() == data
    assert hub.gets("model.safetensors")[-1]["Range"] == f"bytes={len(data) - 4096}-"


def test_a_copy_without_marker_is_checked_file_by_file(env):
    hub = env()
    folder = M.fetch_from_hub(REPO)
    (folder / M.HUB_MANIFEST).unlink()
    tok = folder / "tokenizer.json"
    tok.write_bytes(corrupted(tok.read_bytes()))                    # same size, damaged
    assert M.fetch_from_hub(REPO) == folder
    assert tok.read_bytes() == hub.files["tokenizer.json"]
    assert len(hub.gets("tokenizer.json")) == 2                     # fetched again
    assert len(hub.gets("model.safetensors")) == len(hub.gets("config.json")) == 1   # kept


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
    hub = env(files=files, lfs=())
    with pytest.raises(M.CheckpointError, match=r"model\.safetensors\.index\.json"):
        M.fetch_from_hub(REPO)
    assert not (cache_dir() / M.HUB_MANIFEST).exists()
    hub.files[M.INDEX] = checkpoint_files(sharded=True)[M.INDEX]   # fixed on the Hub
    n = len(hub.requests)
    assert (M.fetch_from_hub(REPO) / M.INDEX).read_bytes() == hub.files[M.INDEX]
    assert len(hub.requests) > n and (cache_dir() / M.HUB_MANIFEST).exists()


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
    with pytest.raises(M.CheckpointError, match="HTTPError: 404 Client Error: Not Found"):
        M.fetch_from_hub("tiny-org/missing")


def test_a_file_the_hub_does_not_list_is_named(env):
    files = checkpoint_files(False)
    del files["tokenizer.json"]
    env(files)
    with pytest.raises(M.CheckpointError, match="the Hub lists no file 'tokenizer.json'"):
        M.fetch_from_hub(REPO)


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
    assert again.layer_devices == [torch.device("cpu")] * len(again.model.layers)  # split
    with pytest.raises(M.CheckpointError, match="no such directory"):
        M.load_model(str(tmp_path / "no" / "such" / "dir"))
