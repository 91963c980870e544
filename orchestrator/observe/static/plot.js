// Small canvas plots for the job page: lines over time, and a heat map (ranks by time).
// Hand-written (about 150 lines) rather than a library: none that is packaged offline
// (Debian's libjs-chart.js, dygraphs, d3) draws a heat map without a plugin, and each
// is 100-300 KB where these plots need a few.

export const COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const PAD = { left: 58, right: 10, top: 22, bottom: 22 };
const MARK_COLOURS = { running: "#59a14f", restart: "#e15759", failed: "#e15759", finished: "#4e79a7", cancelled: "#999" };

function setup(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== width * ratio || canvas.height !== height * ratio) {
    canvas.width = width * ratio;
    canvas.height = height * ratio;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

export function clock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}

function frame(ctx, width, height, opts, [y0, y1]) {
  const [x0, x1] = opts.span;
  const plotW = width - PAD.left - PAD.right, plotH = height - PAD.top - PAD.bottom;
  const x = (t) => PAD.left + ((t - x0) / (x1 - x0 || 1)) * plotW;
  const y = (v) => PAD.top + plotH - ((v - y0) / (y1 - y0 || 1)) * plotH;
  ctx.fillStyle = "#222";
  ctx.fillText(opts.title, PAD.left, 14);
  ctx.strokeStyle = "#e3e3e3";
  ctx.fillStyle = "#666";
  ctx.textAlign = "right";
  if (!opts.rows) {
    for (let i = 0; i <= 3; i++) {
      const v = y0 + ((y1 - y0) * i) / 3;
      ctx.beginPath(); ctx.moveTo(PAD.left, y(v)); ctx.lineTo(width - PAD.right, y(v)); ctx.stroke();
      ctx.fillText(opts.format(v), PAD.left - 4, y(v) + 4);
    }
  }
  ctx.textAlign = "center";
  for (let i = 0; i <= 2; i++) {
    const t = x0 + ((x1 - x0) * i) / 2;
    ctx.fillText(clock(t), Math.min(Math.max(x(t), PAD.left + 22), width - 30), height - 6);
  }
  ctx.textAlign = "left";
  for (const e of opts.events || []) {   // findings on the timeline: a band where seen
    if (e.to < x0) continue;
    ctx.fillStyle = e.kind === "slow" ? "rgba(237,201,72,0.25)" : "rgba(225,87,89,0.22)";
    ctx.fillRect(x(Math.max(e.from, x0)), PAD.top, Math.max(2, x(e.to) - x(Math.max(e.from, x0))), plotH);
  }
  return { x, y, plotW, plotH };
}

// The job's events (opts.marks): a line at each, over what was drawn, named on top.
function marks(ctx, width, height, opts) {
  const [x0, x1] = opts.span;
  const plotW = width - PAD.left - PAD.right, plotH = height - PAD.top - PAD.bottom;
  const x = (t) => PAD.left + ((t - x0) / (x1 - x0 || 1)) * plotW;
  let line = 0, free = -Infinity;   // where the last name ends: a close one goes a line lower
  for (const m of opts.marks || []) {
    if (m.at < x0 || m.at > x1) continue;
    ctx.strokeStyle = ctx.fillStyle = MARK_COLOURS[m.kind] || "#666";
    ctx.beginPath(); ctx.moveTo(x(m.at), PAD.top); ctx.lineTo(x(m.at), PAD.top + plotH); ctx.stroke();
    const left = Math.min(x(m.at) + 3, width - 60);
    line = left < free ? line + 1 : 0;
    ctx.fillText(m.kind, left, PAD.top + 10 + 12 * line);
    free = Math.max(line ? free : -Infinity, left + ctx.measureText(m.kind).width + 4);
  }
}

function empty(ctx, width, height, opts) {
  ctx.fillStyle = "#222";
  ctx.fillText(opts.title, PAD.left, 14);
  ctx.fillStyle = "#999";
  ctx.textAlign = "center";
  ctx.fillText(opts.none || "not known yet", width / 2, height / 2);
  ctx.textAlign = "left";
}

// series: [{label, xs, ys}] (ys: numbers or null); opts: {title, span: [t0, t1], format, events}
export function lines(canvas, series, opts) {
  const { ctx, width, height } = setup(canvas);
  let hi = -Infinity, lo = Infinity;
  for (const s of series) for (const v of s.ys) if (v !== null) { hi = Math.max(hi, v); lo = Math.min(lo, v); }
  if (hi === -Infinity) return empty(ctx, width, height, opts);
  lo = Math.min(0, lo); hi = hi === lo ? lo + 1 : hi * 1.08;
  const { x, y } = frame(ctx, width, height, opts, [lo, hi]);
  series.forEach((s, i) => {
    ctx.strokeStyle = COLOURS[i % COLOURS.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    s.xs.forEach((t, j) => {
      const v = s.ys[j];
      if (v === null || t < opts.span[0]) { drawing = false; return; }
      if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      drawing = true;
    });
    ctx.stroke();
  });
  ctx.lineWidth = 1;
  marks(ctx, width, height, opts);
  if (series.length <= 8) {   // a legend where it fits
    let at = width - PAD.right;
    ctx.textAlign = "right";
    for (let i = series.length - 1; i >= 0; i--) {
      ctx.fillStyle = COLOURS[i % COLOURS.length];
      ctx.fillText(series[i].label, at, 14);
      at -= ctx.measureText(series[i].label).width + 10;
    }
    ctx.textAlign = "left";
  }
}

function heat(f) {   // 0..1 -> pale yellow to dark red
  const r = Math.round(255 - 90 * f), g = Math.round(245 - 215 * f), b = Math.round(200 - 170 * f);
  return `rgb(${r},${g},${b})`;
}

// rows: [{label, xs, ys}] one per rank, top to bottom; cells coloured by value
export function heatmap(canvas, rows, opts) {
  const { ctx, width, height } = setup(canvas);
  let hi = -Infinity, lo = Infinity;
  for (const r of rows) for (const v of r.ys) if (v !== null) { hi = Math.max(hi, v); lo = Math.min(lo, v); }
  if (hi === -Infinity) return empty(ctx, width, height, opts);
  const { x, plotH } = frame(ctx, width, height, { ...opts, rows: true }, [0, 1]);
  const h = plotH / rows.length;
  rows.forEach((r, i) => {
    const top = PAD.top + i * h;
    r.xs.forEach((t, j) => {
      const v = r.ys[j];
      if (v === null || t < opts.span[0]) return;
      const next = j + 1 < r.xs.length ? r.xs[j + 1] : t + 1;
      ctx.fillStyle = heat(hi > lo ? (v - lo) / (hi - lo) : 0);
      ctx.fillRect(x(t), top, Math.max(1, x(next) - x(t)), Math.max(1, h));
    });
    if (h >= 10 || i % Math.ceil(10 / h) === 0) {
      ctx.fillStyle = "#666";
      ctx.textAlign = "right";
      ctx.fillText(r.label, PAD.left - 4, top + Math.min(h, 12) - 1);
      ctx.textAlign = "left";
    }
  });
  marks(ctx, width, height, opts);
  ctx.fillStyle = "#666";
  ctx.textAlign = "right";
  ctx.fillText(`${opts.format(lo)} .. ${opts.format(hi)}`, width - PAD.right, 14);
  ctx.textAlign = "left";
}
