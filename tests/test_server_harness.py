"""A live `ninfer serve` app on 127.0.0.1 for the server tests, and the tests of its life cycle:
loading (503 then 200), a model that fails to load, and the `ninfer serve` command itself
(a subprocess, with --api-key).

`LiveServer` runs the aiohttp app in-process on a background thread with its own event loop, on
a free port, serving the bundled demo model (random weights, a small byte-level tokenizer with
the Qwen special tokens). Every request made through it has a timeout, so a hang fails a test
instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ninfer.engine import Engine, default_model_path
from ninfer.server import ServerConfig, create_app, start_site
from ninfer.server.state import STATE

TIMEOUT = 60.0  # seconds; every request and wait in the server tests is bounded by this


@pytest.fixture(scope="session")
def demo_model() -> Path:
    path = default_model_path()
    assert path.exists(), f"the bundled demo model is missing: {path} (scripts/make_demo_model.py builds it)"
    return path


class LiveServer:
    """The app on a background event loop; `close()` stops it and closes the engine."""

    def __init__(self, config: ServerConfig, loader: Callable[[], Engine] | None = None) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.app = create_app(config, loader)
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.runner, self.port = self.loop.run_until_complete(start_site(self.app, "127.0.0.1", 0))
            except BaseException as e:  # reported to the constructor below
                failure.append(e)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="live-server", daemon=True)
        self.thread.start()
        assert started.wait(TIMEOUT), "the server did not start"
        if failure:
            raise failure[0]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> Engine | None:
        return self.app[STATE].engine

    def wait_ready(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.request("GET", "/health")[0] == 200:
                return
            time.sleep(0.02)
        raise AssertionError("the server did not become ready")

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; returns (status, headers, body)."""
        conn = self.connection()
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        status, _, data = self.request("POST", path, body, headers)
        return status, json.loads(data)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, name -> value."""
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            m = re.fullmatch(r"([a-z0-9_]+) (\S+)", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self) -> dict[str, float]:
        """Waits until no request runs or waits; returns the metrics then."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = self.metrics()
            if m["ninfer_requests_running"] == 0 and m["ninfer_requests_waiting"] == 0 and m["ninfer_slots_used"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not go idle: {m}")
            time.sleep(0.02)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


def live_server(model: Path, **options: Any) -> Iterator[LiveServer]:
    """Generator body for fixtures: a ready server on `model` with ServerConfig `options`."""
    options.setdefault("device", "cpu")
    options.setdefault("model_id", "demo")
    server = LiveServer(ServerConfig(model=str(model), **options))
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def test_health_is_503_while_loading_then_200(demo_model: Path) -> None:
    release = threading.Event()

    def slow_loader() -> Engine:
        assert release.wait(TIMEOUT)
        return Engine(demo_model, device="cpu")

    server = LiveServer(ServerConfig(model=str(demo_model), model_id="demo"), slow_loader)
    try:
        status, _, body = server.request("GET", "/health")
        assert (status, json.loads(body)) == (503, {"status": "loading"})
        status, headers, body = server.request(
            "POST", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 503 and "retry-after" in headers
        assert "still loading" in json.loads(body)["error"]["message"]
        assert server.metrics()["ninfer_model_ready"] == 0
        release.set()
        server.wait_ready()
        status, _, body = server.request("GET", "/health")
        assert (status, json.loads(body)) == (200, {"status": "ok"})
        assert server.metrics()["ninfer_model_ready"] == 1
    finally:
        release.set()
        server.close()


def test_a_model_that_fails_to_load_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "broken.ninfer"
    bad.write_bytes(b"not an artifact")
    server = LiveServer(ServerConfig(model=str(bad), device="cpu"))
    try:
        deadline = time.monotonic() + TIMEOUT
        while (body := json.loads(server.request("GET", "/health")[2]))["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert body["status"] == "error" and body["message"]
        status, _, data = server.request(
            "POST",
            "/v1/messages",
            {"model": "broken", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 503
        err = json.loads(data)
        assert err["type"] == "error" and "failed to load" in err["error"]["message"]
    finally:
        server.close()


def _cli_env() -> dict[str, str]:
    python_dir = str(Path(__file__).resolve().parent.parent / "python")
    env = dict(os.environ)
    env["PYTHONPATH"] = python_dir + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("NINFER_API_KEY", None)
    return env


def test_cli_serve_enforces_the_api_key(demo_model: Path) -> None:
    import openai

    cmd = [
        sys.executable,
        "-m",
        "ninfer.cli",
        "serve",
        str(demo_model),
        "--port",
        "0",
        "--device",
        "cpu",
        "--model-id",
        "tiny",
        "--api-key",
        "s3cret",
        "--kv-capacity",
        "1000",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_cli_env())
    try:
        assert proc.stderr is not None
        port = None
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"ninfer serve exited early with {proc.poll()}"
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(found.group(1)) if found else port
            if "serving `tiny`" in line:
                assert "KV 1008 tokens" in line, line  # --kv-capacity reached the engine, in whole pages
                break
        assert port is not None
        base = f"http://127.0.0.1:{port}/v1"
        good = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0, timeout=TIMEOUT)
        assert [m.id for m in good.models.list().data] == ["tiny"]
        out = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert info.value.status_code == 401 and "invalid API key" in info.value.message
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("POST", "/v1/chat/completions", body=b"{}", headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 401 and "missing API key" in json.loads(resp.read())["error"]["message"]
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200  # probes need no key
        conn.close()
    finally:
        proc.terminate()
        assert proc.wait(TIMEOUT) == 0


def test_cli_serve_refuses_a_missing_model(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ninfer.cli", "serve", str(tmp_path / "nope.ninfer"), "--port", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_cli_env(), timeout=TIMEOUT)
    assert out.returncode == 2
    assert "no such artifact" in out.stderr and "Traceback" not in out.stderr
