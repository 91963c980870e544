// The job page: the list of jobs, and a job's rank table, plots, output, logs and stacks.
// Everything from the cluster is put in the page as text (textContent), never as HTML.
import { lines, heatmap, clock } from "./plot.js";

const HEAT_FROM_RANKS = 16;   // from this many ranks, step time is a heat map, not lines
const KEEP_S = 600;           // the plots show the newest ten minutes
const $ = (id) => document.getElementById(id);
let current = null;           // the job shown: {id, timers, processes, output cursor, events}

async function ask(path) {
  const answer = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  $("error").textContent = "";
  return body;
}

function failed(error) { $("error").textContent = String(error.message || error); }

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function cell(row, text, cls) { row.appendChild(el("td", text, cls)); }

const fixed = (v, digits) => (v === null || v === undefined ? "" : Number(v).toFixed(digits));
function bytes(mb) {
  if (mb === null || mb === undefined) return "";
  return mb >= 1024 ? `${(mb / 1024).toFixed(1)} GiB` : `${mb.toFixed(0)} MiB`;
}
function seconds(s) {
  if (s === null || s === undefined) return "";
  return s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
}
const jobAddress = (id) => `/api/%s?job=${encodeURIComponent(id)}`;
const api = (what, id, more = "") => jobAddress(id).replace("%s", what) + more;

// The list of jobs.
async function showJobs() {
  const listing = await ask("/api/jobs");
  $("source").textContent = listing.title;
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  for (const job of listing.jobs) {
    const row = el("tr");
    const link = el("a", job.name);
    link.href = `#job=${encodeURIComponent(job.id)}`;
    const first = el("td");
    first.appendChild(link);
    if (job.id !== job.name) first.appendChild(el("span", ` ${job.id}`, "muted"));
    row.appendChild(first);
    cell(row, job.state);
    cell(row, job.ranks, "num");
    cell(row, (job.nodes || []).join(", "));
    cell(row, job.user || "");
    cell(row, job.started ? new Date(job.started * 1000).toLocaleString() : "");
    body.appendChild(row);
  }
  $("no-jobs").hidden = listing.jobs.length > 0;
  const pools = listing.pools || [];
  $("pools").hidden = $("pools-title").hidden = pools.length === 0;
  const poolBody = $("pools").querySelector("tbody");
  poolBody.replaceChildren();
  for (const pool of pools) {
    const row = el("tr");
    cell(row, pool.id);
    cell(row, pool.name);
    cell(row, pool.ranks, "num");
    cell(row, Object.entries(pool.holds || {}).map(([k, v]) => `${k} ${v}`).join(", "));
    cell(row, pool.idle_s === null ? "" : `${Math.round(pool.idle_s)} s of ${Math.round(pool.idle_timeout)} s`);
    poolBody.appendChild(row);
  }
}

// A job: its table every second, its output every second, its numbers every two.
function mark(td, text, cls) { td.appendChild(el("span", text, `mark ${cls}`)); }

function rankRow(rank) {   // made once per rank, then updated in place
  let row = current.rows.get(rank);
  if (row) return row;
  row = el("tr");
  row.dataset.rank = rank;
  cell(row, `r${rank}`);
  cell(row, "");
  for (const cls of ["", "", "num", "num step", "num", "num", "num", "num", "num", "num"]) cell(row, "", cls);
  cell(row, "", "line");
  const actions = el("td");
  const output = el("button", "output");
  output.dataset.action = "log";
  output.addEventListener("click", () => showLog(rank).catch(failed));
  const stacks = el("button", "stacks");
  stacks.dataset.action = "stacks";
  stacks.addEventListener("click", () => showStacks(rank).catch(failed));
  actions.append(output, " ", stacks);
  row.appendChild(actions);
  current.rows.set(rank, row);
  return row;
}

function drawTable(table) {
  $("job-name").textContent = table.name;
  $("job-state").textContent = table.state;
  $("job-state").className = `badge ${table.state}`;
  $("job-restarts").textContent = table.restarts ? `restarted ${table.restarts}x` : "";
  $("cause").hidden = !table.cause;
  $("cause").textContent = table.cause ? `root cause: ${table.cause}` : "";
  const findings = $("findings");
  findings.replaceChildren();
  for (const [text, bad] of [[table.waiting_for, false], [table.stopped, true], [table.stall, true], [table.slow, false]]) {
    if (text) findings.appendChild(el("div", text, bad ? "finding bad" : "finding"));
  }
  for (const e of table.events) {   // each restarted attempt's root cause, with its time
    if (e.kind === "restart") findings.appendChild(el("div", `${clock(e.at)} attempt failed, restarted: ${e.text}`, "finding bad"));
  }
  current.marks = table.events;   // on the timeline: running, restarts, the end
  const body = $("ranks").querySelector("tbody");
  const now = table.at;
  for (const r of table.rows) {
    const row = rankRow(r.rank);
    row.className = [r.root_cause && "root", r.stalled && "stalled", r.stopped && "stopped", r.slow && "slow"].filter(Boolean).join(" ");
    const cells = row.cells;
    cells[1].replaceChildren(r.state);
    if (r.root_cause) mark(cells[1], "root cause", "");
    if (r.stopped) mark(cells[1], "stopped", "");
    else if (r.stalled) mark(cells[1], "no progress", "");
    if (r.slow) mark(cells[1], "slow", "slow");
    const texts = [r.node, r.host, r.pid ?? "", r.step ?? "", seconds(r.step_s), fixed(r.samples_per_s, 1),
      r.cpu === null || r.cpu === undefined ? "" : `${r.cpu.toFixed(2)} cores`, bytes(r.rss_mb),
      r.gpu_busy === null || r.gpu_busy === undefined ? "" : `${r.gpu_busy}%`, bytes(r.gpu_mb), r.last_line];
    texts.forEach((text, i) => { if (cells[i + 2].textContent !== String(text)) cells[i + 2].textContent = text; });
    cells[12].title = r.last_line;
    body.appendChild(row);   // in the table's order (the root cause first); moved, not made
  }
  // Findings on the timeline: a band from when each was first seen until it went.
  for (const [kind, on] of [["stall", table.rows.some((r) => r.stalled || r.stopped)], ["slow", table.rows.some((r) => r.slow)]]) {
    const open = current.events.find((e) => e.kind === kind && e.open);
    if (on && !open) current.events.push({ kind, from: now, to: now, open: true });
    else if (on) open.to = now;
    else if (open) open.open = false;
  }
}

function takeMetrics(answer) {
  for (const p of answer.processes) {   // a process's readings: its newest taken once
    const key = `${p.node}:${p.pid}`;
    const kept = current.processes.get(key) || { rank: p.rank, columns: {} };
    kept.rank = p.rank;
    const at = kept.columns.at || [];
    const last = at.length ? at[at.length - 1] : -Infinity;
    const fresh = p.detail.at.map((t) => t > last);
    for (const [name, values] of Object.entries(p.detail)) {
      const column = (kept.columns[name] || []).concat(values.filter((_, i) => fresh[i]));
      kept.columns[name] = column.slice(-KEEP_S);
    }
    current.processes.set(key, kept);
  }
  current.since = answer.now - 5;   // readings arrive written a little earlier
  drawPlots(answer.now);
}

function drawPlots(now) {
  const byRank = [...current.processes.values()].sort((a, b) => a.rank - b.rank);
  const span = [now - 60, now];   // at least a minute, at most the newest ten
  for (const p of byRank) if (p.columns.at && p.columns.at.length) span[0] = Math.min(span[0], p.columns.at[0]);
  span[0] = Math.max(span[0], now - KEEP_S);
  const series = (name, scale = 1) => byRank.map((p) => ({
    label: `r${p.rank}`, xs: p.columns.at || [], ys: (p.columns[name] || []).map((v) => (v === null ? null : v * scale)),
  }));
  const opts = (title, format, none) => ({ title, format, span, events: current.events, marks: current.marks, none });
  const step = opts("step time per rank", seconds, "no step yet");
  if (byRank.length >= HEAT_FROM_RANKS) heatmap($("plot-step"), series("step_s"), step);
  else lines($("plot-step"), series("step_s"), step);
  lines($("plot-samples"), series("samples_per_s"), opts("samples per second", (v) => v.toFixed(0), "no samples reported (report(samples=N))"));
  lines($("plot-cpu"), series("cpu"), opts("CPU (cores)", (v) => v.toFixed(1)));
  lines($("plot-memory"), series("rss_mb"), opts("memory", bytes));
  lines($("plot-gpu"), series("gpu_busy"), opts("GPU use (%)", (v) => v.toFixed(0), "no GPU in use"));
  lines($("plot-gpu-memory"), series("gpu_mb"), opts("GPU memory", bytes, "no GPU in use"));
}

function takeOutput(answer) {
  const pre = $("output");
  if (answer.source !== current.source) { pre.replaceChildren(); current.source = answer.source; }
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  for (const line of answer.lines) pre.appendChild(el("div", line.text, line.stream === "stderr" ? "stderr" : ""));
  while (pre.childNodes.length > 2000) pre.firstChild.remove();
  current.after = answer.next;
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

function openPanel(title, body) {
  $("panel-title").textContent = title;
  $("panel-body").replaceChildren(...body);
  if (!$("panel").open) $("panel").showModal();
}

async function showLog(rank) {
  const answer = await ask(api("log", current.id, `&rank=${rank}`));
  openPanel(`rank ${rank}: its whole output`, [el("pre", answer.text || "(nothing written yet)")]);
}

async function showStacks(rank) {
  const answer = await ask(api("stacks", current.id));
  let groups = answer.groups;
  if (rank !== undefined) groups = groups.filter((g) => g.ranks.includes(rank)).map((g) => ({ ...g, ranks: [rank] }));
  const body = [];
  for (const g of groups) {
    body.push(el("h3", g.ranks.length === 1 ? `rank ${g.ranks[0]}` : `${g.ranks.length} ranks: r${g.ranks.join(",")}`));
    body.push(el("pre", g.text));
  }
  if (!body.length) body.push(el("p", "No stacks: the job does not run now.", "muted"));
  openPanel(rank === undefined ? "stacks of all ranks, grouped" : `rank ${rank}: its stacks`, body);
}

function every(seconds, what) {
  const run = () => what().catch(failed);
  run();
  current.timers.push(setInterval(run, seconds * 1000));
}

function showJob(id) {
  current = { id, timers: [], rows: new Map(), processes: new Map(), since: 0, after: 0, source: null, events: [], marks: [] };
  $("output").replaceChildren();
  $("ranks").querySelector("tbody").replaceChildren();
  every(1, async () => drawTable(await ask(api("table", id))));
  every(1, async () => takeOutput(await ask(api("output", id, `&after=${current.after}&source=${current.source || 0}`))));
  every(2, async () => takeMetrics(await ask(api("metrics", id, `&since=${current.since}`))));
}

function route() {
  if (current) current.timers.forEach(clearInterval);
  current = null;
  const id = new URLSearchParams(location.hash.slice(1)).get("job");
  $("jobs-view").hidden = id !== null;
  $("job-view").hidden = id === null;
  if (id === null) {
    showJobs().catch(failed);
    current = { timers: [setInterval(() => showJobs().catch(failed), 2000)] };
  } else {
    showJob(id);
  }
}

$("panel-close").addEventListener("click", () => $("panel").close());
$("all-stacks").addEventListener("click", () => showStacks().catch(failed));
window.addEventListener("hashchange", route);
ask("/api/jobs").then((l) => { $("source").textContent = l.title; }).catch(failed);
route();
