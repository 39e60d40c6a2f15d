// rlstream dashboard: draws the server's snapshots (GET /events, server-sent events) on canvases.
// No libraries: two chart kinds (lines, bars) drawn with the 2D canvas API, sized for the
// device pixel ratio. Every snapshot bumps <body data-snapshots>, and each chart records how many
// points it drew in data-points, so a headless browser can check that the page is live.
"use strict";

const PALETTE = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477",
                 "#66aa00", "#b82e2e", "#316395"];
const FONT = '11px system-ui, "DejaVu Sans", sans-serif';
const PAD = { left: 58, right: 12, top: 22, bottom: 30 };

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1);
  return v.toFixed(2);
}
function fmtBytes(v) {  // decimal units, so log-axis ticks (powers of 10) read 1 MB, 10 MB
  if (!isFinite(v) || v <= 0) return "0";
  const u = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (v >= 1000 && i < u.length - 1) { v /= 1000; i++; }
  return (v >= 10 || i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + u[i];
}
function niceTicks(lo, hi, n) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

// A canvas sized to its CSS box at the device pixel ratio, with helpers to map data to pixels.
function surface(canvas) {
  const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = FONT;
  return { ctx, w, h, x0: PAD.left, x1: w - PAD.right, y0: h - PAD.bottom, y1: PAD.top };
}
function empty(canvas, s, text) {
  s.ctx.fillStyle = "#98a2b3"; s.ctx.textAlign = "center";
  s.ctx.fillText(text || "no data yet", s.w / 2, s.h / 2);
  canvas.dataset.points = "0";
}
function legend(s, series) {
  let x = s.x0;
  s.ctx.textAlign = "left"; s.ctx.textBaseline = "middle";
  for (const ser of series) {
    const label = ser.label || ser.name;
    s.ctx.fillStyle = ser.color; s.ctx.fillRect(x, 6, 10, 10);
    s.ctx.fillStyle = "#344054"; s.ctx.fillText(label, x + 14, 11);
    x += 22 + s.ctx.measureText(label).width;
  }
  s.ctx.textBaseline = "alphabetic";
}
function yAxis(s, ticks, ymap, label, yfmt) {
  const ctx = s.ctx;
  ctx.strokeStyle = "#eef0f4"; ctx.fillStyle = "#667085"; ctx.textAlign = "right"; ctx.lineWidth = 1;
  for (const t of ticks) {
    const y = ymap(t);
    ctx.beginPath(); ctx.moveTo(s.x0, y); ctx.lineTo(s.x1, y); ctx.stroke();
    ctx.fillText((yfmt || fmt)(t), s.x0 - 6, y + 4);
  }
  if (label) {
    ctx.save(); ctx.translate(11, (s.y0 + s.y1) / 2); ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "center"; ctx.fillText(label, 0, 0); ctx.restore();
  }
}

// series: [{name, color, points: [[x, y], ...]}]; opts: {xLabel, yLabel, yMin, yMax, logY, yfmt, xfmt,
// xInt (integer x ticks only, e.g. policy versions), emptyText}
function lineChart(canvas, series, opts) {
  opts = opts || {};
  const s = surface(canvas), ctx = s.ctx;
  const pts = series.flatMap(x => x.points.filter(p => p[1] !== null && isFinite(p[1]) && (!opts.logY || p[1] > 0)));
  if (!pts.length) return empty(canvas, s, opts.emptyText);
  let xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  let xlo = Math.min(...xs), xhi = Math.max(...xs);
  if (xlo === xhi) { xlo -= 1; xhi += 1; }
  const tf = opts.logY ? Math.log10 : (v => v);
  let ylo = opts.yMin !== undefined ? opts.yMin : Math.min(0, ...ys);
  let yhi = opts.yMax !== undefined ? opts.yMax : Math.max(...ys);
  if (opts.logY) { ylo = Math.floor(Math.log10(Math.min(...ys))); yhi = Math.ceil(Math.log10(Math.max(...ys))); if (ylo === yhi) yhi += 1; }
  if (yhi <= ylo) yhi = ylo + 1;
  const xmap = x => s.x0 + (x - xlo) / (xhi - xlo) * (s.x1 - s.x0);
  const ymap = y => s.y0 - (tf(y) - ylo) / (yhi - ylo) * (s.y0 - s.y1);
  const yticks = opts.logY ? Array.from({ length: yhi - ylo + 1 }, (_, i) => Math.pow(10, ylo + i))
                           : niceTicks(ylo, yhi, 4);
  yAxis(s, yticks, opts.logY ? ymap : (y => s.y0 - (y - ylo) / (yhi - ylo) * (s.y0 - s.y1)), opts.yLabel, opts.yfmt);
  ctx.fillStyle = "#667085"; ctx.textAlign = "center";
  let xticks = niceTicks(xlo, xhi, 6);
  if (opts.xInt) xticks = [...new Set(xticks.map(Math.round))].filter(t => t >= xlo && t <= xhi);
  for (const t of xticks) ctx.fillText((opts.xfmt || fmt)(t), xmap(t), s.y0 + 14);
  if (opts.xLabel) ctx.fillText(opts.xLabel, (s.x0 + s.x1) / 2, s.h - 3);
  for (const ser of series) {
    const p = ser.points.filter(q => q[1] !== null && isFinite(q[1]) && (!opts.logY || q[1] > 0));
    ctx.strokeStyle = ser.color; ctx.fillStyle = ser.color; ctx.lineWidth = 1.8;
    ctx.beginPath();
    p.forEach((q, i) => (i ? ctx.lineTo(xmap(q[0]), ymap(q[1])) : ctx.moveTo(xmap(q[0]), ymap(q[1]))));
    ctx.stroke();
    if (p.length <= 60) for (const q of p) { ctx.beginPath(); ctx.arc(xmap(q[0]), ymap(q[1]), 2.5, 0, 7); ctx.fill(); }
  }
  legend(s, series);
  canvas.dataset.points = String(pts.length);
}

// categories: [label]; series: [{name, color, values: [v per category]}]; opts: {stacked, yLabel}
function barChart(canvas, categories, series, opts) {
  opts = opts || {};
  const s = surface(canvas), ctx = s.ctx;
  const n = categories.length;
  if (!n) return empty(canvas, s, opts.emptyText);
  const totals = categories.map((_, i) => opts.stacked ? series.reduce((a, x) => a + (x.values[i] || 0), 0)
                                                       : Math.max(0, ...series.map(x => x.values[i] || 0)));
  const yhi = Math.max(1e-9, ...totals) * 1.08, ticks = niceTicks(0, yhi, 4);
  const top = Math.max(yhi, ticks[ticks.length - 1]);
  const ymap = y => s.y0 - y / top * (s.y0 - s.y1);
  yAxis(s, ticks, ymap, opts.yLabel, opts.yfmt);
  const slot = (s.x1 - s.x0) / n, groups = opts.stacked ? 1 : series.length;
  const bw = Math.max(2, Math.min(60, slot * 0.8 / groups));
  ctx.textAlign = "center";
  categories.forEach((cat, i) => {
    let base = 0;
    series.forEach((ser, k) => {
      const v = ser.values[i] || 0;
      const x = s.x0 + slot * i + slot / 2 + (opts.stacked ? -bw / 2 : (k - groups / 2) * bw);
      ctx.fillStyle = ser.color;
      ctx.fillRect(x, ymap(base + v), bw - 1, ymap(base) - ymap(base + v));
      if (opts.stacked) base += v;
    });
    const every = Math.ceil(n / Math.max(1, Math.floor((s.x1 - s.x0) / 70)));
    if (i % every === 0) {
      ctx.fillStyle = "#344054";
      ctx.fillText(String(cat).slice(0, 22), s.x0 + slot * i + slot / 2, s.y0 + 14);
    }
    if (n <= 12) { ctx.fillStyle = "#667085"; ctx.fillText(fmt(totals[i]), s.x0 + slot * i + slot / 2, ymap(totals[i]) - 4); }
  });
  if (series.length > 1 || opts.legend) legend(s, series);
  canvas.dataset.points = String(n);
}

const $ = id => document.getElementById(id);
const color = i => PALETTE[i % PALETTE.length];

function drawRates(snap) {
  const active = Object.entries(snap.streams).filter(([, f]) => f.total > 0);
  lineChart($("chart-rates"), active.map(([name, f], i) => ({
    name, label: `${name} ${fmt(f.rate)}/s (${fmt(f.total)})`, color: color(i),
    points: f.recent.map((c, k) => [k - f.recent.length, c]),
  })), { xLabel: "seconds ago", yLabel: "records/s", xfmt: v => fmt(-v), emptyText: "no records yet" });
}
function drawLag(snap) {
  const roles = Object.keys(snap.lag);
  barChart($("chart-lag"), roles, [{ name: "lag", color: color(0), values: roles.map(r => snap.lag[r].total) }],
           { yLabel: "records behind", emptyText: "no group has committed offsets yet" });
}
function drawVersions(snap) {
  const rows = snap.versions;
  $("success-judge").textContent = snap.success_judge ? `(judge "${snap.success_judge}")` : "";
  const evals = snap.evals || [];
  const k = evals.length ? evals[evals.length - 1].k : "k";
  lineChart($("chart-success"), [
    { name: "success rate (training samples)", color: color(3), points: rows.map(r => [r.version, r.success]) },
    { name: "held-out greedy", color: color(1), points: evals.map(e => [e.version, e.greedy_success]) },
    { name: `held-out pass@${k}`, color: color(2), points: evals.map(e => [e.version, e.pass_at_k]) },
  ], { xLabel: "policy version", yLabel: "passed / judged", yMin: 0, yMax: 1, xInt: true });
  const judges = [...new Set(rows.flatMap(r => Object.keys(r.mean_reward)))].sort();
  lineChart($("chart-reward"), judges.map((j, i) => ({
    name: j, color: color(i), points: rows.map(r => [r.version, r.mean_reward[j] ?? null]),
  })), { xLabel: "behaviour policy version", yLabel: "mean score", xInt: true });
}
function drawAdmission(snap) {
  const st = snap.staleness;
  barChart($("chart-staleness"), st.map(r => r[0]), [
    { name: "admitted", color: color(3), values: st.map(r => r[1]) },
    { name: "rejected", color: color(1), values: st.map(r => r[2]) },
  ], { stacked: true, yLabel: "groups", legend: true });
  const reasons = Object.keys(snap.rejections);
  barChart($("chart-rejections"), reasons, [{ name: "rejected", color: color(1), values: reasons.map(r => snap.rejections[r]) }],
           { yLabel: "groups", emptyText: "no group rejected" });
}
function drawWeights(snap) {
  const w = snap.weights;
  lineChart($("chart-weight-bytes"), [
    { name: "raw (full state)", color: color(5), points: w.map(r => [r.version, r.raw_bytes]) },
    { name: "encoded (on the wire)", color: color(0), points: w.map(r => [r.version, r.encoded_bytes]) },
  ], { xLabel: "policy version", logY: true, yfmt: fmtBytes, xInt: true, emptyText: "no weight manifest yet" });
  const regions = [...new Set(w.flatMap(r => Object.keys(r.first_use_ms)))].sort();
  lineChart($("chart-weight-time"), [
    { name: "publish interval", color: color(2), points: w.map(r => [r.version, r.interval_ms]) },
    ...regions.map((g, i) => ({ name: `first rollout (${g})`, color: color(i + 4),
                                points: w.map(r => [r.version, r.first_use_ms[g] ?? null]) })),
  ], { xLabel: "policy version", yLabel: "ms", xInt: true, emptyText: "no weight manifest yet" });
}
function drawJudges(snap) {
  const names = Object.keys(snap.judges), j = snap.judges;
  barChart($("chart-judges"), names, [
    { name: "p50", color: color(0), values: names.map(n => j[n].p50_ms) },
    { name: "p95", color: color(2), values: names.map(n => j[n].p95_ms) },
    { name: "max", color: color(1), values: names.map(n => j[n].max_ms) },
  ], { yLabel: "ms", emptyText: "no reward yet" });
}
function drawRegions(snap) {
  const names = Object.keys(snap.regions), r = snap.regions;
  barChart($("chart-regions"), names, [{ name: "samples", color: color(0), values: names.map(n => r[n].samples) }],
           { yLabel: "samples", emptyText: "no trajectory yet" });
  $("regions-table").tBodies[0].innerHTML = names.map(n => {
    const x = r[n];
    const cells = [n, fmt(x.samples), fmt(x.rate), fmt(x.mean_generate_ms), fmt(x.mean_weights_wait_ms),
                   x.last_version, x.topics.join(", ")];
    return "<tr>" + cells.map(c => `<td>${String(c).replace(/[&<>]/g, ch => "&#" + ch.charCodeAt(0) + ";")}</td>`).join("") + "</tr>";
  }).join("");
}

function drawCapacity(snap) {
  const c = snap.capacity || {}, names = Object.keys(c), now = snap.now_ms;
  lineChart($("chart-capacity"), names.flatMap((n, i) => [
    { name: `lent (${n})`, color: color(2 * i), points: c[n].history.map(h => [(h[0] - now) / 1000, h[1]]) },
    { name: `serving busy (${n})`, color: color(2 * i + 1), points: c[n].history.map(h => [(h[0] - now) / 1000, h[2]]) },
  ]), { xLabel: "seconds ago", yLabel: "engines", yMin: 0, xfmt: v => fmt(-v),
        emptyText: "no capacity signal (no capacity role runs)" });
  $("capacity-table").tBodies[0].innerHTML = names.map(n => {
    const x = c[n];
    const cells = [n, x.lent, x.engines, x.dedicated, fmt(x.busy_engines), fmt(x.serving_p99_ms), x.guard || "–", x.preempted];
    return "<tr>" + cells.map(v => `<td>${String(v).replace(/[&<>]/g, ch => "&#" + ch.charCodeAt(0) + ";")}</td>`).join("") + "</tr>";
  }).join("");
}

let last = null;
function render(snap) {
  last = snap;
  document.title = `rlstream · ${snap.run}`;
  $("run").textContent = snap.run;
  $("kpi-version").textContent = snap.policy_version >= 0 ? "v" + snap.policy_version : "–";
  $("kpi-samples").textContent = fmt(snap.samples);
  $("kpi-admitted").textContent = fmt(snap.admitted);
  $("kpi-rejected").textContent = fmt(snap.rejected);
  $("kpi-staleness").textContent = fmt(snap.mean_recent_staleness);
  $("kpi-dlq").textContent = fmt(Object.values(snap.dead_letters).reduce((a, b) => a + b, 0));
  $("kpi-refused").textContent = fmt(Object.values(snap.weights_refused || {}).reduce((a, b) => a + b, 0));
  for (const draw of [drawRates, drawLag, drawVersions, drawAdmission, drawWeights, drawJudges, drawRegions, drawCapacity]) {
    try { draw(snap); } catch (e) { console.error(draw.name, e); }
  }
  const st = snap.status || {};
  $("updated").textContent = new Date(snap.now_ms).toLocaleTimeString();
  $("reader").textContent = st.reader || "–";
  $("lagstatus").textContent = st.lag || "–";
  $("records").textContent = fmt(st.records || 0);
  const body = document.body.dataset;
  body.samples = String(snap.samples);
  body.policyVersion = String(snap.policy_version);
}

function connect() {
  const es = new EventSource("/events");
  es.addEventListener("snapshot", ev => {
    $("conn").className = "conn on"; $("conn").textContent = "live";
    render(JSON.parse(ev.data));
    document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots) + 1);
  });
  es.onerror = () => { $("conn").className = "conn off"; $("conn").textContent = "reconnecting…"; };
}
window.addEventListener("resize", () => last && render(last));
connect();
