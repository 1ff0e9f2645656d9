// The dashboard: polls the admin API; rates are computed here from the counters, so the
// server keeps no per-viewer state. window.lgState exposes the series (tests read it).
"use strict";
const state = { rin: [], rout: [], bytes: [], conns: [], lag: [], last: null, samples: 0 };
window.lgState = state;
const $ = (id) => document.getElementById(id);
const get = (path) => fetch(path).then((r) => {
  if (r.status === 401) showLogin();
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
});
// A change (POST/PATCH/DELETE) with a JSON body; throws the server's {"error"} text.
async function send(method, path, body) {
  const r = await fetch(path, { method, headers: { "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body) });
  if (r.status === 401) showLogin();
  const out = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(out.error || `HTTP ${r.status}`);
  return out;
}
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const push = (arr, v) => { arr.push(v); if (arr.length > MAX_POINTS) arr.shift(); };
// A topic in a URL path: each level encoded, the slashes kept (the route takes a path).
const topicPath = (t) => t.split("/").map(encodeURIComponent).join("/");
const time = (secs) => (secs ? new Date(secs * 1000).toLocaleTimeString() : "–");

function human(bytes) {
  if (bytes == null) return "–";
  if (bytes < 1024) return `${Math.round(bytes)} B`;
  const u = ["B", "kB", "MB", "GB", "TB"]; let i = 0;
  while (bytes >= 1024 && i < u.length - 1) { bytes /= 1024; i++; }
  return `${bytes.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function duration(s) {
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : `${m}m ${Math.floor(s % 60)}s`;
}

async function tick() {
  try {
    const o = await get("/api/v1/overview");
    if (state.last) {
      const dt = Math.max(0.001, o.time - state.last.time);
      push(state.rin, Math.max(0, o.messages_in - state.last.messages_in) / dt);
      push(state.rout, Math.max(0, o.messages_out - state.last.messages_out) / dt);
    }
    state.last = o; state.samples++;
    push(state.conns, o.connections);
    push(state.bytes, o.store.bytes || 0);
    push(state.lag, o.store.dispatch_lag || 0);
    $("connections").textContent = o.connections;
    $("sessions").textContent = o.sessions;
    $("subscriptions").textContent = o.subscriptions;
    $("inflight").textContent = o.inflight;
    $("rate-in").textContent = Math.round(state.rin.at(-1) ?? 0);
    $("rate-out").textContent = Math.round(state.rout.at(-1) ?? 0);
    $("store-bytes").textContent = human(o.store.bytes);
    $("dispatch-lag").textContent = o.store.up ? human(o.store.dispatch_lag) : "store away";
    drawChart($("chart-rates"), [state.rin, state.rout], ["#2b7de9", "#e9822b"], ["in", "out"]);
    drawChart($("chart-conns"), [state.conns], ["#8a5cd1"], ["connections"]);
    drawChart($("chart-store"), [state.bytes], ["#3aa76d"], ["size"], human, 1024);
    drawChart($("chart-lag"), [state.lag], ["#c0392b"], ["lag"], human, 1024);
    $("status").textContent = "live · " + new Date().toLocaleTimeString();
    $("status").className = "";
    $("uptime").textContent = "up " + duration(o.uptime);
  } catch (e) {
    $("status").textContent = "API unreachable: " + e.message;
    $("status").className = "down";
  }
}

async function clients() {
  const q = encodeURIComponent($("client-search").value.trim());
  const page = await get(`/api/v1/clients?limit=200&q=${q}`);
  $("clients-total").textContent = `${page.total} connected${page.total > page.items.length ? `, first ${page.items.length} shown` : ""}`;
  $("clients").tBodies[0].innerHTML = rows(page.items, 8, (c) => `<tr data-client="${esc(c.client_id)}">
    <td>${esc(c.client_id)}</td><td>${esc(c.peer)}</td><td>${esc(c.protocol_name)}</td>
    <td>${c.persistent ? "persistent" : "clean"}</td><td>${time(c.connected_since)}</td>
    <td class="num">${c.subscriptions}</td><td class="num">${c.inflight}</td>
    <td><button class="kick" data-client="${esc(c.client_id)}" title="disconnect this client">Kick</button></td></tr>`, "no client connected");
}

// Rows, or one muted row saying why the table is empty.
function rows(items, cols, render, empty) {
  return items.length ? items.map(render).join("") : `<tr><td class="empty" colspan="${cols}">${empty}</td></tr>`;
}

function groupsCell(t) {
  return t.groups.map((g) => `${esc(g.group)} (${g.lag})`).join(", ") || "–";
}

async function lists() {
  const [topics, lag, alerts, ret] = await Promise.all([
    get("/api/v1/topics?limit=100"), get("/api/v1/lag?limit=50"),
    get("/api/v1/alerts"), get("/api/v1/retained?limit=100")]);
  $("topics").tBodies[0].innerHTML = rows(topics.items, 4, (t) => `<tr><td>${esc(t.topic)}</td>
    <td class="num">${t.partitions}</td><td class="num">${t.messages}</td><td>${groupsCell(t)}</td></tr>`, "no topic yet");
  $("lag").tBodies[0].innerHTML = rows(lag.items, 5, (r) => `<tr><td>${esc(r.reader)}</td><td>${esc(r.queue)}</td>
    <td class="num">${r.offset}</td><td class="num">${r.end}</td>
    <td class="num${r.lag > 0 ? " lagging" : ""}">${r.lag}</td></tr>`, "no subscriber or consumer group yet");
  $("alerts").innerHTML = alerts.items.map((a) => `<li><time>${time(a.store_time / 1000)}</time>
    <b>${esc(a.topic)}</b> ${esc(a.body_base64 ? "(binary)" : a.body)}</li>`).join("")
    || '<li class="empty">no alerts yet</li>';
  $("retained-total").textContent = `${ret.total}`;
  $("retained").tBodies[0].innerHTML = rows(ret.items, 5, (r) => `<tr data-topic="${esc(r.topic)}"><td>${esc(r.topic)}</td>
    <td>${r.qos}</td><td>${esc(r.body_base64 ? "(binary)" : r.body)}</td><td>${time(r.ts / 1000)}</td>
    <td><button class="del-retained" data-topic="${esc(r.topic)}">Delete</button></td></tr>`, "no retained message");
}

// The store group (GET /api/v1/cluster): one row per store node.
async function storeNodes() {
  const r = await fetch("/api/v1/cluster");
  if (r.status === 401) { showLogin(); return; }
  const c = await r.json().catch(() => ({ up: false, nodes: [] }));
  $("store-group").textContent = c.up
    ? `${c.mode === "none" ? "single node" : `${c.mode} replication, min in-sync ${c.min_insync}`} · epoch ${c.epoch}`
    : `no master reachable: ${c.error || `HTTP ${r.status}`}`;
  $("store-nodes").tBodies[0].innerHTML = rows(c.nodes || [], 6, (n) => `<tr data-node="${esc(n.addr || n.node)}">
    <td>${esc(n.addr || n.node)}</td><td class="${n.role === "master" ? "" : n.role === "replica" ? "" : "lagging"}">${esc(n.role)}</td>
    <td class="num">${n.epoch}</td><td class="num">${n.replicated_offset}</td>
    <td class="num${n.lag_bytes > 0 ? " lagging" : ""}">${human(n.lag_bytes)}</td>
    <td class="${n.insync ? "" : "lagging"}">${n.insync ? "yes" : "no"}</td></tr>`, "store away");
}

async function safely(fn) {
  try { await fn(); } catch (e) { console.warn(e); }
}

// -- sign-in, users and policies (only when the server runs with --auth) ---------------
let polling = false;
function showLogin() {
  $("login").hidden = false;
  $("login-user").focus();
}

async function session() {
  const me = await get("/api/v1/whoami");
  $("whoami").textContent = me.auth && me.user ? `${me.user}${me.super ? " (super)" : ""}` : "";
  $("logout").hidden = !(me.auth && me.user);
  if (me.auth && !me.user) { showLogin(); return; }
  $("login").hidden = true;
  $("admin").hidden = !(me.auth && me.super);
  if (me.auth && me.super) safely(admin);
  if (!polling) {
    polling = true;
    tick(); safely(clients); safely(lists); safely(storeNodes);
    setInterval(tick, 1000);
    setInterval(() => safely(storeNodes), 2000);
    setInterval(() => safely(clients), 2000);
    setInterval(() => safely(lists), 3000);
  }
}

async function admin() {
  const [users, policies] = await Promise.all([get("/api/v1/users"), get("/api/v1/acl")]);
  $("users").tBodies[0].innerHTML = rows(users.items, 5, (u) => `<tr data-user="${esc(u.name)}">
    <td>${esc(u.name)}</td><td>${u.super ? "Super" : "Normal"}</td>
    <td class="${u.enabled ? "" : "lagging"}">${u.enabled ? "enabled" : "disabled"}</td><td>${time(u.created)}</td>
    <td><button class="toggle-user" data-user="${esc(u.name)}" data-enabled="${u.enabled}">${u.enabled ? "Disable" : "Enable"}</button>
    <button class="del-user" data-user="${esc(u.name)}">Delete</button></td></tr>`, "no user");
  $("policies").tBodies[0].innerHTML = rows(policies.items, 7, (p) => `<tr data-policy="${esc(p.user)} ${esc(p.resource)}">
    <td>${esc(p.user)}</td><td>${esc(p.resource)}</td><td>${p.match}</td><td>${p.actions.join(",")}</td>
    <td>${esc(p.ip || "any")}</td><td class="${p.decision === "deny" ? "lagging" : ""}">${p.decision}</td>
    <td><button class="del-policy" data-user="${esc(p.user)}" data-resource="${esc(p.resource)}" data-match="${p.match}">Delete</button></td></tr>`, "no policy: Normal users may do nothing");
}

async function adminAction(fn) {
  $("admin-error").textContent = "";
  try { await fn(); await admin(); } catch (e) { $("admin-error").textContent = e.message; }
}

$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    await send("POST", "/api/v1/login", { username: $("login-user").value, password: $("login-pass").value });
    $("login-pass").value = ""; $("login-error").textContent = "";
    await session();
  } catch (e) { $("login-error").textContent = e.message; }
});
$("logout").addEventListener("click", async () => { await send("POST", "/api/v1/logout"); location.reload(); });
$("user-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  adminAction(async () => {
    await send("POST", "/api/v1/users", { name: $("new-user").value, password: $("new-pass").value, super: $("new-super").checked });
    $("new-user").value = ""; $("new-pass").value = "";
  });
});
$("acl-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  adminAction(() => send("POST", "/api/v1/acl", { user: $("acl-user").value, resource: $("acl-resource").value,
    match: $("acl-match").value, actions: $("acl-actions").value.split(","), ip: $("acl-ip").value,
    decision: $("acl-deny").checked ? "deny" : "allow" }));
});

document.addEventListener("click", async (ev) => {
  const t = ev.target;
  if (t.classList.contains("toggle-user")) {
    adminAction(() => send("PATCH", `/api/v1/users/${encodeURIComponent(t.dataset.user)}`, { enabled: t.dataset.enabled !== "true" }));
  } else if (t.classList.contains("del-user")) {
    adminAction(() => send("DELETE", `/api/v1/users/${encodeURIComponent(t.dataset.user)}`));
  } else if (t.classList.contains("del-policy")) {
    const q = new URLSearchParams({ user: t.dataset.user, resource: t.dataset.resource, match: t.dataset.match });
    adminAction(() => send("DELETE", `/api/v1/acl?${q}`));
  } else if (t.classList.contains("kick")) {
    t.disabled = true;
    await fetch(`/api/v1/clients/${encodeURIComponent(t.dataset.client)}/kick`, { method: "POST" });
    setTimeout(() => safely(clients), 300);
  } else if (t.classList.contains("del-retained")) {
    t.disabled = true;
    await fetch(`/api/v1/retained/${topicPath(t.dataset.topic)}`, { method: "DELETE" });
    safely(lists);
  }
});
$("client-search").addEventListener("input", () => safely(clients));
session().catch((e) => { $("status").textContent = "API unreachable: " + e.message; $("status").className = "down"; });
