"""A real S3-protocol server on loopback for the remote-path tests: moto's server mode in its own process,
behind a small proxy that can fail writes on demand and records which process sent each request.

Nothing here leaves 127.0.0.1. ``S3Server`` is a context manager; leaving it stops both servers."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

from processes import free_port

_WRITES = ("PUT", "POST")
_ERROR = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code><Message>injected</Message></Error>"


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv = self.server
        srv.record(self.command, self.path, self.client_address[1])
        if srv.hold_suffix and self.command == "PUT" and self.path.split("?")[0].endswith(srv.hold_suffix):
            srv.held.set()
            srv.release.wait(120)  # bounded: a test that forgets to release fails, it does not hang
        if srv.fail_writes.is_set() and self.command in _WRITES:
            self.send_response(500)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_ERROR)))
            self.end_headers()
            self.wfile.write(_ERROR)
            return
        conn = http.client.HTTPConnection("127.0.0.1", srv.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding",)}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                self.send_header(k, v)
        # a HEAD answer has no body but says the object's size
        self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
            if self.command == "GET":
                srv.served(len(data))
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", port), _Proxy)
        self.upstream_port = upstream_port
        self.fail_writes = threading.Event()
        self.hold_suffix: str | None = None  # a PUT to a key ending so waits for ``release``
        self.held, self.release = threading.Event(), threading.Event()
        self.requests: list[tuple[str, str, int | None]] = []  # (method, path, pid of the sender)
        self.get_bytes = 0  # the bodies of every GET answered
        self._lock = threading.Lock()

    def served(self, nbytes: int) -> None:
        with self._lock:
            self.get_bytes += nbytes

    def record(self, method: str, path: str, client_port: int) -> None:
        pid = None
        for c in psutil.net_connections(kind="tcp4"):
            if c.laddr and c.laddr.port == client_port and c.raddr and c.raddr.port == self.server_address[1]:
                pid = c.pid
                break
        with self._lock:
            self.requests.append((method, path, pid))


class S3Server:
    """moto (``python -m moto.server``) on a free loopback port, and the proxy in front of it. ``env`` is
    what a client needs (endpoint, dummy credentials); ``fail_writes`` makes every PUT/POST a 500."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self._moto: subprocess.Popen | None = None
        self._proxy: _ProxyServer | None = None

    def __enter__(self) -> S3Server:
        port = free_port()
        log = open(self.workdir / "moto.log", "w")  # noqa: SIM115 - closed with the process
        self._log = log
        self._moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:  # handshake: the server answers HTTP
            if self._moto.poll() is not None:
                raise RuntimeError(f"moto server exited: {(self.workdir / 'moto.log').read_text()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/moto-api/")
                conn.getresponse().read()
                conn.close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError("moto server did not answer within 60 s") from None
                time.sleep(0.05)
        self._proxy = _ProxyServer(free_port(), port)
        threading.Thread(target=self._proxy.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self.direct_endpoint = f"http://127.0.0.1:{port}"  # moto itself, without the proxy (benchmarks)
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard",
        }
        return self

    @property
    def server_pid(self) -> int:
        """moto's process (benchmarks read its CPU time: on a cluster the store's CPU is not a node's)."""
        assert self._moto is not None
        return self._moto.pid

    @property
    def fail_writes(self) -> threading.Event:
        assert self._proxy is not None
        return self._proxy.fail_writes

    def hold_puts(self, suffix: str) -> tuple[threading.Event, threading.Event]:
        """PUTs of keys ending with ``suffix`` wait until the returned ``release`` is set; ``held`` is set
        when one arrives."""
        assert self._proxy is not None
        self._proxy.hold_suffix = suffix
        return self._proxy.held, self._proxy.release

    def requests(self) -> list[tuple[str, str, int | None]]:
        assert self._proxy is not None
        return list(self._proxy.requests)

    def get_bytes(self) -> int:
        """The bytes of every GET's body answered so far (what clients downloaded)."""
        assert self._proxy is not None
        return self._proxy.get_bytes

    def __exit__(self, *exc: object) -> None:
        if self._proxy is not None:
            self._proxy.release.set()
            self._proxy.shutdown()
            self._proxy.server_close()
            self._proxy = None
        if self._moto is not None:
            try:
                os.killpg(self._moto.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._moto.wait()
            self._log.close()
            self._moto = None
