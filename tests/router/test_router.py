"""The KV-aware router in front of two `slipstream serve` instances (tiny model, CPU).

A request sharing a prefix with an earlier one goes to the instance that cached
it (and hits its prefix cache there); other requests spread by load; streaming
and chat pass through; one instance killed, the router fails only the requests
it was serving and goes on through the other.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.server.conftest import ROOT, TINY_ARGS, ServerProcess, free_port, write_tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("h11")

PROMPT_A = "The quick brown fox jumps over the lazy dog, then it runs far away into the wood"
PROMPT_B = "Pack my box with five dozen liquor jugs, said the sphinx of black quartz, judge my vow"
HANG_LIMIT_S = 180     # tests/conftest.py: a hang ends the run with a traceback


class RouterProcess:
    def __init__(self, instances: list[str], model, log_path, extra: tuple = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.cli", "router", "--instances", ",".join(instances),
             "--model", str(model), "--port", str(self.port), "--poll-interval", "0.3",
             "--log-level", "warning", *extra], stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"router did not come up: {log_path.read_text()}")

    def post(self, path: str, body: dict, timeout: float = 60):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.headers.get("x-slipstream-instance"), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("x-slipstream-instance"), json.loads(e.read())

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("router-model"))
    logs = tmp_path_factory.mktemp("router-logs")
    a = ServerProcess(["--model", str(folder), *TINY_ARGS], logs / "a.log")
    b = ServerProcess(["--model", str(folder), *TINY_ARGS], logs / "b.log")
    router = RouterProcess([a.url, b.url], folder, logs / "router.log")
    yield router, {a.url: a, b.url: b}
    router.stop()
    for s in (a, b):
        s.stop()


def _complete(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}


def _hits(server) -> float:
    """The instance's prefix-cache hit tokens so far (its /metrics counter)."""
    return sum(v for k, v in server.metrics().items()
               if k.startswith("slipstream_prefix_cache_hit_tokens_total"))


def test_prefix_sharing_requests_go_where_the_prefix_is_cached(cluster):
    router, servers = cluster
    status, first, body = router.post("/v1/completions", _complete(PROMPT_A))
    assert status == 200 and body["choices"][0]["text"] is not None
    hits_before = _hits(servers[first])
    status, again, _ = router.post("/v1/completions", _complete(PROMPT_A + ", and back home"))
    assert status == 200 and again == first
    assert _hits(servers[first]) > hits_before          # its blocks were reused there
    # No shared prefix: the other instance (same load, chosen less recently).
    status, other, _ = router.post("/v1/completions", _complete(PROMPT_B))
    assert status == 200 and other != first
    status, other_again, _ = router.post("/v1/completions", _complete(PROMPT_B + " again"))
    assert other_again == other
    # The instances' own reports (the poll), not only the router's memory, hold the blocks.
    time.sleep(1.0)
    state = router.get("/router/state")
    assert state["block_size"] == 4
    assert all(i["alive"] and i["cached_blocks"] > 0 for i in state["instances"])


def test_streaming_and_chat_pass_through(cluster):
    router, servers = cluster
    status, inst, direct = router.post("/v1/completions", _complete(PROMPT_B + " stream", max_tokens=8))
    req = urllib.request.Request(router.url + "/v1/completions", method="POST",
                                 data=json.dumps(_complete(PROMPT_B + " stream", max_tokens=8,
                                                           stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers.get("x-slipstream-instance") == inst
        events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        text += json.loads(e)["choices"][0]["text"] if json.loads(e)["choices"] else ""
    assert text == direct["choices"][0]["text"]
    status, _, chat = router.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0})
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    status, _, bad = router.post("/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert status == 400 and "max_tokens" in bad["error"]["message"]   # the instance's own error
    models = router.get("/v1/models")
    assert models["data"][0]["id"]


def test_a_killed_instance_fails_its_stream_and_the_router_goes_on(cluster):
    router, servers = cluster
    status, victim, _ = router.post("/v1/completions", _complete(PROMPT_A + " once more"))
    assert status == 200
    req = urllib.request.Request(router.url + "/v1/completions", method="POST",
                                 data=json.dumps(_complete(PROMPT_A + " once more, slowly",
                                                           max_tokens=900, ignore_eos=True,
                                                           stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers.get("x-slipstream-instance") == victim
        r.readline()
        servers[victim].proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rest = r.read().decode()     # the stream ends: with an error, not a hang
    assert time.monotonic() - t0 < 10
    assert "failed while serving this request" in rest and rest.rstrip().endswith("data: [DONE]")
    # Its cached prefix does not matter any more: the survivor answers, at once.
    t0 = time.monotonic()
    status, inst, body = router.post("/v1/completions", _complete(PROMPT_A + " at last"))
    assert status == 200 and inst != victim and time.monotonic() - t0 < 10
    time.sleep(1.0)
    state = {i["url"]: i for i in router.get("/router/state")["instances"]}
    assert not state[victim]["alive"] and state[inst]["alive"]
    assert state[victim]["in_flight"] == state[inst]["in_flight"] == 0   # nothing left counted
    assert router.get("/health")["live_instances"] == 1


def test_instances_with_an_api_key_and_openai_errors(tmp_path):
    """Instances started with --api-key: the router's polls carry --api-key, the
    clients' requests their own key; unknown routes answer OpenAI error objects;
    models.retrieve passes through."""
    folder = write_tiny_model(tmp_path / "model")
    inst = ServerProcess(["--model", str(folder), *TINY_ARGS, "--api-key", "k3y"], tmp_path / "i.log")
    router = RouterProcess([inst.url], folder, tmp_path / "r.log", ("--api-key", "k3y"))
    try:
        assert router.get("/health")["live_instances"] == 1
        key = {"Authorization": "Bearer k3y", "Content-Type": "application/json"}

        def call(path, body=None, headers=key):
            req = urllib.request.Request(router.url + path, method="POST" if body else "GET",
                                         data=json.dumps(body).encode() if body else None,
                                         headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
        status, obj = call("/v1/completions", _complete(PROMPT_A))
        assert status == 200 and obj["choices"][0]["text"], obj
        status, obj = call("/v1/completions", _complete(PROMPT_A), {"Content-Type": "application/json"})
        assert status == 401, obj
        model = call("/v1/models")[1]["data"][0]["id"]
        status, obj = call(f"/v1/models/{model}")
        assert status == 200 and obj["id"] == model
        status, obj = call("/v1/nothing-here")
        assert status == 404 and obj["error"]["message"]
        # A non-streaming client hangs up: the router closes the instance's connection,
        # which aborts the request there; nothing stays counted in flight.
        import http.client
        import socket
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=0.5)
        conn.request("POST", "/v1/completions", json.dumps(
            _complete(PROMPT_B, max_tokens=900, ignore_eos=True)), key)
        with pytest.raises(socket.timeout):
            conn.getresponse()
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()

        def aborted() -> float:
            text = inst.get("/metrics", {"Authorization": "Bearer k3y"})
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("slipstream_requests_total") and 'outcome="aborted"' in line)
        deadline = time.monotonic() + 20
        while aborted() < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert aborted() >= 1, inst.log()
        assert router.get("/router/state")["instances"][0]["in_flight"] == 0
    finally:
        router.stop()
        inst.stop()
