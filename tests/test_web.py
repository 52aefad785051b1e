"""The explorer's web page: its JSON API over urllib (always), and the page itself driven in Debian's headless Chromium
through Playwright (marked `browser`; skipped where /usr/bin/chromium or playwright is missing). Both run against
FakeExplorer, which satisfies the Explorer protocol with a Qwen3-like layer."""

from __future__ import annotations

import http.client
import importlib.resources
import json
import math
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_explorer import FakeExplorer  # noqa: E402

from lanefuse.engine import flags  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.lane.explore.server import serve  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


@pytest.fixture
def served():
    ex = FakeExplorer()
    server, url = serve(ex)
    yield ex, url
    server.stop()


def get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def post(url: str, body, ctype: str = "application/json") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


# ---- the API, no browser ---------------------------------------------------------------------------------------------

def test_binds_loopback_only(served):
    ex = FakeExplorer()
    server, url = serve(ex, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
    finally:
        server.stop()
    with pytest.raises(UserError, match="only on 127.0.0.1"):
        serve(ex, host="0.0.0.0")


def test_serves_the_page_from_the_package(served):
    _, url = served
    status, html = get(url)
    assert status == 200 and "app.js" in html and "app.css" in html
    for name, ctype in (("app.js", "text/javascript"), ("app.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        with urllib.request.urlopen(url + name, timeout=10) as r:
            assert r.status == 200 and r.headers.get_content_type() == ctype
    web = importlib.resources.files("lanefuse.lane.explore").joinpath("web")
    for name in ("index.html", "app.js", "app.css"):
        assert web.joinpath(name).is_file()


def test_assets_reach_nothing_outside():
    web = importlib.resources.files("lanefuse.lane.explore").joinpath("web")
    for name in ("index.html", "app.js", "app.css"):
        text = web.joinpath(name).read_text()
        # the SVG namespace is a name, not a fetch
        urls = [u for u in re.findall(r"https?://[^\s\"'`)]+", text) if u != "http://www.w3.org/2000/svg"]
        assert urls == [], f"web/{name} names outside URLs: {urls}"
        assert "@import" not in text


def test_state_and_layers(served):
    ex, url = served
    status, st = get(url + "api/state")
    assert status == 200
    assert {"model", "layers", "layer", "graph", "groups", "rules", "census", "launches", "cost_us", "fusions",
            "arena", "forced", "knobs"} <= set(st)
    assert len(st["graph"]["nodes"]) == 20
    _, st3 = get(url + "api/state?layer=3")
    assert st3["layer"] == 3 and all(n["id"].startswith("L3.") for n in st3["graph"]["nodes"])
    status, err = get(url + "api/state?layer=99")
    assert status == 400 and "out of range" in err["error"]
    status, err = get(url + "api/state?layer=x")
    assert status == 400 and "integer" in err["error"]


def test_hold_changes_the_census_and_release_restores_it(served):
    _, url = served
    _, before = get(url + "api/state")
    status, st = post(url + "api/hold", {"rule": "gemv_norm_epilogue"})
    assert status == 200
    assert st["census"] != before["census"]
    assert st["diff"]["launches"] == [before["launches"], st["launches"]]
    assert next(r for r in st["rules"] if r["name"] == "gemv_norm_epilogue")["held"]
    _, st = post(url + "api/release", {"rule": "gemv_norm_epilogue"})
    assert st["census"] == before["census"]


def test_user_errors_are_400_with_one_line(served):
    _, url = served
    status, err = post(url + "api/hold", {"rule": "add_nrom"})
    assert status == 400 and "did you mean `add_norm`" in err["error"]
    assert "Traceback" not in err["error"] and "\n" not in err["error"]
    status, err = get(url + "api/choices?tensor=L0.qq")
    assert status == 400 and "L0.q" in err["error"]
    status, err = post(url + "api/force", {"tensor": "L0.kc", "index": 1})
    assert status == 400 and "refuses" in err["error"]
    status, err = post(url + "api/knob", {"name": "fuse_qunt", "value": True})
    assert status == 400 and "fuse_quant" in err["error"]


def test_malformed_requests(served):
    _, url = served
    assert post(url + "api/hold", b"{not json")[0] == 400
    assert post(url + "api/hold", {"rule": "add_norm"}, ctype="text/plain")[0] == 400  # no cross-site form posts
    assert post(url + "api/hold", [1, 2])[0] == 400
    status, err = post(url + "api/force", {"tensor": "L0.q"})
    assert status == 400 and "index" in err["error"]
    status, err = post(url + "api/force", {"tensor": "L0.q", "index": "0"})
    assert status == 400 and "integer" in err["error"]
    assert post(url + "api/nothing", {})[0] == 404
    assert get(url + "nothing.js")[0] == 404


def test_foreign_host_header_is_refused(served):
    _, url = served
    port = int(url.rsplit(":", 1)[1].strip("/"))
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/api/state", headers={"Host": "evil.example:80"})
    r = c.getresponse()
    assert r.status == 403 and "127.0.0.1" in json.loads(r.read())["error"]
    c.close()


def test_force_choices_unforce_knob(served):
    _, url = served
    _, ch = get(url + "api/choices?tensor=L0.q")
    assert [c["index"] for c in ch] == list(range(len(ch)))
    assert sum(c["chosen"] for c in ch) == 1
    lifted = next(c for c in ch if c["support"] == "lifted")
    status, st = post(url + "api/force", {"tensor": "L0.q", "index": lifted["index"], "layer": 0})
    assert status == 200 and st["forced"] == {"L0.q": lifted["index"]}
    assert st["cost_us"] == pytest.approx(lifted["plan_cost_us"], abs=0.02)
    _, ch = get(url + "api/choices?tensor=L0.q")
    assert next(c for c in ch if c["index"] == lifted["index"])["chosen"]
    status, st = post(url + "api/unforce", {"tensor": "L0.q"})
    assert status == 200 and st["forced"] == {}
    _, st = post(url + "api/knob", {"name": "numerics", "value": "q8"})
    assert st["knobs"]["numerics"] == "q8" and st["census"].get("quantize") == 4 * st["layers"]
    _, st = post(url + "api/knob", {"name": "fuse_quant", "value": True, "layer": 5})
    assert "quantize" not in st["census"] and st["layer"] == 5


class _Buggy(FakeExplorer):
    def choices(self, tensor):
        raise RuntimeError("boom")

    def state(self, layer=None):
        st = super().state(layer)
        st["cost_us"] = math.inf  # JSON has no infinity: it must travel as null
        return st


def test_a_bug_is_a_500_with_one_line_and_infinity_is_null(capsys):
    server, url = serve(_Buggy())
    try:
        status, err = get(url + "api/choices?tensor=L0.q")
        assert status == 500 and err["error"] == "internal error: RuntimeError: boom"
        status, st = get(url + "api/state")
        assert status == 200 and st["cost_us"] is None
    finally:
        server.stop()
    assert "Traceback" in capsys.readouterr().err  # the terminal sees it, the page does not


# ---- the page in a real browser ------------------------------------------------------------------------------------

def _playwright():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get update && apt-get install -y chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is missing: .venv/bin/pip install playwright (never `playwright install`)")
    return sync_playwright


@pytest.fixture
def browser_page(served, tmp_path):
    sync_playwright = _playwright()
    ex, url = served
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        log: list[str] = []
        page.on("console", lambda m: log.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: log.append(f"requestfailed: {r.url}"))
        page.goto(url)
        page.wait_for_selector(".node[data-tensor='L0.attn_norm']")
        page.locator("#fold-auto").uncheck()  # every op drawn: these tests click inner ops (folds have their own test)
        yield page, ex, log
        browser.close()


def _shots(tmp_path: Path) -> Path:
    d = Path(flags.read("LANEFUSE_SCREENSHOTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


def _pan_into_view(page, selector: str) -> None:
    """Wheel the graph (the page's own pan) until the node's centre lies inside the graph's box."""
    graph = page.locator("#graph").bounding_box()
    for _ in range(40):
        b = page.locator(selector).bounding_box()
        cx, cy = b["x"] + b["width"] / 2, b["y"] + b["height"] / 2
        dx = 0 if graph["x"] + 20 < cx < graph["x"] + graph["width"] - 20 else cx - (graph["x"] + graph["width"] / 2)
        dy = 0 if graph["y"] + 20 < cy < graph["y"] + graph["height"] - 20 else cy - (graph["y"] + graph["height"] / 2)
        if not dx and not dy:
            return
        page.mouse.move(graph["x"] + graph["width"] / 2, graph["y"] + graph["height"] / 2)
        page.mouse.wheel(dx, dy)
    raise AssertionError(f"{selector} never came into the graph's view")


@pytest.mark.browser
def test_page_hold_force_layer(browser_page, tmp_path):
    page, ex, log = browser_page
    assert page.locator("#graph .node:not(.input)").count() == 20
    assert page.locator("#graph .gbox").count() >= 3  # fused groups are boxed
    assert page.locator("#arena .arr").count() > 0

    # hold a rule: the census panel changes and the diff banner says so
    fold = page.locator("#census [data-count='fold']")
    assert fold.inner_text() == "28"
    page.locator("[data-rule-row='gemv_norm_epilogue'] .switch").click()
    page.wait_for_selector("#census:not(:has([data-count='fold']:text-is('28')))")
    assert page.locator("#census [data-count='fold']").inner_text() == "0"
    assert page.locator("#census [data-count='norm']").inner_text() == "57"
    banner = page.locator("#diff")
    assert banner.is_visible() and "hold gemv_norm_epilogue" in banner.inner_text()
    assert "284 → 312" in banner.inner_text()
    assert "gemv_norm_epilogue" in ex.held
    page.screenshot(path=str(_shots(tmp_path) / "explore-held.png"))

    # click a tensor, pick an alternative: the page shows it forced
    page.locator(".node[data-tensor='L0.q']").click()
    page.wait_for_selector("#choices tr[data-choice]")
    assert page.locator("#sel-name").inner_text() == "L0.q"
    assert page.locator("#choices tr[data-choice]").count() >= 2
    page.locator("#choices button[data-force='0']").click()
    page.wait_for_selector("#forced-badge")
    assert ex.forced == {"L0.q": 0}
    assert "forced" in page.locator(".node[data-tensor='L0.q']").get_attribute("class")
    assert page.locator("#forced [data-forced='L0.q']").count() == 1
    assert "force L0.q" in banner.inner_text()
    _pan_into_view(page, ".node[data-tensor='L0.glu']")  # the fit opens a tall layer at its top: scroll, as a user does
    page.hover(".node[data-tensor='L0.glu']")
    page.wait_for_selector("#tip:not(.hidden)")
    path = _shots(tmp_path) / "explore.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000

    # undo takes the force back
    page.locator("#undo").click()
    page.wait_for_selector("#forced [data-forced='L0.q']", state="detached")
    assert ex.forced == {}

    # the layer selector
    page.select_option("#layer", "2")
    page.wait_for_selector(".node[data-tensor='L2.attn_norm']")
    assert page.locator("#sel-name").inner_text() == "L2.q"  # the same tensor, in the new layer
    assert page.locator("#graph .node[data-tensor^='L0.']").count() == 0

    assert log == [], f"the page logged: {log}"


@pytest.mark.browser
def test_page_shows_a_user_error_as_a_toast(browser_page):
    page, ex, log = browser_page
    page.evaluate("window.lanefuse.hold('add_nrom')")
    toast = page.locator(".toast")
    toast.wait_for()
    assert "did you mean `add_norm`" in toast.inner_text()
    assert "Traceback" not in page.content()
    # the only thing logged is the browser's note of the 400 itself
    assert all("status of 400" in line for line in log), log


# ---- malformed and hostile requests (issue 11, item 13): each a 4xx with a JSON message, the terminal quiet -----------

def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].strip("/"))


def _raw(url: str, head: bytes, body: bytes = b"", then: bytes = b"") -> bytes:
    """Send a hand-made request's head (and body), read every answer until the server closes or 3 s pass; `then`
    is sent after the first answer came (the rest of a body the server should not have waited for)."""
    import socket

    s = socket.create_connection(("127.0.0.1", _port(url)), timeout=3)
    out = b""
    try:
        s.sendall(head + body)
        if then:
            out += s.recv(65536)
            try:
                s.sendall(then)
            except OSError:
                pass
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except (TimeoutError, ConnectionError):
        pass
    finally:
        s.close()
    return out


def _answers(raw: bytes) -> list[tuple[int, dict, dict]]:
    """The (status, headers, JSON body) of each answer on a connection."""
    out = []
    while raw.startswith(b"HTTP/"):
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        hdrs = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(hdrs.get("content-length", 0))
        out.append((int(lines[0].split()[1]), hdrs, json.loads(rest[:n])))
        raw = rest[n:]
    return out


def _post_head(path: str, length: str | None, extra: str = "", ctype: str = "application/json") -> bytes:
    h = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
    if length is not None:
        h += f"Content-Length: {length}\r\n"
    return (h + extra + "\r\n").encode()


def _one(raw: bytes) -> tuple[int, dict, dict]:
    a = _answers(raw)
    assert len(a) == 1, raw[:500]
    return a[0]


class _Knobbed(FakeExplorer):
    """FakeExplorer with the real lane's kinds of knob beside its own: an integer, a float."""

    def __init__(self):
        super().__init__()
        self.knobs.update({"sms": 132, "hbm_gbps": 4300.0})

    def set_knob(self, name, value):
        if name in ("sms", "hbm_gbps"):
            self._change(lambda: self.knobs.__setitem__(name, value))
        else:
            super().set_knob(name, value)


@pytest.fixture
def knobbed():
    ex = _Knobbed()
    server, url = serve(ex)
    yield ex, url
    server.stop()


def test_content_length_minus_one_is_refused_and_the_connection_closed(served, capsys):
    ex, url = served
    status, hdrs, err = _one(_raw(url, _post_head("/api/hold", "-1"), then=b"x" * 5_000_000))
    assert status == 400 and "Content-Length -1 is not one byte count" in err["error"]
    assert hdrs["connection"] == "close" and not ex.held
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("length,status,words", [
    ("abc", 400, "Content-Length abc is not one byte count"),
    ("1e3", 400, "is not one byte count"),
    ("+5", 400, "is not one byte count"),
    ("70000", 413, "a body of 70000 bytes is too long"),
    ("99999999999999999999", 413, "too long"),
])
def test_a_bad_content_length_is_a_4xx_and_ends_the_connection(served, capsys, length, status, words):
    ex, url = served
    smuggled = b"POST /api/hold HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
               b"Content-Length: 20\r\n\r\n{\"rule\": \"add_norm\"}"
    st, hdrs, err = _one(_raw(url, _post_head("/api/hold", length), smuggled))  # one answer: the body is no request
    assert st == status and words in err["error"] and hdrs["connection"] == "close"
    assert not ex.held
    assert capsys.readouterr().err == ""


def test_two_lengths_chunked_and_a_short_body_are_refused(served, capsys):
    _, url = served
    st, _, err = _one(_raw(url, _post_head("/api/hold", "2", "Content-Length: 3\r\n"), b"{}"))
    assert st == 400 and "not one byte count" in err["error"]
    st, _, err = _one(_raw(url, _post_head("/api/hold", None, "Transfer-Encoding: chunked\r\n"), b"2\r\n{}\r\n0\r\n\r\n"))
    assert st == 411 and "Content-Length" in err["error"]
    import socket

    s = socket.create_connection(("127.0.0.1", _port(url)), timeout=5)
    s.sendall(_post_head("/api/hold", "100") + b'{"rule": ')
    s.shutdown(socket.SHUT_WR)
    raw = b""
    while (b := s.recv(65536)):
        raw += b
    s.close()
    st, _, err = _one(raw)
    assert st == 400 and "the body ended after 9 of 100 bytes" in err["error"]
    assert capsys.readouterr().err == ""


def test_deep_json_nan_and_huge_numbers_are_400(knobbed, capsys):
    ex, url = knobbed
    deep = b"[" * 30000 + b"]" * 30000
    st, _, err = _one(_raw(url, _post_head("/api/hold", str(len(deep)), "Connection: close\r\n"), deep))
    assert st == 400 and "nests too deep" in err["error"]
    deep = b'{"rule": ' + b"{\"a\": " * 9000 + b"1" + b"}" * 9000 + b"}"
    st, _, err = _one(_raw(url, _post_head("/api/hold", str(len(deep)), "Connection: close\r\n"), deep))
    assert st == 400 and "nests too deep" in err["error"]
    for value, words in ((b"1e999", "1e999, too large for a number"), (b"-1e999", "too large for a number"),
                         (b"NaN", "NaN, which JSON has not"), (b"Infinity", "Infinity, which JSON has not"),
                         (b"1" * 5000, "not JSON")):
        body = b'{"name": "hbm_gbps", "value": ' + value + b"}"
        st, _, err = _one(_raw(url, _post_head("/api/knob", str(len(body)), "Connection: close\r\n"), body))
        assert st == 400 and words in err["error"], (value[:20], err)
    assert ex.knobs["hbm_gbps"] == 4300.0
    assert capsys.readouterr().err == ""


def test_a_knob_takes_only_its_own_json_type(knobbed, capsys):
    ex, url = knobbed
    for name, value, words in (("sms", "12", "takes an integer, not \"12\""), ("sms", 12.5, "takes an integer"),
                               ("sms", True, "takes an integer"), ("sms", None, "takes an integer"),
                               ("hbm_gbps", "4000", "takes a number"), ("fuse_quant", 1, "takes true or false"),
                               ("numerics", 8, "takes a string")):
        status, err = post(url + "api/knob", {"name": name, "value": value})
        assert status == 400 and words in err["error"], (name, value, err)
    assert ex.knobs["sms"] == 132
    status, st = post(url + "api/knob", {"name": "sms", "value": 12})
    assert status == 200 and st["knobs"]["sms"] == 12
    status, st = post(url + "api/knob", {"name": "hbm_gbps", "value": 4000})  # a float knob takes an integer
    assert status == 200 and st["knobs"]["hbm_gbps"] == 4000
    status, err = post(url + "api/knob", {"name": "smz", "value": 1})  # an unknown name: the explorer's words
    assert status == 400 and "no knob `smz`" in err["error"]
    assert capsys.readouterr().err == ""


def test_the_real_explorers_knobs_refuse_strings_and_infinity(capsys):
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.explore.explorer import Explorer

    cfg, _ = demo_model()
    ex = Explorer(build_step(cfg, 1), model_name="demo")
    server, url = serve(ex)
    try:
        status, err = post(url + "api/knob", {"name": "sms", "value": "12"})
        assert status == 400 and "knob `sms` takes an integer" in err["error"]
        body = b'{"name": "hbm_gbps", "value": 1e999}'
        st, _, err = _one(_raw(url, _post_head("/api/knob", str(len(body)), "Connection: close\r\n"), body))
        assert st == 400 and "too large" in err["error"]
        assert ex.knobs.sms == 132 and ex.knobs.hbm_gbps == 4300.0
        status, st = post(url + "api/knob", {"name": "sms", "value": 100})
        assert status == 200 and st["knobs"]["sms"] == 100
    finally:
        server.stop()
        ex.close()
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1",
                                    "http://localhost.evil.example", "http://[::1"])
def test_a_foreign_origin_cannot_change_the_state(served, capsys, origin):
    ex, url = served
    body = b'{"rule": "add_norm"}'
    st, _, err = _one(_raw(url, _post_head("/api/hold", str(len(body)), f"Origin: {origin}\r\nConnection: close\r\n"),
                           body))
    assert st == 403 and "only from its own page" in err["error"]
    assert not ex.held
    assert capsys.readouterr().err == ""


def test_the_pages_own_origin_and_no_origin_pass(served):
    ex, url = served
    body = b'{"rule": "add_norm"}'
    for origin in (url.rstrip("/"), url.rstrip("/").replace("127.0.0.1", "localhost")):
        st, _, out = _one(_raw(url, _post_head("/api/hold", str(len(body)), f"Origin: {origin}\r\nConnection: close\r\n"),
                               body))
        assert st == 200 and "add_norm" in ex.held
        post(url + "api/release", {"rule": "add_norm"})
    status, _ = post(url + "api/hold", {"rule": "add_norm"})  # no Origin: a script, not a page
    assert status == 200


def test_closed_tabs_and_garbage_leave_the_terminal_quiet(served, capsys):
    import socket
    import struct
    import time

    _, url = served
    for i in range(50):  # a tab closed mid-answer: the socket reset while the page's script is being sent
        s = socket.create_connection(("127.0.0.1", _port(url)), timeout=5)
        s.sendall(b"GET /app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    st, _, err = _one(_raw(url, b"GARBAGE\r\n\r\n"))
    assert st == 400 and "Bad request" in err["error"]
    st, _, err = _one(_raw(url, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"))
    assert st == 414
    # a GET with a body: answered, and the connection closed so the body is not read as a request
    a = _answers(_raw(url, b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 24\r\n\r\n",
                      b"GET /api/state HTTP/1.1\r\n"))
    assert len(a) == 1 and a[0][0] == 200 and a[0][1]["connection"] == "close"
    time.sleep(0.5)
    assert get(url + "api/state")[0] == 200  # the server still serves
    assert capsys.readouterr().err == ""
