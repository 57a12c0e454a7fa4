/* kvlab visualiser. Reads the NDJSON events of POST /viz/api/run (see docs/viz.md) and
   draws them: prompt chips and prefill, decode chips with their latency, the request's KV
   blocks, speculative decoding's accepted and rejected proposals, the paged pool, metrics beside the estimator's prediction, and a what-if replay.
   Plain browser JavaScript, no libraries, no network access beyond this server. */
"use strict";

const COLORS = ["#2463c9", "#d9730d", "#2e9b57", "#b8322a", "#7a4fc0", "#a68a00", "#1f9aa6",
                "#c23a8a"];
const OTHER = "#8d99ab";        // visualiser requests of another tab or run
const FREE = "#e6eaf0";
const FREED_CACHED = "#cdeed8"; // freed, contents still in the prefix cache
const SHARED = "#e0a800";
const REUSED = "#17663a";

const $ = (id) => document.getElementById(id);
const S = {
  options: null,  // GET /viz/api/options
  run: null,      // the current or last run: its start event and per-user state
  pool: null,     // the latest pool record
  selected: 0,    // the user shown in the KV and metrics panels
  abort: null,    // AbortController of the stream in flight
  freed: new Map(),  // block id -> true if freed with its contents kept in the prefix cache
  replay: 0,      // animation frame of the what-if replay
  frame: 0,
};
window.vizState = S;  // for the browser tests and for curious people with devtools

// ---- formatting ------------------------------------------------------------------------

const int = (n) => Math.round(n).toLocaleString("en-US");
const fixed = (x, d) => Number(x).toLocaleString("en-US", {minimumFractionDigits: d,
                                                           maximumFractionDigits: d});
const showToken = (t) => (t.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅");
const mib = (bytes) => fixed(bytes / 1048576, 2) + " MiB";

function seconds(s) {
  if (s < 1) return fixed(s * 1e3, 1) + " ms";
  if (s < 120) return fixed(s, 2) + " s";
  return fixed(s / 60, 1) + " min";
}

function setValue(id, value, text) {
  const el = $(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text;
}

function setStatus(text, error = false) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", error);
}

async function getJSON(url) {
  const resp = await fetch(url);
  const body = await resp.json().catch(() => null);
  if (!resp.ok) throw new Error(body && body.error ? body.error.message : resp.statusText);
  return body;
}

function schedule() {
  if (!S.frame) S.frame = requestAnimationFrame(() => { S.frame = 0; render(); });
}

// ---- start-up --------------------------------------------------------------------------

async function init() {
  $("run").onclick = () => startRun(1);
  $("send-users").onclick = () => startRun(Math.max(2, Number($("users").value) || 2));
  $("users").oninput = () => {
    $("send-users").textContent = `Send ${Math.max(2, Number($("users").value) || 2)} users`;
  };
  $("stop").onclick = () => S.abort && S.abort.abort();
  $("wi-go").onclick = whatIf;
  $("wi-model").onchange = syncQuant;
  window.addEventListener("resize", schedule);
  try {
    S.options = await getJSON("/viz/api/options");
  } catch (e) {
    setStatus(`could not load /viz/api/options: ${e.message}`, true);
    return;
  }
  const o = S.options;
  $("model-line").textContent = `model ${o.model} · context ${int(o.max_model_len)} tokens · ` +
    `KV ${int(o.kv_bytes_per_token)} B/token (${o.kv_dtype}) · blocks of ${o.block_size} ` +
    `tokens · prefix caching ${o.prefix_caching ? "on" : "off"}`;
  $("machine-line").textContent = `predictions for this machine: ${o.this_machine.label}`;
  $("users").max = o.max_users;
  fillSelect($("wi-hw"), o.hardware);
  fillSelect($("wi-model"), o.models);
  fillSelect($("wi-quant"), o.quants);
  syncQuant();
  setStatus("idle: type a prompt and press Run");
  pollPool();
  setInterval(pollPool, 1000);
  render();
}

function fillSelect(sel, rows) {
  sel.innerHTML = "";
  for (const r of rows) sel.add(new Option(r.name, r.key));
}

function syncQuant() {
  const served = $("wi-model").value === "served";
  const file = [...$("wi-quant").options].find((o) => o.value === "file");
  if (file) file.disabled = !served;
  if (served) $("wi-quant").value = "file";
  else if ($("wi-quant").value === "file") $("wi-quant").value = "q4_k_m";
}

async function pollPool() {
  if (S.abort || document.hidden) return;  // a running stream brings its own pool records
  try {
    S.pool = await getJSON("/viz/api/pool");
    schedule();
  } catch (e) { /* the server may be restarting; the next poll will tell */ }
}

// ---- a run -----------------------------------------------------------------------------

function runBody(users) {
  const body = {
    prompt: $("prompt").value, max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    top_k: Number($("top-k").value), users, arrival: $("arrival").value,
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const schema = $("json-schema").value.trim();
  if (schema) {
    try { body.json_schema = JSON.parse(schema); } catch { body.json_schema = schema; }  // 400 says why
  }
  return body;
}

async function startRun(users) {
  if (S.abort) return;
  const ctl = new AbortController();
  S.abort = ctl;
  setRunning(true);
  setStatus(users > 1 ? `sending ${users} users…` : "sending…");
  try {
    const resp = await fetch("/viz/api/run", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(runBody(users)), signal: ctl.signal,
    });
    if (!resp.ok) {
      const body = await resp.json().catch(() => null);
      throw new Error(body && body.error ? body.error.message : `HTTP ${resp.status}`);
    }
    await readLines(resp.body.getReader(), (line) => handle(JSON.parse(line)));
  } catch (e) {
    if (e.name === "AbortError") {
      markStopped();
      setStatus("stopped: the server aborted the requests and freed their blocks");
    }
    else setStatus(e.message, true);
  } finally {
    S.abort = null;
    setRunning(false);
    schedule();
  }
}

async function readLines(reader, onLine) {
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true});
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      if (line.trim()) onLine(line);
    }
  }
  if (buf.trim()) onLine(buf);
}

function setRunning(on) {
  $("run").disabled = on;
  $("send-users").disabled = on;
  $("stop").disabled = !on;
}

function handle(ev) {
  switch (ev.event) {
    case "start": newRun(ev); break;
    case "prefill": case "decode": onToken(ev); break;
    case "verify": onVerify(ev); break;
    case "pool": S.pool = ev; break;
    case "done": onDone(ev); break;
    case "end":
      S.run.ended = true;
      setStatus(`done in ${seconds(ev.elapsed_s)}: ${S.run.users.length} user(s); ` +
                "the blocks are freed, full ones stay in the prefix cache for the next run");
      break;
    case "error": setStatus(ev.message, true); break;
    default: break;  // newer servers may add events: ignore what we do not know
  }
  schedule();
}

function newRun(ev) {
  S.run = {
    start: ev, id: ev.run_id, bs: ev.block_size, bpt: ev.kv_bytes_per_token, ended: false,
    promptKey: "",
    users: ev.request_ids.map((rid, i) => ({
      i, rid, color: COLORS[i % COLORS.length], out: [], first: null, kv: null, done: null,
      itl: [], text: "", lastT: 0, spec: null,
    })),
  };
  S.selected = 0;
  S.pool = ev.pool;
  $("spec-legend").hidden = true;
  buildLanes();
  setStatus(`running: ${ev.users} user(s), prompt of ${ev.prompt.token_ids.length} tokens`);
}

function onToken(ev) {
  const u = S.run.users[ev.user];
  const first = ev.event === "prefill";
  if (first) u.first = ev;
  else u.itl.push([ev.index, ev.itl_ms]);
  u.kv = ev.kv;
  u.text += ev.text_delta;
  u.lastT = ev.t_ms;
  u.out.push(ev);
  const c = chip(ev.token.id, ev.token.text, "out" + (first ? " first" : ""));
  const ms = document.createElement("span");
  ms.className = "ms";
  ms.textContent = first ? `TTFT ${fixed(ev.ttft_ms, 0)}` : `${fixed(ev.itl_ms, 0)} ms`;
  c.append(ms);
  c.title += first ? " · sampled from the prefill pass" : ` · decode step ${ev.index}`;
  if (ev.structure && ev.structure.forced) {
    c.classList.add("forced");
    c.title += " · forced by the structure: appended without sampling, computed as a chunk";
  } else if (ev.structure) {
    c.title += ` · sampled from the ${int(ev.structure.allowed)} tokens the structure allowed`;
  }
  if (ev.proposal === "accepted") {
    c.classList.add("accepted");
    c.title += " · a speculative proposal the model accepted";
  }
  u.lane.chips.append(c);
  for (const [id] of S.freed) if (ev.kv.block_table.includes(id)) S.freed.delete(id);
}

// A verify run: its kept proposals are the accepted chips before the model's own token
// (ev.index); each rejected one is a struck mark beside that token, which took its place.
function onVerify(ev) {
  const u = S.run.users[ev.user];
  u.spec = ev;
  $("spec-legend").hidden = false;
  const marks = [];
  for (let k = 0; k < ev.rejected; k++) {
    const m = document.createElement("span");
    m.className = "rej";
    m.dataset.index = ev.index;
    m.textContent = "✕";
    m.title = `proposal rejected: ${ev.accepted} of ${ev.proposed} kept this step; ` +
              `token ${ev.index} is the model's own`;
    marks.push(m);
  }
  const own = u.lane.chips.querySelectorAll(".chip")[ev.index];
  if (own) own.after(...marks);
  else u.lane.chips.append(...marks);
}

function onDone(ev) {
  const u = S.run.users[ev.user];
  u.done = ev;
  u.kv = ev.kv;
  u.text = ev.text;
  markFreed(ev.kv);
}

function markFreed(kv) {
  const full = Math.floor(kv.tokens / S.run.bs);  // full blocks stay in the prefix cache
  kv.block_table.forEach((id, i) => {
    S.freed.set(id, !!(S.options && S.options.prefix_caching) && i < full);
  });
}

function markStopped() {
  if (!S.run) return;
  S.run.stopped = true;
  for (const u of S.run.users) if (u.kv && !u.done) markFreed(u.kv);
}

// ---- chips and lanes -------------------------------------------------------------------

function chip(id, text, cls) {
  const el = document.createElement("span");
  el.className = "chip " + cls + (/^<[^<>\s]+>$/.test(text) ? " special" : "");
  el.dataset.id = id;
  el.title = `token id ${id}: ${JSON.stringify(text)}`;
  const t = document.createElement("span");
  t.className = "t";
  t.textContent = showToken(text);
  const i = document.createElement("span");
  i.className = "id";
  i.textContent = id;
  el.append(t, i);
  return el;
}

function buildLanes() {
  const box = $("lanes");
  box.innerHTML = "";
  for (const u of S.run.users) {
    const lane = document.createElement("div");
    lane.className = "lane";
    lane.dataset.user = u.i;
    lane.style.setProperty("--c", u.color);
    const head = document.createElement("div");
    head.className = "lane-head";
    const chips = document.createElement("div");
    chips.className = "chips out-chips";
    const text = document.createElement("div");
    text.className = "lane-text";
    lane.append(head, chips, text);
    lane.onclick = () => { S.selected = u.i; schedule(); };
    box.append(lane);
    u.lane = {el: lane, head, chips, text};
  }
}

function laneState(u) {
  if (u.done) return `done (${u.done.finish_reason}) · ${u.done.output_tokens} tokens`;
  if (S.run.stopped) return `stopped · ${u.out.length} tokens`;
  if (u.first) return `decoding · ${u.out.length} tokens`;
  return u.i < 1 || S.run.start.arrival === "together" ? "prefill…" : "waiting to arrive";
}

function renderLanes() {
  for (const u of S.run.users) {
    const cached = u.first && u.first.cached_tokens
      ? ` · <span style="color:${REUSED}">♻ ${u.first.cached_tokens} prompt tokens from the prefix cache</span>`
      : "";
    const spec = u.spec
      ? ` · <span class="spec-rate">proposals: ${int(u.spec.accepted_tokens)} of ` +
        `${int(u.spec.draft_tokens)} accepted (${fixed(100 * u.spec.acceptance_rate, 0)} %)</span>`
      : "";
    u.lane.head.innerHTML = `<b style="color:${u.color}">user ${u.i + 1}</b> · ` +
      `${laneState(u)}${cached}${spec}`;
    u.lane.text.textContent = u.text;
    u.lane.el.classList.toggle("selected", u.i === S.selected && S.run.users.length > 1);
  }
}

function renderPrompt() {
  const r = S.run;
  const u = r.users[S.selected];
  const kv = u.kv;
  const key = [r.id, u.i, !!u.first, kv ? kv.block_table.join(",") : ""].join("|");
  if (key === r.promptKey) return;
  r.promptKey = key;
  const ids = r.start.prompt.token_ids;
  const texts = r.start.prompt.tokens;
  const cached = u.first ? u.first.cached_tokens : 0;
  const box = $("prompt-chips");
  box.innerHTML = "";
  for (let b = 0; b * r.bs < ids.length; b++) {
    const blk = document.createElement("div");
    const reused = u.first && (b + 1) * r.bs <= cached;
    blk.className = "blk" + (reused ? " cached" : "");
    const id = kv && b < kv.block_table.length ? `#${kv.block_table[b]}` : "#?";
    const label = document.createElement("span");
    label.className = "blk-label";
    label.textContent = `block ${id}` + (reused ? " ♻ prefix cache" : "");
    blk.append(label);
    for (let i = b * r.bs; i < Math.min(ids.length, (b + 1) * r.bs); i++) {
      const state = !u.first ? "pending" : i < cached ? "cached" : "computed";
      blk.append(chip(ids[i], texts[i], state));
    }
    box.append(blk);
  }
  const s = $("prefill-summary");
  if (!u.first) {
    s.textContent = `${ids.length} prompt tokens (ids below), waiting for the prefill pass…`;
    return;
  }
  const f = u.first;
  const budget = S.options ? S.options.max_num_batched_tokens : Infinity;
  const passes = Math.ceil(f.computed_tokens / budget);
  const how = passes > 1 ? `${passes} parallel passes (chunked prefill: at most ${budget} ` +
    "tokens a step)" : "one parallel pass";
  s.innerHTML = `<b>${f.prompt_tokens}</b> prompt tokens: ` +
    `<b id="prefill-cached" data-value="${f.cached_tokens}">${f.cached_tokens}</b> served by the ` +
    `prefix cache, <b>${f.computed_tokens}</b> computed in ${how} in ` +
    `<b id="prefill-ms" data-value="${f.prefill_ms}">${fixed(f.prefill_ms, 1)} ms</b>` +
    (f.queue_ms > 0.5 ? ` after ${fixed(f.queue_ms, 1)} ms in the queue` : "") +
    `; ${passes > 1 ? "the last" : "that"} pass also sampled the first output token.`;
}

// ---- the KV cache ----------------------------------------------------------------------

function tableCounts() {
  const counts = new Map();
  for (const q of (S.pool && S.pool.requests) || []) {
    for (const id of q.block_table) counts.set(id, (counts.get(id) || 0) + 1);
  }
  return counts;
}

function renderKV() {
  const r = S.run;
  const u = r.users[S.selected];
  const kv = u.kv || {tokens: 0, bytes: 0, blocks: 0, block_table: [], cached_tokens: 0,
                      cached_blocks: 0};
  const step = `after decode step ${u.out.length - 1}`;
  $("kv-who").textContent = `user ${u.i + 1} · ` + (u.done ? "at finish (its blocks are freed now)"
    : r.stopped ? `stopped ${step} (its blocks are freed now)`
    : u.first ? step : "not scheduled yet");
  setValue("kv-tokens", kv.tokens, int(kv.tokens));
  setValue("kv-bytes", kv.bytes, int(kv.bytes) + " B");
  $("kv-bytes-how").textContent = `= ${int(kv.tokens)} tokens × ${int(r.bpt)} B/token ` +
    `(${mib(kv.bytes)})`;
  setValue("kv-blocks", kv.blocks, int(kv.blocks));
  const total = S.pool ? S.pool.blocks_total : 0;
  const slack = kv.blocks * r.bs - kv.tokens;
  $("kv-blocks-how").textContent = `of ${int(total)} in the pool; ${r.bs} tokens each, ` +
    `${slack} slot${slack === 1 ? "" : "s"} still free in the last`;
  setValue("kv-cached", kv.cached_tokens, `${int(kv.cached_tokens)} tokens`);
  $("kv-cached-how").textContent = `${kv.cached_blocks} block${kv.cached_blocks === 1 ? "" : "s"}` +
    " reused, not recomputed";
  const counts = tableCounts();
  const box = $("block-table");
  box.innerHTML = "";
  for (let i = 0; i < kv.blocks; i++) {
    const id = kv.block_table[i];
    const fill = Math.min(r.bs, kv.tokens - i * r.bs);
    const el = document.createElement("div");
    const shared = id !== undefined && (counts.get(id) || 0) > 1;
    el.className = "bt" + (i < kv.cached_blocks ? " cached" : "") + (shared ? " shared" : "") +
      (id === undefined ? " unknown" : "");
    el.style.setProperty("--c", u.color);
    el.dataset.block = id === undefined ? "" : id;
    const tag = i < kv.cached_blocks ? "♻ prefix cache" : shared ? `shared ×${counts.get(id)}`
      : `${fill}/${r.bs} tokens`;
    el.innerHTML = `<span class="bid">#${id === undefined ? "?" : id}</span>` +
      `<span class="tag">${tag}</span><span class="fill" style="width:${100 * fill / r.bs}%"></span>`;
    el.title = id === undefined
      ? "allocated and freed within the final step: its id was never observable"
      : `logical block ${i} -> physical block ${id}: token positions ${i * r.bs}..${i * r.bs + fill - 1}`;
    box.append(el);
  }
}

function renderPool() {
  const p = S.pool;
  const canvas = $("pool-canvas");
  if (!p) return;
  const owners = new Map();  // block id -> [{color, reused}]
  let union = 0;
  for (const q of p.requests) {
    const mine = S.run && q.run_id === S.run.id;
    const color = mine ? COLORS[q.user % COLORS.length] : OTHER;
    q.block_table.forEach((id, i) => {
      if (!owners.has(id)) { owners.set(id, []); union++; }
      owners.get(id).push({color, reused: i < q.cached_blocks});
    });
  }
  const other = Math.max(0, p.blocks_used - union);
  $("pool-summary").textContent = `${int(p.blocks_used)} of ${int(p.blocks_total)} blocks in use ` +
    `(${fixed(100 * p.usage, 2)} %) · ${p.running} running, ${p.waiting} waiting · prefix cache ` +
    `served ${int(p.prefix_hits)} of ${int(p.prefix_queries)} prompt tokens looked up` +
    (other ? ` · ${int(other)} blocks held by requests from other clients` : "");
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 560;
  const cell = 13, gap = 3, step = cell + gap;
  const cols = Math.max(8, Math.floor((width - gap) / step));
  let top = 0;
  for (const id of owners.keys()) top = Math.max(top, id + 1);
  for (const id of S.freed.keys()) top = Math.max(top, id + 1);
  const shown = Math.min(p.blocks_total, Math.max(cols * 4, Math.ceil(top / cols) * cols));
  const rows = Math.ceil(shown / cols);
  canvas.height = Math.round((rows * step + gap) * dpr);
  canvas.width = Math.round(width * dpr);
  canvas.style.height = `${rows * step + gap}px`;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  for (let id = 0; id < shown; id++) {
    const x = gap + (id % cols) * step, y = gap + Math.floor(id / cols) * step;
    const own = owners.get(id);
    if (!own) {
      g.fillStyle = S.freed.get(id) ? FREED_CACHED : FREE;
      g.fillRect(x, y, cell, cell);
      continue;
    }
    own.forEach((o, k) => {  // a shared block is split between its owners
      g.fillStyle = o.color;
      g.fillRect(x + (k * cell) / own.length, y, cell / own.length, cell);
    });
    if (own.length > 1) { g.strokeStyle = SHARED; g.lineWidth = 2; g.strokeRect(x, y, cell, cell); }
    if (own.some((o) => o.reused)) { g.fillStyle = "#fff"; g.fillRect(x + 4, y + 4, 5, 5); }
  }
  renderLegend(shown, p.blocks_total);
  renderStates(p.states);
}

// A hybrid model's recurrent layers keep one fixed-size state per sequence, not KV blocks:
// one row (slot) per running sequence, plus rows of states saved for the prefix cache.
function renderStates(st) {
  $("states-panel").hidden = !st;
  if (!st) return;
  const per = S.options && S.options.state_bytes_per_seq;
  $("states-summary").textContent = `${int(st.slots_used)} of ${int(st.slots_total)} slots ` +
    `owned` + (per ? ` · ${mib(per)} of fp32 state each, whatever the length` : "") +
    ` · prefix-cache snapshot rows ${int(st.snapshot_rows_used)} of ` +
    `${int(st.snapshot_rows_total)} used (${int(st.snapshots_saved)} saved states)`;
  const box = $("state-slots");
  box.replaceChildren();
  st.slots.forEach((owner, i) => {
    const el = document.createElement("span");
    el.className = "slot" + (owner ? "" : " free");
    el.textContent = i;
    if (!owner) {
      el.title = `slot ${i}: free`;
    } else if (owner.run_id === null || owner.run_id === undefined) {
      el.style.background = OTHER;
      el.title = `slot ${i}: a request from another client`;
    } else {
      const mine = S.run && owner.run_id === S.run.id;
      el.style.background = mine ? COLORS[owner.user % COLORS.length] : OTHER;
      el.title = `slot ${i}: user ${owner.user + 1}` + (mine ? "" : " of another tab / run");
    }
    box.append(el);
  });
}

function renderLegend(shown, total) {
  const items = [];
  const users = S.run ? S.run.users : [];
  users.forEach((u) => items.push([u.color, `user ${u.i + 1}`]));
  items.push([OTHER, "other tab / run"], ["shared", "shared by 2+ requests"],
             ["reused", "reused from prefix cache"], [FREED_CACHED, "free, kept in prefix cache"],
             [FREE, "free"]);
  $("pool-legend").innerHTML = items.map(([c, text]) => {
    const style = c === "shared" ? `background:#fff;box-shadow:inset 0 0 0 2px ${SHARED}`
      : c === "reused" ? `background:${COLORS[0]};box-shadow:inset 0 0 0 3px ${COLORS[0]},inset 0 0 0 6px #fff`
      : `background:${c}`;
    return `<span><i style="${style}"></i>${text}</span>`;
  }).join("") + (shown < total ? `<span>blocks ${int(shown)}–${int(total - 1)} not drawn</span>` : "");
}

// ---- metrics ---------------------------------------------------------------------------

function measured(u) {
  const m = u.done && u.done.metrics;
  if (m) {
    return {ttft: m.ttft_s * 1e3, prefill: m.prefill_tok_s, decode: m.decode_tok_s,
            itl: m.itl_mean_ms, total: m.total_s, final: true};
  }
  if (!u.first) return null;
  const f = u.first;
  const sum = u.itl.reduce((a, [, ms]) => a + ms, 0);
  return {ttft: f.ttft_ms, prefill: f.prefill_ms > 0 ? f.computed_tokens / (f.prefill_ms / 1e3) : 0,
          decode: sum > 0 ? u.itl.length / (sum / 1e3) : null,
          itl: u.itl.length ? sum / u.itl.length : null, total: u.lastT / 1e3, final: false};
}

function renderMetrics() {
  const u = S.run.users[S.selected];
  const m = measured(u);
  const show = (id, v, text) => setValue(id, v === null || v === undefined ? null : v,
                                         v === null || v === undefined ? "–" : text(v));
  show("m-ttft", m && m.ttft, (v) => `${fixed(v, 1)} ms`);
  show("m-prefill", m && m.prefill, (v) => `${fixed(v, 1)} tok/s`);
  show("m-decode", m && m.decode, (v) => `${fixed(v, 1)} tok/s`);
  show("m-itl", m && m.itl, (v) => `${fixed(v, 1)} ms`);
  show("m-total", m && m.total, (v) => `${fixed(v, 3)} s`);
  const p = (u.done && u.done.prediction) || S.run.start.prediction;
  show("p-ttft", p && p.ttft_s * 1e3, (v) => `${fixed(v, 1)} ms`);
  show("p-prefill", p && p.prefill_tok_s, (v) => `${fixed(v, 1)} tok/s`);
  show("p-decode", p && p.decode_tok_s, (v) => `${fixed(v, 1)} tok/s (${fixed(p.decode_tok_s_range[0], 0)}–` +
                                                `${fixed(p.decode_tok_s_range[1], 0)})`);
  show("p-itl", p && p.itl_ms, (v) => `${fixed(v, 1)} ms`);
  show("p-total", p && p.total_s, (v) => `${fixed(v, 3)} s`);
  const multi = S.run.users.length > 1 ? `user ${u.i + 1} (click a lane to switch) · ` : "";
  $("metrics-who").textContent = multi + (m ? (m.final ? "final record of the run" : "live") : "");
  $("metrics-note").textContent = p ? `Predicted by the roofline estimator for ` +
    `${p.workload.prompt_tokens} prompt tokens to compute, ${p.workload.output_tokens} output ` +
    `tokens, ${p.workload.concurrency} stream(s), on ${p.hardware.source}.` : "";
}

function renderChart() {
  const canvas = $("itl-chart");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 560, h = 170;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  canvas.style.height = `${h}px`;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const L = 44, R = 10, T = 18, B = 24;
  const users = S.run ? S.run.users : [];
  const pred = S.run && ((users[S.selected].done && users[S.selected].done.prediction)
                         || S.run.start.prediction);
  let xmax = 8, ymax = pred ? pred.itl_ms : 10;
  for (const u of users) for (const [i, ms] of u.itl) { xmax = Math.max(xmax, i); ymax = Math.max(ymax, ms); }
  ymax *= 1.15;
  const X = (i) => L + ((i - 1) / Math.max(1, xmax - 1)) * (w - L - R);
  const Y = (ms) => h - B - (ms / ymax) * (h - T - B);
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#5f6b7d";
  g.fillText("inter-token latency per decode step (ms)", L, 11);
  g.strokeStyle = "#dde2ea";
  g.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = (ymax / 4) * k;
    g.beginPath(); g.moveTo(L, Y(v)); g.lineTo(w - R, Y(v)); g.stroke();
    g.fillText(fixed(v, 0), 6, Y(v) + 4);
  }
  g.fillText("step 1", L, h - 6);
  g.fillText(`step ${xmax}`, w - R - 42, h - 6);
  if (pred) {
    g.setLineDash([5, 4]);
    g.strokeStyle = "#7a4fc0";
    g.beginPath(); g.moveTo(L, Y(pred.itl_ms)); g.lineTo(w - R, Y(pred.itl_ms)); g.stroke();
    g.setLineDash([]);
    g.fillStyle = "#7a4fc0";
    g.fillText(`predicted ${fixed(pred.itl_ms, 1)} ms`, w - R - 120, Y(pred.itl_ms) - 4);
  }
  for (const u of users) {
    if (!u.itl.length) continue;
    g.strokeStyle = u.color;
    g.fillStyle = u.color;
    g.lineWidth = u.i === S.selected ? 2 : 1;
    g.beginPath();
    u.itl.forEach(([i, ms], k) => (k ? g.lineTo(X(i), Y(ms)) : g.moveTo(X(i), Y(ms))));
    g.stroke();
    for (const [i, ms] of u.itl) g.fillRect(X(i) - 1.5, Y(ms) - 1.5, 3, 3);
  }
}

function render() {
  if (S.run) {
    renderLanes();
    renderPrompt();
    renderKV();
    renderMetrics();
  }
  renderPool();
  renderChart();
}

// ---- what if ---------------------------------------------------------------------------

async function whatIf() {
  const last = S.run && S.run.users[0];
  const q = new URLSearchParams({hardware: $("wi-hw").value, model: $("wi-model").value,
                                 quant: $("wi-quant").value});
  if (S.run) q.set("prompt_tokens", S.run.start.prompt.token_ids.length);
  else q.set("prompt", $("prompt").value || " ");
  q.set("output_tokens", last && last.done ? Math.max(1, last.done.output_tokens)
                                           : Number($("max-tokens").value) || 32);
  let p;
  try {
    p = await getJSON(`/viz/api/estimate?${q}`);
  } catch (e) {
    $("wi-results").textContent = `no prediction: ${e.message}`;
    return;
  }
  showPrediction(p);
  replay(p, Number($("wi-pace").value));
}

function showPrediction(p) {
  const [lo, hi] = p.decode_tok_s_range;
  const [tlo, thi] = p.total_s_range;
  const fit = p.fits === null ? "memory size unknown"
    : p.fits ? `fits: needs ${fixed(p.memory_needed_gib, 1)} GiB`
    : `does not fit: needs ${fixed(p.memory_needed_gib, 1)} GiB`;
  const mem = p.hardware.memory_gib ? ` of ${fixed(p.hardware.memory_gib, 0)} GiB` : "";
  $("wi-results").innerHTML =
    `<div class="note">${esc(p.model.name)} · ${fixed(p.model.bits_per_param, 2)} bits/param, ` +
    `${fixed(p.model.weight_bytes / 1e9, 2)} GB of weights · on ${esc(p.hardware.name)} ` +
    `(${fixed(p.hardware.bandwidth_gbs, 0)} GB/s, ${fixed(p.hardware.tflops, 1)} TFLOPS ` +
    `${p.hardware.compute_dtype}) · prompt ${p.workload.prompt_tokens}, output ` +
    `${p.workload.output_tokens} tokens, KV ${p.workload.kv_dtype}</div>` +
    `<div class="wi-cards">` +
    `<div><span class="k">TTFT</span><b id="wi-ttft" data-value="${p.ttft_s}">${seconds(p.ttft_s)}</b>` +
    `<small>${fixed(p.prefill_tok_s, 0)} tok/s prefill, ${p.prefill_bound}-bound</small></div>` +
    `<div><span class="k">decode</span><b id="wi-decode" data-value="${p.decode_tok_s}">${fixed(p.decode_tok_s, 1)} tok/s</b>` +
    `<small>${fixed(lo, 1)}–${fixed(hi, 1)}; ${fixed(p.itl_ms, 1)} ms/token, ${p.decode_bound}-bound</small></div>` +
    `<div><span class="k">response time</span><b id="wi-total" data-value="${p.total_s}">${seconds(p.total_s)}</b>` +
    `<small>${seconds(tlo)}–${seconds(thi)}</small></div>` +
    `<div class="${p.fits === false ? "nofit" : ""}"><span class="k">memory</span>` +
    `<b>${p.fits === false ? "✗" : p.fits ? "✓" : "?"}</b><small>${fit}${mem}</small></div></div>`;
}

function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}

function replay(p, pace) {
  cancelAnimationFrame(S.replay);
  const box = $("wi-replay");
  const last = S.run && S.run.users[0];
  const tokens = last && last.out.length ? last.out.map((e) => e.token) : null;
  const n = p.workload.output_tokens;
  box.innerHTML = `<div class="cap">PREDICTED pace on ${esc(p.hardware.name)}` +
    `${pace !== 1 ? ` (shown ${fixed(1 / pace, 0)}× slower)` : ""}: a simulation of the estimate, ` +
    `not a measurement</div><div class="summary" id="wi-clock"></div>` +
    `<div class="bar"><div id="wi-bar"></div></div><div class="chips" id="wi-chips"></div>`;
  const chips = $("wi-chips");
  const t0 = performance.now();
  let shown = 0;
  const tick = (now) => {
    const t = ((now - t0) / 1e3) * pace;  // predicted seconds elapsed
    const prefill = Math.min(1, t / p.ttft_s);
    $("wi-bar").style.width = `${100 * prefill}%`;
    const due = t < p.ttft_s ? 0 : Math.min(n, 1 + Math.floor((t - p.ttft_s) / (p.itl_ms / 1e3)));
    for (; shown < due; shown++) {
      const tok = tokens && tokens[shown];
      chips.append(tok ? chip(tok.id, tok.text, "ghost") : chip("?", "▪", "ghost"));
    }
    const phase = prefill < 1 ? `prefill of ${p.workload.prompt_tokens} tokens` :
      shown < n ? `decode: ${shown} of ${n} tokens` : "done";
    $("wi-clock").textContent = `t = ${seconds(Math.min(t, p.total_s))} (predicted) · ${phase}`;
    if (shown < n) S.replay = requestAnimationFrame(tick);
  };
  S.replay = requestAnimationFrame(tick);
}

init();
