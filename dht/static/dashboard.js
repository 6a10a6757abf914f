// The p2p-spes dashboard: reads /api/state every few seconds and draws it. No library, no network
// beyond this server. Every value from the run goes into the page as text (textContent), never as markup.
"use strict";

const REFRESH_MS = 3000;
const COLORS = ["#2f81f7", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#0a7b83", "#cf222e", "#6e7781"];
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") { if (v) node.className = v; } else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

const short = (id) => id.slice(-10);
const mb = (b) => ((b || 0) / 1e6).toFixed(1);
const num = (v, d = 3) => (v === null || v === undefined ? "-" : Number(v).toFixed(d));

function table(headers, rows, rowClass) {
  const head = el("tr", {}, ...headers.map((h) => el("th", { class: h.left ? "l" : "" }, h.name)));
  const body = rows.map((r, i) => el("tr", { class: rowClass ? rowClass(i) : "" },
    ...r.map((cell, j) => el("td", { class: headers[j].left ? "l" + (headers[j].mono ? " mono" : "") : "" }, cell))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function replace(id, node) {
  const target = document.getElementById(id);
  target.replaceChildren(node);
}

function renderStatus(state) {
  const box = document.getElementById("status");
  box.className = "status " + state.status;
  const peers = state.snapshot ? state.snapshot.peers.length : 0;
  const text = {
    live: `live: ${peers} peer(s)`,
    connecting: "connecting to the run…",
    unreachable: "cannot reach the run",
    empty: "no peers in this run",
  }[state.status] || state.status;
  box.textContent = state.message ? `${text}: ${state.message}` : text;
  document.getElementById("run-id").textContent = `run ${state.run_id}`;
  document.getElementById("updated").textContent =
    state.updated ? `last read ${new Date(state.updated * 1000).toLocaleTimeString()}` : "not read yet";
}

function renderSummary(snap) {
  const run = snap.run;
  const hashes = run.config_hashes.map((c) => c.hash.slice(0, 16)).join(", ") || "-";
  const cards = [
    ["live peers", run.private_peers ? `${run.peers} (${run.private_peers} private)` : run.peers], ["tokens", run.total_tokens.toLocaleString()],
    ["tokens/s", Math.round(run.tokens_per_s).toLocaleString()],
    ["sent / received MB", `${mb(run.bytes_sent)} / ${mb(run.bytes_received)}`],
    ["model", run.fingerprints.join(", ") || "-"], ["config hash", hashes],
  ];
  replace("run-summary", el("div", { class: "cards" },
    ...cards.map(([k, v]) => el("div", { class: "card" }, el("div", { class: "v" }, v), el("div", { class: "k" }, k)))));
}

function renderCoverage(snap) {
  const peers = snap.peers.map((p) => p.peer_id);
  if (!snap.coverage.length) {
    replace("coverage", el("p", { class: "empty" }, "no experts reported yet"));
    return;
  }
  const headers = [{ name: "expert", left: true }, ...peers.map((p) => ({ name: short(p) })), { name: "holders" }];
  const head = el("tr", {}, ...headers.map((h) => el("th", { class: h.left ? "l" : "" }, h.name)));
  const rows = snap.coverage.map((c) => {
    const cells = peers.map((p) => el("td", { class: c.peers.includes(p) ? "held" : "", title: `${short(p)} ${c.peers.includes(p) ? "trains" : "does not train"} expert ${c.expert}` }, ""));
    const label = c.status === "missing" ? `${c.expert} MISSING` : c.status === "low" ? `${c.expert} LOW` : `${c.expert}`;
    return el("tr", { class: c.status, "data-expert": c.expert },
      el("td", { class: "l expert" }, label), ...cells, el("td", { class: "count" }, c.holders));
  });
  replace("coverage", el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

function renderPeers(snap) {
  if (!snap.peers.length) {
    replace("peers", el("p", { class: "empty" }, "no live peers"));
    return;
  }
  const headers = [{ name: "peer", left: true, mono: true }, { name: "reach", left: true }, { name: "experts", left: true }, { name: "step" },
    { name: "round" }, { name: "loss" }, { name: "tokens/s" }, { name: "sent MB" }, { name: "recv MB" },
    { name: "rounds averaged / adopted / alone / failed" }, { name: "last seen s" }, { name: "version", left: true }, { name: "device", left: true }];
  // reach: public peers can be dialled and reduce; private ones (behind a NAT) contribute and fetch only
  const rows = snap.peers.map((p) => [short(p.peer_id), p.reachability || "-", JSON.stringify(p.experts) + (p.residency === "partial" ? " partial" : ""),
    p.step, p.round, num(p.loss), Math.round(p.tokens_per_s || 0), mb(p.bytes_sent), mb(p.bytes_received),
    `${p.rounds_joined} / ${p.rounds_adopted || 0} / ${p.rounds_alone || 0} / ${p.rounds_failed}`, p.last_seen_s === null ? "-" : p.last_seen_s, p.version || "-", p.device || "-"]);
  replace("peers", table(headers, rows));
}

function renderRounds(rounds) {
  if (!rounds.length) {
    replace("rounds", el("p", { class: "empty" }, "no rounds reported yet"));
    document.getElementById("rounds-chart").replaceChildren();
    return;
  }
  const latest = rounds.slice().reverse().slice(0, 30);
  const headers = [{ name: "round" }, { name: "step" }, { name: "participants" }, { name: "averaged / alone / reported" },
    { name: "seconds" }, { name: "sent MB" }, { name: "recv MB" }, { name: "failed groups" }];
  const rows = latest.map((r) => [r.round, r.step, r.participants, `${r.ok} / ${r.alone} / ${r.reported_by.length}`,
    num(r.seconds, 2), mb(r.bytes_sent), mb(r.bytes_received), r.failed_groups]);
  replace("rounds", table(headers, rows, (i) => (latest[i].failed_groups || latest[i].alone ? "bad" : "")));
  const bars = rounds.slice(-60).map((r) => ({ x: r.round, y: r.seconds, bad: r.failed_groups > 0 || r.alone > 0 }));
  replace("rounds-chart", barChart(bars, "seconds per round (red: a group failed or a peer was alone)"));
}

function barChart(bars, title) {
  const W = 760, H = 180, L = 48, B = 24, T = 18;
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const top = Math.max(...bars.map((b) => b.y), 1e-9);
  const w = (W - L - 10) / Math.max(bars.length, 1);
  bars.forEach((b, i) => {
    const h = (H - B - T) * b.y / top;
    root.append(svg("rect", { x: L + i * w + 1, y: H - B - h, width: Math.max(w - 2, 1), height: h, fill: b.bad ? "#d1242f" : "#2f81f7" }));
  });
  axes(root, W, H, L, B, T, [bars[0].x, bars[bars.length - 1].x], [0, top], title, "round");
  return root;
}

function lineChart(series, title, xlabel) {
  const W = 520, H = 240, L = 56, B = 30, T = 18;
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#8c959f" });
    t.textContent = "no data yet";
    root.append(t);
    return root;
  }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => L + (W - L - 10) * (x - x0) / (x1 - x0), Y = (y) => H - B - (H - B - T) * (y - y0) / (y1 - y0);
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    if (s.points.length > 1) {
      root.append(svg("polyline", { points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
    }
    s.points.forEach((p) => root.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2, fill: color })));
    const label = svg("text", { x: W - 12, y: T + 12 + 13 * i, "text-anchor": "end", fill: color, "font-size": 11 });
    label.textContent = s.name;
    root.append(label);
  });
  axes(root, W, H, L, B, T, [x0, x1], [y0, y1], title, xlabel);
  return root;
}

function axes(root, W, H, L, B, T, [x0, x1], [y0, y1], title, xlabel) {
  root.append(svg("line", { x1: L, y1: H - B, x2: W - 10, y2: H - B, stroke: "#57606a" }));
  root.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#57606a" }));
  const texts = [
    [L - 4, H - B, "end", fmt(y0)], [L - 4, T + 8, "end", fmt(y1)], [L, H - 8, "start", fmt(x0)],
    [W - 10, H - 8, "end", fmt(x1)], [(W + L) / 2, H - 8, "middle", xlabel], [L + 4, 12, "start", title],
  ];
  for (const [x, y, anchor, text] of texts) {
    const t = svg("text", { x, y, "text-anchor": anchor, "font-size": 11, fill: "#57606a" });
    t.textContent = text;
    root.append(t);
  }
}

function fmt(v) {
  if (typeof v !== "number") return String(v);
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (Math.abs(v) >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(3);
}

function renderCharts(state) {
  const t0 = Math.min(...Object.values(state.history).flat().map((p) => p.t), ...state.throughput.map((p) => p.t));
  const loss = Object.entries(state.history).map(([peer, points]) => ({
    name: short(peer), points: points.filter((p) => p.loss !== null).map((p) => [p.t - t0, p.loss]),
  }));
  replace("loss-chart", lineChart(loss, "training loss per peer", "seconds since the dashboard started"));
  const tput = [{ name: "all peers", points: state.throughput.map((p) => [p.t - t0, p.tokens_per_s]) }];
  replace("throughput-chart", lineChart(tput, "tokens/s", "seconds since the dashboard started"));
}

function render(state) {
  renderStatus(state);
  if (state.snapshot) {
    renderSummary(state.snapshot);
    renderCoverage(state.snapshot);
    renderPeers(state.snapshot);
  }
  renderRounds(state.rounds);
  renderCharts(state);
}

async function refresh() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`the dashboard answered ${response.status}`);
    render(await response.json());
  } catch (err) {
    const box = document.getElementById("status");
    box.className = "status unreachable";
    box.textContent = `the dashboard server does not answer (${err.message}); is p2p-spes dashboard still running?`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
