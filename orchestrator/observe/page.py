"""The page: an HTTP server on 127.0.0.1 that shows jobs to whoever holds its token.

Standard library only (`http.server.ThreadingHTTPServer` in a daemon thread): the page is
a few static files and JSON, which needs no framework. Every request shows the token, as
Jupyter's does: `?token=` in the address (the page's own requests then carry it as a
cookie, SameSite=Strict, named by port), or `Authorization: Bearer` (Prometheus's
`authorization` setting for `/metrics`); compared with `hmac.compare_digest`. A request
whose Host is not this machine's loopback name is refused (DNS rebinding). Every answer
carries a strict Content-Security-Policy (scripts and styles from this server alone, no
inline script), `nosniff`, no referrer, no caching. The page takes no action: GET only,
no POST route (cancel a job with `job.cancel()` or `orchestrator stop`).

Routes: `/` the page, `/static/NAME` its files, `/metrics` Prometheus text, and JSON under
`/api/`: `jobs` (the list), and for `?job=ID`: `table`, `metrics` (`&since=T`), `output`
(`&after=N&source=S`), `log` (`&rank=R`), `stacks`.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from orchestrator.observe import exposition
from orchestrator.observe.reading import Reader

HOST = "127.0.0.1"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


class Source(Protocol):
    """What a page shows: a driver's own jobs, or a cluster's detached ones."""

    title: str

    def listing(self) -> dict[str, Any]:
        """The jobs (`jobs`: each a Reader's summary) and warm pools (`pools`) to list."""

    def reader(self, key: str) -> Reader | None:
        """The job named `key` in the page's addresses (None: none such)."""

    def running(self) -> list[Reader]:
        """The jobs whose ranks' figures `/metrics` shows."""


class Page:
    """A page server for `source`, on 127.0.0.1, in a daemon thread of its own."""

    def __init__(self, source: Source, port: int = 0, token: str | None = None) -> None:
        """Serve `source` on `port` (0: a free one) with `token` (None: a new random one)."""
        self.source = source
        self.token = token or secrets.token_urlsafe(32)
        handler = type("Handler", (_Handler,), {"page": self})
        self._server = ThreadingHTTPServer((HOST, port), handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self.cookie = f"orchestrator-page-{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="orchestrator page", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The page's address, with its token."""
        return f"http://{HOST}:{self.port}/?token={self.token}"

    def allows(self, offered: str | None) -> bool:
        """Whether `offered` is this page's token."""
        return offered is not None and hmac.compare_digest(offered.encode(), self.token.encode())

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    page: Page
    server_version = "orchestrator"
    sys_version = ""

    def do_GET(self) -> None:
        """Answer a GET for a route, once the request shows the token."""
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
        if host not in LOOPBACK_NAMES:
            self._send(403, {"error": f"Host {host!r}: open the page at {HOST}"})
            return
        given = query.get("token") or self._bearer() or self._cookie()
        if not self.page.allows(given):
            self._send(
                401,
                {
                    "error": "no token, or not this page's: open the address with ?token= "
                    "that the driver or `orchestrator dashboard` printed"
                },
                extra={"WWW-Authenticate": "Bearer"},
            )
            return
        extra = {}
        if "token" in query:  # the page's own requests carry it from now on
            extra["Set-Cookie"] = (
                f"{self.page.cookie}={self.page.token}; Path=/; HttpOnly; SameSite=Strict"
            )
        try:
            self._route(parts.path, query, extra)
        except (KeyError, ValueError) as exc:
            self._send(400, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a supervisor unreachable, a job gone
            self._send(502, {"error": f"{type(exc).__name__}: {exc}"})

    def do_HEAD(self) -> None:
        """No HEAD: the page's answers are made per request."""
        self._send(405, {"error": "GET only"}, extra={"Allow": "GET"})

    def _route(self, path: str, query: dict[str, str], extra: dict[str, str]) -> None:
        source = self.page.source
        if path == "/":
            self._static("index.html", extra)
        elif path.startswith("/static/"):
            self._static(path.removeprefix("/static/"), extra)
        elif path == "/metrics":
            jobs = [(reader.key, reader.figures()) for reader in source.running()]
            self._send(200, exposition.text(jobs).encode(), exposition.CONTENT_TYPE)
        elif path == "/api/jobs":
            self._send(200, {"title": source.title, **source.listing()}, extra=extra)
        elif path.removeprefix("/api/") in _ANSWERS:
            key = query.get("job", "")
            reader = source.reader(key)
            if reader is None:
                self._send(404, {"error": f"no job {key!r} here (it may have ended)"})
                return
            self._send(200, _ANSWERS[path.removeprefix("/api/")](reader, query), extra=extra)
        else:
            self._send(404, {"error": f"no page at {path}"})

    def _static(self, name: str, extra: dict[str, str]) -> None:
        suffix = name[name.rfind(".") :] if "." in name else ""
        files = resources.files("orchestrator.observe") / "static"
        if "/" in name or suffix not in STATIC_TYPES or not (files / name).is_file():
            self._send(404, {"error": f"no file {name!r}"})
            return
        self._send(200, (files / name).read_bytes(), STATIC_TYPES[suffix], extra)

    def _bearer(self) -> str | None:
        scheme, _, value = (self.headers.get("Authorization") or "").partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None

    def _cookie(self) -> str | None:
        for part in (self.headers.get("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == self.page.cookie:
                return value
        return None

    def _send(
        self,
        status: int,
        body: Any,
        content_type: str = "application/json",
        extra: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(body, bytes):
            body = _json(body)
        self.send_response(status)
        for name, value in {**HEADERS, **(extra or {}), "Content-Type": content_type}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a page asks every second."""


def _json(data: Any) -> bytes:
    """`data` as JSON, NaN and infinities as null (JSON has none)."""
    try:
        return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        return json.dumps(_finite(data), separators=(",", ":")).encode()


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if data - data == 0 else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


_ANSWERS: dict[str, Callable[[Reader, dict[str, str]], Any]] = {
    "table": lambda reader, _: reader.table(),
    "metrics": lambda reader, q: reader.metrics(float(q.get("since", 0))),
    "output": lambda reader, q: reader.output(int(q.get("after", 0)), int(q.get("source", 0))),
    "log": lambda reader, q: {"rank": int(q["rank"]), "text": reader.log(int(q["rank"]))},
    "stacks": lambda reader, _: {"groups": reader.stacks()},
}
