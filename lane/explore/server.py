"""The explorer's local web page: a stdlib HTTP server on the loopback address that serves the page's own assets (from
the package, so it works offline) and a small JSON API over an Explorer. `lanefuse explore --web` calls `serve`.

API (every answer is JSON; a POST answers with the new state):
  GET  /api/state?layer=N          the explorer's state for layer N (the current layer without it)
  GET  /api/choices?tensor=T       T's alternatives
  GET  /api/launch?index=N         launch N of the plan: fields, CUDA functions with grid and source, bytes, time
  GET  /api/saturation             the saturation iteration by iteration, and why each rule was or was not chosen
  POST /api/hold    {"rule"}       POST /api/release {"rule"}
  POST /api/force   {"tensor", "index"}    POST /api/unforce {"tensor"}
  POST /api/knob    {"name", "value"}
  POST /api/undo    {}                     POST /api/goto {"n"}: back to the plan after the history's first n changes
  POST /api/what_if {"method"}: "ilp" (every change re-planned exactly) or "local" (by local search)
  POST /api/compare {"a": spec, "b": spec}: A/B, each spec {held, forced, knobs, numerics} or null (the current
                    configuration), answered with both sides and their diff (it changes nothing)
A POST body may carry "layer" to say which layer's state to answer with. A UserError answers 400 {"error": message};
a malformed request a 4xx as well (400; 403 for a foreign Host or Origin; 411/413 for a body of no or too great a
length, the connection then closed so no unread body is taken for a request), the terminal quiet; a bug 500
{"error": one line} (the traceback goes to the server's stderr only). A knob's value must have the JSON type of its
current value (a finite number for a number: `"12"` and `1e999` are refused). A tab closed mid-answer is not an error.
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

from lanefuse.engine.errors import UserError, one_line

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
GONE = (ConnectionError, TimeoutError)  # the client went away (a closed tab) or stalled: nothing to tell anyone


class Explorer(Protocol):
    def state(self, layer: int | None = None) -> dict: ...
    def choices(self, tensor: str) -> list[dict]: ...
    def hold(self, rule: str) -> None: ...
    def release(self, rule: str) -> None: ...
    def force(self, tensor: str, index: int) -> None: ...
    def unforce(self, tensor: str) -> None: ...
    def set_knob(self, name: str, value: Any) -> None: ...
    def launch(self, index: int) -> dict: ...
    def saturation(self) -> dict: ...
    def compare(self, a: dict | None = None, b: dict | None = None) -> dict: ...
    def undo(self) -> str: ...
    def goto(self, n: int) -> None: ...
    def set_what_if(self, method: str) -> None: ...


class BadRequest(Exception):
    """A request the page should never send: answered 400 like a UserError (or `status`); `close` ends the connection
    (its body was not read, so what follows it is no request)."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, close: bool = False):
        super().__init__(message)
        self.status = status
        self.close = close


def _no_constant(name: str) -> Any:
    raise BadRequest(f"the body holds {name}, which JSON has not; send a finite number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise BadRequest(f"the body holds {_clip(text, 20)}, too large for a number; send a finite number")
    return v


def _knob_value(name: str, v: Any, current: dict) -> Any:
    """`v` as knob `name` takes it: the JSON type of the knob's current value (a bool, a string; a finite number, an
    integer for an integer knob). An unknown name passes through for the explorer to refuse with its near names."""
    if name not in current:
        return v
    cur = current[name]
    if isinstance(cur, bool):
        ok, want = isinstance(v, bool), "true or false"
    elif isinstance(cur, int):
        ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
    elif isinstance(cur, float):
        ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
    elif isinstance(cur, str):
        ok, want = isinstance(v, str), "a string"
    else:
        return v
    if isinstance(v, float) and not math.isfinite(v):
        raise BadRequest(f"knob `{name}`: {v} is not a finite number")
    if not ok:
        raise BadRequest(f"knob `{name}` takes {want}, not {_clip(json.dumps(v))}")
    return v


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


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


def _int(v: Any, name: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise BadRequest(f"`{name}` must be an integer, not {v!r}") from None


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
    timeout = 30  # a stalled client (a body promised, never sent) frees its thread

    def handle(self) -> None:
        try:
            super().handle()
        except GONE:  # a closed tab, a reset, a stalled client: the terminal stays quiet
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, a header too long) answer JSON like the rest."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # no request line worth the name: answer with a status line all the same
            self.request_version = "HTTP/1.0"
        try:
            self._json(code, {"error": message or HTTPStatus(code).phrase})
        except GONE:
            pass

    def _send(self, status: int, body: bytes, ctype: str, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=60" if cache else "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        if self.close_connection:
            self.send_header("Connection", "close")
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

    def _origin_ok(self) -> bool:
        # a state-changing request from a page of another site (or a sandboxed one: `null`) is refused; a client that
        # sends no Origin (curl, a script) is not a browser page and passes
        origin = self.headers.get("Origin")
        if origin is None:
            return True
        try:
            u = urlsplit(origin)
            port = u.port
        except ValueError:  # not a URL at all
            return False
        return u.scheme == "http" and u.hostname in LOOPBACK and port == self.server.server_address[1]

    def _api(self, fn) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.FORBIDDEN, {"error": "this server answers only requests to 127.0.0.1"})
            return
        try:
            with self.server.lock:  # the explorer is one mutable object: one request at a time
                out = fn()
            status = HTTPStatus.OK
        except BadRequest as e:
            status, out = e.status, {"error": one_line(e)}
        except UserError as e:
            status, out = HTTPStatus.BAD_REQUEST, {"error": one_line(e)}
        except RecursionError:
            status, out = HTTPStatus.BAD_REQUEST, {"error": "the request nests too deep"}
        except Exception as e:  # a bug: one line to the page, the traceback to the terminal
            traceback.print_exc(file=sys.stderr)
            status, out = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(e).__name__}: "
                                                                      f"{one_line(e)}"}
        self._json(status, out)  # outside the try: a tab closed mid-answer is no bug (`handle` drops it)

    # ---- GET ---------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        if (self.headers.get("Content-Length") or "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
            self.close_connection = True  # a body is never read here: what follows is no request
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        ex = self.server.explorer
        if url.path == "/api/state":
            self._api(lambda: ex.state(_layer(q.get("layer"))))
        elif url.path == "/api/choices":
            self._api(lambda: ex.choices(_field(q, "tensor", str)))
        elif url.path == "/api/launch":
            self._api(lambda: ex.launch(_int(q.get("index"), "index")))
        elif url.path == "/api/saturation":
            self._api(lambda: ex.saturation())
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
            self.close_connection = self.close_connection or e.close
            self._json(e.status, {"error": str(e)})
            return
        if not self._origin_ok():  # after the body is read: the connection stays a sequence of whole requests
            self._json(HTTPStatus.FORBIDDEN, {"error": "this server takes changes only from its own page on "
                                                       "127.0.0.1, not from " + _clip(self.headers["Origin"])})
            return
        ex = self.server.explorer
        actions = {
            "/api/hold": lambda: ex.hold(_field(body, "rule", str)),
            "/api/release": lambda: ex.release(_field(body, "rule", str)),
            "/api/force": lambda: ex.force(_field(body, "tensor", str), _field(body, "index", int)),
            "/api/unforce": lambda: ex.unforce(_field(body, "tensor", str)),
            "/api/knob": lambda: ex.set_knob(_field(body, "name", str), self._knob(body)),
            "/api/undo": lambda: ex.undo(),
            "/api/goto": lambda: ex.goto(_field(body, "n", int)),
            "/api/what_if": lambda: ex.set_what_if(_field(body, "method", str)),
        }
        if url.path == "/api/compare":  # reads the body's specs, changes nothing: answers the comparison
            self._api(lambda: ex.compare(self._spec(body, "a"), self._spec(body, "b")))
            return
        act = actions.get(url.path)
        if act is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such action: {url.path}"})
            return

        def run() -> dict:
            layer = _layer(body.get("layer"))
            act()
            return ex.state(layer)

        self._api(run)

    @staticmethod
    def _spec(body: dict, name: str) -> dict | None:
        v = body.get(name)
        if v is not None and not isinstance(v, dict):
            raise BadRequest(f"`{name}` must be a spec (an object of held, forced, knobs) or null, not {_clip(json.dumps(v))}")
        return v

    def _knob(self, body: dict) -> Any:
        name, value = _field(body, "name", str), _field(body, "value", object)
        if self.server.knob_values is None:  # a knob keeps its type: its current values read once
            self.server.knob_values = dict(self.server.explorer.state().get("knobs") or {})
        return _knob_value(name, value, self.server.knob_values)

    def _body(self) -> dict:
        # only a JSON body: a form on another site cannot send one without the browser asking first (CORS)
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest("send the body with a Content-Length, not a Transfer-Encoding",
                             HTTPStatus.LENGTH_REQUIRED, close=True)
        lengths = self.headers.get_all("Content-Length") or []
        text = lengths[0].strip() if len(lengths) == 1 else ("0" if not lengths else None)
        if text is None or not text.isascii() or not text.isdigit():
            shown = ", ".join(_clip(v, 20) for v in lengths)
            raise BadRequest(f"Content-Length {shown} is not one byte count", close=True)
        n = int(text)
        if n > MAX_BODY:
            raise BadRequest(f"a body of {n} bytes is too long (at most {MAX_BODY})",
                             HTTPStatus.REQUEST_ENTITY_TOO_LARGE, close=True)
        raw = self.rfile.read(n) if n else b""
        if len(raw) < n:
            raise BadRequest(f"the body ended after {len(raw)} of {n} bytes", close=True)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise BadRequest("the body must be JSON (Content-Type: application/json)")
        try:
            body = json.loads(raw or b"{}", parse_constant=_no_constant, parse_float=_finite_float)
        except RecursionError:
            raise BadRequest("the body nests too deep") from None
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {_clip(str(e))}") from None
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
        self.knob_values: dict | None = None  # the explorer's knobs, read at the first knob request

    def handle_error(self, request, client_address) -> None:
        """What escapes a handler: a client gone is no news; anything else one line, not a traceback."""
        e = sys.exc_info()[1]
        if isinstance(e, GONE):
            return
        print(f"lanefuse explore: a request failed: {type(e).__name__}: {_clip(str(e), 200)}", file=sys.stderr)

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
