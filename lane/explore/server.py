"""The explorer's local web page: a stdlib HTTP server on the loopback address that serves the page's own assets (from
the package, so it works offline) and a small JSON API over an Explorer. `lanefuse explore --web` calls `serve`.

API (every answer is JSON; a POST answers with the new state):
  GET  /api/state?layer=N          the explorer's state for layer N (the current layer without it)
  GET  /api/choices?tensor=T       T's alternatives
  POST /api/hold    {"rule"}       POST /api/release {"rule"}
  POST /api/force   {"tensor", "index"}    POST /api/unforce {"tensor"}
  POST /api/knob    {"name", "value"}
A POST body may carry "layer" to say which layer's state to answer with. A UserError answers 400 {"error": message};
a malformed request 400 as well; a bug 500 {"error": one line} (the traceback goes to the server's stderr only).
"""

from __future__ import annotations

import importlib.resources
import json
import math
import sys
import threading
import traceback
import webbrowser
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from lanefuse.engine.errors import UserError

ASSETS = {  # path -> (file under lane/web, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
    "/favicon.ico": ("favicon.svg", "image/svg+xml"),
}
LOOPBACK = ("127.0.0.1", "localhost")
MAX_BODY = 1 << 16


class Explorer(Protocol):
    def state(self, layer: int | None = None) -> dict: ...
    def choices(self, tensor: str) -> list[dict]: ...
    def hold(self, rule: str) -> None: ...
    def release(self, rule: str) -> None: ...
    def force(self, tensor: str, index: int) -> None: ...
    def unforce(self, tensor: str) -> None: ...
    def set_knob(self, name: str, value: Any) -> None: ...


class BadRequest(Exception):
    """A request the page should never send: answered 400 like a UserError."""


def _finite(x: Any) -> Any:
    """JSON has no infinity: a refused choice's infinite cost travels as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _field(body: dict, name: str, kind: type) -> Any:
    if name not in body:
        raise BadRequest(f"the request lacks `{name}`")
    v = body[name]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"`{name}` must be an integer, not {v!r}")
    if kind is str and not isinstance(v, str):
        raise BadRequest(f"`{name}` must be a string, not {v!r}")
    return v


def _layer(v: Any) -> int | None:
    if v is None or v == "":
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise BadRequest(f"layer must be an integer, not {v!r}") from None


class _Handler(BaseHTTPRequestHandler):
    server: "ExplorerServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the terminal is the user's
        pass

    # ---- plumbing ----------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=60" if cache else "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(_finite(obj), allow_nan=False, separators=(",", ":")).encode()
        self._send(status, body, "application/json")

    def _host_ok(self) -> bool:
        # a page from elsewhere reaching this port through a rebound DNS name carries its own Host: refuse it
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        return host in LOOPBACK

    def _api(self, fn) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.FORBIDDEN, {"error": "this server answers only requests to 127.0.0.1"})
            return
        try:
            with self.server.lock:  # the explorer is one mutable object: one request at a time
                out = fn()
            self._json(HTTPStatus.OK, out)
        except (UserError, BadRequest) as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except Exception as e:  # a bug: one line to the page, the traceback to the terminal
            traceback.print_exc(file=sys.stderr)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(e).__name__}: {e}"})

    # ---- GET ---------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        ex = self.server.explorer
        if url.path == "/api/state":
            self._api(lambda: ex.state(_layer(q.get("layer"))))
        elif url.path == "/api/choices":
            self._api(lambda: ex.choices(_field(q, "tensor", str)))
        elif url.path in ASSETS:
            name, ctype = ASSETS[url.path]
            try:
                body = importlib.resources.files("lanefuse.lane.explore").joinpath("web", name).read_bytes()
            except FileNotFoundError:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"the package lacks web/{name}: reinstall lanefuse"})
                return
            self._send(HTTPStatus.OK, body, ctype)
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path: {url.path}"})

    do_HEAD = do_GET

    # ---- POST --------------------------------------------------------------------------------------------------
    def do_POST(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        try:
            body = self._body()
        except BadRequest as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            return
        ex = self.server.explorer
        actions = {
            "/api/hold": lambda: ex.hold(_field(body, "rule", str)),
            "/api/release": lambda: ex.release(_field(body, "rule", str)),
            "/api/force": lambda: ex.force(_field(body, "tensor", str), _field(body, "index", int)),
            "/api/unforce": lambda: ex.unforce(_field(body, "tensor", str)),
            "/api/knob": lambda: ex.set_knob(_field(body, "name", str), _field(body, "value", object)),
        }
        act = actions.get(url.path)
        if act is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such action: {url.path}"})
            return

        def run() -> dict:
            layer = _layer(body.get("layer"))
            act()
            return ex.state(layer)

        self._api(run)

    def _body(self) -> dict:
        # only a JSON body: a form on another site cannot send one without the browser asking first (CORS)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise BadRequest(f"a body of {n} bytes is too long")
        raw = self.rfile.read(n) if n else b""
        if ctype != "application/json":
            raise BadRequest("the body must be JSON (Content-Type: application/json)")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body


class ExplorerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], explorer: Explorer):
        super().__init__(addr, _Handler)
        self.explorer = explorer
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def serve(explorer: Explorer, host: str = "127.0.0.1", port: int = 0,
          open_browser: bool = False) -> tuple[ExplorerServer, str]:
    """Serve the explorer's page on the loopback address (a free port when `port` is 0) from a daemon thread; answer
    the server (`server.stop()` ends it; `wait(server)` blocks until Ctrl-C) and the page's URL."""
    if host not in LOOPBACK:
        raise UserError(f"the explorer serves only on 127.0.0.1, not {host}: it runs your plan's controls unguarded")
    try:
        server = ExplorerServer(("127.0.0.1", port), explorer)
    except OSError as e:
        raise UserError(f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}; pick another --port or 0") from None
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    server.thread = threading.Thread(target=server.serve_forever, name="lanefuse-explore-web", daemon=True)
    server.thread.start()
    if open_browser:
        webbrowser.open(url)
    return server, url


def wait(server: ExplorerServer) -> None:
    """Block until Ctrl-C, then stop the server."""
    try:
        while server.thread is not None and server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
