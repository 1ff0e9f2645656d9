// The history view: a topic's or a filter's stored messages from GET /api/v1/messages,
// a page at a time (the API's cursor goes forward only), and a chart of the page's
// numeric payloads, or of a JSON field the user names. window.lgHistory exposes the
// state (tests read it).
"use strict";
const PAGE = 100;
const SERIES_COLORS = ["#2b7de9", "#e9822b", "#3aa76d", "#8a5cd1", "#c0392b", "#16a2b8"];
const hist = { query: null, cursor: null, page: 0, rows: [], points: 0, cut: false };
window.lgHistory = hist;

// A datetime-local value (the browser's local time) as ms since the epoch, for the API.
const localMs = (value) => String(new Date(value).getTime());

function historyQuery() {
  const since = $("history-since").value;
  const q = { filter: $("history-filter").value.trim(), limit: PAGE,
              since: since === "custom" ? localMs($("history-from").value) : since };
  if ($("history-until").value) q.until = localMs($("history-until").value);
  return q;
}

// The number a message stands for: its payload, or the named (dotted) JSON field of it.
function valueOf(m, field) {
  if (m.payload_base64) return null;
  let v = m.payload;
  if (field) {
    try { v = JSON.parse(m.payload); } catch { return null; }
    for (const key of field.split(".")) v = v == null ? null : v[key];
  }
  const n = typeof v === "number" ? v : typeof v === "string" && v.trim() !== "" ? Number(v) : NaN;
  return Number.isFinite(n) ? n : null;
}

function chartPage(messages) {
  const field = $("history-field").value.trim();
  const byTopic = new Map();
  for (const m of messages) {
    const v = valueOf(m, field);
    if (v === null) continue;
    if (!byTopic.has(m.topic)) byTopic.set(m.topic, []);
    byTopic.get(m.topic).push([m.time, v]);
  }
  const series = [...byTopic].slice(0, SERIES_COLORS.length).map(([label, points], k) =>
    ({ label, points, color: SERIES_COLORS[k] }));
  hist.points = series.reduce((n, s) => n + s.points.length, 0);
  $("history-chart-box").hidden = hist.points === 0;
  if (!hist.points) return;
  $("history-chart-caption").textContent = `${field || "payload"} over time` +
    (byTopic.size > series.length ? ` (first ${series.length} topics of ${byTopic.size})` : "");
  drawTimeChart($("history-chart"), series);
}

function renderPage(answer) {
  hist.rows = answer.messages;
  hist.cursor = answer.next;
  hist.cut = answer.cut;
  $("history").tBodies[0].innerHTML = rows(answer.messages, 5, (m) => `<tr data-offset="${m.offset}">
    <td>${new Date(m.time).toLocaleString()}</td><td>${esc(m.topic)}</td>
    <td class="payload" title="${esc(m.payload)}">${m.payload_base64 ? `<i>binary</i> ${esc(m.payload)}` : esc(m.payload)}</td>
    <td>${m.qos}${m.retain ? " r" : ""}</td><td>${esc(m.client_id)}</td></tr>`, "no message stored for that");
  const shown = `page ${hist.page}: ${answer.messages.length} message${answer.messages.length === 1 ? "" : "s"}`;
  $("history-status").textContent = shown + (answer.next ? ", more on the next page" : ", the end")
    + (answer.cut ? " · older messages were removed by retention: this starts at the oldest kept" : "");
  $("history-next").disabled = !answer.next;
  $("history-first").disabled = hist.page <= 1;
  chartPage(answer.messages);
}

async function historyLoad(cursor) {
  $("history-error").textContent = "";
  const params = new URLSearchParams(hist.query);
  if (cursor) params.set("cursor", cursor);
  // URLSearchParams writes a space as "+", which the API refuses in a filter (a "+" typed
  // into a URL by hand is a wildcard lost): %20 is a space without doubt.
  const r = await fetch(`/api/v1/messages?${params.toString().replace(/\+/g, "%20")}`);
  if (r.status === 401) { showLogin(); return; }
  const answer = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) {
    $("history-error").textContent = answer.error || `HTTP ${r.status}`;
    return;
  }
  hist.page = cursor ? hist.page + 1 : 1;
  renderPage(answer);
}

$("history-since").addEventListener("change", () => {
  $("history-from").hidden = $("history-since").value !== "custom";
});
$("history-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  hist.query = historyQuery();
  historyLoad(null).catch((e) => { $("history-error").textContent = e.message; });
});
$("history-next").addEventListener("click", () => {
  if (hist.cursor) historyLoad(hist.cursor).catch((e) => { $("history-error").textContent = e.message; });
});
$("history-first").addEventListener("click", () => {
  if (hist.query) historyLoad(null).catch((e) => { $("history-error").textContent = e.message; });
});
// On input, not change: a change fires on blur, as the user clicks Show, and a chart that
// goes away then can move the button from under the pointer.
$("history-field").addEventListener("input", () => { if (hist.rows.length) chartPage(hist.rows); });
