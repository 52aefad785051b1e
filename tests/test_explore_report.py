"""`lanefuse plan MODEL --html DIR`: a static report of the plan that opens from the file system with no server and
no network — the demo model and a Qwen3-8B shape from a config-only folder; its data against the plan; the page in
headless Chromium from file:// (marked `browser`) with no console error and no request leaving the folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("egglog", reason="the engine needs egglog (the GPU machine has none)")

from lanefuse.engine import flags

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]

QWEN3_8B = {  # Qwen/Qwen3-8B's config.json, the fields lanefuse reads
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False}


def lanefuse(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


def data(folder: Path) -> dict:
    text = (folder / "report.js").read_text()
    assert text.startswith("window.LANEFUSE_REPORT = ") and text.rstrip().endswith(";")
    return json.loads(text[len("window.LANEFUSE_REPORT = "):].rstrip().rstrip(";"))


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("report") / "demo"
    r = lanefuse("plan", "--html", str(d), "--json", str(d.parent / "plan.json"))
    assert r.returncode == 0, r.stderr
    assert f"report written: {d / 'index.html'}" in r.stderr
    return d, json.loads((d.parent / "plan.json").read_text())


@pytest.fixture(scope="module")
def qwen3_8b_report(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3-8b")
    model = base / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    d = base / "report"
    r = lanefuse("plan", str(model), "--html", str(d), "--json", str(base / "plan.json"))
    assert r.returncode == 0, r.stderr
    return d, json.loads((base / "plan.json").read_text())


def test_the_report_holds_the_plan(demo_report):
    d, plan = demo_report
    assert sorted(p.name for p in d.iterdir()) == ["app.css", "app.js", "favicon.svg", "index.html", "report.js"]
    r = data(d)
    c = r["common"]
    assert c["census"] == plan["census"] and c["fusions"] == plan["fusions"]
    assert len(r["layers"]) == c["layers"] == plan["layers"]
    assert c["launches"] == len(r["launches"]) == len(plan["launches"])
    for mine, theirs in zip(r["launches"], plan["launches"]):  # the same launches, in the same order
        assert (mine["census"], mine["tensors"], mine["layer"]) == (theirs["kind"], theirs["ops"], theirs["layer"])
    for x in r["launches"]:  # each kernel's source once, by name
        for f in x["functions"]:
            assert "source" not in f and r["sources"][f["function"]]["source"]
    tail = r["layers"][-1]["graph"]["nodes"]
    assert {"final_norm", "next"} <= {n["id"] for n in tail}  # the step's tail is in the last layer's graph
    assert r["saturation"]["iterations"] and r["choices"]["L0.q_rot"]
    rules = {x["name"]: x for x in c["rules"]}
    assert rules["add_norm"]["source"].startswith("- name: add_norm")


def test_the_report_reaches_nothing_outside(demo_report):
    d, _ = demo_report
    for p in d.iterdir():
        text = p.read_text()
        urls = [u for u in re.findall(r"https?://[^\s\"'`)]+", text)
                if u != "http://www.w3.org/2000/svg"]
        assert urls == [], (p.name, urls)
    html = (d / "index.html").read_text()
    assert re.findall(r'(?:src|href)="([^"]+)"', html) == ["favicon.svg", "app.css", "report.js", "app.js"]


def test_html_onto_a_file_is_one_line(tmp_path):
    f = tmp_path / "x.html"
    f.write_text("")
    r = lanefuse("plan", "--html", str(f))
    assert r.returncode != 0 and r.stderr.strip() == \
        f"lanefuse: error: --html {f}: is a file; give a folder for the report (it is made if missing)"


def test_a_qwen3_8b_shape_report_is_small(qwen3_8b_report):
    d, plan = qwen3_8b_report
    r = data(d)
    assert r["common"]["layers"] == 36 and len(r["layers"]) == 36 and r["common"]["launches"] == len(plan["launches"])
    size = sum(p.stat().st_size for p in d.iterdir())
    print(f"\nQwen3-8B shape report: {size / 1024:.0f} KiB in {len(list(d.iterdir()))} files")
    assert size < 2 << 20  # a bug report takes it


def _open(browser, folder: Path, tmp_path: Path, name: str):
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    log: list[str] = []
    page.on("console", lambda m: log.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    page.on("request", lambda r: None if r.url.startswith(f"file://{folder}/") else log.append(f"request: {r.url}"))
    page.goto(f"file://{folder}/index.html")
    page.wait_for_selector("#graph .node")
    page.locator("#fold-auto").uncheck()  # every op drawn: these tests click inner ops (folds have their own test)
    return page, log


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is missing")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def shots(tmp_path: Path) -> Path:
    d = Path(flags.read("LANEFUSE_SCREENSHOTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.mark.browser
def test_the_report_opens_from_the_file_system(browser, demo_report, qwen3_8b_report, tmp_path):
    d, plan = demo_report
    page, log = _open(browser, d, tmp_path, "demo")
    r = data(d)
    assert page.locator("#graph .node").count() == len(r["layers"][0]["graph"]["nodes"])
    assert page.locator("#static-note").is_visible()
    assert page.locator("#census [data-count='fold']").inner_text() == str(plan["census"]["fold"])
    # how the report was made (issue 37): version, the command, date, model, lane, numerics, knobs, held rules
    head = page.locator("#report-header")
    assert head.is_visible() and r["header"]["command"].startswith("lanefuse plan --html")
    for k in ("lanefuse", "command", "date", "model", "lane", "numerics", "knobs", "held"):
        assert page.locator(f"#report-header [data-h='{k}']").count() == 1, k
    assert r["header"]["command"] in head.inner_text()
    page.evaluate("window.lanefuse.select('L0.q_rot')")
    page.wait_for_selector("#choices tr[data-choice]")
    assert page.locator("#choices tr[data-choice]").count() == len(r["choices"]["L0.q_rot"])
    for row in page.locator("#choices tr[data-choice]").all():  # every alternative's step cost (or why not)
        assert re.search(r"\d+\.\d|refused|held", row.locator("td").nth(4).inner_text()), row.inner_text()
    page.locator("#fusions tr[data-fusion='qkv_attn_o_glu_down_norm']").click()  # (a fusion the demo plan chose)
    page.wait_for_selector("#rule-source")
    page.locator(".glabel").first.click()
    page.wait_for_selector("#detail-panel[data-kind='launch'] pre.cu")
    page.locator("#sat-panel summary").click()
    page.wait_for_selector("#sat-iterations tr[data-iteration]")
    page.select_option("#layer", str(len(r["layers"]) - 1))
    page.wait_for_selector(".node[data-tensor='next']")
    page.evaluate("window.lanefuse.hold('add_norm')")  # what-ifs are the live page's: said, not broken
    page.locator(".toast").wait_for()
    assert "static report" in page.locator(".toast").inner_text()
    page.screenshot(path=str(shots(tmp_path) / "report-demo.png"))
    assert log == [], log
    page.close()
    d8, _ = qwen3_8b_report
    page, log = _open(browser, d8, tmp_path, "qwen3-8b")
    assert page.locator("#layer option").count() == 36
    page.select_option("#layer", "35")
    page.wait_for_selector(".node[data-tensor='next']")
    page.screenshot(path=str(shots(tmp_path) / "report-qwen3-8b.png"))
    assert log == [], log
    page.close()
