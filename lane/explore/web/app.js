// lanefuse explore: the page over the explorer's JSON API (lane/webserver.py). Vanilla JS, hand-drawn SVG, no
// network beyond the server it came from. One state object from the server is drawn into every panel.
"use strict";

const $ = (id) => document.getElementById(id);
const SVGNS = "http://www.w3.org/2000/svg";

// ---- small helpers -----------------------------------------------------------------------------------------------
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false) el.append(k instanceof Node ? k : String(k));
  return el;
}
function s(tag, attrs, ...kids) {
  const el = document.createElementNS(SVGNS, tag);
  setAttrs(el, attrs);
  for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false) el.append(k instanceof Node ? k : String(k));
  return el;
}
function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "tip") el._tip = v;
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
}
const fmtUs = (x) => (x === null || x === undefined ? "∞" : x >= 100 ? x.toFixed(1) : x.toFixed(2)) ;
function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  if (b < 1024) return b + " B";
  if (b < 1024 * 1024) return (b / 1024).toFixed(b % 1024 ? 1 : 0) + " KiB";
  if (b < 1024 ** 3) return (b / 1024 ** 2).toFixed(1) + " MiB";
  return (b / 1024 ** 3).toFixed(2) + " GiB";
}
const fmtShape = (sh) => (sh && sh.length ? sh.join("×") : "");
function delta(b, a, fmt = (x) => String(x), lowerIsBetter = true) {
  const d = a - b;
  if (!d || Math.abs(d) < 1e-9) return h("span", { class: "delta same" }, "±0");
  const cls = (d > 0) === lowerIsBetter ? "up" : "down";
  return h("span", { class: "delta " + cls }, (d > 0 ? "+" : "−") + fmt(Math.abs(d)));
}
function hash(str) { let x = 2166136261; for (const c of str) { x ^= c.charCodeAt(0); x = Math.imul(x, 16777619); } return x >>> 0; }

// launch kind -> colour: fixed for the lane's kinds, a stable hash for any other
const KIND_COLOUR = {
  gemv: "#4e9cff", gemm: "#3f7fe0", gemm_parts: "#7b8cff", gemv_glu: "#b07cff", gemv_parts: "#8f9cff", fold: "#ff7eb6",
  norm: "#3ecf8e", rope: "#f5c04a", rope_parts: "#ffa24a", attention: "#ff6b6b", set_row: "#8aa0b4", binary: "#4fd1c5",
  unary: "#7fd6e8", gather: "#c3e88d", argmax: "#e0a0ff", quantize: "#d4b483", moe: "#ff9f7f", conv: "#9fe0a0",
  gated_delta: "#f08fd0", gates: "#c0b0ff", copy: "#a0a8b4", view: "#6b7482",
};
function colour(kind) {
  if (!kind) return "#6b7482";
  if (KIND_COLOUR[kind]) return KIND_COLOUR[kind];
  return `hsl(${hash(kind) % 360} 62% 66%)`;
}
function tint(hex, alpha) { // "#rrggbb" or hsl() -> a translucent fill
  if (hex.startsWith("#")) return hex + Math.round(alpha * 255).toString(16).padStart(2, "0");
  return hex.replace(")", ` / ${alpha})`);
}

// ---- the page's state ----------------------------------------------------------------------------------------
const S = {
  st: null, layer: null, sel: null, choices: null, showInputs: false, litKind: null,
  view: null, viewKey: null, layout: null, busy: 0,
  // folds: a fused launch's inner ops behind one node. foldAuto folds the largest launches until the layer fits the
  // view at legible size; a launch the user opened (S.open) or folded by hand (S.shut) is named by its shown tensor
  foldAuto: true, open: new Set(), shut: new Set(),
};

// ---- the API -------------------------------------------------------------------------------------------------
class ShownError extends Error {}
// a static report (`lanefuse plan MODEL --html DIR`) carries the answers in report.js: no server, no network
const REPORT = window.LANEFUSE_REPORT || null;
function reportAnswer(path, body) {
  const R = REPORT, u = new URL(path, location.href), q = u.searchParams;  // only its path and query are read
  if (body !== undefined) {
    const msg = "a static report: its plan is fixed; run `lanefuse explore MODEL --web` to hold rules, force choices and see the cost live";
    toast(msg);
    throw new ShownError(msg);
  }
  if (u.pathname === "/api/state") {
    const n = q.has("layer") ? Number(q.get("layer")) : S.layer === null ? 0 : S.layer;
    const L = R.layers[n];
    if (!L) { toast(`layer ${q.get("layer")} is out of range: the model has layers 0..${R.layers.length - 1}`); throw new ShownError("layer"); }
    return { ...R.common, ...L };
  }
  if (u.pathname === "/api/choices") return (R.choices[q.get("tensor")] || []).map((c) => ({ ...c, plan_cost_us: c.plan_cost_us ?? (c.chosen ? R.common.cost_us : null) }));
  if (u.pathname === "/api/launch") {
    const d = R.launches[Number(q.get("index"))];
    return { ...d, functions: d.functions.map((f) => ({ ...f, ...(R.sources[f.function] || {}) })) };
  }
  if (u.pathname === "/api/saturation") return R.saturation;
  throw new ShownError(`no such path in a static report: ${u.pathname}`);
}
async function api(path, body) {
  if (REPORT) return reportAnswer(path, body);
  const opt = body === undefined ? {} :
    { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  let r;
  try { r = await fetch(path, opt); } catch (e) { toast("the server does not answer: is `lanefuse explore --web` still running?"); throw new ShownError(e.message); }
  let j = null;
  try { j = await r.json(); } catch (e) { j = { error: `a ${r.status} answer that is not JSON` }; }
  if (!r.ok) { toast(j && j.error ? j.error : `${r.status} ${r.statusText}`); throw new ShownError(j && j.error); }
  return j;
}
function busy(on) {
  S.busy += on ? 1 : -1;
  $("busy").classList.toggle("hidden", S.busy <= 0);
  document.body.style.cursor = S.busy > 0 ? "progress" : "";
}

// the server answers on threads, so two layer switches in a row may be answered out of order: only the newest
// load draws (an older answer arriving last would show a layer the switch no longer names)
let loads = 0;
async function load(layer) {
  const mine = ++loads;
  busy(true);
  try {
    const q = layer === null || layer === undefined ? "" : `?layer=${layer}`;
    const st = await api("/api/state" + q);
    if (mine !== loads) return;
    if (S.sel && S.layer !== null && S.layer !== st.layer) { // the same tensor in the new layer
      const short = shortName(S.sel, S.layer);
      const next = st.graph.nodes.find((n) => shortName(n.id, st.layer) === short);
      S.sel = next ? next.id : null;
      S.choices = null;
    }
    apply(st);
    await loadChoices();
  } catch (e) { if (!(e instanceof ShownError)) toast(String(e)); }
  finally { busy(false); }
}

async function loadChoices() {
  if (!S.sel) { S.choices = null; renderInspector(); return; }
  const want = S.sel;
  try {
    const ch = await api("/api/choices?tensor=" + encodeURIComponent(want));
    if (S.sel === want) { S.choices = ch; renderInspector(); }
  } catch (e) { if (!(e instanceof ShownError)) toast(String(e)); S.choices = []; renderInspector(); }
}

// a change: POST it, draw the new state, show what it did. The server keeps the history (undo, go back to an
// entry); a request that fails redraws the state the server still has, so no switch shows what it never applied.
async function act(path, body, label) {
  const before = S.st;
  busy(true);
  try {
    const st = await api(path, { ...body, layer: S.layer });
    const diff = st.diff || clientDiff(before, st);
    apply(st);
    showDiff(st.diff && st.diff.what || label, diff);
    if (S.detail && S.detail.kind === "launch") closeDetail();  // its index is the old plan's
    S.sat = null;
    await Promise.all([loadChoices(), loadSaturation(), loadCompare()]);
  } catch (e) {
    if (!(e instanceof ShownError)) toast(String(e));
    if (S.st) apply(S.st);
  }
  finally { busy(false); }
}
const hold = (rule) => act("/api/hold", { rule }, `hold ${rule}`);
const release = (rule) => act("/api/release", { rule }, `release ${rule}`);
const force = (tensor, index, what) => act("/api/force", { tensor, index }, `force ${tensor} → ${what}`);
const unforce = (tensor) => act("/api/unforce", { tensor }, `unforce ${tensor}`);
const setKnob = (name, value) => act("/api/knob", { name, value }, `${name} = ${JSON.stringify(value)}`);
const hist = () => (S.st && S.st.history) || [];
function undoLast() { if (hist().length) return act("/api/undo", {}, "undo"); }
const goBack = (n) => act("/api/goto", { n }, n ? `back to #${n}` : "back to the start");
const setExact = (on) => act("/api/what_if", { method: on ? "ilp" : "local" }, on ? "exact on" : "exact off");

function clientDiff(b, a) {
  if (!b) return null;
  const keys = (x, y) => [...new Set([...Object.keys(x || {}), ...Object.keys(y || {})])].sort();
  const ch = (x, y) => Object.fromEntries(keys(x, y).filter((k) => (x[k] || 0) !== (y[k] || 0)).map((k) => [k, [x[k] || 0, y[k] || 0]]));
  return { launches: [b.launches, a.launches], cost_us: [b.cost_us, a.cost_us], arena: [b.arena.bytes, a.arena.bytes],
    census: ch(b.census, a.census), fusions: ch(b.fusions, a.fusions) };
}

// ---- drawing the state -----------------------------------------------------------------------------------------
const shortName = (id, layer) => (id.startsWith(`L${layer}.`) ? id.slice(`L${layer}.`.length) : id);

function apply(st) {
  S.st = st;
  S.layer = st.layer;
  if (S.sel && !st.graph.nodes.some((n) => n.id === S.sel)) { S.sel = null; S.choices = null; }
  renderHeader(); renderRules(); renderKnobs(); renderForced(); renderHistory(); renderMinimap();
  renderCost(); renderCensus(); renderFusions(); renderGraph(); renderArena(); renderInspector();
  if (S.detail && S.detail.kind === "rule") showRule(S.detail.key);
}

function renderHeader() {
  const st = S.st;
  $("model").textContent = st.model;
  const sel = $("layer");
  if (sel.options.length !== st.layers) {
    sel.replaceChildren(...Array.from({ length: st.layers }, (_, i) => h("option", { value: i }, `layer ${i}`)));
  }
  sel.value = st.layer;
  $("prev").disabled = st.layer <= 0;
  $("next").disabled = st.layer >= st.layers - 1;
  const nFused = Object.values(st.fusions).reduce((a, b) => a + b, 0);
  $("stats").replaceChildren(
    h("div", { class: "stat", title: "launches in the whole step" }, h("b", {}, st.launches), h("span", {}, "launches")),
    h("div", { class: "stat", title: "the lane's estimate of the whole step" }, h("b", {}, fmtUs(st.cost_us)), h("span", {}, "µs")),
    h("div", { class: "stat", title: "the step-local arena (lower bound: the most bytes alive at once)" },
      h("b", {}, fmtBytes(st.arena.bytes)), h("span", {}, `arena (≥ ${fmtBytes(st.arena.lower_bound)})`)),
    h("div", { class: "stat", title: "fused ops chosen in the whole step" }, h("b", {}, nFused), h("span", {}, "fusions")),
  );
  $("graph-title").textContent = `L${st.layer}: ${st.graph.nodes.length} tensors → ${st.groups.length} launches`;
  $("exact").checked = st.what_if === "ilp";
  $("method").textContent = st.method ? `plan: ${st.method === "ilp" ? "exact" : "local search"}` : "";
}

function showDiff(label, d) {
  const el = $("diff");
  if (!d) { el.classList.add("hidden"); return; }
  const [lb, la] = d.launches, [cb, ca] = d.cost_us;
  const item = (k, ...v) => h("span", { class: "item" }, h("span", { class: "k" }, k + " "), ...v);
  const pct = cb ? ` ${((ca - cb) / cb * 100 >= 0 ? "+" : "−")}${Math.abs((ca - cb) / cb * 100).toFixed(1)}%` : "";
  const kids = [
    h("span", { class: "what" }, label),
    item("launches", `${lb} → ${la} `, delta(lb, la)),
    item("cost", `${fmtUs(cb)} → ${fmtUs(ca)} µs `, delta(cb, ca, (x) => x.toFixed(2)), h("span", { class: "dim" }, pct)),
  ];
  if (d.arena) kids.push(item("arena", `${fmtBytes(d.arena[0])} → ${fmtBytes(d.arena[1])} `, delta(d.arena[0], d.arena[1], fmtBytes)));
  const cen = Object.entries(d.census || {});
  if (cen.length) kids.push(item("census", ...cen.map(([k, [b, a]]) => h("span", { style: `margin-right:8px` },
    h("span", { class: "sw", style: `background:${colour(k)};margin-right:3px` }), `${k} ${b}→${a}`))));
  const fus = Object.entries(d.fusions || {});
  if (fus.length) kids.push(item("fusions", fus.map(([k, [b, a]]) => `${k} ${b}→${a}`).join("  ")));
  kids.push(h("span", { class: "spacer" }));
  kids.push(h("span", { class: "dim", id: "diff-method" }, d.method === "ilp" ? "exact" : d.method ? "local search" : ""));
  if (hist().length) kids.push(h("button", { id: "undo", title: "take the last change back (u); again: the one before", onclick: undoLast }, "undo"));
  kids.push(h("button", { title: "dismiss", onclick: () => el.classList.add("hidden") }, "×"));
  el.replaceChildren(...kids);
  el.className = la > lb || (la === lb && ca > cb + 1e-9) ? "worse" : la < lb || ca < cb - 1e-9 ? "better" : "";
  // restart the flash
  el.style.animation = "none"; void el.offsetWidth; el.style.animation = "";
}

function renderRules() {
  const st = S.st, q = $("rule-filter").value.trim().toLowerCase();
  const held = new Set(st.rules.filter((r) => r.held).map((r) => r.name));
  const rows = [];
  const lane = st.rules.filter((r) => r.cls === "lane step");
  const shared = st.rules.filter((r) => r.cls !== "lane step");
  const row = (r) => {
    if (q && !(r.name.toLowerCase().includes(q) || (r.cls || "").toLowerCase().includes(q) || (r.why || "").toLowerCase().includes(q))) return null;
    const blockedBy = (r.depends_on || []).filter((d) => held.has(d));
    const cls = [r.held ? "held" : "", blockedBy.length ? "blocked" : "", r.fired ? "" : "zero"].join(" ");
    const cb = h("input", { type: "checkbox", "data-rule": r.name, "aria-label": `hold ${r.name}` });
    cb.checked = r.held;
    cb.disabled = !!REPORT;
    cb.addEventListener("change", () => (cb.checked ? hold(r.name) : release(r.name)));
    const tip = () => [
      ["h", r.name], ["class", r.cls], ["why", r.why], ["fired", `${r.fired} in the step`],
      r.depends_on && r.depends_on.length ? ["needs", r.depends_on.join(", ")] : null,
      blockedBy.length ? ["blocked", `by held ${blockedBy.join(", ")}`] : null,
      ["", r.held ? "held back: the engine does not apply it" : "click the switch to hold it back"],
    ];
    return h("tr", { class: cls, "data-rule-row": r.name, tip },
      h("td", { class: "sw-cell" }, h("label", { class: "switch", title: r.held ? "held: click to release" : "click to hold back" }, cb, h("i"))),
      h("td", { class: "name", title: r.name, onclick: () => showRule(r.name) }, ...breakable(r.name),
        r.cls !== r.name && r.cls !== "lane step" ? h("span", { class: "cls" }, r.cls) : ""),
      h("td", { class: "num" }, r.fired));
  };
  rows.push(h("tr", { class: "group" }, h("td", { colspan: 2 }, "shared rules"), h("td", { class: "num" }, "fired")));
  rows.push(...shared.map(row).filter(Boolean));
  if (lane.length) {
    rows.push(h("tr", { class: "group" }, h("td", { colspan: 3 }, "lane schedule steps")));
    rows.push(...lane.map(row).filter(Boolean));
  }
  $("rules").replaceChildren(h("colgroup", {}, h("col", { class: "c-sw" }), h("col"), h("col", { class: "c-num" })), ...rows);
  $("rules-count").textContent = `${held.size ? held.size + " held · " : ""}${st.rules.length}`;
}

function renderKnobs() {
  const knobs = Object.entries(S.st.knobs || {});
  $("knobs-panel").classList.toggle("hidden", !knobs.length);
  $("knobs").replaceChildren(...knobs.map(([name, v]) => {
    let input;
    if (typeof v === "boolean") {
      input = h("input", { type: "checkbox", "data-knob": name });
      input.checked = v;
      input.addEventListener("change", () => setKnob(name, input.checked));
    } else {
      input = h("input", { type: typeof v === "number" ? "number" : "text", "data-knob": name, value: v, title: "Enter to set" });
      input.addEventListener("keydown", (e) => {
        if (e.key !== "Enter") return;
        const raw = input.value;
        setKnob(name, typeof v === "number" ? Number(raw) : raw);
      });
    }
    input.disabled = !!REPORT;
    return h("div", { class: "knob" }, h("span", { class: "name" }, name), input);
  }));
}

function renderForced() {
  const f = Object.entries(S.st.forced || {});
  $("forced-count").textContent = f.length || "";
  $("forced").replaceChildren(...(f.length ? f.map(([t, i]) => h("span", { class: "chip", "data-forced": t, title: "select", onclick: () => select(t) },
    `${t} #${i}`, h("button", { title: `unforce ${t}`, onclick: (e) => { e.stopPropagation(); unforce(t); } }, "×")))
    : [h("span", { class: "faint" }, "nothing forced: extraction picks every choice")]));
}

function renderHistory() {
  const entries = hist();
  $("history-panel").classList.toggle("hidden", !!REPORT);  // a static report has no history, nothing to pin
  const items = entries.map((e, i) => ({ ...e, n: i + 1 })).reverse();
  items.push({ what: "start (the first, exact plan)", n: 0, launches: null, cost_us: null });
  $("history").replaceChildren(...items.map((e, k) => h("li", {
    "data-history": e.n, class: k === 0 ? "cur" : "", title: k === 0 ? "the plan now" : `click: back to the plan after this (later changes leave the history)`,
    onclick: k === 0 ? null : () => goBack(e.n) },
    h("span", { class: "a" }, e.n ? `${e.n}. ${e.what}` : e.what),
    e.launches !== null ? h("span", { class: "dim" }, `${e.launches} · ${fmtUs(e.cost_us)} µs`) : "")));
}

function renderCost() {
  const st = S.st, d = st.diff;
  const perLayer = st.groups.length;
  const row = (k, v, extra) => [h("span", { class: "k" }, k), h("span", {}, v, extra ? " " : "", extra || "")];
  $("cost").replaceChildren(
    ...row("step", h("b", {}, fmtUs(st.cost_us) + " µs"), d ? delta(d.cost_us[0], d.cost_us[1], (x) => x.toFixed(2)) : null),
    ...row("launches", h("b", {}, st.launches), d ? delta(d.launches[0], d.launches[1]) : null),
    ...row(`layer ${st.layer}`, `${perLayer} launches, ${st.graph.nodes.length} tensors (${(st.graph.nodes.length / Math.max(perLayer, 1)).toFixed(2)} per launch)`),
    ...row("arena", `${fmtBytes(st.arena.bytes)} · lower bound ${fmtBytes(st.arena.lower_bound)} · ${st.arena.arrays.length} arrays`),
  );
}

function renderCensus() {
  const st = S.st, d = (st.diff && st.diff.census) || {};
  const entries = Object.entries(st.census);
  for (const k of Object.keys(d)) if (!(k in st.census)) entries.push([k, 0]);
  entries.sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  const max = Math.max(1, ...entries.map((e) => e[1]));
  $("census").replaceChildren(
    h("tr", {}, h("th", {}, "launch kind"), h("th", { class: "num" }, "count"), h("th", { class: "num" }, "Δ"), h("th", {}, "")),
    ...entries.map(([k, n]) => h("tr", {
      "data-kind": k, class: S.litKind === k ? "lit" : "",
      tip: () => [["h", k], ["count", `${n} in the step`], ["layer", `${st.groups.filter((g) => g.launch === k).length} in layer ${st.layer}`], ["", "click to light them in the graph"]],
      onclick: () => { S.litKind = S.litKind === k ? null : k; renderCensus(); renderGraph(); },
    },
      h("td", {}, h("span", { class: "sw", style: `background:${colour(k)};margin-right:6px` }), k),
      h("td", { class: "num", "data-count": k }, n),
      h("td", { class: "num" }, d[k] ? delta(d[k][0], d[k][1]) : ""),
      h("td", { class: "bar-cell" }, h("div", { class: "barv", style: `width:${(n / max) * 100}%;background:${colour(k)}` })))),
    h("tr", {}, h("td", { class: "dim" }, "total"), h("td", { class: "num" }, h("b", {}, st.launches)), h("td"), h("td")),
  );
}

function renderFusions() {
  const st = S.st, d = (st.diff && st.diff.fusions) || {};
  const entries = Object.entries(st.fusions);
  for (const k of Object.keys(d)) if (!(k in st.fusions)) entries.push([k, 0]);
  entries.sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  const why = Object.fromEntries(st.rules.map((r) => [r.name, r]));
  $("fusions").replaceChildren(
    h("tr", {}, h("th", {}, "rule"), h("th", { class: "num" }, "count"), h("th", { class: "num" }, "Δ"), h("th", {}, "class")),
    ...(entries.length ? entries.map(([k, n]) => h("tr", { "data-fusion": k, class: "clickable", onclick: () => showRule(k), tip: why[k] ? [["h", k], ["class", why[k].cls], ["why", why[k].why], ["", "click for its source"]] : null },
      h("td", { class: n ? "" : "faint" }, k), h("td", { class: "num" }, n), h("td", { class: "num" }, d[k] ? delta(d[k][0], d[k][1], String, false) : ""),
      h("td", { class: "faint" }, why[k] && why[k].cls !== k ? why[k].cls : "")))
      : [h("tr", {}, h("td", { colspan: 4, class: "faint" }, "no fusion fired: every op runs alone"))]),
  );
}

// ---- the graph: a layered DAG by topological depth -------------------------------------------------------------
// node sizes: a 13 px name (7.9 px a character in the monospace font), a 10.5 px line under it; with "inputs" ticked,
// each node lists what it reads from outside the layer under its name (no edges from them: they are many)
const NODE_H = 32, IN_LINE = 13, VGAP = 14, BOX_GAP = 12, GAP = 16, CH = 7.9, CH_SUB = 6.4, IN_WRAP = 44;
const shortInput = (name) => name.replace(/^model\./, "").replace(/^layers\.\d+\./, "").replace(/^(self_attn|mlp|attn)\./, "");
function inputLines(names) { // "in: a, b, c" wrapped at IN_WRAP characters, never a name cut
  const lines = [];
  let cur = "in: ";
  for (const [i, nm] of names.entries()) {
    const piece = nm + (i < names.length - 1 ? "," : "");
    if (cur.length > 4 && cur.length + piece.length > IN_WRAP) { lines.push(cur.trimEnd()); cur = "    "; }
    cur += piece + " ";
  }
  if (names.length) lines.push(cur.trimEnd());
  return lines;
}

// the tensor a folded launch shows: its last member read outside the launch (its output), else its last member
function foldRep(g, st) {
  const mem = new Set(g.tensors), shown = new Set(st.graph.nodes.map((n) => n.id));
  const inside = g.tensors.filter((t) => shown.has(t));
  const out = inside.filter((t) => st.graph.edges.some(([a, b]) => a === t && !mem.has(b)));
  return out.length ? out[out.length - 1] : inside[inside.length - 1];
}
// the launches that can fold: two or more of their tensors drawn in this layer
function foldable(st) {
  const shown = new Set(st.graph.nodes.map((n) => n.id));
  return st.groups.filter((g) => g.tensors.filter((t) => shown.has(t)).length >= 2);
}

function layout(st, folded = new Set()) {
  const nodes = new Map();
  // a folded launch: its members drawn as one node (its shown tensor's), every edge of a member moved onto it
  const alias = new Map(), foldOf = new Map(), shown = new Set(st.graph.nodes.map((n) => n.id));
  for (const g of foldable(st)) {
    if (!folded.has(g.id)) continue;
    const r = foldRep(g, st);
    foldOf.set(r, g);
    for (const t of g.tensors) alias.set(t, r);
  }
  const al = (t) => alias.get(t) || t;
  st.graph.nodes.forEach((n, i) => {
    if (al(n.id) !== n.id) return;
    const g = foldOf.get(n.id) || null;
    const members = g ? g.tensors.filter((t) => shown.has(t)) : [];
    nodes.set(n.id, { ...n, input: false, preds: [], succs: [], ord: i, folded: g, members });
  });
  const edges = [], seen = new Set();
  for (const n of nodes.values()) n.ins = [];
  for (const [a0, b0] of st.graph.edges) {
    const a = al(a0), b = al(b0);
    if (!nodes.has(b) || a === b) continue;
    if (!nodes.has(a)) { if (!nodes.get(b).ins.includes(a)) nodes.get(b).ins.push(a); continue; }
    if (seen.has(a + "\u0000" + b)) continue;
    seen.add(a + "\u0000" + b);
    nodes.get(a).succs.push(b); nodes.get(b).preds.push(a);
    edges.push([a, b]);
  }
  const groupSize = new Map();
  for (const g of st.groups) groupSize.set(g.id, folded.has(g.id) ? 1 : g.tensors.length);
  // topological order (Kahn); anything left in a cycle goes last
  const indeg = new Map([...nodes.values()].map((n) => [n.id, n.preds.length]));
  const order = [], ready = [...nodes.values()].filter((n) => !n.preds.length).sort((a, b) => a.ord - b.ord);
  while (ready.length) {
    const n = ready.shift(); order.push(n);
    for (const t of n.succs) { indeg.set(t, indeg.get(t) - 1); if (!indeg.get(t)) ready.push(nodes.get(t)); }
  }
  for (const n of nodes.values()) if (!order.includes(n)) order.push(n);
  // depth: longest path over computed tensors; a lone op (no fused group) sinks to just above its first reader
  for (const n of order) {
    if (n.input) continue;
    n.depth = 0;
    for (const p of n.preds) { const pn = nodes.get(p); if (!pn.input && pn.depth !== undefined) n.depth = Math.max(n.depth, pn.depth + 1); }
  }
  for (const n of [...order].reverse()) {
    if (n.input || !n.succs.length) continue;
    const alone = n.group === null || n.group === undefined || (groupSize.get(n.group) || 1) <= 1;
    if (!alone) continue;
    const lo = Math.min(...n.succs.map((t) => nodes.get(t).depth));
    if (lo - 1 > n.depth) n.depth = lo - 1;
  }
  const minD = Math.min(0, ...[...nodes.values()].map((n) => n.depth));
  const rows = [];
  for (const n of order) { n.depth -= minD; (rows[n.depth] = rows[n.depth] || []).push(n); }
  for (let i = 0; i < rows.length; i++) rows[i] = rows[i] || [];
  // sizes
  for (const n of nodes.values()) {
    const nm = shortName(n.id, st.layer);
    n.label = nm;
    n.sub = n.folded ? `${n.folded.launch} · ${n.members.length} ops folded ▸` : `${n.op} · ${fmtShape(n.shape)}`;
    n.inLines = S.showInputs ? inputLines(n.ins.map(shortInput)) : [];
    n.w = Math.max(100, nm.length * CH + 34, n.sub.length * CH_SUB + 20, ...n.inLines.map((l) => l.length * CH_SUB + 20));
    n.h = NODE_H + n.inLines.length * IN_LINE;
  }
  // order within rows: barycenter sweeps, each fused group kept together
  const pos = new Map();
  const index = () => rows.forEach((r) => r.forEach((n, i) => pos.set(n.id, i - (r.length - 1) / 2)));
  index();
  const sweep = (r, key) => {
    const bc = new Map(r.map((n) => { const nb = key(n).filter((x) => pos.has(x)); return [n.id, nb.length ? nb.reduce((a, x) => a + pos.get(x), 0) / nb.length : pos.get(n.id)]; }));
    const gk = new Map();
    for (const n of r) if (n.group !== null && n.group !== undefined) (gk.get(n.group) || gk.set(n.group, []).get(n.group)).push(bc.get(n.id));
    const gmean = (n) => (n.group !== null && n.group !== undefined && gk.get(n.group).length > 1 ? gk.get(n.group).reduce((a, b) => a + b, 0) / gk.get(n.group).length : bc.get(n.id));
    r.sort((a, b) => gmean(a) - gmean(b) || (a.group ?? -1) - (b.group ?? -1) || bc.get(a.id) - bc.get(b.id) || a.ord - b.ord);
    r.forEach((n, i) => pos.set(n.id, i - (r.length - 1) / 2));
  };
  for (let it = 0; it < 4; it++) {
    for (let i = 1; i < rows.length; i++) sweep(rows[i], (n) => n.preds);
    for (let i = rows.length - 2; i >= 0; i--) sweep(rows[i], (n) => n.succs);
  }
  for (let i = 1; i < rows.length; i++) sweep(rows[i], (n) => n.preds);
  // x: each node under the mean of its readers' sources, rows kept apart by GAP, then inputs over their readers
  const place = (r, want) => {
    if (!r.length) return;
    const xs = r.map((n) => want(n));
    for (let i = 0; i < r.length; i++) {
      let x = xs[i];
      if (i > 0) x = Math.max(x, r[i - 1].x + r[i - 1].w / 2 + GAP + r[i].w / 2);
      r[i].x = x;
    }
    const shift = r.reduce((a, n, i) => a + (n.x - xs[i]), 0) / r.length;
    r.forEach((n) => (n.x -= shift));
  };
  const packed = (r) => { let x = 0; const m = new Map(); r.forEach((n) => { m.set(n.id, x + n.w / 2); x += n.w + GAP; }); const c = x / 2; return (n) => m.get(n.id) - c; };
  // each row as tall as its tallest node; where a launch's box starts or ends between two rows, room for its frame
  // and label (BOX_GAP more)
  const boxed = (r) => new Set(r.filter((n) => n.group !== null && n.group !== undefined && (groupSize.get(n.group) || 1) > 1).map((n) => n.group));
  let top = 0;
  rows.forEach((r, i) => {
    const pk = packed(r);
    place(r, (n) => { const ps = n.preds.map((p) => nodes.get(p)).filter((p) => p.x !== undefined); return ps.length ? ps.reduce((a, p) => a + p.x, 0) / ps.length : pk(n); });
    const hmax = Math.max(NODE_H, ...r.map((n) => n.h));
    r.forEach((n) => (n.y = top + n.h / 2));
    const a = boxed(r), b = i + 1 < rows.length ? boxed(rows[i + 1]) : new Set();
    const edge = [...a].some((g) => !b.has(g)) || [...b].some((g) => !a.has(g));
    top += hmax + VGAP + (edge ? BOX_GAP : 0);
  });
  // a node outside a fused group never sits inside the group's box: push it clear, and its row-mates with it
  for (let it = 0; it < 2; it++) for (const g of st.groups) {
    const mem = g.tensors.map((t) => nodes.get(t)).filter(Boolean);
    if (mem.length < 2) continue;
    const ids = new Set(g.tensors);
    const x0 = Math.min(...mem.map((n) => n.x - n.w / 2)) - 8, x1 = Math.max(...mem.map((n) => n.x + n.w / 2)) + 8;
    const cx = (x0 + x1) / 2;
    for (let r = Math.min(...mem.map((n) => n.depth)); r <= Math.max(...mem.map((n) => n.depth)); r++) {
      const row = [...rows[r]].sort((a, b) => a.x - b.x);
      let edge = x0 - 10;
      for (const n of row.filter((n) => !ids.has(n.id) && n.x < cx).reverse()) {
        if (n.x + n.w / 2 > edge) n.x = edge - n.w / 2;
        edge = n.x - n.w / 2 - GAP;
      }
      edge = x1 + 10;
      for (const n of row.filter((n) => !ids.has(n.id) && n.x >= cx)) {
        if (n.x - n.w / 2 < edge) n.x = edge + n.w / 2;
        edge = n.x + n.w / 2 + GAP;
      }
    }
  }
  // groups' boxes
  const boxes = [];
  for (const g of st.groups) {
    const mem = g.tensors.map((t) => nodes.get(t)).filter(Boolean);
    if (mem.length < 2) continue;
    const x0 = Math.min(...mem.map((n) => n.x - n.w / 2)) - 8, x1 = Math.max(...mem.map((n) => n.x + n.w / 2)) + 8;
    const y0 = Math.min(...mem.map((n) => n.y - n.h / 2)) - 14, y1 = Math.max(...mem.map((n) => n.y + n.h / 2)) + 8;
    boxes.push({ g, x0, x1, y0, y1 });
  }
  const all = [...nodes.values()];
  const bx0 = Math.min(...all.map((n) => n.x - n.w / 2), ...boxes.map((b) => b.x0)) - 20;
  const bx1 = Math.max(...all.map((n) => n.x + n.w / 2), ...boxes.map((b) => b.x1)) + 20;
  const by0 = Math.min(...all.map((n) => n.y - n.h / 2), ...boxes.map((b) => b.y0)) - 20;
  const by1 = Math.max(...all.map((n) => n.y + n.h / 2), ...boxes.map((b) => b.y1)) + 20;
  return { nodes, edges, boxes, alias, bounds: { x0: bx0, y0: by0, x1: bx1, y1: by1 } };
}

function groupOf(id) {
  const n = S.st.graph.nodes.find((x) => x.id === id);
  return n && n.group !== null && n.group !== undefined ? S.st.groups[n.group] : S.st.groups.find((g) => g.tensors.includes(id)) || null;
}

// the layout drawn: the launches folded by hand, then (foldAuto) the largest launches folded one by one until the
// layer fits the graph's room at the fit's least scale, where its text is legible (issue 37: never below 11 px)
function foldedLayout(st) {
  const wrap = $("graph-wrap");
  const W = (wrap && wrap.clientWidth) || 800, room = $("graph").clientHeight || (wrap && wrap.clientHeight) || 600;
  const can = foldable(st);
  const folded = new Set(can.filter((g) => S.shut.has(foldRep(g, st))).map((g) => g.id));
  let L = layout(st, folded);
  const fits = (l) => (l.bounds.x1 - l.bounds.x0) * MIN_K <= W && (l.bounds.y1 - l.bounds.y0) * MIN_K <= room;
  if (S.foldAuto) {
    const order = can.filter((g) => !folded.has(g.id) && !S.open.has(foldRep(g, st)))
      .sort((a, b) => b.tensors.length - a.tensors.length || a.index - b.index);
    for (const g of order) {
      if (fits(L)) break;
      folded.add(g.id);
      L = layout(st, folded);
    }
  }
  L.folded = folded;
  return L;
}
// the graph's room changed: fold again where the launches folded would change (foldAuto), else fit
function refit() {
  if (S.foldAuto && S.st && S.layout) {
    const now = foldedLayout(S.st).folded, was = S.layout.folded || new Set();
    if (now.size !== was.size || [...now].some((g) => !was.has(g))) { renderGraph(); return; }
  }
  fit();
}
// `fit` (the button, f): the launches opened by hand fold again where the layer does not fit, then the view fits
function fitAll() {
  if (S.foldAuto && S.open.size) { S.open.clear(); S.fitted = true; renderGraph(); }
  fit();
}
function openFold(rep, open) {
  if (open) { S.open.add(rep); S.shut.delete(rep); } else { S.shut.add(rep); S.open.delete(rep); }
}

function renderGraph() {
  const st = S.st, svg = $("graph");
  const L = foldedLayout(st);
  S.layout = L;
  const gcol = (g) => colour(g ? g.launch : null);
  const groupById = new Map(st.groups.map((g) => [g.id, g]));
  const nodeGroup = (n) => (n.group === null || n.group === undefined ? null : groupById.get(n.group) || st.groups[n.group] || null);
  const root = s("g", { id: "viewport" });
  const defs = s("defs", {},
    s("marker", { id: "arrow", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" },
      s("path", { d: "M0,0 L8,4 L0,8 z", fill: "#6b7482" })),
    s("marker", { id: "arrow-hot", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" },
      s("path", { d: "M0,0 L8,4 L0,8 z", fill: "#6cb6ff" })));
  // group boxes under everything, their labels over everything
  const labels = [];
  for (const b of L.boxes) {
    const c = colour(b.g.launch), lbl = `${b.g.launch} · ${b.g.rule || b.g.cls}`;
    const lit = S.litKind === b.g.launch ? " lit" : "";
    const label = s("g", { class: "glabel", "data-launch": b.g.index, onclick: (e) => { e.stopPropagation(); showLaunch(b.g.index); } },
      s("rect", { x: b.x0 + 6, y: b.y0 - 8, width: lbl.length * 6.6 + 12, height: 15, rx: 3, fill: "#0f1114" }),
      s("text", { x: b.x0 + 12, y: b.y0 + 3, fill: c }, lbl));
    label._tip = [["h", `launch #${b.g.index} · ${b.g.launch}`], ["", `${b.g.cls}${b.g.rule ? " by " + b.g.rule : ""} — click for its fields and CUDA code`]];
    root.append(s("g", { class: "gbox" + lit, "data-group": b.g.id },
      s("rect", { x: b.x0, y: b.y0, width: b.x1 - b.x0, height: b.y1 - b.y0, rx: 7, fill: tint(c, 0.07), stroke: tint(c, 0.75), "stroke-width": 1.2 })));
    const rep = foldRep(b.g, st), lx = b.x0 + 6 + lbl.length * 6.6 + 16;
    const shut = s("g", { class: "fold-ctl", "data-fold": rep, onclick: (e) => { e.stopPropagation(); openFold(rep, false); renderGraph(); } },
      s("rect", { x: lx, y: b.y0 - 8, width: 18, height: 15, rx: 3, fill: "#0f1114" }),
      s("text", { x: lx + 5, y: b.y0 + 3, fill: c }, "▴"));
    shut._tip = [["h", `fold launch #${b.g.index}`], ["", `draw its ${b.g.tensors.length} ops as one node`]];
    // drawn over the edges and nodes: always clickable; kept inside the view while its box crosses the view's top or
    // left edge (applyView), so an opened launch taller or wider than the view can be folded back without panning
    labels.push(s("g", { class: "gbox-top" + lit, "data-box": `${b.x0} ${b.y0} ${b.x1} ${b.y1} ${lx + 18 - b.x0}` }, label, shut));
  }
  // edges
  const hot = new Set();
  const focus = S.hover || S.sel;
  const edgeEls = [], lanes = { l: 0, r: 0 };
  for (const [a, b] of L.edges) {
    const na = L.nodes.get(a), nb = L.nodes.get(b);
    const ga = nodeGroup(na), gb = nodeGroup(nb);
    const fused = ga && gb && ga === gb;
    const isHot = focus && (a === focus || b === focus);
    if (isHot) { hot.add(a); hot.add(b); }
    const cls = ["edge", fused ? "fused" : "", isHot ? "hot" : ""].join(" ");
    const e = s("path", { class: cls, d: edgePath(L, na, nb, lanes),
      stroke: fused ? gcol(ga) : null, "marker-end": fused ? null : isHot ? "url(#arrow-hot)" : "url(#arrow)" });
    edgeEls.push(e);
  }
  root.append(...edgeEls);
  // nodes
  for (const n of L.nodes.values()) {
    const g = nodeGroup(n), c = gcol(g);
    const forced = st.forced && n.id in st.forced;
    const cls = ["node", n.folded ? "folded" : "", S.sel === n.id ? "sel" : "", forced ? "forced" : "",
      (S.litKind && g && g.launch === S.litKind) || (focus && hot.has(n.id)) || focus === n.id ? "lit" : ""].join(" ");
    const x = n.x - n.w / 2, y = n.y - n.h / 2;
    const el = s("g", { class: cls, "data-tensor": n.id, transform: `translate(${x},${y})`, ...(n.folded ? { "data-members": n.members.join(" ") } : {}) });
    el.append(
      s("rect", { class: "box", width: n.w, height: n.h, rx: 4, fill: tint(c, 0.16), stroke: c }),
      s("rect", { x: 0, y: 0, width: 3, height: n.h, fill: c }),
      s("rect", { class: "ring", x: -3, y: -3, width: n.w + 6, height: n.h + 6, rx: 6, fill: "none", stroke: "none" }),
      s("text", { class: "nm", x: 10, y: 14 }, n.label),
      s("text", { class: "sub", x: 10, y: 26.5 }, n.sub),
      ...n.inLines.map((l, i) => s("text", { class: "ins", x: 10, y: 26.5 + IN_LINE * (i + 1) }, l)));
    if (forced) el.append(s("text", { class: "pin", x: n.w - 7, y: 13, "text-anchor": "end" }, `⚑${st.forced[n.id]}`));
    if (n.folded) {  // a folded launch opens on a click, its shown tensor selected
      el.addEventListener("click", (e) => { e.stopPropagation(); openFold(n.id, true); S.viewKeep = true; const p = select(n.id); centerOn(n.id); return p; });
    } else el.addEventListener("click", (e) => { e.stopPropagation(); select(n.id); });
    el._tip = () => nodeTip(n, g);
    el.addEventListener("mouseenter", () => { S.hover = n.id; highlight(); });
    el.addEventListener("mouseleave", () => { S.hover = null; highlight(); });
    root.append(el);
  }
  root.append(...labels);
  svg.replaceChildren(defs, root);
  svg.classList.toggle("dimmed", !!S.litKind);
  // the view: kept across changes of the same layer and graph, fitted otherwise
  const key = `${st.layer}|${S.showInputs}|${st.graph.nodes.length}`;
  if (S.viewKey !== key || !S.view) { S.viewKey = key; fit(); } else if (S.fitted && !S.viewKeep) fit(); else applyView();
  S.viewKeep = false;
  renderLegend();
}

// an edge's path: a curve from the source's foot to the target's head, or, where nodes of the rows between stand in
// its way, down a lane beside them (each such edge a lane of its own on its side), so no edge crosses a node's text
function edgePath(L, na, nb, lanes) {
  const x1 = na.x, y1 = na.y + na.h / 2, x2 = nb.x, y2 = nb.y - nb.h / 2 - 1;
  const dy = Math.max(18, (y2 - y1) * 0.5), PAD = 8;
  const straight = `M${x1},${y1} C${x1},${y1 + dy} ${x2},${y2 - dy} ${x2},${y2}`;
  const between = [...L.nodes.values()].filter((n) => n !== na && n !== nb && n.y - n.h / 2 > y1 - 1 && n.y + n.h / 2 < y2 + 1);
  const lo = Math.min(x1, x2), hi = Math.max(x1, x2);
  const inWay = between.filter((n) => n.x + n.w / 2 + PAD > lo && n.x - n.w / 2 - PAD < hi);
  if (!inWay.length) return straight;
  // the lane on each side: past every node of the rows between that it would cross
  const lane = (side) => {
    let x = side > 0 ? Math.max(...inWay.map((n) => n.x + n.w / 2)) + 14 + 7 * lanes.r
                     : Math.min(...inWay.map((n) => n.x - n.w / 2)) - 14 - 7 * lanes.l;
    for (let moved = true; moved;) {
      moved = false;
      for (const n of between) {
        if (n.x - n.w / 2 - PAD < x && x < n.x + n.w / 2 + PAD) { x = side > 0 ? n.x + n.w / 2 + 14 : n.x - n.w / 2 - 14; moved = true; }
      }
    }
    return x;
  };
  const xr = lane(1), xl = lane(-1), mid = (x1 + x2) / 2;
  const right = Math.abs(xr - mid) <= Math.abs(xl - mid), xs = right ? xr : xl;
  if (right) lanes.r++; else lanes.l++;
  const top = Math.min(...between.map((n) => n.y - n.h / 2)), bot = Math.max(...between.map((n) => n.y + n.h / 2));
  const ya = (y1 + top) / 2, yb = (bot + y2) / 2;  // turn in the gap under the source and over the target
  return `M${x1},${y1} C${x1},${ya} ${x1},${ya} ${(x1 + xs) / 2},${ya} S${xs},${ya} ${xs},${Math.min(ya + 10, (ya + yb) / 2)} ` +
    `L${xs},${Math.max(yb - 10, (ya + yb) / 2)} C${xs},${yb} ${xs},${yb} ${(xs + x2) / 2},${yb} S${x2},${yb} ${x2},${y2}`;
}

// a light redraw on hover: the edges and nodes around the focus
function highlight() {
  if (!S.layout) return;
  const focus = S.hover || S.sel;
  const svg = $("graph");
  const near = new Set(focus ? [focus] : []);
  svg.querySelectorAll(".edge").forEach((e, i) => {
    const [a, b] = S.layout.edges[i];
    const on = !!focus && (a === focus || b === focus);
    if (on) { near.add(a); near.add(b); }
    e.classList.toggle("hot", on);
    if (!e.classList.contains("fused")) e.setAttribute("marker-end", on ? "url(#arrow-hot)" : "url(#arrow)");
  });
  svg.querySelectorAll(".node").forEach((el) => {
    const id = el.getAttribute("data-tensor");
    const g = groupOf(id);
    el.classList.toggle("lit", near.has(id) || (!!S.litKind && !!g && g.launch === S.litKind));
  });
  document.querySelectorAll("#arena .arr").forEach((el) => el.classList.toggle("lit", el.getAttribute("data-array") === focus));
}

function nodeTip(n, g) {
  const st = S.st;
  if (n.folded) return [["h", `${n.folded.launch} #${n.folded.index} (folded)`], ["", `${n.members.map((t) => shortName(t, st.layer)).join(", ")}`],
    ["", "click to open it; ▴ on its box folds it again"]];
  const reads = st.graph.edges.filter((e) => e[1] === n.id).map((e) => shortName(e[0], st.layer));
  const readBy = st.graph.edges.filter((e) => e[0] === n.id).map((e) => shortName(e[1], st.layer));
  const arr = st.arena.arrays.find((a) => a.name === n.id);
  return [
    ["h", n.id], ["op", `${n.op}  ${fmtShape(n.shape)}`],
    g ? ["launch", `${g.launch} #${st.groups.indexOf(g)}  (${g.rule ? g.cls + " by " + g.rule : g.cls})`] : ["launch", "none"],
    g && g.tensors.length > 1 ? ["with", g.tensors.filter((t) => t !== n.id).map((t) => shortName(t, st.layer)).join(", ")] : null,
    ["reads", reads.join(", ") || "–"], n.ins.length ? ["inputs", n.ins.join(", ")] : null, ["read by", readBy.join(", ") || "– (leaves the layer)"],
    arr ? ["arena", `@${arr.offset} +${fmtBytes(arr.bytes)}  launches ${arr.first}..${arr.last}`] : ["arena", "not placed (stays inside its launch, or a table written in place)"],
    st.forced && n.id in st.forced ? ["forced", `choice #${st.forced[n.id]}`] : null,
  ];
}

function renderLegend() {
  const kinds = [...new Set(S.st.groups.map((g) => g.launch))].sort();
  $("legend").replaceChildren(...kinds.map((k) => h("span", { class: "lg", tip: [["h", k], ["", `${S.st.groups.filter((g) => g.launch === k).length} in this layer, ${S.st.census[k] || 0} in the step`]] },
    h("span", { class: "sw", style: `background:${colour(k)}` }), k)));
}

// pan and zoom
function applyView() {
  const v = S.view, vp = $("viewport");
  if (!vp) return;
  vp.setAttribute("transform", `translate(${v.x},${v.y}) scale(${v.k})`);
  // a box's label and ▴ stick to the view's top and left edges while the box crosses them (never past its own box)
  const top = (4 - v.y) / v.k + 8, left = (4 - v.x) / v.k - 6;  // the label's rect 4 px inside the view's corner
  for (const el of vp.querySelectorAll(".gbox-top[data-box]")) {
    const [x0, y0, x1, y1, w] = el.dataset.box.split(" ").map(Number);
    const dy = Math.max(0, Math.min(top - y0, y1 - y0 - 24)), dx = Math.max(0, Math.min(left - x0, x1 - x0 - w));
    if (dx || dy) el.setAttribute("transform", `translate(${dx},${dy})`); else el.removeAttribute("transform");
  }
}
function fit() {
  const L = S.layout, wrap = $("graph-wrap");
  if (!L) return;
  const W = wrap.clientWidth || 800, H = wrap.clientHeight || 600, b = L.bounds;
  // the whole layer in view (its tail too), never magnified past 1.4, and never shrunk below MIN_K: node text stays
  // at 11 px or more (where the layer is taller or wider than the view, it opens at its top, centred; drag to pan,
  // − to zoom out past it). The key's strip at the bottom is kept clear of the nodes.
  const key = document.querySelector("#graph-wrap .graph-key");
  const room = $("graph").clientHeight || H;  // the key has a strip of its own below the graph: no node under it
  const whole = Math.min(1.4, W / (b.x1 - b.x0), room / (b.y1 - b.y0));
  const k = Math.max(MIN_K, whole);
  const x = (b.x1 - b.x0) * k <= W ? W / 2 - ((b.x0 + b.x1) / 2) * k : 12 - b.x0 * k;
  const y = (b.y1 - b.y0) * k <= room ? room / 2 - ((b.y0 + b.y1) / 2) * k : 12 - b.y0 * k;
  S.clipped = k > whole;
  if (key) key.classList.toggle("clipped", S.clipped);
  S.view = { k, x, y };
  S.fitted = true;  // refitted when the graph's room changes (a banner, a resize) until the user pans or zooms
  applyView();
}
const MIN_K = 1.0;  // the fit's least scale: the smallest node text (11 px in SVG units) at 11 px on screen
// a name as text that breaks only after `_` and `.` (never inside an identifier's word); the whole name in a title
function breakable(name) {
  const parts = String(name).split(/(?<=[_.])/);
  return parts.flatMap((p, i) => (i ? [h("wbr"), p] : [p]));
}
function zoom(f, cx, cy) {
  const v = S.view, wrap = $("graph-wrap");
  if (!v) return;
  if (cx === undefined) { cx = wrap.clientWidth / 2; cy = wrap.clientHeight / 2; }
  S.fitted = false;
  const k = Math.max(0.2, Math.min(3, v.k * f));
  v.x = cx - ((cx - v.x) * k) / v.k; v.y = cy - ((cy - v.y) * k) / v.k; v.k = k;
  applyView();
}
function setupPanZoom() {
  const svg = $("graph");
  let drag = null;
  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    if (!S.view) return;
    const r = svg.getBoundingClientRect();
    if (e.ctrlKey || e.metaKey) zoom(Math.exp(-e.deltaY * 0.002), e.clientX - r.left, e.clientY - r.top);
    else { S.view.x -= e.shiftKey ? e.deltaY : e.deltaX; S.view.y -= e.shiftKey ? 0 : e.deltaY; S.fitted = false; applyView(); }
  }, { passive: false });
  svg.addEventListener("mousedown", (e) => {
    if (e.button !== 0 || e.target.closest(".node")) return;
    drag = { x: e.clientX, y: e.clientY, vx: S.view.x, vy: S.view.y, moved: false };
    svg.classList.add("panning");
  });
  window.addEventListener("mousemove", (e) => {
    if (!drag) return;
    S.view.x = drag.vx + e.clientX - drag.x; S.view.y = drag.vy + e.clientY - drag.y;
    S.fitted = false;
    if (Math.abs(e.clientX - drag.x) + Math.abs(e.clientY - drag.y) > 3) drag.moved = true;
    applyView();
  });
  window.addEventListener("mouseup", () => { if (drag) svg.classList.remove("panning"); setTimeout(() => (drag = null), 0); });
  svg.addEventListener("click", (e) => { if (!e.target.closest(".node") && !(drag && drag.moved)) select(null); });
  svg.addEventListener("dblclick", (e) => { if (!e.target.closest(".node")) fit(); });
}

// ---- the arena: launch index across, offset down ---------------------------------------------------------------
function renderArena() {
  const st = S.st, a = st.arena, svg = $("arena");
  const W = svg.clientWidth || 800, H = svg.clientHeight || 132;
  const ml = 62, mr = 12, mt = 20, mb = 8;
  const n = Math.max(1, a.launches), top = Math.max(1, a.bytes, a.lower_bound);
  const cw = (W - ml - mr) / n, sy = (H - mt - mb) / top;
  const X = (i) => ml + i * cw, Y = (b) => mt + b * sy;
  const grid = s("g", { class: "grid" }), axis = s("g", { class: "axis" });
  const every = Math.max(1, Math.ceil(24 / cw));
  for (let i = 0; i <= n; i++) {
    grid.append(s("line", { x1: X(i), x2: X(i), y1: mt, y2: H - mb }));
    if (i < n && i % every === 0) axis.append(s("text", { x: X(i) + cw / 2, y: 12, "text-anchor": "middle" }, i));
  }
  for (let k = 0; k <= 4; k++) {
    const b = (top * k) / 4;
    grid.append(s("line", { x1: ml, x2: W - mr, y1: Y(b), y2: Y(b) }));
    axis.append(s("text", { x: ml - 6, y: Y(b) + 3, "text-anchor": "end" }, fmtBytes(Math.round(b))));
  }
  const arrs = s("g", {});
  for (const r of a.arrays) {
    const g = groupOf(r.name), c = colour(g ? g.launch : null);
    const x = X(r.first) + 1, w = Math.max(2, (r.last - r.first + 1) * cw - 2), y = Y(r.offset), hh = Math.max(2, r.bytes * sy);
    const label = shortName(r.name, st.layer);
    const el = s("g", { class: "arr" + (S.sel === r.name ? " lit" : ""), "data-array": r.name },
      s("rect", { x, y, width: w, height: hh, rx: 2, fill: c, "fill-opacity": 0.85 }));
    if (w > label.length * 6 + 6 && hh >= 11) el.append(s("text", { x: x + 4, y: y + Math.min(hh / 2 + 3.5, 11) }, label));
    el._tip = () => [["h", r.name], ["offset", `${r.offset} (${fmtBytes(r.offset)})`], ["bytes", `${r.bytes} (${fmtBytes(r.bytes)})`],
      ["alive", `launches ${r.first}..${r.last}`], g ? ["written by", `${g.launch} #${st.groups.indexOf(g)}`] : null];
    el.addEventListener("click", () => { if (st.graph.nodes.some((x) => x.id === r.name)) select(r.name); });
    el.addEventListener("mouseenter", () => { S.hover = r.name; highlight(); });
    el.addEventListener("mouseleave", () => { S.hover = null; highlight(); });
    arrs.append(el);
  }
  const lines = s("g", {},
    s("g", { class: "top" }, s("line", { x1: ml, x2: W - mr, y1: Y(a.bytes), y2: Y(a.bytes) }),
      s("text", { x: W - mr - 4, y: Y(a.bytes) - 3, "text-anchor": "end" }, `arena ${fmtBytes(a.bytes)}`)),
    a.lower_bound !== a.bytes ? s("g", { class: "bound" }, s("line", { x1: ml, x2: W - mr, y1: Y(a.lower_bound), y2: Y(a.lower_bound) }),
      s("text", { x: W - mr - 4, y: Y(a.lower_bound) + 10, "text-anchor": "end" }, `lower bound ${fmtBytes(a.lower_bound)}`)) : null);
  svg.replaceChildren(grid, axis, arrs, lines);
  const eff = a.bytes ? ((a.lower_bound / a.bytes) * 100).toFixed(0) : "100";
  $("arena-title").textContent = `layer ${st.layer} · ${fmtBytes(a.bytes)} placed, lower bound ${fmtBytes(a.lower_bound)} (${eff}%) · ${a.arrays.length} arrays over ${a.launches} launches · launch index → , offset ↓`;
}

// ---- the inspector: one tensor's alternatives ------------------------------------------------------------------
async function select(id) {
  const L = S.layout;
  if (id && L && L.alias && L.alias.has(id) && !L.nodes.has(id)) openFold(L.alias.get(id), true);  // inside a fold: open it
  S.sel = id; S.choices = null;
  renderGraph(); renderArena(); renderInspector();
  if (id) await loadChoices();
}

function renderInspector() {
  const st = S.st, id = S.sel;
  $("sel-name").textContent = id || "";
  if (!id) {
    $("tensor-info").className = "dim";
    $("tensor-info").textContent = "click a tensor in the graph to see its alternatives";
    $("choices").replaceChildren();
    return;
  }
  const n = st.graph.nodes.find((x) => x.id === id), g = groupOf(id);
  const forced = st.forced && id in st.forced;
  const kv = (k, v) => [h("span", { class: "k" }, k), h("span", {}, v)];
  $("tensor-info").className = "";
  $("tensor-info").replaceChildren(h("div", { class: "kv" },
    ...kv("op", `${n ? n.op : "?"}  ${n ? fmtShape(n.shape) : ""}`),
    ...kv("launch", g ? h("span", {}, h("span", { class: "sw", style: `background:${colour(g.launch)};margin-right:5px` }),
      h("a", { href: "#", id: "launch-link", onclick: (e) => { e.preventDefault(); showLaunch(g.index); } }, `${g.launch} #${g.index}`),
      ` · ${g.cls}`, g.rule ? h("span", {}, " by ", ruleLink(g.rule)) : "") : "–"),
    ...(g && g.tensors.length > 1 ? kv("with", g.tensors.filter((t) => t !== id).map((t) => shortName(t, st.layer)).join(", ")) : []),
    ...kv("forced", forced ? h("span", {}, h("span", { class: "badge forced", id: "forced-badge" }, `forced #${st.forced[id]}`), " ",
      h("button", { id: "unforce-btn", onclick: () => unforce(id) }, "unforce")) : h("span", { class: "faint" }, "no: extraction's pick"))));
  if (!S.choices) { $("choices").replaceChildren(h("tr", {}, h("td", { class: "faint" }, "loading choices…"))); return; }
  const ch = S.choices;
  const finite = ch.filter((c) => c.plan_cost_us !== null && c.plan_cost_us !== undefined).map((c) => c.plan_cost_us);
  const best = finite.length ? Math.min(...finite) : null;
  const rows = [h("tr", {}, h("th", {}, "#"), h("th", {}, "op / fused class"), h("th", { class: "num", title: "its own cost" }, "own µs"),
    h("th", {}, "support"), h("th", { class: "num", title: "the best whole step if forced to this choice" }, "step µs"), h("th", {}))];
  for (const c of ch) {
    const isForced = forced && st.forced[id] === c.index;
    const can = c.support !== "refuse" && c.support !== "decompose" && c.support !== "held" && !isForced;
    const d = c.plan_cost_us !== null && c.plan_cost_us !== undefined ? c.plan_cost_us - st.cost_us : null;
    rows.push(h("tr", { class: [c.chosen ? "chosen" : "", c.support].join(" "), "data-choice": c.index,
      tip: [["h", `${id} #${c.index}`], ["op", c.op], ["rule", c.rule || "– (the lifted op)"],
        c.also && c.also.length ? ["with", c.also.join(", ")] : null, ["own", `${fmtUs(c.cost_us)} µs`],
        ["support", c.support], c.reason ? ["why", c.reason] : null, ["step", c.plan_cost_us === null || c.plan_cost_us === undefined ? (c.plan_cost_why || "no plan: refused") : `${fmtUs(c.plan_cost_us)} µs if forced`]] },
      h("td", { class: "faint" }, c.chosen ? "●" : c.index),
      h("td", { class: "op" }, c.op, c.rule && c.rule !== c.op ? h("span", { class: "faint" }, ` (${c.rule})`) : "",
        c.also && c.also.length ? h("span", { class: "faint" }, ` +${c.also.map((t) => shortName(t, st.layer)).join(" ")}`) : ""),
      h("td", { class: "num" }, fmtUs(c.cost_us)),
      h("td", {}, h("span", { class: "badge " + c.support }, c.support)),
      h("td", { class: "num" + (c.plan_cost_us === best ? " best" : ""), title: c.plan_cost_why || "" }, c.plan_cost_us === null || c.plan_cost_us === undefined ? (c.plan_cost_why ? h("span", { class: "faint why-none" }, c.support === "refuse" ? "refused" : c.support === "held" ? "held" : "–") : "–") : fmtUs(c.plan_cost_us),
        d !== null && Math.abs(d) > 1e-9 ? h("span", {}, " ", delta(0, d, (x) => x.toFixed(1))) : ""),
      h("td", { class: "act" }, isForced ? h("span", { class: "badge forced" }, "forced")
        : h("button", { "data-force": c.index, disabled: !can || !!REPORT, title: can ? `force ${id} to #${c.index}` : c.reason || "", onclick: () => force(id, c.index, c.op) },
          c.chosen && !forced ? "pin" : "force"))));
    if (c.reason) rows.push(h("tr", { class: "why" }, h("td", { colspan: 6 }, (c.support === "refuse" ? "refused: " : c.support === "decompose" ? "decomposes: " : c.support === "held" ? "held: " : "") + c.reason)));
  }
  $("choices").replaceChildren(...rows);
}

// ---- the whole step: a mini-map of every layer's launches, and search --------------------------------------------
function renderMinimap() {
  const st = S.st, step = st.step;
  if (!step) { $("minimap-wrap").classList.add("hidden"); return; }
  const by = Array.from({ length: st.layers }, () => []);
  for (const x of step.launches) by[Math.min(Math.max(x.layer, 0), st.layers - 1)].push(x);
  const lit = S.litRule;
  const cols = by.map((xs, n) => {
    const cells = xs.map((x) => h("span", {
      class: "mm-cell" + (lit && x.rule === lit ? " lit" : "") + (S.litKind && x.launch === S.litKind ? " lit" : ""),
      style: `background:${colour(x.launch)}`, "data-mm-launch": x.index,
      tip: [["h", `launch #${x.index} · ${x.launch}`], ["", `${x.cls || "lifted"}${x.rule ? " by " + x.rule : ""}`], ["computes", x.tensors.join(", ")]],
      onclick: (e) => { e.stopPropagation(); goToLaunch(x.index); } }));
    return h("div", { class: "mm-col" + (n === st.layer ? " cur" : ""), "data-mm-layer": n, title: `layer ${n}: ${xs.length} launches`,
      onclick: () => n !== S.layer && load(n) }, h("span", { class: "mm-n" }, n === st.layers - 1 && st.layers > 1 ? (st.layers > 16 ? "tail" : `${n}+tail`) : st.layers <= 16 || n % 5 === 0 || n === st.layer ? n : ""), h("span", { class: "mm-cells" }, ...cells));
  });
  $("minimap").replaceChildren(...cols);
  // each layer a column of its launches, as wide as the strip allows (14 px at most, 5 at least: Qwen3-8B's 36
  // layers fit without scrolling); numbered every few layers where many
  const room = $("minimap").clientWidth - st.layers * 8;
  $("minimap").style.setProperty("--mm-w", `${Math.max(5, Math.min(14, Math.floor(room / Math.max(1, st.layers))))}px`);
  const cur = $("minimap").querySelector(".mm-col.cur");
  if (cur && cur.scrollIntoView) cur.scrollIntoView({ block: "nearest", inline: "nearest" });
  const names = [...Object.keys(step.tensor_layer), ...st.rules.map((r) => r.name)];
  if ($("search-list").childElementCount !== names.length) $("search-list").replaceChildren(...names.map((n) => h("option", { value: n })));
}

async function goToLaunch(index) {
  const x = S.st.step.launches[index];
  if (x && x.layer !== S.layer) await load(x.layer);
  showLaunch(index);
}
async function goToTensor(t) {
  const n = S.st.step.tensor_layer[t];
  if (n === undefined) return false;
  if (n !== S.layer) await load(n);
  const chosen = select(t);  // draws the selection at once; its alternatives come later
  const el = document.querySelector(`.node[data-tensor="${CSS.escape(t)}"]`);
  if (el) centerOn(t);  // in view in the same frame the selection shows, not after its alternatives arrive
  await chosen;
  return true;
}
async function search(text) {
  const q = text.trim();
  if (!q) return;
  const st = S.st, step = st.step;
  const m = q.match(/^#?(\d+)$/);
  if (m && q.startsWith("#")) {
    const i = Number(m[1]);
    if (i < step.launches.length) return goToLaunch(i);
    toast(`launch #${i}: the plan has launches 0..${step.launches.length - 1}`);
    return;
  }
  if (q in step.tensor_layer) return goToTensor(q);
  const rule = st.rules.find((r) => r.name === q);
  if (rule) { S.litRule = rule.name; renderMinimap(); showRule(rule.name); return; }
  // a layer's short name (`q_rot`): this layer's first
  const short = `L${S.layer}.${q}`;
  if (short in step.tensor_layer) return goToTensor(short);
  const low = q.toLowerCase();
  const t = Object.keys(step.tensor_layer).find((n) => n.toLowerCase().includes(low));
  if (t) return goToTensor(t);
  const r = st.rules.find((x) => x.name.toLowerCase().includes(low));
  if (r) { S.litRule = r.name; renderMinimap(); showRule(r.name); return; }
  toast(`nothing named like \`${q}\`: give a tensor (L0.q_rot), a rule (add_norm) or a launch (#12)`);
}
function centerOn(t) {
  const L = S.layout, n = L && L.nodes.get(t), wrap = $("graph-wrap");
  if (!n || !S.view) return;
  const v = S.view, W = wrap.clientWidth, H = wrap.clientHeight;
  const sx = n.x * v.k + v.x, sy = n.y * v.k + v.y;
  if (sx > 20 && sx < W - 20 && sy > 20 && sy < H - 20) return;
  v.x = W / 2 - n.x * v.k; v.y = H / 2 - n.y * v.k;
  S.fitted = false;  // a later change of the graph's room must not refit it away from the node it went to
  applyView();
}
async function goToTail() {
  const st = S.st;
  const last = [...st.step.launches].reverse().find((x) => x.plan_layer < 0) || st.step.launches[st.step.launches.length - 1];
  if (!last) return;
  await goToTensor(last.tensors[last.tensors.length - 1]);
}

// ---- the detail panel: one rule's source, one launch's fields and code ---------------------------------------------
function openDetail(title, kids, kind, key) {
  S.detail = { kind, key };
  $("detail-title").textContent = title;
  $("detail").replaceChildren(...kids);
  $("detail-panel").classList.remove("hidden");
  $("detail-panel").dataset.kind = kind;
  $("right").scrollTop = 0;
}
function closeDetail() { S.detail = null; $("detail-panel").classList.add("hidden"); }
const kvRows = (pairs) => h("div", { class: "kv" }, ...pairs.filter(Boolean).flatMap(([k, v]) => [h("span", { class: "k" }, k), h("span", {}, v)]));
const ruleLink = (name) => h("a", { class: "rule-link", href: "#", "data-rule-link": name, onclick: (e) => { e.preventDefault(); showRule(name); } }, name);

function showRule(name) {
  const r = S.st && S.st.rules.find((x) => x.name === name);
  if (!r) { toast(`no rule \`${name}\` in this table`); return; }
  if (!S.sat && !S.satLoading) {  // the why-not is the saturation's: fetched now, not when its section is opened
    const st0 = S.st;  // an answer for a plan since changed is dropped
    S.satLoading = api("/api/saturation").then((v) => { if (S.st !== st0) return; S.sat = v; if ($("sat-details").open) renderSaturation(); })
      .catch(() => {}).finally(() => { S.satLoading = null; if (S.detail && S.detail.kind === "rule" && S.detail.key === name) showRule(name); });
  }
  const sat = S.sat && S.sat.rules.find((x) => x.name === name);
  const why = sat && sat.why_not ? (typeof sat.why_not === "string" ? sat.why_not : sat.why_not.text) : null;
  const lane = r.cls === "lane step";
  openDetail(lane ? `${r.name} @ ${r.where}` : r.where, [
    kvRows([
      ["class", lane ? "a schedule step of the lane" : r.cls],
      ["why", r.why],
      ["state", r.held ? "held: the engine does not apply it" : "applied"],
      [lane ? "shaped" : "fired", `${r.fired} ${lane ? "launches" : "times"} in this plan`],
      sat ? ["matched", `${sat.matches} times in saturation`] : ["matched", h("span", { class: "faint" }, "working it out…")],
      why ? ["not chosen", h("span", { id: "rule-why-not" }, why)] : null,
      r.depends_on && r.depends_on.length ? ["builds on", h("span", {}, ...r.depends_on.flatMap((d, i) => [i ? ", " : "", ruleLink(d)]))] : null,
    ]),
    r.pattern && r.pattern.length ? h("div", { class: "sub-h" }, "pattern") : "",
    r.pattern && r.pattern.length ? h("pre", { class: "code", id: "rule-pattern" }, r.pattern.join("\n")) : "",
    r.source ? h("div", { class: "sub-h" }, `source · ${r.where.split(" @ ")[1] || r.where}`) : "",
    r.source ? h("pre", { class: "code", id: "rule-source" }, r.source) : "",
    h("div", { class: "row-btns" }, h("button", { onclick: () => (r.held ? release(r.name) : hold(r.name)) }, r.held ? "release" : "hold back")),
  ], "rule", name);
}

async function showLaunch(index) {
  let d;
  try { d = await api(`/api/launch?index=${index}`); } catch (e) { return; }
  const grid = (c) => `${c.function}<<<(${c.grid.join(", ")}), (${c.block.join(", ")})>>>`;
  const kids = [
    kvRows([
      ["kind", `${d.census} (${d.kind}) · layer ${d.layer < 0 ? "tail" : d.layer}`],
      ["class", d.cls ? h("span", {}, d.cls, d.rule ? h("span", {}, " by ", ruleLink(d.rule)) : "") : "a lifted op alone"],
      ["computes", d.tensors.join(", ")],
      ["cost", `${fmtUs(d.cost_us)} µs estimated · ${fmtBytes(d.bytes)} moved · ${d.flops.toLocaleString()} flops`],
      ["reads", d.reads.join(", ")], ["writes", d.writes.join(", ")],
      ["numpy", d.numpy + (d.fast ? ` · fast: ${d.fast}` : "") + ` (${d.source_file})`],
    ]),
    h("div", { class: "sub-h" }, `CUDA · ${d.calls.length} kernel call${d.calls.length === 1 ? "" : "s"}`),
    d.calls.length ? h("pre", { class: "code", id: "launch-calls" }, d.calls.map((c) => grid(c) + `   // module: prelude + ${c.stems.join(" + ")}`).join("\n"))
      : h("div", { class: "faint" }, d.calls_note || "none"),
    h("div", { class: "sub-h" }, "fields as planned"),
    h("pre", { class: "code", id: "launch-fields" }, Object.entries(d.fields).map(([k, v]) => `${k} = ${JSON.stringify(v, null, 1).replace(/\n\s*/g, " ")}`).join("\n")),
    ...d.functions.flatMap((f) => f.source ? [h("div", { class: "sub-h" }, `${f.function} @ ${f.file}:${f.line}`), h("pre", { class: "code cu", "data-function": f.function }, f.source)] : []),
  ];
  openDetail(`launch #${d.index} · ${d.census}`, kids, "launch", index);
}

// ---- A/B: a pinned configuration against the current one ------------------------------------------------------------
function pinA() {
  const st = S.st;
  S.pinA = { held: [...st.held], forced: { ...st.forced }, knobs: { ...st.knobs }, stable: true };
  S.pinLabel = hist().length ? `#${hist().length} ${hist()[hist().length - 1].what}` : "the start";
  return loadCompare();
}
function unpinA() { S.pinA = null; S.ab = null; $("ab-panel").classList.add("hidden"); }
async function loadCompare() {
  if (!S.pinA) return;
  try { S.ab = await api("/api/compare", { a: S.pinA, b: null }); } catch (e) { return; }
  renderCompare();
}
function renderCompare() {
  const r = S.ab;
  if (!r) return;
  const { a, b, diff: d } = r;
  const list = (o) => Object.entries(o).map(([k, v]) => `${k} ${typeof v === "number" && !Number.isInteger(v) ? v : v}`).join(", ") || "–";
  const row = (k, x, y, dlt) => h("tr", {}, h("td", { class: "k" }, k), h("td", { class: "wrap" }, x), h("td", { class: "wrap" }, y), h("td", { class: "num" }, dlt || ""));
  const rows = [
    h("tr", {}, h("th", {}, ""), h("th", {}, `A · ${S.pinLabel}`), h("th", {}, "B · now"), h("th", { class: "num" }, "B − A")),
    row("launches", a.launches, b.launches, delta(a.launches, b.launches)),
    row("cost µs", fmtUs(a.cost_us), fmtUs(b.cost_us), delta(a.cost_us, b.cost_us, (x) => x.toFixed(2))),
    row("arena", fmtBytes(a.arena), fmtBytes(b.arena), delta(a.arena, b.arena, fmtBytes)),
    row("held", a.held.join(", ") || "–", b.held.join(", ") || "–"),
    row("forced", list(Object.fromEntries(Object.entries(a.forced).map(([t, i]) => [t, "#" + i]))), list(Object.fromEntries(Object.entries(b.forced).map(([t, i]) => [t, "#" + i])))),
    row("knobs", list(Object.fromEntries(Object.entries(a.knobs).map(([k, v]) => [k, "= " + v]))), list(Object.fromEntries(Object.entries(b.knobs).map(([k, v]) => [k, "= " + v])))),
    ...Object.entries(d.census).map(([k, [x, y]]) => row(h("span", {}, h("span", { class: "sw", style: `background:${colour(k)};margin-right:4px` }), k), x, y, delta(x, y))),
    ...Object.entries(d.fusions).map(([k, [x, y]]) => row(h("span", {}, "fusion ", ruleLink(k)), x, y, delta(x, y, String, false))),
  ];
  const only = (side, xs) => xs.length ? h("div", { class: "ab-only" }, h("div", { class: "sub-h" }, `only in ${side} (${xs.length})`),
    ...xs.map((x) => h("div", { class: "ab-l", "data-ab-only": side, "data-index": x.index, onclick: side === "B" ? () => goToLaunch(x.index) : null, title: side === "B" ? "click for its code" : "" },
      h("span", { class: "sw", style: `background:${colour(x.launch)};margin-right:4px` }), `#${x.index} ${x.launch} · ${x.cls || "lifted"}${x.rule ? " by " + x.rule : ""} · L${x.layer < 0 ? "tail" : x.layer}: `,
      h("span", { class: "dim" }, x.tensors.join(", "))))) : "";
  $("ab").replaceChildren(h("table", { class: "grid", id: "ab-table" }, ...rows),
    h("div", { class: "dim", id: "ab-same" }, `${d.same} launches alike, ${d.only_a.length} only in A, ${d.only_b.length} only in B`),
    only("A", d.only_a), only("B", d.only_b));
  $("ab-panel").classList.remove("hidden");
}

// ---- the saturation, step by step --------------------------------------------------------------------------------
async function loadSaturation() {
  if (!$("sat-details").open) return;
  try { S.sat = await api("/api/saturation"); } catch (e) { return; }
  renderSaturation();
  if (S.detail && S.detail.kind === "rule") showRule(S.detail.key);
}
function renderSaturation() {
  const s = S.sat;
  if (!s) return;
  const its = s.iterations, max = Math.max(1, ...its.map((i) => i.enodes));
  $("sat-sum").textContent = `${its.length} iterations · ${s.stop} · ${s.egraph.nodes} e-nodes in ${s.egraph.classes} classes`;
  const itRows = its.map((i) => h("tr", { "data-iteration": i.iteration },
    h("td", { class: "num" }, i.iteration), h("td", { class: "num" }, i.stage), h("td", { class: "num" }, i.enodes),
    h("td", { class: "bar-cell" }, h("div", { class: "barv", style: `width:${(i.enodes / max) * 100}%;background:#6cb6ff` })),
    h("td", { class: "wrap" }, i.rules.length ? h("span", {}, ...i.rules.flatMap((r, k) => [k ? "  " : "", ruleLink(r), ` ${i.matches[r]}`])) : h("span", { class: "faint" }, "nothing new: saturated"))));
  // each rule's why-not on a row of its own below it, the table's whole width (a column of its own was ~60 px)
  const ruleRows = s.rules.flatMap((r) => {
    const why = r.why_not ? (typeof r.why_not === "string" ? r.why_not : r.why_not.text) : "";
    return [h("tr", { class: r.fired ? "" : "zero", "data-sat-rule": r.name },
      h("td", { class: "rname" }, ruleLink(r.name)), h("td", { class: "num" }, r.matches), h("td", { class: "num" }, r.fired)),
      why ? h("tr", { class: "why-row", "data-sat-why": r.name }, h("td", { class: "wrap why", colspan: 3 }, why)) : null].filter(Boolean);
  });
  $("sat").replaceChildren(
    h("table", { class: "grid", id: "sat-iterations" }, h("tr", {}, h("th", { class: "num" }, "it"), h("th", { class: "num" }, "stage"), h("th", { class: "num" }, "e-nodes"), h("th", {}, ""), h("th", {}, "matches by rule")), ...itRows),
    h("table", { class: "grid", id: "sat-rules" }, h("tr", {}, h("th", {}, "rule"), h("th", { class: "num" }, "matched"), h("th", { class: "num" }, "fired")),
      h("tr", { class: "why-row" }, h("th", { colspan: 3, class: "wrap" }, `below each: why not chosen (one place; ${s.method === "ilp" ? "exact" : "local search"} plan)`)), ...ruleRows));
}

// ---- tooltips and toasts -----------------------------------------------------------------------------------------
function setupTips() {
  const tip = $("tip");
  let cur = null;
  document.addEventListener("mouseover", (e) => {
    let el = e.target;
    while (el && el !== document && !el._tip) el = el.parentNode;
    cur = el && el._tip ? el : null;
    if (!cur) { tip.classList.add("hidden"); return; }
    const spec = typeof cur._tip === "function" ? cur._tip() : cur._tip;
    tip.replaceChildren(...spec.filter(Boolean).map(([k, v]) => (k === "h" ? h("div", { class: "h" }, v) : h("div", {}, k ? h("span", { class: "k" }, k + " ") : "", v))));
    tip.classList.remove("hidden");
  });
  document.addEventListener("mousemove", (e) => {
    if (!cur) return;
    const r = tip.getBoundingClientRect();
    let x = e.clientX + 14, y = e.clientY + 14;
    if (x + r.width > innerWidth - 6) x = e.clientX - r.width - 14;
    if (y + r.height > innerHeight - 6) y = e.clientY - r.height - 14;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  });
}
function toast(msg) {
  const el = h("div", { class: "toast", role: "alert" }, h("span", {}, msg), h("button", { onclick: () => el.remove(), title: "dismiss" }, "×"));
  $("toasts").append(el);
  setTimeout(() => el.remove(), 8000);
  while ($("toasts").children.length > 4) $("toasts").firstChild.remove();
}

// ---- wiring ------------------------------------------------------------------------------------------------------
function setupStatic() {
  document.body.classList.add("static");
  document.title = `lanefuse report · ${REPORT.common.model}`;
  $("exact").disabled = true;
  const note = h("span", { id: "static-note", class: "dim", title: "written by `lanefuse plan MODEL --html DIR`; what-ifs need `lanefuse explore MODEL --web`" }, "static report");
  $("busy").before(note);
  const hd = REPORT.header;
  if (hd) {  // how the report was made: a report attached to a bug says so
    const kv = Object.entries(hd.knobs || {}).map(([k, v]) => `${k}=${v}`).join(", ");
    const items = [["lanefuse", hd.version], ["command", hd.command], ["date", hd.date], ["model", `${hd.model} · ${hd.layers} layers · ${hd.rows} row${hd.rows > 1 ? "s" : ""}`],
      ["lane", hd.lane], ["numerics", hd.numerics], ["knobs", kv || "defaults"], ["held", (hd.held || []).join(", ") || "none"],
      Object.keys(hd.forced || {}).length ? ["forced", Object.entries(hd.forced).map(([t, k]) => `${t} #${k}`).join(", ")] : null].filter(Boolean);
    const bar = h("div", { id: "report-header", class: "mono", title: items.map(([k, v]) => `${k}: ${v}`).join("\n") },
      ...items.map(([k, v]) => h("span", { "data-h": k }, h("span", { class: "k" }, k + " "), h("span", { class: k === "command" ? "v cmd" : "v" }, String(v)))));
    $("top").before(bar);
  }
}

function setup() {
  if (REPORT) setupStatic();
  $("layer").addEventListener("change", (e) => load(Number(e.target.value)));
  $("prev").addEventListener("click", () => S.st && S.st.layer > 0 && load(S.st.layer - 1));
  $("next").addEventListener("click", () => S.st && S.st.layer < S.st.layers - 1 && load(S.st.layer + 1));
  $("rule-filter").addEventListener("input", () => S.st && renderRules());
  $("show-inputs").addEventListener("change", (e) => { S.showInputs = e.target.checked; renderGraph(); });
  $("fold-auto").addEventListener("change", (e) => { S.foldAuto = e.target.checked; if (S.foldAuto) S.open.clear(); else S.shut.clear(); renderGraph(); });
  $("fit").addEventListener("click", fitAll);
  $("zoom-in").addEventListener("click", () => zoom(1.2));
  $("zoom-out").addEventListener("click", () => zoom(1 / 1.2));
  $("help-btn").addEventListener("click", () => $("help").classList.toggle("hidden"));
  $("exact").addEventListener("change", (e) => setExact(e.target.checked));
  $("detail-close").addEventListener("click", closeDetail);
  $("pin-a").addEventListener("click", pinA);
  $("ab-close").addEventListener("click", unpinA);
  $("search").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); search(e.target.value); } });
  $("search").addEventListener("change", (e) => { if (e.target.value && e.target.value in ((S.st && S.st.step && S.st.step.tensor_layer) || {})) search(e.target.value); });
  document.querySelector("#arena-wrap .title").addEventListener("click", () => { $("arena-wrap").classList.toggle("folded"); setTimeout(fit, 0); });
  // opened: drawn from the saturation a rule's panel may have fetched already, else fetched now
  $("sat-details").addEventListener("toggle", () => { if ($("sat-details").open) { if (S.sat) renderSaturation(); else loadSaturation(); } });
  document.addEventListener("keydown", (e) => {
    if (e.target.matches("input, select, textarea")) { if (e.key === "Escape") e.target.blur(); return; }
    if (!S.st || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.key === "[" && S.st.layer > 0) load(S.st.layer - 1);
    else if (e.key === "]" && S.st.layer < S.st.layers - 1) load(S.st.layer + 1);
    else if (e.key === "/") { e.preventDefault(); $("rule-filter").focus(); }
    else if (e.key === "f") fitAll();
    else if (e.key === "+" || e.key === "=") zoom(1.2);
    else if (e.key === "-") zoom(1 / 1.2);
    else if (e.key === "u") undoLast();
    else if (e.key === "s") { e.preventDefault(); $("search").focus(); $("search").select(); }
    else if (e.key === "t") goToTail();
    else if (e.key === "?") $("help").classList.toggle("hidden");
    else if (e.key === "Escape") { $("help").classList.add("hidden"); if (S.detail) closeDetail(); else select(null); }
  });
  let t = null;
  window.addEventListener("resize", () => { clearTimeout(t); t = setTimeout(() => { if (S.st) { renderArena(); refit(); } }, 120); });
  window.addEventListener("unhandledrejection", (e) => { e.preventDefault(); toast(String(e.reason && e.reason.message || e.reason)); });
  setupPanZoom();
  if (window.ResizeObserver) new ResizeObserver(() => { if (S.fitted && S.layout) refit(); }).observe($("graph-wrap"));
  setupTips();
  const q = new URLSearchParams(location.search);
  load(q.has("layer") ? Number(q.get("layer")) : null);
}

// for tests and the console: the page's state and its actions
window.lanefuse = { get state() { return S.st; }, get selected() { return S.sel; }, api, hold, release, force, unforce, setKnob, select, load, undo: undoLast, goBack, setExact, showRule, showLaunch, search, goToTail, pinA };
setup();
