"""Helpers of the weights tests: greedy text through the real start path, and a loopback HTTP proxy in front
of moto that counts requests and can cut one response short."""

from __future__ import annotations

import asyncio
import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from runtime.config import Settings
from runtime.engine import SamplingParams
from runtime.launch import build_engine, engine_config
from runtime.weights.resolve import resolve_model

PROMPT = [5, 9, 33, 100, 7]


def cpu_settings(cache_dir: Path, **env: str) -> Settings:
    return Settings.from_env({"DEVICE": "cpu", "CACHE_DIR": str(cache_dir), **env})


def start(model: str, settings: Settings):
    """MODEL -> a started engine, the way the cold start path does it."""
    model_dir = resolve_model(model, settings.cache_dir, settings.cache_max_gb)
    engine = build_engine(model_dir, engine_config(settings), None, "m", settings)
    try:
        engine.start()
    except BaseException:
        engine.shutdown()
        raise
    return engine


def greedy(engine, n: int = 12) -> list[int]:
    async def run():
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return [t async for o in engine.generate(PROMPT, params) for t in o.token_ids]

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


class CuttingProxy:
    """Forwards every request to `upstream`; records (method, path, range); `cut_next(part)` makes the next
    ranged GET of a path containing `part` send its headers and half its body, then drop the connection;
    `fail(method, part, times)` answers the next TIMES such requests 503 without forwarding them."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests: list[tuple[str, str, str | None]] = []
        self.cuts: list[str] = []
        self.cut_done: list[str] = []
        self.failing: list[list] = []  # [method, part, times left]
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def cut_next(self, part: str) -> None:
        with self._lock:
            self.cuts.append(part)

    def fail(self, method: str, part: str, times: int) -> None:
        with self._lock:
            self.failing.append([method, part, times])

    def count(self, method: str, part: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == method and part in p)

    def _take_failure(self, method: str, path: str) -> bool:
        with self._lock:
            for failure in self.failing:
                if failure[0] == method and failure[1] in path and failure[2] > 0:
                    failure[2] -= 1
                    return True
        return False

    def ranged_gets(self, part: str = "") -> int:
        return sum(1 for m, p, r in self.requests if m == "GET" and r and part in p)

    def stop(self) -> None:
        self.server.shutdown()

    def _take_cut(self, method: str, path: str, rng: str | None) -> bool:
        with self._lock:
            for part in self.cuts:
                if method == "GET" and rng and part in path:
                    self.cuts.remove(part)
                    self.cut_done.append(path)
                    return True
        return False

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                rng = self.headers.get("Range")
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, rng))
                if proxy._take_failure(self.command, self.path):
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                conn.request(self.command, self.path, body, {k: v for k, v in self.headers.items()})
                resp = conn.getresponse()
                data = resp.read()
                cut = proxy._take_cut(self.command, self.path, rng)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2] if cut else data)
                self.wfile.flush()
                if cut:
                    self.close_connection = True
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        return Handler
