// The dashboard: polls the admin API every second; rates are computed here from counters.
"use strict";
const state = { rin: [], rout: [], mb: [], conns: [], last: null, samples: 0 };
window.lgState = state;
const $ = (id) => document.getElementById(id);
const get = (path) => fetch(path).then((r) => { if (!r.ok) throw new Error(r.status); return r.json(); });
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
const push = (arr, v) => { arr.push(v); if (arr.length > 120) arr.shift(); };

function human(bytes) {
  if (bytes == null) return "–";
  const u = ["B", "kB", "MB", "GB", "TB"]; let i = 0;
  while (bytes >= 1024 && i < u.length - 1) { bytes /= 1024; i++; }
  return `${bytes.toFixed(1)} ${u[i]}`;
}

async function tick() {
  try {
    const o = await get("/api/v1/overview");
    if (state.last) {
      const dt = Math.max(0.001, o.time - state.last.time);
      push(state.rin, (o.messages_in - state.last.messages_in) / dt);
      push(state.rout, (o.messages_out - state.last.messages_out) / dt);
    }
    state.last = o; state.samples++;
    push(state.conns, o.connections);
    push(state.mb, (o.store.bytes || 0) / 1048576);
    $("connections").textContent = o.connections;
    $("rate-in").textContent = Math.round(state.rin.at(-1) ?? 0);
    $("rate-out").textContent = Math.round(state.rout.at(-1) ?? 0);
    $("store-bytes").textContent = human(o.store.bytes);
    $("dispatch-lag").textContent = o.store.dispatch_lag == null ? "store away" : human(o.store.dispatch_lag);
    drawChart($("chart-rates"), [state.rin, state.rout], ["#2b7de9", "#e9822b"]);
    drawChart($("chart-store"), [state.mb, state.conns], ["#3aa76d", "#8a5cd1"]);
    $("status").textContent = "live · " + new Date().toLocaleTimeString();
  } catch (e) {
    $("status").textContent = "API unreachable: " + e.message;
  }
}

async function clients() {
  const q = encodeURIComponent($("client-search").value);
  const page = await get(`/api/v1/clients?limit=200&q=${q}`);
  $("clients").tBodies[0].innerHTML = page.items.map((c) => `<tr data-client="${esc(c.client_id)}">
    <td>${esc(c.client_id)}</td><td>${esc(c.peer)}</td><td>${c.protocol === 5 ? "5.0" : c.protocol === 3 ? "3.1" : "3.1.1"}</td>
    <td>${c.persistent ? "persistent" : "clean"}</td><td>${c.subscriptions}</td><td>${c.inflight}</td>
    <td><button class="kick" data-client="${esc(c.client_id)}">Kick</button></td></tr>`).join("");
}

async function lists() {
  const lag = await get("/api/v1/lag?limit=50");
  $("lag").tBodies[0].innerHTML = lag.items.map((r) => `<tr><td>${esc(r.reader)}</td><td>${esc(r.queue)}</td>
    <td>${r.offset}</td><td>${r.end}</td><td>${r.lag}</td></tr>`).join("");
  const alerts = await get("/api/v1/alerts");
  $("alerts").innerHTML = alerts.items.map((a) => `<li><b>${esc(a.topic)}</b> ${esc(a.body)}</li>`).join("");
  const ret = await get("/api/v1/retained?limit=100");
  $("retained").tBodies[0].innerHTML = ret.items.map((r) => `<tr><td>${esc(r.topic)}</td><td>${r.qos}</td>
    <td>${esc(r.body_base64 ? "(binary)" : r.body)}</td>
    <td><button class="del-retained" data-topic="${esc(r.topic)}">Delete</button></td></tr>`).join("");
}

document.addEventListener("click", async (ev) => {
  const t = ev.target;
  if (t.classList.contains("kick")) {
    await fetch(`/api/v1/clients/${encodeURIComponent(t.dataset.client)}/kick`, { method: "POST" });
    setTimeout(clients, 300);
  } else if (t.classList.contains("del-retained")) {
    await fetch(`/api/v1/retained/${t.dataset.topic}`, { method: "DELETE" });
    lists();
  }
});
$("client-search").addEventListener("input", clients);
tick(); clients(); lists();
setInterval(tick, 1000);
setInterval(clients, 2000);
setInterval(lists, 3000);
