"""The explorer's page at Qwen3-8B scale (a config-only folder: the shape, no weights), timed in headless Chromium:
the explorer's setup, the state's size, the page from navigation to the graph drawn, a layer switch, a hold (click to
the census changed), the saturation panel, a launch's code, a search. Prints figures; asserts nothing.

    python bench/explore_page.py [--layers 36] [--rounds 3]

Needs /usr/bin/chromium and playwright (pip install playwright; never `playwright install`)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False}
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from lanefuse.lane.cli.main import build_parser
    from lanefuse.lane.cli.explore import _open
    from lanefuse.lane.explore.server import serve

    folder = Path(tempfile.mkdtemp()) / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN3_8B, "num_hidden_layers": args.layers}))
    t0 = time.perf_counter()
    ex = _open(build_parser().parse_args(["explore", str(folder)]))
    setup = time.perf_counter() - t0
    st = ex.state()
    size = len(json.dumps(st, separators=(",", ":")))
    server, url = serve(ex)
    rows = {k: [] for k in ("open", "layer", "hold", "release", "saturation", "launch", "search")}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        for _ in range(args.rounds):
            page = b.new_page(viewport={"width": 1600, "height": 1000})
            t = time.perf_counter()
            page.goto(url + "?layer=0")
            page.wait_for_selector(".node[data-tensor='L0.attn_norm']")
            page.wait_for_selector("#minimap .mm-cell")
            rows["open"].append(time.perf_counter() - t)
            t = time.perf_counter()
            page.select_option("#layer", str(args.layers - 1))
            page.wait_for_selector(".node[data-tensor='next']")
            rows["layer"].append(time.perf_counter() - t)
            fold = page.locator("#census [data-count='fold']").inner_text()
            t = time.perf_counter()
            page.locator("[data-rule-row='gemv_norm_epilogue'] .switch").click()
            page.wait_for_selector(f"#census:not(:has([data-count='fold']:text-is('{fold}')))")
            rows["hold"].append(time.perf_counter() - t)
            t = time.perf_counter()
            page.locator("[data-rule-row='gemv_norm_epilogue'] .switch").click()
            page.wait_for_selector(f"#census [data-count='fold']:text-is('{fold}')")
            rows["release"].append(time.perf_counter() - t)
            t = time.perf_counter()
            page.locator("#sat-panel summary").click()
            page.wait_for_selector("#sat-iterations tr[data-iteration]")
            rows["saturation"].append(time.perf_counter() - t)
            page.locator("#sat-panel summary").click()
            t = time.perf_counter()
            page.locator(".glabel").first.click()
            page.wait_for_selector("#detail-panel[data-kind='launch'] pre.cu")
            rows["launch"].append(time.perf_counter() - t)
            t = time.perf_counter()
            page.locator("#search").fill("L17.q_rot")
            page.locator("#search").press("Enter")
            page.wait_for_selector("#sel-name:text-is('L17.q_rot')")
            rows["search"].append(time.perf_counter() - t)
            page.close()
            ex.goto(0)  # the next round starts where this one did
        b.close()
    server.stop()
    ex.close()
    print(f"Qwen3-8B shape, {args.layers} layers, decode step: {st['launches']} launches; explorer setup (front, "
          f"engine, first exact plan) {setup:.2f} s; state of one layer {size / 1024:.0f} KiB")
    print(f"page timings, median of {args.rounds} rounds (min–max), seconds:")
    for k, v in rows.items():
        print(f"  {k:<11} {statistics.median(v):6.3f}  ({min(v):.3f}–{max(v):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
