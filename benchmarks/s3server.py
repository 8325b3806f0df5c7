"""A real S3-compatible server for the tests and the object-storage benchmark: moto's server on 127.0.0.1,
behind a proxy of ours that counts each request and the body bytes it returned, and can fail requests on demand (a 503 or a connection reset).

The clients under test talk to the proxy (`S3Server.endpoint`); setup talks to moto directly, so it is not
counted: a bucket is one plain PUT, objects are put with obstore. (Not boto3: moto's import hooks botocore,
and in some processes boto3's uploads then missed the server.)
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Headers that belong to one hop of a connection, never forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    fault: str | None = None


@dataclass
class Counts:
    """What the proxy forwarded since the last `S3Server.reset()`."""

    requests: list[Request] = field(default_factory=list)
    #: Most requests the proxy was serving at once.
    most_in_flight: int = 0

    def gets(self, key_part: str = "") -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and key_part in r.path and r.status in (200, 206)
                and not r.fault]

    def get_bytes(self, key_part: str = "") -> int:
        return sum(r.body_bytes for r in self.gets(key_part))


class S3Server:
    """moto (server mode) plus the counting proxy; `storage_options` point raylazy at the proxy."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.upstream = (host, port)
        self.counts = Counts()
        #: Faults to inject, consumed one per request in order: "503", "reset" (before answering), "cut" (reset
        #: half-way through the body) or None (forward it).
        self.faults: list[str | None] = []
        #: Emulated remote store (0: off): seconds before each answer, and bytes per second each response is sent at.
        self.first_byte_s = 0.0
        self.connection_bps = 0.0
        self.in_flight = 0
        self.lock = threading.Lock()
        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.proxy.daemon_threads = True
        threading.Thread(target=self.proxy.serve_forever, daemon=True, name="s3-proxy").start()
        self.endpoint = f"http://127.0.0.1:{self.proxy.server_address[1]}"
        #: The ETag of each object uploaded, by "bucket/key".
        self.etags: dict[str, str] = {}
        self.credentials = dict(access_key_id="testing", secret_access_key="testing", region="us-east-1")

    @property
    def storage_options(self) -> dict:
        """Endpoint, credentials, plain http, and quick retries (a failing server is reported in about a second)."""
        return dict(endpoint=self.endpoint, allow_http="true", max_retries=3, retry_timeout=5, init_backoff=0.01,
                    max_backoff=0.05, **self.credentials)

    def _upstream(self, method: str, path: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            resp.read()
            return resp
        finally:
            conn.close()

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Store `data` as s3://bucket/key (uncounted); returns its ETag."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(bucket, endpoint=f"http://{self.upstream[0]}:{self.upstream[1]}", allow_http=True,
                        **self.credentials)
        return obstore.put(store, key, data)["e_tag"]

    def upload_dir(self, local_dir: str, bucket: str, prefix: str) -> str:
        """Put every file of `local_dir` under s3://bucket/prefix/ (creating the bucket); returns that URI."""
        assert self._upstream("PUT", f"/{bucket}").status in (200, 409)  # 409: it exists already
        for name in sorted(os.listdir(local_dir)):
            with open(os.path.join(local_dir, name), "rb") as f:
                self.etags[f"{bucket}/{prefix}/{name}"] = self.put(bucket, f"{prefix}/{name}", f.read())
        return f"s3://{bucket}/{prefix}"

    def reset(self) -> Counts:
        """The counts so far, and start counting afresh."""
        with self.lock:
            counts, self.counts = self.counts, Counts()
        return counts

    def _fault(self) -> str | None:
        with self.lock:
            return self.faults.pop(0) if self.faults else None

    def close(self) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()


def _handler(server: S3Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _serve(self) -> None:
            with server.lock:
                server.in_flight += 1
                server.counts.most_in_flight = max(server.counts.most_in_flight, server.in_flight)
            try:
                self._forward()
            finally:
                with server.lock:
                    server.in_flight -= 1

        def _forward(self) -> None:
            fault = server._fault()
            if fault == "reset":  # abort: RST instead of a response
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if fault == "503":
                status, headers, data = 503, [("Content-Type", "application/xml")], _SLOW_DOWN
            else:
                up = http.client.HTTPConnection(*server.upstream, timeout=30)
                try:
                    up.request(self.command, self.path, body=body,
                               headers={k: v for k, v in self.headers.items() if k.lower() not in _HOP})
                    resp = up.getresponse()
                    status, headers, data = resp.status, resp.getheaders(), resp.read()
                finally:
                    up.close()
            sent = 0 if self.command == "HEAD" else len(data)
            with server.lock:
                server.counts.requests.append(Request(self.command, self.path, self.headers.get("Range"), status,
                                                      sent // 2 if fault == "cut" else sent, fault))
            try:
                self._answer(fault, status, headers, data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on this request (counted as sent)
                self.close_connection = True

        def _answer(self, fault, status, headers, data) -> None:
            time.sleep(server.first_byte_s)
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            length = next((v for k, v in headers if k.lower() == "content-length"), None)
            self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
            self.end_headers()
            if fault == "cut":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
            elif self.command != "HEAD":
                self._send(memoryview(data))

        def _send(self, data: memoryview) -> None:
            """The body; at `connection_bps` when set, a tenth of a second's bytes at a time."""
            rate = server.connection_bps
            if not rate:
                self.wfile.write(data)
                return
            step = max(1, int(rate / 10))
            for at in range(0, len(data), step):
                piece, t = data[at : at + step], time.perf_counter()
                self.wfile.write(piece)
                time.sleep(max(0.0, len(piece) / rate - (time.perf_counter() - t)))

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve

    return Handler
