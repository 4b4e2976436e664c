// fleetwave's dashboard (docs/dashboard.md): plain JavaScript, no build step, no other host.
// Pages by the URL's fragment: #/ (strategies), #/strategy/ID, #/step/ID, #/target/NAME,
// #/conductors. Each page reads /v1 with the token kept in this tab's sessionStorage, and
// follows one live stream (server-sent events read with fetch, so that the token goes
// in a header), reconnecting when it is lost.
"use strict";

const TOKEN_KEY = "fleetwave.token";
const TERMINAL = new Set(["complete", "failed", "aborted"]);
const FIXED_COLORS = {
  initial: "#afb8c1", complete: "#1a7f37", failed: "#cf222e", aborted: "#8250df",
};
// in-flight states, in the order a workflow names them
const PALETTE = ["#0969da", "#bf8700", "#1b7c83", "#e16f24", "#6639ba", "#4e8cd6", "#9a6700", "#0e8a9d"];

// when the pages drew what (ms since the page loaded): bench/dashboard_load.py reads it
window.fleetwaveTimes = { firstGrid: null, updates: [] };

const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
};

// ---- time and numbers --------------------------------------------------------------

function when(at) {
  if (at === null || at === undefined) return "";
  const d = new Date(at * 1000);
  return d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}
function span(s) {
  if (s === null || s === undefined) return "";
  s = Math.round(s);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}
function secs(s) {
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${+s.toFixed(1)} s`;
  return span(s);
}

// ---- state colors --------------------------------------------------------------------

const colors = new Map(Object.entries(FIXED_COLORS));
function learnStates(names) {
  for (const n of names || []) {
    if (!colors.has(n)) colors.set(n, PALETTE[(colors.size - 4 + PALETTE.length) % PALETTE.length]);
  }
}
function colorOf(state) {
  learnStates([state]);
  return colors.get(state);
}
const swatch = (state) => el("span", { class: "sw", style: `background:${colorOf(state)}`, "aria-hidden": "true" });

// ---- the token and the API --------------------------------------------------------------

let me = null; // {name, role, may_drive}

function token() { return sessionStorage.getItem(TOKEN_KEY); }

class Unauthorized extends Error {}

async function api(path, opts = {}) {
  const headers = { Authorization: `Bearer ${token()}`, ...(opts.headers || {}) };
  const res = await fetch(path, { ...opts, headers });
  if (res.status === 401) {
    signOut("The token is not valid (unknown, revoked or expired): sign in again.");
    throw new Unauthorized();
  }
  const body = res.headers.get("content-type")?.includes("json") ? await res.json() : await res.text();
  if (!res.ok) {
    const msg = body && body.error ? body.error.message : `HTTP ${res.status}`;
    throw new Error(msg);
  }
  return body;
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  me = null;
  stopStream();
  showLogin(message || "");
}

function showLogin(message) {
  $("#page").replaceChildren();
  $("#login").hidden = false;
  $("#login-error").textContent = message;
  $("#who").textContent = "";
  $("#signout").hidden = true;
  $("#live").textContent = "";
  $("#token").focus();
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const given = $("#token").value.trim();
  if (!given) return;
  sessionStorage.setItem(TOKEN_KEY, given);
  try {
    await start();
  } catch (e) {
    if (!(e instanceof Unauthorized)) showLogin(e.message);
  }
});
$("#signout").addEventListener("click", () => signOut(""));

async function start() {
  me = await api("/v1/me");
  $("#login").hidden = true;
  $("#token").value = "";
  $("#who").textContent = `${me.name} (${me.role})`;
  $("#signout").hidden = false;
  route();
}

// ---- the live stream ------------------------------------------------------------------------

let streamCtl = null; // {abort: AbortController, timer}

function stopStream() {
  if (streamCtl) {
    streamCtl.stopped = true;
    streamCtl.abort.abort();
    clearTimeout(streamCtl.timer);
    streamCtl = null;
  }
}

function setLive(text, lost) {
  const live = $("#live");
  live.textContent = text;
  live.classList.toggle("lost", !!lost);
}

// Follows `path` (server-sent events) until the page changes: each event to onEvent(name,
// data). Lost (the server went, the network dropped): said, and tried again after 1 s,
// 2 s, 4 s, then every 5 s (a server back is found within 5 s; a try costs it little).
function follow(path, onEvent) {
  stopStream();
  const ctl = { abort: new AbortController(), timer: null, stopped: false, wait: 1000 };
  streamCtl = ctl;
  const again = (why) => {
    if (ctl.stopped) return;
    const s = Math.round(ctl.wait / 1000);
    setLive(`Live updates lost (${why}): reconnecting in ${s} s`, true);
    ctl.timer = setTimeout(connect, ctl.wait);
    ctl.wait = Math.min(ctl.wait * 2, 5000);
  };
  async function connect() {
    if (ctl.stopped) return;
    ctl.abort = new AbortController();
    let res;
    try {
      res = await fetch(path, {
        headers: { Authorization: `Bearer ${token()}`, Accept: "text/event-stream" },
        signal: ctl.abort.signal, cache: "no-store",
      });
    } catch (e) {
      again("no answer");
      return;
    }
    if (res.status === 401) { signOut("The token is no longer valid: sign in again."); return; }
    if (!res.ok || !res.body) { again(`HTTP ${res.status}`); return; }
    setLive("Live", false);
    ctl.wait = 1000;
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let name = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event: ")) name = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (!data) continue;
          if (name === "unauthorized") { signOut("The token is no longer valid: sign in again."); return; }
          if (name === "problem") { setLive(`Live, but: ${JSON.parse(data).problem}`, true); continue; }
          setLive(`Live · updated ${new Date().toLocaleTimeString()}`, false);
          onEvent(name, JSON.parse(data));
        }
      }
    } catch (e) {
      if (ctl.stopped) return;
      if (!(e instanceof DOMException)) console.error("live update failed:", e);
    }
    again("the stream ended");
  }
  connect();
}

// ---- the router ------------------------------------------------------------------------------

let leave = null; // the current page's clean-up
// pages shown so far: a page's late callback (an answer that came after the user moved
// on) checks that its page is still the one shown before it acts
let pagesShown = 0;

function route() {
  if (!me) return;
  pagesShown++;
  stopStream();
  if (leave) { leave(); leave = null; }
  hideTip();
  const hash = location.hash || "#/";
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  const page = $("#page");
  page.replaceChildren();
  for (const a of document.querySelectorAll(".top nav a")) a.removeAttribute("aria-current");
  let m;
  if (parts[0] === "strategy" && (m = /^\d+$/.exec(parts[1] || ""))) strategyPage(page, +parts[1]);
  else if (parts[0] === "step" && /^\d+$/.test(parts[1] || "")) stepPage(page, +parts[1]);
  else if (parts[0] === "target" && parts[1]) targetPage(page, parts.slice(1).join("/"));
  else if (parts[0] === "conductors") { $("#nav-conductors").setAttribute("aria-current", "page"); conductorsPage(page); }
  else { $("#nav-strategies").setAttribute("aria-current", "page"); strategiesPage(page); }
}
window.addEventListener("hashchange", route);

// Replaces a container's children, unless they would be the same (`key`): a link that
// has the keyboard's focus keeps it (found again by its href) when the list is redrawn.
function refill(box, key, make) {
  if (key !== undefined && box.dataset.key === key) return;
  if (key !== undefined) box.dataset.key = key;
  const had = box.contains(document.activeElement) ? document.activeElement : null;
  const href = had && had.getAttribute("href");
  box.replaceChildren(...[make()].flat());
  if (href) {
    const again = box.querySelector(`[href="${CSS.escape(href)}"]`);
    if (again) again.focus();
  }
}

function failed(page, e) {
  if (e instanceof Unauthorized) return;
  page.append(el("p", { class: "error", role: "alert", text: e.message }));
}

// ---- widgets ----------------------------------------------------------------------------------

function badge(state) { return el("span", { class: `badge s-${state}`, text: state }); }

function progress(counts, total) {
  const bar = el("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": String(total) });
  let done = 0, left = 0;
  for (const s of ["complete", "failed", "aborted"]) {
    const n = counts[s] || 0;
    if (!n || !total) continue;
    bar.append(el("span", { style: `left:${(100 * left) / total}%;width:${(100 * n) / total}%;background:${colorOf(s)}` }));
    left += n; done += n;
  }
  bar.setAttribute("aria-valuenow", String(done));
  bar.setAttribute("aria-label", `${done} of ${total} steps ended`);
  return bar;
}

function chips(counts) {
  const order = Object.keys(counts).sort((a, b) => rank(a) - rank(b));
  return el("div", { class: "chips" }, order.map((s) => el("span", { class: "chip" }, swatch(s), `${s} ${counts[s]}`)));
}
function rank(state) {
  return state === "initial" ? 0 : TERMINAL.has(state) ? 2 + ["complete", "failed", "aborted"].indexOf(state) : 1;
}

function table(headers, rows, label) {
  return el("div", { class: "scroll" },
    el("table", { "aria-label": label },
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col", class: h.cls || null, text: h.text || h })))),
      el("tbody", {}, rows)));
}

// ---- strategies --------------------------------------------------------------------------------

function strategiesPage(page) {
  page.append(el("h1", { text: "Strategies" }));
  const body = el("div", { id: "strategies" }, el("p", { class: "muted", text: "Loading..." }));
  page.append(body);
  follow("/v1/live", (name, data) => {
    const rows = data.strategies.map((s) => {
      const ended = TERMINAL.has(s.state) || s.state === "deleted";
      const elapsed = s.elapsed_s ?? (ended ? s.updated_at - s.created_at : null);
      return el("tr", { "data-strategy": s.id },
        el("td", {}, el("a", { href: `#/strategy/${s.id}`, text: `#${s.id}` })),
        el("td", { text: s.workflow }),
        el("td", {}, badge(s.state)),
        el("td", {}, progress(s.step_states, s.steps), el("span", { class: "muted", text: `${s.done} / ${s.steps}` })),
        el("td", {}, chips(s.step_states)),
        el("td", { class: "hide-narrow", text: when(s.created_at) }),
        el("td", { class: "num", text: span(elapsed) }),
        el("td", { class: "num", text: s.time_left_estimate_s != null ? span(s.time_left_estimate_s) : "" }));
    });
    refill(body, undefined, () => rows.length
      ? table(["id", "workflow", "state", "progress", "steps by state", { text: "created", cls: "hide-narrow" }, { text: "elapsed", cls: "num" }, { text: "time left", cls: "num" }], rows, "Strategies")
      : el("p", { text: "No strategy yet: 'fleetwave strategy create' makes one." }));
  });
}

// ---- conductors ----------------------------------------------------------------------------------

function conductorsPage(page) {
  page.append(el("h1", { text: "Conductors" }));
  const body = el("div", {}, el("p", { class: "muted", text: "Loading..." }));
  page.append(body);
  follow("/v1/live", (name, data) => {
    const now = data.at;
    const rows = data.conductors.map((c) => el("tr", {},
      el("td", { text: c.id }), el("td", { text: c.host }), el("td", { class: "num", text: c.pid }),
      el("td", {}, badge(c.state)),
      el("td", { class: "num", text: c.strategies }), el("td", { class: "num", text: c.steps }),
      el("td", { text: when(c.started_at) }),
      el("td", { text: `${when(c.heartbeat_at)} (${span(now - c.heartbeat_at)} ago)` })));
    body.replaceChildren(rows.length
      ? table(["id", "host", { text: "pid", cls: "num" }, "state", { text: "strategies", cls: "num" }, { text: "steps held", cls: "num" }, "started", "heartbeat"], rows, "Conductors")
      : el("p", { text: "No conductor has run on this database yet." }));
  });
}

// ---- a strategy ----------------------------------------------------------------------------------

const ACTIONS = [
  { verb: "apply", when: ["initial"], ask: "Apply strategy {id}? Its steps start, as many at once as its max parallel allows." },
  { verb: "pause", when: ["applying", "waiting-approval"], ask: "Pause strategy {id}? No new step starts; steps under way finish their state." },
  { verb: "resume", when: ["paused"], ask: "Resume strategy {id}?" },
  { verb: "approve", when: ["waiting-approval"], ask: "Approve strategy {id}'s next stage?" },
  { verb: "abort", when: ["initial", "applying", "paused", "waiting-approval"], ask: "Abort strategy {id}? Nothing new starts, and it cannot be resumed.", danger: true },
];

// The question being asked: its answer, to give "no" when another question replaces it.
let asking = null;

function confirmThen(text) {
  const dlg = $("#confirm");
  // Asked again before the last answer's close event came (Chrome drops that event when
  // the dialog opens again, as a quick Cancel then click does): the last one was "no",
  // or both questions would hear this one's "yes" and act twice.
  if (asking) asking(false);
  $("#confirm-text").textContent = text;
  dlg.returnValue = "";
  dlg.showModal();
  $("#confirm-no").focus();
  return new Promise((resolve) => {
    const answer = (yes) => {
      dlg.removeEventListener("close", closed);
      if (asking === answer) asking = null;
      resolve(yes);
    };
    const closed = () => { if (!dlg.open) answer(dlg.returnValue === "yes"); }; // (not a stale one)
    asking = answer;
    dlg.addEventListener("close", closed);
  });
}

function strategyPage(page, sid) {
  const title = el("h1", {}, `Strategy #${sid}`);
  const state = el("span", { id: "strategy-state" });
  const summary = el("dl", { class: "summary", id: "summary" });
  const actions = el("div", { class: "actions", id: "actions" });
  const note = el("p", { id: "action-note", role: "status" });
  const legend = el("div", { class: "legend", id: "counts", "aria-label": "Steps by state" });
  const canvas = el("canvas", { id: "grid", tabindex: "0", role: "img", "aria-label": "Fleet grid: one cell per target; arrow keys move, Enter opens the step" });
  const info = el("p", { id: "cell-info", "aria-live": "polite" });
  const through = el("div", { class: "chart" }, el("h3", { text: "Throughput (steps ended and transitions per second)" }));
  const durs = el("div", { class: "chart" }, el("h3", { text: "Time in each state (steps that left it)" }));
  const fails = el("div", { id: "failures" });
  page.append(title, el("p", {}, state), summary, actions, note,
    el("h2", { text: "Fleet" }), legend, el("div", { class: "gridwrap" }, canvas), info,
    el("h2", { text: "Charts" }), el("div", { class: "charts" }, through, durs),
    el("h2", { text: "Latest failures" }), fails);

  const grid = new FleetGrid(canvas, info);
  let current = null;
  leave = () => grid.destroy();

  for (const a of ACTIONS) {
    if (!me.may_drive) break; // a reader sees no buttons
    const b = el("button", { type: "button", id: `act-${a.verb}`, class: a.danger ? "danger" : null, hidden: true, text: a.verb[0].toUpperCase() + a.verb.slice(1) });
    b.addEventListener("click", async () => {
      if (!(await confirmThen(a.ask.replace("{id}", sid)))) return;
      b.disabled = true; // one request at a time from one button
      try {
        const res = await api(`/v1/strategies/${sid}/${a.verb}`, { method: "POST" });
        note.textContent = `${a.verb}: ${res.details || res.state || "done"}`;
        note.className = "";
      } catch (e) {
        if (!(e instanceof Unauthorized)) { note.textContent = `${a.verb}: ${e.message}`; note.className = "error"; }
      } finally {
        b.disabled = false;
      }
    });
    actions.append(b);
  }

  follow(`/v1/strategies/${sid}/live`, (name, data) => {
    const s = data.strategy;
    current = s;
    learnStates(["initial", ...(Array.isArray(s.states) ? s.states : []), "complete", "failed", "aborted"]);
    state.replaceChildren(badge(s.state), " ", el("span", { class: "muted", text: `${s.workflow}, ${s.steps} targets${s.driven_by ? `, ${s.driven_by}` : ""}` }));
    const facts = [
      ["ended", `${s.done} of ${s.steps} (${s.percent_done}%)`],
      ["in flight", s.in_flight],
      ["waiting for callback", s.waiting_for_callback],
      ["max parallel", s.max_parallel],
      ["created", when(s.created_at)],
      ["elapsed", s.elapsed_s != null ? span(s.elapsed_s) : TERMINAL.has(s.state) ? span(s.updated_at - s.created_at) : ""],
      ["time left (estimate)", s.time_left_estimate_s != null ? span(s.time_left_estimate_s) : ""],
      ["details", s.details || ""],
    ];
    if (s.stage_now != null) facts.splice(4, 0, ["stage", String(s.stage_now)]);
    if (Array.isArray(s.approvals) && s.approvals.length) {
      facts.push(["approved", s.approvals.map((a) => `${a.details} (${when(a.at)})`).join("; ")]);
    }
    summary.replaceChildren(...facts.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: v === "" ? "-" : v }))));
    for (const a of ACTIONS) {
      const b = $(`#act-${a.verb}`);
      if (b) b.hidden = !a.when.includes(s.state);
    }
    const counts = s.step_states || {};
    legend.replaceChildren(...Object.keys(counts).sort((a, b) => rank(a) - rank(b)).map((st) =>
      el("span", { class: "chip", "data-state": st }, swatch(st), el("span", { text: st }), " ", el("span", { class: "n", text: counts[st] }))));
    if (name === "full") grid.load(data.grid);
    else grid.change(data.changes);
    const times = window.fleetwaveTimes.updates;
    times.push(performance.now());
    if (times.length > 5000) times.splice(0, 1000);
    drawThroughput(through, data.throughput);
    drawDurations(durs, data.durations);
    refill(fails, JSON.stringify(data.failures), () => data.failures.length
      ? table(["target", "step", "failed in", "at", "details"], data.failures.map((f) => el("tr", {},
        el("td", {}, el("a", { href: `#/target/${encodeURIComponent(f.target)}`, text: f.target })),
        el("td", {}, el("a", { href: `#/step/${f.step}`, class: "failure-link", text: `step ${f.step}` })),
        el("td", { text: f.from }), el("td", { text: when(f.at) }), el("td", { class: "details", text: f.details }))), "Latest failures")
      : el("p", { class: "muted", text: "None." }));
  });
}

// The fleet grid: one cell per step on a canvas (10,000 cells redraw in a few ms; a change
// repaints its cells only), in bands by stage and group, details on hover or focus.
class FleetGrid {
  constructor(canvas, info) {
    this.canvas = canvas;
    this.info = info;
    this.cols = null;
    this.focus = -1;
    this.detail = new Map();
    this.onResize = () => this.layout();
    window.addEventListener("resize", this.onResize);
    canvas.addEventListener("mousemove", (e) => this.hover(e));
    canvas.addEventListener("mouseleave", () => hideTip());
    canvas.addEventListener("click", (e) => { const i = this.at(e); if (i >= 0) location.hash = `#/step/${this.cols.step[i]}`; });
    canvas.addEventListener("keydown", (e) => this.key(e));
    canvas.addEventListener("focus", () => { if (this.focus < 0 && this.cols && this.cols.step.length) this.setFocus(0); });
    canvas.addEventListener("blur", () => { hideTip(); this.paint(this.focus); });
  }
  destroy() { window.removeEventListener("resize", this.onResize); hideTip(); }
  load(cols) {
    this.cols = cols;
    this.layout();
    if (window.fleetwaveTimes.firstGrid === null) window.fleetwaveTimes.firstGrid = performance.now();
  }
  change(changes) {
    if (!this.cols) return;
    for (const [i, state, attempt] of changes) {
      this.cols.state[i] = state;
      this.cols.attempt[i] = attempt;
      this.paint(i);
    }
    if (changes.some((c) => c[0] === this.focus)) this.describe(this.focus);
  }
  layout() {
    if (!this.cols) return;
    const n = this.cols.step.length;
    const width = Math.max(200, this.canvas.parentElement.clientWidth - 14);
    const cell = Math.max(5, Math.min(18, Math.floor(Math.sqrt((width * 320) / Math.max(1, n)))));
    this.cell = cell;
    this.gap = cell >= 8 ? 2 : 1;
    this.perRow = Math.max(1, Math.floor(width / cell));
    this.bands = [];
    let y = 0, i = 0;
    while (i < n) {
      const stage = this.cols.stage[i], group = this.cols.group[i];
      let j = i;
      while (j < n && this.cols.stage[j] === stage && this.cols.group[j] === group) j++;
      const rows = Math.ceil((j - i) / this.perRow);
      this.bands.push({ from: i, to: j, label: `stage ${stage} · ${group} · ${j - i}`, y, top: y + 16 });
      y += 16 + rows * cell + 6;
      i = j;
    }
    const ratio = window.devicePixelRatio || 1;
    this.width = width;
    this.height = Math.max(y, 20);
    this.canvas.width = Math.round(width * ratio);
    this.canvas.height = Math.round(this.height * ratio);
    this.canvas.style.height = `${this.height}px`;
    this.ctx = this.canvas.getContext("2d");
    this.ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    this.draw();
  }
  draw() {
    const ctx = this.ctx;
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, this.width, this.height);
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "top";
    for (const b of this.bands) {
      ctx.fillStyle = "#57606a";
      ctx.fillText(b.label, 0, b.y + 1);
      for (let i = b.from; i < b.to; i++) this.paint(i, true);
    }
    if (this.focus >= 0) this.paint(this.focus);
  }
  where(i) {
    for (const b of this.bands) {
      if (i < b.to) {
        const k = i - b.from;
        return [(k % this.perRow) * this.cell, b.top + Math.floor(k / this.perRow) * this.cell];
      }
    }
    return [0, 0];
  }
  paint(i, bulk) {
    if (i < 0 || !this.ctx) return;
    const [x, y] = this.where(i);
    const c = this.cell, g = this.gap, ctx = this.ctx;
    if (!bulk) { ctx.fillStyle = "#ffffff"; ctx.fillRect(x, y, c, c); }
    ctx.fillStyle = colorOf(this.cols.state[i]);
    ctx.fillRect(x, y, c - g, c - g);
    if (i === this.focus && document.activeElement === this.canvas) {
      ctx.strokeStyle = "#bf3989";
      ctx.lineWidth = 2;
      ctx.strokeRect(x + 1, y + 1, c - g - 2, c - g - 2);
    }
  }
  at(e) {
    if (!this.cols) return -1;
    const r = this.canvas.getBoundingClientRect();
    const x = e.clientX - r.left, y = e.clientY - r.top;
    for (const b of this.bands) {
      if (y >= b.top && y < b.top + Math.ceil((b.to - b.from) / this.perRow) * this.cell) {
        const col = Math.floor(x / this.cell), row = Math.floor((y - b.top) / this.cell);
        if (col >= this.perRow) return -1;
        const i = b.from + row * this.perRow + col;
        return i < b.to ? i : -1;
      }
    }
    return -1;
  }
  text(i) {
    const c = this.cols;
    const d = this.detail.get(c.step[i]);
    const lines = [`${c.target[i]}: ${c.state[i]} (attempt ${c.attempt[i]})`, `stage ${c.stage[i]} · ${c.group[i]} · step ${c.step[i]}`];
    if (d) {
      if (d.started_at) lines.push(`started ${when(d.started_at)}`);
      if (d.finished_at) lines.push(`ended ${when(d.finished_at)} (${secs(d.finished_at - d.started_at)})`);
      if (d.details) lines.push(d.details);
    }
    return lines;
  }
  fetchDetail(i) {
    const step = this.cols.step[i];
    clearTimeout(this.detailTimer);
    this.detailTimer = setTimeout(async () => {
      try {
        const rows = await api(`/v1/strategies/${"" + this.sid()}/steps?target=${encodeURIComponent(this.cols.target[i])}&limit=1`);
        if (rows.items.length) this.detail.set(step, rows.items[0]);
        if (this.shown === i) this.show(i);
      } catch (e) { /* the tip keeps what it has */ }
    }, 200);
  }
  sid() { return /^#\/strategy\/(\d+)/.exec(location.hash)[1]; }
  show(i) {
    this.shown = i;
    const lines = this.text(i);
    if (this.tipAt) showTip(lines, this.tipAt[0], this.tipAt[1]);
    if (i === this.focus) this.info.textContent = lines.join(" · ") + " (Enter opens the step)";
  }
  hover(e) {
    const i = this.at(e);
    if (i < 0) { hideTip(); this.shown = -1; return; }
    this.tipAt = [e.clientX + 14, e.clientY + 14];
    if (i !== this.shown) { this.detail.delete(this.cols.step[i]); this.fetchDetail(i); }
    this.show(i);
  }
  setFocus(i) {
    const was = this.focus;
    this.focus = i;
    if (was >= 0) this.paint(was);
    this.paint(i);
    const [x, y] = this.where(i);
    const r = this.canvas.getBoundingClientRect();
    this.tipAt = [r.left + x + this.cell + 6, r.top + y + this.cell + 6];
    this.fetchDetail(i);
    this.describe(i);
  }
  describe(i) { this.show(i); }
  key(e) {
    if (!this.cols) return;
    const n = this.cols.step.length;
    const moves = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: this.perRow, ArrowUp: -this.perRow, Home: -n, End: n };
    if (e.key in moves) {
      e.preventDefault();
      this.setFocus(Math.max(0, Math.min(n - 1, (this.focus < 0 ? 0 : this.focus) + moves[e.key])));
    } else if (e.key === "Enter" && this.focus >= 0) {
      location.hash = `#/step/${this.cols.step[this.focus]}`;
    } else if (e.key === "Escape") {
      hideTip();
    }
  }
}

function showTip(lines, x, y) {
  const tip = $("#tip");
  tip.replaceChildren(...lines.map((l) => el("div", { text: l })));
  tip.hidden = false;
  const w = tip.offsetWidth, h = tip.offsetHeight;
  tip.style.left = `${Math.max(4, Math.min(x, window.innerWidth - w - 4))}px`;
  tip.style.top = `${Math.max(4, y + h > window.innerHeight ? y - h - 28 : y)}px`;
}
function hideTip() { const t = $("#tip"); if (t) t.hidden = true; }

// ---- small charts (SVG, drawn here) -------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, ...kids) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const k of kids) node.append(k);
  return node;
}

function drawThroughput(box, t) {
  const W = Math.max(240, Math.min(640, box.clientWidth - 16)), H = 120, pad = 28;
  const n = t.ended_per_s.length;
  const top = Math.max(1, ...t.transitions_per_s, ...t.ended_per_s);
  const x = (i) => pad + (n <= 1 ? 0 : (i * (W - pad - 4)) / (n - 1));
  const y = (v) => H - 16 - (v / top) * (H - 26);
  const line = (vals) => vals.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  const last = (vals) => (vals.length ? vals[vals.length - 1] : 0);
  const chart = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `Throughput: now ${last(t.ended_per_s)} steps ended and ${last(t.transitions_per_s)} transitions per second; peak ${top} per second` },
    svg("line", { x1: pad, y1: H - 16, x2: W - 4, y2: H - 16, stroke: "#8c959f" }),
    svg("text", { x: 0, y: 12 }, document.createTextNode(`peak ${+top.toFixed(1)}/s`)),
    svg("text", { x: pad, y: H - 3 }, document.createTextNode(when(t.t0).slice(11))),
    svg("text", { x: W - 70, y: H - 3 }, document.createTextNode(`${t.bucket_s} s a point`)),
    svg("polyline", { points: line(t.transitions_per_s), fill: "none", stroke: "#0969da", "stroke-width": 1.5 }),
    svg("polyline", { points: line(t.ended_per_s), fill: "none", stroke: "#1a7f37", "stroke-width": 2 }));
  const key = el("div", { class: "chips" },
    el("span", { class: "chip" }, el("span", { class: "sw", style: "background:#1a7f37" }), `steps ended ${last(t.ended_per_s)}/s`),
    el("span", { class: "chip" }, el("span", { class: "sw", style: "background:#0969da" }), `transitions ${last(t.transitions_per_s)}/s`));
  box.replaceChildren(box.firstChild, chart, key);
}

function drawDurations(box, d) {
  const edges = d.edges_s;
  const label = (k) => (k < edges.length ? `<= ${secs(edges[k])}` : `> ${secs(edges[edges.length - 1])}`);
  const states = Object.keys(d.states);
  const hists = el("div", { class: "hists" });
  for (const st of states) {
    const { counts, mean_s } = d.states[st];
    const W = 140, H = 60, top = Math.max(1, ...counts), bw = W / counts.length;
    const bars = counts.map((c, k) => svg("rect", { x: (k * bw).toFixed(1), y: (H - 12 - (c / top) * (H - 14)).toFixed(1), width: Math.max(1, bw - 1).toFixed(1), height: ((c / top) * (H - 14)).toFixed(1), fill: colorOf(st) },
      svg("title", {}, document.createTextNode(`${label(k)}: ${c}`))));
    hists.append(el("figure", { style: "margin:0" },
      svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${st}: ${counts.reduce((a, b) => a + b, 0)} left it, mean ${secs(mean_s)}` },
        ...bars, svg("text", { x: 0, y: H - 1 }, document.createTextNode("10 ms")), svg("text", { x: W - 34, y: H - 1 }, document.createTextNode("1 h"))),
      el("figcaption", { class: "muted", style: "font-size:12px", text: `${st}: mean ${secs(mean_s)}` })));
  }
  box.replaceChildren(box.firstChild, states.length ? hists : el("p", { class: "muted", text: "No state has ended yet." }));
}

// ---- a step ---------------------------------------------------------------------------------------

function stepPage(page, id) {
  page.append(el("h1", { text: `Step ${id}` }));
  const body = el("div", {}, el("p", { class: "muted", text: "Loading..." }));
  page.append(body);
  let last = 0, step = null;
  const load = async () => {
    last = Date.now();
    try {
      step = await api(`/v1/steps/${id}`);
    } catch (e) { body.replaceChildren(); failed(body, e); return null; }
    body.replaceChildren(...stepBody(step));
    return step;
  };
  const mine = pagesShown;
  load().then((s) => {
    if (!s || mine !== pagesShown) return; // (gone to another page meanwhile: its stream stays)
    // live: the strategy's stream; the step read again when it moves (at most every 2 s)
    follow(`/v1/strategies/${s.strategy}/live`, () => {
      if (step && !TERMINAL.has(step.state) && Date.now() - last > 2000) load();
    });
  });
}

// " (visit N)" after a state entered more than once (a bounded cycle's), else nothing
function visitOf(v) {
  return v > 1 ? ` (visit ${v})` : "";
}

function stepBody(s) {
  const facts = [
    ["strategy", el("a", { href: `#/strategy/${s.strategy}`, text: `#${s.strategy}` })],
    ["target", el("a", { href: `#/target/${encodeURIComponent(s.target)}`, text: s.target })],
    ["state", badge(s.state)], ["attempt", s.attempt], ["stage", s.stage],
    ["started", when(s.started_at)], ["ended", when(s.finished_at)],
    ["owner", s.owner || ""], ["details", s.details || ""],
  ];
  const out = [el("dl", { class: "summary", id: "step-summary" }, facts.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", {}, v === "" ? "-" : v))))];
  out.push(el("h2", { text: "Journal" }), table(["at", "from", "to", "conductor", { text: "fence", cls: "num" }, "details"], (s.history || []).map((h) => el("tr", {},
    el("td", { text: when(h.at) }), el("td", { text: h.from }), el("td", {}, badge(h.to), visitOf(h.visit)), el("td", { text: h.conductor }),
    el("td", { class: "num", text: h.fence ?? "" }), el("td", { class: "details", text: h.details }))), "Journal"));
  if ((s.attempts || []).length) {
    out.push(el("h2", { text: "Attempts sent" }), table(["at", "state", "attempt", "conductor", "how"], s.attempts.map((a) => el("tr", {},
      el("td", { text: when(a.at) }), el("td", { text: a.state + visitOf(a.visit) }), el("td", { class: "num", text: a.attempt }), el("td", { text: a.conductor }), el("td", { text: a.how }))), "Attempts"));
  }
  out.push(el("h2", { text: "Events" }), (s.events || []).length
    ? table(["at", "kind", "conductor", "details"], s.events.map((e) => el("tr", {},
      el("td", { text: when(e.at) }), el("td", { text: e.kind }), el("td", { text: e.conductor || "" }), el("td", { class: "details", text: e.details }))), "Events")
    : el("p", { class: "muted", text: "None." }));
  out.push(el("h2", { text: "Callbacks" }), (s.callbacks || []).length
    ? table(["received", "state", "kind", "outcome", "reason", "details"], s.callbacks.map((c) => el("tr", {},
      el("td", { text: when(c.received_at) }), el("td", { text: c.state + visitOf(c.visit) }), el("td", { text: c.kind }), el("td", { text: c.outcome || "open" }),
      el("td", { text: c.reason || "" }), el("td", { class: "details", text: c.details || "" }))), "Callbacks")
    : el("p", { class: "muted", text: "None." }));
  return out;
}

// ---- a target ---------------------------------------------------------------------------------------

function targetPage(page, name) {
  page.append(el("h1", { text: `Target ${name}` }));
  const body = el("div", {}, el("p", { class: "muted", text: "Loading..." }));
  page.append(body);
  let last = 0, open = true;
  const load = async () => {
    last = Date.now();
    let t;
    try { t = await api(`/v1/targets/${encodeURIComponent(name)}/timeline`); } catch (e) { body.replaceChildren(); failed(body, e); return; }
    open = t.strategies.some((s) => !TERMINAL.has(s.step_state));
    const parts = [el("p", { class: "muted", text: `group ${t.group || "(none)"}; in ${t.strategies.length} strateg${t.strategies.length === 1 ? "y" : "ies"}` })];
    for (const s of t.strategies.slice().reverse()) {
      const spent = Object.entries(s.time_per_state_s);
      const total = spent.reduce((a, [, v]) => a + v, 0) || 1;
      parts.push(el("h2", {}, el("a", { href: `#/strategy/${s.strategy}`, text: `Strategy #${s.strategy}` }), " ", badge(s.strategy_state), " · ",
        el("a", { href: `#/step/${s.step}`, text: `step ${s.step}` }), " ", badge(s.step_state)));
      parts.push(el("div", { class: "stacked", role: "img", "aria-label": spent.map(([k, v]) => `${k} ${secs(v)}`).join(", ") },
        spent.map(([k, v]) => el("span", { style: `width:${(100 * v) / total}%;background:${colorOf(k)}`, title: `${k}: ${secs(v)}` }))));
      parts.push(el("div", { class: "chips" }, spent.map(([k, v]) => el("span", { class: "chip" }, swatch(k), `${k} ${secs(v)}`))));
      parts.push(table(["at", "from", "to", "conductor", "details"], s.transitions.map((h) => el("tr", {},
        el("td", { text: when(h.at) }), el("td", { text: h.from }), el("td", { text: h.to }), el("td", { text: h.conductor }), el("td", { class: "details", text: h.details }))), `Strategy ${s.strategy} transitions`));
    }
    body.replaceChildren(...parts);
  };
  load();
  follow("/v1/live", () => { if (open && Date.now() - last > 3000) load(); });
}

// ---- start -------------------------------------------------------------------------------------------

if (token()) start().catch((e) => { if (!(e instanceof Unauthorized)) showLogin(e.message); });
else showLogin("");
