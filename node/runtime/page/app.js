// The status page: polls /status, /rounds and /rewards and draws them; no library, no CDN.
// Everything from the node goes into the DOM as text (textContent), never as markup.
"use strict";

const POLL_MS = 5000;
const LEADERBOARDS = 3;
const STANDINGS = 20;
const SVG = "http://www.w3.org/2000/svg";
let nextPhaseAt = null;
let nextPhaseName = "";
let loading = false;
let again = false;

const $ = (id) => document.getElementById(id);
const short = (id) => (id ? String(id).slice(0, 12) : "—");
const num = (x, digits = 4) => (x === null || x === undefined ? "—" : Number(x).toFixed(digits));

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function card(label, value, id) {
  const box = el("div", null, "card");
  box.append(el("div", label, "label"));
  const v = el("div", value, "value");
  if (id) v.id = id;
  box.append(v);
  return box;
}

// One line on how the network learns (the spec's submission, training and aggregation).
function learningLine(l) {
  if (!l) return "";
  const sent = l.format === "pgrad"
    ? `compressed pseudo-gradients (${l.pgrad.topk} of ${l.pgrad.chunk} entries a chunk, ${l.pgrad.quant}` +
      `${l.pgrad.partitions > 1 ? `, 1/${l.pgrad.partitions} of the chunks` : ""})`
    : "full experts";
  return `${l.experts} experts · ${l.inner_steps} AdamW steps a round ` +
    `(lr ${l.inner_lr}, beta1 ${l.inner_beta1}, batch ${l.batch_size}) · ` +
    `miners send ${sent} · top ${l.top_g} merged, outer lr ${l.outer_lr}, momentum ${l.momentum}, ` +
    `${l.weighting} weights`;
}

function renderGlance(status) {
  $("title").textContent = `tessera ${status.role}`;
  document.title = `tessera ${status.role} ${short(status.node_id)}`;
  $("subtitle").textContent = `node ${short(status.node_id)} on network ${status.network} (${short(status.network_id)})`;
  $("learning").textContent = learningLine(status.learning);
  renderSpec(status.spec);
  const agreement = status.agreement;
  nextPhaseAt = Date.now() + status.next_phase.in_s * 1000;
  nextPhaseName = `${status.next_phase.phase} of round ${status.next_phase.round}`;
  // head_round is null for the base, and for a state older than the rounds the node looks back on.
  const since = status.head_round !== null ? ` (round ${status.head_round})` : status.head === status.base ? " (base)" : "";
  const head = status.head ? `${short(status.head)}${since}` : "unknown";
  const cards = [
    card("round", status.round === null ? "before genesis" : status.round, "glance-round"),
    card("phase", status.phase || "—", "glance-phase"),
    card("next phase", "", "countdown"),
    card("head state", head, "glance-head"),
    card("peers", status.peers, "glance-peers"),
    card("validator agreement", agreement ? `${Math.round(agreement.share * 100)}% (round ${agreement.round})` : "—",
         "glance-agreement"),
  ];
  if (status.me && status.me.length) {
    const last = status.me[status.me.length - 1];
    cards.push(card("my last rank", last.rank === null ? "unranked" : `#${last.rank}`, "glance-my-rank"));
    cards.push(card("my last reward", num(last.reward, 3), "glance-my-reward"));
  }
  $("glance").replaceChildren(...cards);
  const elsewhere = status.key_used_elsewhere;
  $("key-alert").hidden = !elsewhere;
  $("key-alert").textContent = elsewhere ? `Another node is running with this node's key: ${elsewhere.messages} ` +
    `message(s) signed with it reached this node that it did not send (the last a ${elsewhere.last_kind} of ` +
    `round ${elsewhere.last_round}). Stop one of them, or give each its own key.` : "";
  const behind = status.clock_behind;
  $("clock-alert").hidden = !behind;
  $("clock-alert").textContent = behind ? `This node's clock is probably at least ${behind.behind_by_at_least_s} s ` +
    `behind: messages from ${behind.early_validators} validator(s) arrived before their windows opened. Peers judge this ` +
    `node's messages by their clocks; check that this machine keeps time (NTP).` : "";
  const outvoted = status.outvoted;
  $("outvote-alert").hidden = !outvoted;
  $("outvote-alert").textContent = outvoted ? `Outvoted in round ${outvoted.round}: this validator's merge gate ` +
    `adopted the ${outvoted.mine} state, validators holding a majority of weight the ${outvoted.majority} state ` +
    `${short(outvoted.state)}` + (outvoted.gain === null ? "" : ` (here it measured ${Number(outvoted.gain).toPrecision(2)} nats ` +
    `against ours; a change needs a gain whose interval clears ${outvoted.margin} nats)`) +
    `. This node follows the majority's state.` : "";
  const disk = status.disk && (status.disk.low || status.disk.refused) ? status.disk : null;
  $("disk-alert").hidden = !disk;
  $("disk-alert").textContent = disk ? diskText(disk) : "";
  $("protocol-alert").hidden = !status.protocol_alert;
  $("protocol-alert").textContent = status.protocol_alert ? `${status.protocol_alert} (peers on another ` +
    `protocol version are refused).` : "";
  $("version").textContent = `tessera ${status.version} · protocol ${status.protocol}`;
  tick();
}

// The expert group trained now and, once validators signed its successor, when and to what it changes.
function renderSpec(spec) {
  const group = (g) => Object.keys(g).sort((a, b) => a - b).map((l) => `layer ${l}: ${g[l].join(" ")}`).join(" · ");
  $("spec").textContent = spec ? `expert group ${group(spec.group)}` +
    (spec.since_round ? ` (successor spec ${short(spec.id)}, since round ${spec.since_round})` : "") : "";
  const next = spec && spec.successor;
  $("successor").hidden = !next;
  $("successor").textContent = next ? `Expert group changes at round ${next.activation}, in ${duration(next.in_s)}; ` +
    `signed by ${next.signed_by} of ${next.validators} validators` +
    (next.group ? ` (next group: ${group(next.group)}).` : ".") : "";
}

// Seconds as the node's log writes a wait: 2 h 10 min, or 4 min 5 s.
function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h} h ${m} min` : `${m} min ${s % 60} s`;
}

// Bytes as the node's log writes them: 0 B, 812 KiB, 13.4 MiB, 8.0 GiB.
function size(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 ** 2) return `${Math.floor(n / 1024)} KiB`;
  return n < 1024 ** 3 ? `${(n / 1024 ** 2).toFixed(1)} MiB` : `${(n / 1024 ** 3).toFixed(1)} GiB`;
}

function diskText(d) {
  const refused = d.refused ? `A full disk refused a write in round ${d.refused.round} (${d.refused.error}). ` : "";
  return `${refused}The disk of ${d.path} has ${size(d.free_bytes)} free, and the rounds ahead need about ` +
    `${size(d.needed_bytes)}: free space there or move node.data_dir to a larger disk. The node goes on, and ` +
    "catches up once there is room.";
}

function tick() {
  const target = $("countdown");
  if (!target || nextPhaseAt === null) return;
  const s = Math.max(0, Math.round((nextPhaseAt - Date.now()) / 1000));
  target.textContent = `${nextPhaseName} in ${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

function renderChart(rounds, role) {
  const figure = $("loss-chart");
  const points = rounds.filter((r) => r.global_loss !== null && r.global_loss !== undefined);
  if (!points.length) {
    const first = rounds.find((r) => r.base_loss !== null && r.base_loss !== undefined);
    const started = first ? `; round ${first.round} started at ${num(first.base_loss)}` : "";
    // Only validators measure the adopted state at once; any other node reads it from the next round's reports.
    const wait = role === "validator" ? "" : "; a round's point appears once the next round's score reports are in";
    figure.replaceChildren(el("figcaption", `no completed round yet${started}${wait}`, "muted"));
    return;
  }
  const W = 640, H = 220, L = 56, R = 16, T = 14, B = 30;
  const start = rounds.length ? rounds[0].base_loss : null;
  const losses = points.map((p) => p.global_loss);
  const spread = Math.max(...losses) - Math.min(...losses) + 0.05;
  // The starting loss is drawn only when it would not squash the curve into a flat line.
  const base = start !== null && Math.abs(start - Math.max(...losses)) <= 3 * spread ? start : null;
  const values = losses.concat(base === null ? [] : [base]);
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi - lo < 1e-9) { lo -= 0.01; hi += 0.01; }
  const pad = (hi - lo) * 0.1;
  lo -= pad; hi += pad;
  const x = (i) => (points.length === 1 ? L + (W - L - R) / 2 : L + (i * (W - L - R)) / (points.length - 1));
  const y = (v) => T + ((hi - v) * (H - T - B)) / (hi - lo);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "held-out loss by round" });
  chart.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  chart.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  chart.append(svg("text", { x: L - 6, y: y(hi - pad) + 4, "text-anchor": "end" }, num(hi - pad, 3)));
  chart.append(svg("text", { x: L - 6, y: y(lo + pad) + 4, "text-anchor": "end" }, num(lo + pad, 3)));
  if (base !== null) {
    chart.append(svg("line", { x1: L, y1: y(base), x2: W - R, y2: y(base), class: "base" }));
    chart.append(svg("text", { x: W - R, y: y(base) - 4, "text-anchor": "end" }, `start of round ${rounds[0].round}`));
  }
  chart.append(svg("polyline", { class: "line", points: points.map((p, i) => `${x(i)},${y(p.global_loss)}`).join(" ") }));
  points.forEach((p, i) => {
    const dot = svg("circle", { class: "point", cx: x(i), cy: y(p.global_loss), r: 4, "data-round": p.round,
                               "data-loss": p.global_loss });
    dot.append(svg("title", {}, `round ${p.round}: ${num(p.global_loss)}`));
    chart.append(dot);
    chart.append(svg("text", { x: x(i), y: H - B + 16, "text-anchor": "middle" }, p.round));
  });
  const lag = role === "validator" ? "" : "; a round's point appears once the next round's score reports are in";
  const started = base !== null ? "dashed: where it started" : start !== null ? `it started at ${num(start)}` : "";
  figure.replaceChildren(chart, el("figcaption", `after each round (${points.length} completed); ${started}${lag}`, "muted"));
}

function row(cells, attrs = {}) {
  const tr = document.createElement("tr");
  for (const [k, v] of Object.entries(attrs)) tr.setAttribute(k, v);
  for (const [text, cls] of cells) tr.append(el("td", text, cls));
  return tr;
}

function head(names) {
  const tr = document.createElement("tr");
  for (const name of names) tr.append(el("th", name, ["loss", "rank", "reward"].includes(name) ? "num" : ""));
  const thead = document.createElement("thead");
  thead.append(tr);
  return thead;
}

function renderLeaderboards(rounds, me) {
  const shown = rounds.filter((r) => r.miners.length).slice(-LEADERBOARDS).reverse();
  if (!shown.length) {  // none of the rounds the node keeps now had miners: drop the tables of older polls
    $("leaderboards").replaceChildren(el("p", "no scored round yet", "muted"));
    return;
  }
  const tables = shown.map((r) => {
    const table = el("table", null, "leaderboard");
    table.dataset.round = r.round;
    table.append(el("caption", `round ${r.round} · base loss ${num(r.base_loss)}${gateText(r.gate)}${r.source === "public" ? " · from public score reports" : ""}`));
    table.append(head(["miner", "verdict", "loss", "rank", "reward", "reason"]));
    const body = document.createElement("tbody");
    const ordered = [...r.miners].sort((a, b) => (a.rank ?? 1e9) - (b.rank ?? 1e9) || (a.id < b.id ? -1 : 1));
    for (const m of ordered) {
      const tr = row([[short(m.id), "mono miner"], [m.verdict, `verdict-${m.verdict}`], [num(m.loss), "num loss"],
                      [m.rank === null ? "—" : m.rank, "num rank"], [num(m.reward, 3), "num reward"],
                      [m.reason || "", "reason"]], { "data-miner": m.id });
      if (m.id === me) tr.classList.add("self");
      body.append(tr);
    }
    table.append(body);
    const wrap = el("div", null, "scroll");
    wrap.append(table);
    return wrap;
  });
  $("leaderboards").replaceChildren(...tables);
}

// A validator's merge gate: the candidate state it adopted, then every candidate's gate loss (refused ones marked).
function gateText(gate) {
  if (!gate || !Object.keys(gate.losses).length) return "";
  const losses = Object.entries(gate.losses).map(([name, loss]) =>
    `${name.replace("_", " ")} ${num(loss)}${gate.refused.includes(name) ? " (refused)" : ""}`);
  return ` · gate adopted ${gate.adopted.replace("_", " ")} (${losses.join(", ")})`;
}

function renderStandings(rewards) {
  // JSON objects come with sorted keys: order by standing here, best first.
  const entries = Object.entries(rewards.standings || {}).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1))
    .slice(0, STANDINGS);
  const body = document.createElement("tbody");
  if (!entries.length) body.append(row([["no rewards yet", "muted"]]));
  entries.forEach(([miner, standing], i) => body.append(row([[i + 1, "num"], [short(miner), "mono"], [num(standing, 4), "num"]],
                                                            { "data-miner": miner })));
  $("standings").replaceChildren(head(["#", "miner", "standing"]), body);
}

function renderHistory(title, history) {
  $("me").hidden = false;
  $("me-title").textContent = title;
  const validators = [...new Set(history.flatMap((h) => Object.keys(h.scores || {})))].sort();
  const thead = head(["round", "verdict", ...validators.map((v) => `by ${short(v).slice(0, 8)}`), "loss", "rank", "reward", "reason"]);
  const body = document.createElement("tbody");
  for (const h of [...history].reverse()) {
    const scores = validators.map((v) => {
      const s = (h.scores || {})[v];
      return [s ? (s.loss !== null ? num(s.loss) : s.verdict) : "—", "num score"];
    });
    body.append(row([[h.round, "num"], [h.verdict, `verdict-${h.verdict}`], ...scores, [num(h.loss), "num loss"],
                     [h.rank === null ? "—" : h.rank, "num rank"], [num(h.reward, 3), "num reward"],
                     [h.reason || "", "reason"]], { class: "my-round", "data-round": h.round }));
  }
  $("me-table").replaceChildren(thead, body);
}

async function renderMinerPage(status) {
  const wanted = new URLSearchParams(location.hash.slice(1)).get("miner");
  if (status.me) {
    renderHistory(`My results (${short(status.node_id)})`, status.me);
  } else if (wanted && /^[0-9a-f]{64}$/.test(wanted)) {
    const response = await fetch(`/miners/${wanted}`, { cache: "no-store" });
    renderHistory(`Miner ${short(wanted)}`, response.ok ? await response.json() : []);
  } else {
    $("me").hidden = true;
  }
}

// One poll at a time: a node slower than POLL_MS is not sent a new set of requests at every tick. A click while a
// poll is out (`queue`) gets its own as soon as that one is back.
async function refresh(queue = false) {
  if (loading) {
    again = again || queue;
    return;
  }
  loading = true;
  try {
    await load();
  } finally {
    loading = false;
  }
  if (again) {
    again = false;
    refresh();
  }
}

async function load() {
  try {
    const [status, rounds, rewards] = await Promise.all([getJSON("/status"), getJSON("/rounds"), getJSON("/rewards")]);
    renderGlance(status);
    renderChart(rounds, status.role);
    renderLeaderboards(rounds, status.node_id);
    renderStandings(rewards);
    await renderMinerPage(status);
    $("error").hidden = true;
    document.querySelector("main").classList.remove("stale");
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
  } catch (err) {
    $("error").hidden = false;
    $("error").textContent = `cannot reach the node: ${err.message}`;
    // What is still shown is the last answer: dim it and stop the countdown rather than let it look live.
    document.querySelector("main").classList.add("stale");
    nextPhaseAt = null;
    if ($("countdown")) $("countdown").textContent = "—";
  }
}

document.addEventListener("click", (event) => {
  const cell = event.target.closest("tr[data-miner]");
  if (cell) { location.hash = `miner=${cell.dataset.miner}`; refresh(true); }
});
refresh();
setInterval(refresh, POLL_MS);
setInterval(tick, 1000);
