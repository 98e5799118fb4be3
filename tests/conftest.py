"""Shared test fixtures: the ../shared material (skipped cleanly when absent), the 0.5B model,
a local OpenAI-compatible server; eager decoding. Nothing of the lab is loaded here: a test of the
core runs the core alone, and a test of the lab imports what it needs."""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Decode eagerly (model.py's PAIR_COMPILE switch, also for the command lines the tests start):
# compiling a graph for each tiny config would cost more than the suite. The tests that hold
# the compiled step against the eager one turn it back on.
os.environ["PAIR_COMPILE"] = "0"
# The command lines the tests start find the core and the lab (python -m lab.X) from anywhere.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))

SHARED = Path(os.environ.get("PAIR_SHARED", ROOT.parent / "shared"))
RELEASE = SHARED / "data" / "pair-release"
QWEN_TOKENIZER = SHARED / "data" / "qwen2.5-tokenizer"
QWEN05B = Path(os.environ.get("PAIR_QWEN05B",
                              Path.home() / ".cache" / "pair-models" / "qwen2.5-0.5b"))


@pytest.fixture
def release_dir():
    if not RELEASE.is_dir():
        pytest.skip(f"released splits not found at {RELEASE}")
    return RELEASE


@pytest.fixture
def qwen_tokenizer_dir():
    if not (QWEN_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"Qwen2.5 tokenizer not found at {QWEN_TOKENIZER}")
    return QWEN_TOKENIZER


@pytest.fixture
def qwen05b_dir():
    if not (QWEN05B / "model.safetensors").is_file():
        pytest.skip(f"0.5B checkpoint not found at {QWEN05B} (build it with "
                    "../shared/tools/make_qwen05b.sh)")
    return QWEN05B


@pytest.fixture
def one_thread():
    # Tiny matrices on a shared 2-core machine: thread hand-offs cost more than the math.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class FakeOpenAI:
    """Answers POST /v1/chat/completions: scripted (status, body) first, then `reply(request)`."""

    def __init__(self):
        self.requests, self.script = [], []
        self.reply = lambda body: {"label": "yes"}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "body": body,
                                      "auth": self.headers.get("Authorization")})
                if fake.script:
                    status, payload = fake.script.pop(0)
                else:
                    content = fake.reply(body)
                    status, payload = 200, {"choices": [{"message": {
                        "role": "assistant", "content": content if isinstance(content, str)
                        else json.dumps(content)}}]}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake_openai(monkeypatch):
    fake = FakeOpenAI()
    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    yield fake
    fake.server.shutdown()
    fake.server.server_close()
