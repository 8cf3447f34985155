"""Server processes for the tests: the default GGUF model (real text, chat template) and a
tiny random model (fast, for load and fault tests), each started with `slipstream serve`
on 127.0.0.1 at a free port and stopped with SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.loader.checkpoints import hf_config, write_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama with the tests' byte-level tokenizer and a 1024-token context."""
    from transformers import AutoModelForCausalLM
    cfg = hf_config("llama")
    cfg.max_position_embeddings = 1024
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    model.save_pretrained(folder)
    write_hf_tokenizer(folder)
    return folder


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.cli", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def get(self, path: str, headers: dict | None = None):
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-serve"))


TINY_ARGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "4", "--num-kv-blocks", "4096",
             "--max-num-seqs", "64"]


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """The default model (SmolLM2-135M GGUF): real text for client and browser tests.
    Dequantized weights: with the file's Q4_1 blocks and int8 activations (the CPU
    default) the greedy answer to "What is the capital of France?" is "L'Étoile, la
    Cité, la Nation", as llama.cpp answers too; dequantized, it is "Paris", which
    the tests look for."""
    server = ServerProcess(["--device", "cpu", "--max-model-len", "1024", "--max-num-seqs", "16",
                            "--quantization", "none"],
                           tmp_path_factory.mktemp("logs") / "default.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model_dir):
    server = ServerProcess(["--model", str(tiny_model_dir), *TINY_ARGS],
                           tmp_path_factory.mktemp("logs") / "tiny.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(default_server):
    """The official `openai` client on the default model's server."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
