"""The dashboard page: one HTML document with its CSS and a small hand-written SVG renderer.

No CDN, no build chain, no vendored chart library: line charts (loss, throughput, PS rows and
QPS) and stacked bars (step-time breakdown, admitted/filtered/evicted) are drawn as SVG by the
~150 lines of JavaScript below, from ``/api/state`` polled every second. Element ids and
``data-*`` attributes (``svg[data-points]``, ``tr[data-key]``) are what the browser tests read.
"""

from __future__ import annotations

PAGE_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fleetrun dashboard</title>
<style>
  :root { --fg:#1d2430; --muted:#6b7480; --line:#dde2e8; --bg:#f6f8fa; --card:#fff;
          --ok:#1a7f37; --bad:#cf222e; --warn:#9a6700; --info:#0969da; }
  * { box-sizing: border-box; }
  [hidden] { display:none !important; }
  .scroll { overflow-x:auto; }
  body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
         color:var(--fg); background:var(--bg); }
  header { display:flex; flex-wrap:wrap; gap:14px; align-items:baseline; padding:12px 20px;
           background:var(--card); border-bottom:1px solid var(--line); }
  header h1 { font-size:18px; margin:0; }
  header .meta { color:var(--muted); }
  main { padding:16px 20px; display:grid; gap:16px; }
  section.card { background:var(--card); border:1px solid var(--line); border-radius:6px;
                 padding:12px 14px; min-width:0; }
  h2 { font-size:15px; margin:0 0 8px; }
  .grid { display:grid; gap:16px; grid-template-columns:repeat(auto-fit, minmax(440px, 1fr)); }
  .badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px;
           font-weight:600; color:#fff; background:var(--muted); }
  .s-up, .s-running, .s-succeeded { background:var(--ok); }
  .s-failed { background:var(--bad); }
  .s-restarting, .s-unknown { background:var(--warn); }
  .s-starting { background:var(--info); }
  table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
  th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); }
  th { color:var(--muted); font-weight:600; font-size:12px; }
  #failure { border-color:var(--bad); }
  #failure h2 { color:var(--bad); }
  #failure-summary { margin:0; white-space:pre-wrap; font:12px/1.35 ui-monospace, monospace;
                     max-height:420px; overflow:auto; }
  svg.chart { width:100%; height:230px; display:block; }
  svg text { font-size:11px; fill:var(--muted); }
  .empty { fill:var(--muted); font-size:13px; }
  #conn.bad { color:var(--bad); font-weight:600; }
  .err { color:var(--bad); font-size:12px; }
</style>
</head>
<body>
<header>
  <h1>fleetrun · <span id="job-name">…</span></h1>
  <span id="job-state" class="badge s-unknown">unknown</span>
  <span class="meta" id="job-meta"></span>
  <span class="meta" id="launcher"></span>
  <span class="meta" id="conn">connecting…</span>
</header>
<main>
  <section class="card" id="failure" hidden>
    <h2>Job failed — root cause</h2>
    <pre id="failure-summary"></pre>
  </section>
  <section class="card">
    <h2>Processes</h2>
    <div id="job-error" class="err"></div>
    <div class="scroll"><table id="procs"><thead><tr><th>role</th><th>rank</th><th>host</th><th>pid</th><th>state</th>
      <th>exit</th><th>restarts</th><th>steps</th><th>loss</th><th>metrics</th><th>log</th></tr></thead>
      <tbody></tbody></table></div>
  </section>
  <div class="grid">
    <section class="card"><h2>Loss per rank</h2><svg class="chart" id="chart-loss"></svg></section>
    <section class="card"><h2>Throughput per rank (samples/s)</h2>
      <svg class="chart" id="chart-throughput"></svg></section>
    <section class="card"><h2>Step time breakdown (share of each trainer's step, last ~10 s)</h2>
      <svg class="chart" id="chart-breakdown"></svg></section>
  </div>
  <div class="grid" id="ps" hidden>
    <section class="card"><h2>PS table rows</h2><svg class="chart" id="chart-ps-rows"></svg></section>
    <section class="card"><h2>PS requests per second</h2><svg class="chart" id="chart-ps-qps"></svg></section>
    <section class="card"><h2>PS tables</h2>
      <div class="scroll"><table id="tables"><thead><tr><th>table</th><th>servers</th><th>rows</th><th>bytes</th>
        <th>QPS</th><th>errors</th><th>admitted</th><th>filtered</th><th>evicted</th>
        <th>nodes</th><th>edges</th><th>samples</th><th>sample ms</th></tr></thead>
        <tbody></tbody></table></div>
      <svg class="chart" id="chart-entry"></svg></section>
  </div>
</main>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#1b7c83", "#6e7781"];
const PART_COLORS = {compute: "#0969da", all_reduce: "#cf222e", ps_pull: "#9a6700", ps_push: "#8250df",
                     data: "#6e7781", pull_wait: "#9a6700", forward: "#0969da", backward: "#1b7c83",
                     push_optimizer: "#8250df", other: "#bf3989",
                     admitted: "#1a7f37", filtered: "#9a6700", evicted: "#cf222e"};
// Step parts in stacking order: a trainer's phases (fleet_trainer_phase_seconds), else comm ops.
const STEP_PARTS = ["data", "pull_wait", "forward", "backward", "push_optimizer", "other", "compute",
                    "all_reduce", "ps_pull", "ps_push"];
const $ = (id) => document.getElementById(id);

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
  return v.toPrecision(3);
}
function clock(t) { return new Date(t * 1000).toTimeString().slice(0, 8); }
function when(v) { return typeof v === "number" ? clock(v) : (v || "–"); }

function svgEl(parent, tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e);
  return e;
}
function frame(svg) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const w = Math.max(svg.clientWidth || 0, 320), h = Math.max(svg.clientHeight || 0, 180);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  return {w, h, l: 54, r: 12, t: 10, b: 40};
}
function empty(svg, f, msg) {
  svgEl(svg, "text", {x: f.w / 2, y: f.h / 2, "text-anchor": "middle", class: "empty"}, msg);
  svg.dataset.points = "0";
}
function ticks(lo, hi, n) {
  const step = (hi - lo) / n;
  return Array.from({length: n + 1}, (_, i) => lo + i * step);
}
// Legend entries in rows under the plot; grows the bottom margin f.b by the rows it needs.
function legendLayout(f, labels) {
  const out = [];
  let x = f.l, row = 0;
  for (const lab of labels) {
    const w = 24 + lab.length * 6.2;
    if (x + w > f.w && x > f.l) { x = f.l; row += 1; }
    out.push({lab, x, row});
    x += w;
  }
  f.b += 15 * (out.length ? out[out.length - 1].row : 0);
  return out;
}
function legend(svg, f, layout, colors) {
  const rows = layout.length ? layout[layout.length - 1].row : 0;
  layout.forEach(({lab, x, row}, i) => {
    const y = f.h - 3 - 15 * (rows - row);
    svgEl(svg, "rect", {x, y: y - 9, width: 10, height: 10, fill: colors[i]});
    svgEl(svg, "text", {x: x + 14, y}, lab);
  });
}

// lines: {label: [[t, v], ...]} -> one polyline per label, time on x.
function lineChart(svg, lines) {
  const f = frame(svg);
  const labels = Object.keys(lines || {}).filter((k) => lines[k].length);
  const pts = labels.flatMap((k) => lines[k]);
  if (!pts.length) return empty(svg, f, "no data");
  const layout = legendLayout(f, labels.map((lab) => `${lab} (${fmt(lines[lab][lines[lab].length - 1][1])})`));
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const nonneg = y0 >= 0;  // counts, rates, losses: no negative axis
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  if (nonneg && y0 < 0) y0 = 0;
  const X = (t) => f.l + (t - x0) / (x1 - x0) * (f.w - f.l - f.r);
  const Y = (v) => f.t + (1 - (v - y0) / (y1 - y0)) * (f.h - f.t - f.b);
  for (const v of ticks(y0, y1, 4)) {
    svgEl(svg, "line", {x1: f.l, x2: f.w - f.r, y1: Y(v), y2: Y(v), stroke: "#eef1f4"});
    svgEl(svg, "text", {x: f.l - 6, y: Y(v) + 4, "text-anchor": "end"}, fmt(v));
  }
  let prev = "";
  ticks(x0, x1, 3).forEach((t, i) => {
    const anchor = i === 0 ? "start" : (i === 3 ? "end" : "middle"), label = clock(t);
    if (label !== prev) svgEl(svg, "text", {x: X(t), y: f.h - f.b + 14, "text-anchor": anchor}, label);
    prev = label;
  });
  svgEl(svg, "line", {x1: f.l, x2: f.l, y1: f.t, y2: f.h - f.b, stroke: "#c9d1d9"});
  const colors = labels.map((_, i) => COLORS[i % COLORS.length]);
  labels.forEach((lab, i) => {
    const line = lines[lab];
    svgEl(svg, "polyline", {points: line.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" "),
                            fill: "none", stroke: colors[i], "stroke-width": 1.8, "data-label": lab});
    const last = line[line.length - 1];
    svgEl(svg, "circle", {cx: X(last[0]), cy: Y(last[1]), r: 3, fill: colors[i]})
      .appendChild(document.createElementNS(NS, "title")).textContent = `${lab}: ${fmt(last[1])}`;
  });
  legend(svg, f, layout, colors);
  svg.dataset.points = String(pts.length);
}

// rows: [{key, part: value, ...}] -> one horizontal stacked bar per row. share: every bar is
// 100 % wide, each part its share of the row's total (the total, times scale, printed after it
// with unit); else widths are values times scale against the longest bar.
function barChart(svg, rows, parts, scale, share, unit) {
  const f = frame(svg);
  const used = parts.filter((p) => rows.some((r) => (r[p] || 0) > 0));
  if (!rows.length || !used.length) return empty(svg, f, "no data");
  const layout = legendLayout(f, used);
  const total = (r) => used.reduce((s, p) => s + (r[p] || 0) * scale, 0);
  const max = Math.max(...rows.map(total)) || 1;
  const left = 90, bh = Math.min(26, (f.h - f.t - f.b) / rows.length - 6), width = f.w - left - 70;
  rows.forEach((r, i) => {
    const y = f.t + i * (bh + 6), sum = total(r) || 1;
    svgEl(svg, "text", {x: left - 6, y: y + bh / 2 + 4, "text-anchor": "end"}, r.key);
    let x = left;
    for (const p of used) {
      const v = (r[p] || 0) * scale, pct = 100 * v / sum;
      const w = (share ? v / sum : v / max) * width;
      const rect = svgEl(svg, "rect", {x, y, width: Math.max(w, 0), height: bh, fill: PART_COLORS[p] || "#888",
                                       "data-row": r.key, "data-part": p, "data-share": pct.toFixed(2)});
      rect.appendChild(document.createElementNS(NS, "title")).textContent =
        share ? `${r.key} ${p}: ${pct.toFixed(1)}% (${fmt(v)} ${unit})` : `${p}: ${fmt(v)}`;
      x += w;
    }
    svgEl(svg, "text", {x: x + 4, y: y + bh / 2 + 4}, fmt(total(r)) + (unit ? " " + unit : ""));
  });
  legend(svg, f, layout, used.map((p) => PART_COLORS[p] || "#888"));
  svg.dataset.points = String(rows.length * used.length);
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text); else td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}
function badge(state) {
  const b = document.createElement("span");
  b.className = "badge s-" + state;
  b.textContent = state;
  return b;
}

function render(s) {
  const job = s.job || {};
  $("job-name").textContent = job.name || "(no job_state.json yet)";
  const st = $("job-state");
  st.textContent = job.state || "unknown";
  st.className = "badge s-" + (job.state || "unknown");
  $("job-meta").textContent = s.job ? `run ${job.run_id || "?"} · attempt ${job.attempt ?? 0} · ` +
    `restarts ${job.restarts ?? 0}/${job.max_restarts ?? 0} · started ${when(job.started_at)} · ` +
    `updated ${when(job.updated_at)} · ${s.log_dir}` : s.log_dir;
  const la = s.launcher, live = ["starting", "running", "restarting"].includes(job.state);
  $("launcher").textContent = la && live ? "up: " + Object.entries(la.processes_up || {})
    .filter(([, n]) => n > 0).map(([role, n]) => `${fmt(n)} ${role}`).join(", ") : "";
  $("job-error").textContent = s.job_error || "";
  const fail = $("failure");
  fail.hidden = !s.failure_summary;
  $("failure-summary").textContent = s.failure_summary || "";

  const body = $("procs").tBodies[0];
  body.replaceChildren();
  for (const p of s.processes) {
    const tr = document.createElement("tr");
    tr.dataset.key = p.key;
    tr.dataset.state = p.state;
    cell(tr, p.role); cell(tr, String(p.rank)); cell(tr, p.host || "–"); cell(tr, p.pid ?? "–");
    cell(tr, badge(p.state), "state");
    cell(tr, p.signal ? String(p.signal) : (p.exit_code ?? "–"));
    cell(tr, p.restarts ?? "–"); cell(tr, fmt(p.steps)); cell(tr, fmt(p.loss));
    const last = p.last_scrape ? clock(p.last_scrape) : "";
    cell(tr, p.state !== "up" ? (last ? "last " + last : "–")
      : (p.scrape_error ? "unreachable" : (last ? "ok " + last : "–")), "scrape");
    if (p.log_url) {
      const a = document.createElement("a");
      a.href = p.log_url; a.textContent = (p.log || "").split("/").pop() || "log"; a.target = "_blank";
      cell(tr, a, "log");
    } else cell(tr, "–");
    body.appendChild(tr);
  }

  const series = s.series || {};
  lineChart($("chart-loss"), series.loss);
  lineChart($("chart-throughput"), series.throughput);
  barChart($("chart-breakdown"), s.breakdown || [], STEP_PARTS, 1000, true, "ms");

  const hasPs = (s.tables || []).length > 0 || s.processes.some((p) => p.role === "server" || p.role === "heter");
  $("ps").hidden = !hasPs;
  if (hasPs) {
    lineChart($("chart-ps-rows"), series.ps_rows);
    lineChart($("chart-ps-qps"), series.ps_qps);
    const tb = $("tables").tBodies[0];
    tb.replaceChildren();
    for (const t of s.tables) {
      const tr = document.createElement("tr");
      tr.dataset.table = t.table;
      tr.dataset.kind = t.kind || "";
      const graph = t.kind === "graph";
      for (const k of ["table", "servers", "rows", "bytes", "qps", "errors", "admitted", "filtered", "evicted",
                       "nodes", "edges", "samples", "sample_ms"]) {
        const sparseOnly = ["rows", "bytes", "admitted", "filtered", "evicted"].includes(k);
        cell(tr, k === "table" ? t.table + (graph ? " (graph)" : "") : (graph && sparseOnly ? "–" : fmt(t[k])));
      }
      tb.appendChild(tr);
    }
    barChart($("chart-entry"), (s.tables || []).filter((t) => t.kind !== "graph").map((t) => ({...t, key: t.table})),
             ["admitted", "filtered", "evicted"], 1);
  }
}

async function tick() {
  const conn = $("conn");
  try {
    const r = await fetch("/api/state", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    conn.textContent = "live · " + clock(Date.now() / 1000);
    conn.className = "meta";
  } catch (e) {
    conn.textContent = "dashboard server unreachable (" + e.message + ")";
    conn.className = "meta bad";
  } finally {
    setTimeout(tick, 1000);
  }
}
tick();
</script>
</body>
</html>
"""
