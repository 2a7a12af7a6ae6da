"""`download` against a minimal Hub served on 127.0.0.1 (no other host is ever contacted).

The fake Hub implements exactly the requests huggingface_hub.snapshot_download makes
(2.x): GET /api/models/{repo}/revision/{rev} (commit sha), GET
/api/models/{repo}/tree/{sha}?recursive=... (file listing), HEAD and GET
/{repo}/resolve/{sha}/{file} (ETag, X-Repo-Commit, Content-Length).  Any other request
is answered 500 and recorded, and the tests fail on it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest
import torch

from omnidesk.models import download as dl
from omnidesk.models.download import ALLOW_PATTERNS, DownloadError, download
from omnidesk.models.families import RECOMMENDED
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.checkpoint import resolve_checkpoint

REPO = "Org/Tiny-Omni"
SHA = "0123456789abcdef0123456789abcdef01234567"
EXTRAS = {"README.md": b"# tiny\n", "assets/logo.png": b"\x89PNG fake", ".gitattributes": b"*.safetensors lfs\n"}
IDS = torch.tensor([1, 5, 42, 100, 300, 519])


class FakeHub:
    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.log: list[tuple[str, str]] = []
        self.unexpected: list[str] = []
        self.fail_get_once: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, body=False)

            def do_GET(self):
                hub.handle(self, body=True)

            def do_POST(self):
                hub.unexpected.append(f"POST {self.path}")
                self.send_response(500)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def send(self, h, status, payload: bytes = b"", headers=None, body=True):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if body:
            h.wfile.write(payload)

    def handle(self, h, body: bool):
        path = unquote(urlsplit(h.path).path)
        self.log.append((h.command, path))
        api = f"/api/models/{REPO}/"
        resolve = f"/{REPO}/resolve/{SHA}/"
        if path.startswith("/api/models/") and "/revision/" in path and not path.startswith(api):
            return self.send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if h.command == "GET" and path == api + "revision/main":
            info = {"id": REPO, "sha": SHA, "siblings": [{"rfilename": f} for f in self.files]}
            return self.send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if h.command == "GET" and path == api + f"tree/{SHA}":
            tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in self.files.items()]
            return self.send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
        if path.startswith(resolve) and path[len(resolve):] in self.files:
            name = path[len(resolve):]
            if body and name in self.fail_get_once:
                self.fail_get_once.discard(name)
                return self.send(h, 500, b"boom")
            data = self.files[name]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": SHA,
                       "Content-Type": "application/octet-stream"}
            return self.send(h, 200, data, headers, body)
        self.unexpected.append(f"{h.command} {h.path}")
        self.send(h, 500, b"unexpected request", body=body)

    def gets(self, since: int = 0) -> set[str]:
        prefix = f"/{REPO}/resolve/{SHA}/"
        return {p[len(prefix):] for m, p in self.log[since:] if m == "GET" and p.startswith(prefix)}


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Empty HF cache in tmp, online mode, no Xet, and sockets limited to loopback."""
    from huggingface_hub import constants

    hub_cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads these at import time
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)

    real_connect = socket.socket.connect

    def loopback_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"test tried to reach {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    return hub_cache


@pytest.fixture
def hub(tiny_checkpoints):
    src, _ = tiny_checkpoints("a")
    files = {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}
    files.update(EXTRAS)
    server = FakeHub(files)
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()
    server.thread.join(5)
    assert not server.unexpected, f"unexpected requests: {server.unexpected}"


@torch.inference_mode()
def _thinker_logits(stack) -> torch.Tensor:
    cache = stack.thinker.new_cache(16)
    return stack.thinker.logits(stack.thinker(stack.thinker.embed(IDS), cache))


def test_download_loads_and_second_run_is_noop(env, hub, tiny_checkpoints):
    src, _ = tiny_checkpoints("a")
    snap = download(REPO, endpoint=hub.endpoint, progress=False)
    assert snap == env / "models--Org--Tiny-Omni" / "snapshots" / SHA
    assert resolve_checkpoint(REPO) == snap
    wanted = {p.name for p in src.iterdir() if p.is_file()}
    assert {p.name for p in snap.iterdir()} == wanted  # no README / assets / .gitattributes
    assert hub.gets() == wanted
    assert torch.equal(_thinker_logits(load_stack(REPO)), _thinker_logits(load_stack(src)))

    before = len(hub.log)
    assert download(REPO, endpoint=hub.endpoint, progress=False) == snap
    assert hub.gets(before) == set()  # nothing fetched again
    assert hub.log[before:]  # but it did ask the endpoint for the current commit


def test_interrupted_download_resumes(env, hub):
    hub.fail_get_once.add("model.safetensors")
    with pytest.raises(DownloadError) as info:
        download(REPO, endpoint=hub.endpoint, progress=False)
    msg = str(info.value)
    assert REPO in msg and "again to resume" in msg
    done = {p.name for p in (env / "models--Org--Tiny-Omni" / "snapshots" / SHA).iterdir()}
    assert "model.safetensors" not in done
    before = len(hub.log)
    snap = download(REPO, endpoint=hub.endpoint, progress=False)
    assert "model.safetensors" in hub.gets(before)
    assert not hub.gets(before) & done  # finished files are not fetched again
    assert load_stack(snap).path == snap


def test_unknown_repo(env, hub):
    with pytest.raises(DownloadError) as info:
        download("Org/Nope", endpoint=hub.endpoint, progress=False)
    assert "Org/Nope" in str(info.value) and "not found" in str(info.value)
    assert "Org/Nope is not one of the repos OmniDesk knows" in str(info.value)  # a typo is compared with the known


def test_an_unknown_repo_on_an_unreachable_hub_is_compared_with_the_known_ones(env):
    """`omnidesk models download Qwen/Qwen2.5-Omni-14B` offline: the name is questioned too, a known repo's is not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for repo, questioned in (("Qwen/Qwen2.5-Omni-14B", True), ("Qwen/Qwen2.5-Omni-3B", False)):
        with pytest.raises(DownloadError) as info:
            download(repo, endpoint=f"http://127.0.0.1:{port}", progress=False)
        msg = str(info.value)
        assert "unreachable" in msg and ("not one of the repos OmniDesk knows" in msg) == questioned, msg
        assert ("Qwen/Qwen2.5-Omni-3B, Qwen/Qwen2.5-Omni-7B" in msg) == questioned


def test_unreachable_endpoint(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError) as info:
        download(REPO, endpoint=f"http://127.0.0.1:{port}", progress=False)
    msg = str(info.value)
    assert REPO in msg and "unreachable" in msg and f"127.0.0.1:{port}" in msg


@pytest.mark.parametrize("error, words", [
    (OSError(errno.ENOSPC, "No space left on device"), ["disk space", "resume"]),
    (KeyboardInterrupt(), ["interrupted", "again to resume"]),
])
def test_disk_full_and_interrupt_messages(env, monkeypatch, error, words):
    import huggingface_hub

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(DownloadError) as info:
        download("Qwen/Qwen2.5-Omni-3B", endpoint="http://127.0.0.1:9", progress=False)
    msg = str(info.value)
    assert "Qwen/Qwen2.5-Omni-3B" in msg
    for w in words:
        assert w in msg


def test_recommended_and_patterns():
    import fnmatch

    assert set(RECOMMENDED) == {"Qwen/Qwen2.5-Omni-3B", "Qwen/Qwen2.5-Omni-7B", "kyutai/moshiko-pytorch-bf16",
                                "kyutai/moshika-pytorch-bf16", "Qwen/Qwen3-Omni-30B-A3B-Instruct",
                                "Qwen/Qwen2.5-Omni-7B-GPTQ-Int4", "Qwen/Qwen2.5-Omni-7B-AWQ"}
    # Qwen3-Omni: 15 shards + index, tokenizer, chat template and the processor configs
    for name in ("model-00001-of-00015.safetensors", "model.safetensors.index.json", "chat_template.json",
                 "preprocessor_config.json", "generation_config.json", "merges.txt"):
        assert any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS), name
    assert RECOMMENDED["Qwen/Qwen2.5-Omni-3B"].gpu_memory_gb <= 16 < RECOMMENDED["Qwen/Qwen2.5-Omni-7B"].gpu_memory_gb
    assert "spk_dict.pt" in ALLOW_PATTERNS and "*.safetensors" in ALLOW_PATTERNS
    # the files of the published Moshi repos (FACTS.md) are fetched; their README is not
    for name in ("model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors", "tokenizer_spm_32k_3.model"):
        assert any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS), name
    assert not any(fnmatch.fnmatch("README.md", p) for p in ALLOW_PATTERNS)
    assert dl.DownloadError.__mro__[1] is RuntimeError
