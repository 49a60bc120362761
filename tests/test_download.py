"""Downloads against a local stand-in for the Hugging Face Hub (HF_ENDPOINT=http://127.0.0.1:PORT).

The server speaks the endpoints huggingface_hub 2.x uses: `GET /api/models/{repo}[/revision/{rev}]`
(JSON with `sha` and `siblings`), and `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with ETag,
X-Repo-Commit, Content-Length and Range support. It can cut a file off mid-transfer (the client
resumes with a Range request) or fail a file outright (a rerun fetches only what is missing).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from core.io.download import DownloadProgress, download_model, resolve_model
from core.errors import MlightError, ModelError, UnsupportedModelError

ROOT = Path(__file__).resolve().parent.parent
SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop_once: set[str] = set()  # files whose next GET is cut off halfway
        self.fail: set[str] = set()  # files whose GET answers 500
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub.serve(self, head=True)

            def do_GET(self):
                hub.serve(self, head=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self, name: str) -> list[str | None]:
        """Range headers of the GETs of file `name` (None = whole file)."""
        return [rng for m, p, rng in self.log if m == "GET" and p.endswith("/" + name)]

    def serve(self, h, head: bool) -> None:
        path = h.path.split("?")[0]
        self.log.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self.send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            body = json.dumps({"id": repo, "modelId": repo, "sha": SHA, "private": False, "siblings": [
                {"rfilename": f, "size": len(b)} for f, b in sorted(self.repos[repo].items())]}).encode()
            return self.send(h, 200, body, {"Content-Type": "application/json"}, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            files = self.repos.get(repo)
            if files is None:
                return self.send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, head)
            if name not in files:
                return self.send(h, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA}, head)
            data = files[name]
            hdr = {"ETag": '"' + hashlib.sha256(data).hexdigest() + '"', "X-Repo-Commit": SHA,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if head:
                return self.send(h, 200, data, hdr, head=True)
            if name in self.fail:
                return self.send(h, 500, b"internal error", {})
            start = 0
            rng = h.headers.get("Range")
            if rng:
                start = int(rng.split("=")[1].split("-")[0])
                hdr["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if name in self.drop_once and not rng:
                self.drop_once.discard(name)
                h.send_response(200)
                for k, v in {**hdr, "Content-Length": str(len(data))}.items():
                    h.send_header(k, v)
                h.end_headers()
                h.wfile.write(data[: len(data) // 2])
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(2)  # the connection drops mid-file
                return
            return self.send(h, 206 if rng else 200, data[start:], hdr)
        self.send(h, 404, b"", {})

    @staticmethod
    def send(h, status: int, body: bytes, headers: dict, head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def sharded_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny sharded Mixtral checkpoint plus files mlight must not download."""
    from checkpoints import make_checkpoint

    d = make_checkpoint("mixtral", tmp_path_factory.mktemp("ckpt sharded"), max_shard_size="200KB")
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert sum(n.endswith(".safetensors") for n in files) >= 2
    files.update({"README.md": b"# tiny", "pytorch_model.bin": b"pickle!", "consolidated.safetensors": b"x" * 10,
                  "original/params.json": b"{}", "onnx/model.onnx": b"onnx"})
    return files


@pytest.fixture
def hub(sharded_files, tmp_path, monkeypatch):
    from huggingface_hub import constants

    h = FakeHub()
    h.repos["org/tiny"] = dict(sharded_files)
    # what HF_ENDPOINT sets at import time, for this process
    monkeypatch.setattr(constants, "ENDPOINT", h.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", h.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf cache ü"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    # the client resumes from the last whole chunk it received (10 MB by default); our shards are smaller
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield h
    h.close()


def _expected(files: dict[str, bytes]) -> set[str]:
    shards = set(json.loads(files["model.safetensors.index.json"])["weight_map"].values())
    return shards | {f for f in files if f.endswith(".json") and "/" not in f} | {"chat_template.jinja"}


def test_downloads_only_needed_files_with_progress(hub, sharded_files):
    events = []
    path = download_model("org/tiny", progress=events.append)
    got = {p.name for p in path.iterdir()}
    assert got == _expected(sharded_files)
    for name in got:
        assert (path / name).read_bytes() == sharded_files[name]
    for unwanted in ("pytorch_model.bin", "consolidated.safetensors", "README.md", "params.json", "model.onnx"):
        assert not hub.gets(unwanted)
    prog = [e for e in events if isinstance(e, DownloadProgress)]
    assert prog[-1].done == prog[-1].total == sum(
        len(sharded_files[f]) for f in got if f not in ("config.json", "model.safetensors.index.json"))
    assert all(a.done <= b.done for a, b in zip(prog, prog[1:])) and prog[-1].rate > 0 and prog[-1].unit == "B"
    # a second call reuses the cache: metadata only, no file body fetched again
    n = len(hub.log)
    assert download_model("org/tiny") == path
    assert not [m for m, p, _ in hub.log[n:] if m == "GET" and "/resolve/" in p and "config.json" not in p]


def test_dropped_connection_is_resumed_with_range(hub, sharded_files):
    big = max((f for f in _expected(sharded_files) if f.endswith(".safetensors")), key=lambda f: len(sharded_files[f]))
    hub.drop_once.add(big)
    path = download_model("org/tiny")
    assert (path / big).read_bytes() == sharded_files[big]
    ranges = hub.gets(big)
    half = len(sharded_files[big]) // 2
    assert ranges[0] is None and len(ranges) == 2
    assert half - 4096 < int(ranges[1].removeprefix("bytes=").removesuffix("-")) <= half


def test_failed_file_then_rerun_fetches_only_the_rest(hub, sharded_files):
    shards = sorted(f for f in _expected(sharded_files) if f.endswith(".safetensors"))
    hub.fail.add(shards[-1])
    with pytest.raises(MlightError, match=f"the download of org/tiny/{shards[-1]} failed"):
        download_model("org/tiny")
    hub.fail.clear()
    download_model("org/tiny")
    assert len(hub.gets(shards[0])) == 1  # kept from the first try
    assert len(hub.gets(shards[-1])) == 2


def _repo(hub, name, files):
    hub.repos[name] = files
    return name


def _cfg(files, **extra):
    cfg = json.loads(files["config.json"])
    cfg.update(extra)
    return json.dumps(cfg).encode()


def test_refusals_before_any_weight_is_fetched(hub, sharded_files):
    remote = _repo(hub, "org/remote", {**sharded_files, "config.json": _cfg(sharded_files, auto_map={"x": "y"})})
    with pytest.raises(UnsupportedModelError, match="remote code"):
        download_model(remote)
    alien = _repo(hub, "org/alien", {**sharded_files,
                                     "config.json": _cfg(sharded_files, architectures=["LlamaForCausalLM"])})
    with pytest.raises(UnsupportedModelError, match="architecture LlamaForCausalLM is not supported"):
        download_model(alien)
    pickles = _repo(hub, "org/pickles", {"config.json": sharded_files["config.json"], "pytorch_model.bin": b"x"})
    with pytest.raises(ModelError, match=r"only PyTorch pickle weights \(pytorch_model.bin\)"):
        download_model(pickles)
    index = json.loads(sharded_files["model.safetensors.index.json"])
    index["weight_map"]["extra.weight"] = "model-09999-of-09999.safetensors"
    broken = _repo(hub, "org/broken", {**sharded_files, "model.safetensors.index.json": json.dumps(index).encode()})
    with pytest.raises(ModelError, match="names model-09999-of-09999.safetensors, which the repo does not have"):
        download_model(broken)
    with pytest.raises(ModelError, match="org/missing was not found on the Hugging Face Hub"):
        download_model("org/missing")
    assert not [p for m, p, _ in hub.log if m == "GET" and p.endswith(".safetensors")]


def test_free_disk_space_checked_first(hub, monkeypatch):
    import core.io.download

    monkeypatch.setattr(core.io.download, "_free_bytes", lambda folder: 1000)
    with pytest.raises(MlightError, match=r"not enough disk space: the download needs .* MB and .* has 0.0 MB free"):
        download_model("org/tiny")
    assert not [p for m, p, _ in hub.log if m == "GET" and p.endswith(".safetensors")]


def test_offline_and_unreachable_use_the_cache(hub, monkeypatch):
    from huggingface_hub import constants

    path = download_model("org/tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(hub.log)
    assert download_model("org/tiny") == path and len(hub.log) == n
    with pytest.raises(MlightError, match="HF_HUB_OFFLINE is set and org/other is not in the local cache — unset HF_HUB_OFFLINE"):
        download_model("org/other")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    assert download_model("org/tiny", endpoint=dead) == path
    with pytest.raises(MlightError, match=r"the Hub \(http://127.0.0.1:9\) cannot be reached and org/other"):
        download_model("org/other", endpoint=dead)


def test_resolve_model_folder_repo_or_error(hub, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "ckpt")) == (tmp_path / "ckpt", "ckpt")
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "nope" / "deeper"))
    assert resolve_model("org/tiny")[1] == "org/tiny"


def test_cli_download_and_run_from_repo_id(hub, sharded_files, tmp_path, monkeypatch):
    """`mlight download` in a subprocess honours HF_ENDPOINT and HF_HOME; `mlight run --model REPO` reuses it."""
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf home"), PYTHONPATH=str(ROOT),
               HF_HUB_DISABLE_XET="1")
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)
    p = subprocess.run([sys.executable, "-m", "app.cli", "download", "org/tiny"], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    snap = Path(p.stdout.strip())
    assert snap.is_relative_to(tmp_path / "hf home") and (snap / "config.json").is_file()
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nworld\n")
    from huggingface_hub import constants

    from app.cli import main

    # as HF_HOME and HF_HUB_OFFLINE=1 would set them: everything needed is cached now
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["run", "--model", "org/tiny", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "3"]) == 0
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
    shutil.rmtree(tmp_path / "hf home")
