// A small line chart on a canvas (no library, no network): series of numbers, auto-scaled,
// newest on the right, with a legend. Sharp on high-DPI screens.
"use strict";
const MAX_POINTS = 120;  // two minutes at one sample per second
const MIN_SPAN = 30;

function fmtNum(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return a >= 10 || v === 0 ? String(Math.round(v)) : v.toFixed(1);
}

// A canvas sized for the screen's pixel ratio, cleared: its context and CSS size.
function prepareCanvas(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || canvas.width, cssH = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(cssW * dpr)) {
    canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  return { ctx, w: cssW, h: cssH };
}

function drawChart(canvas, series, colors, labels, fmt = fmtNum, floor = 1) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const left = 52, top = 18, bottom = 6;
  const max = Math.max(floor, ...series.flat()) * 1.1;  // floor: a flat zero line stays readable
  ctx.font = "10px system-ui, sans-serif"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + (h - top - bottom) * i / 4;
    ctx.strokeStyle = "#e3e5ea"; ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillStyle = "#889"; ctx.textAlign = "right";
    ctx.fillText(fmt(max * (4 - i) / 4), left - 4, y + 3);
  }
  series.forEach((points, k) => {
    ctx.fillStyle = colors[k]; ctx.textAlign = "left";
    const x0 = left + 4 + k * 110;
    ctx.fillRect(x0, 4, 10, 3);
    if (labels) ctx.fillText(`${labels[k]} ${points.length ? fmt(points.at(-1)) : "–"}`, x0 + 14, 9);
    if (points.length < 2) return;
    ctx.strokeStyle = colors[k]; ctx.lineWidth = 2; ctx.lineJoin = "round"; ctx.beginPath();
    // Right-aligned; the x scale spans at least MIN_SPAN samples so that a young chart
    // does not stretch three points across the whole width.
    const span = Math.max(points.length, MIN_SPAN) - 1;
    points.forEach((v, i) => {
      const x = left + (w - left) * (span - (points.length - 1 - i)) / span;
      const y = top + (h - top - bottom) * (1 - v / max);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  });
}

// Values over time: series of {label, color, points: [[ms, value], ...]}, x from the first
// to the last point of all series, y from their lowest to their highest value.
function drawTimeChart(canvas, series) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const left = 52, right = 8, top = 18, bottom = 18;
  const all = series.flatMap((s) => s.points);
  let [t0, t1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [lo, hi] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (t1 === t0) { t0 -= 1000; t1 += 1000; }
  const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.1 || 1;
  lo -= pad; hi += pad;
  const x = (t) => left + (w - left - right) * (t - t0) / (t1 - t0);
  const y = (v) => top + (h - top - bottom) * (1 - (v - lo) / (hi - lo));
  ctx.font = "10px system-ui, sans-serif"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = hi - (hi - lo) * i / 4, yy = y(v);
    ctx.strokeStyle = "#e3e5ea"; ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
    ctx.fillStyle = "#889"; ctx.textAlign = "right"; ctx.fillText(fmtNum(v), left - 4, yy + 3);
  }
  ctx.textAlign = "left"; ctx.fillText(new Date(t0).toLocaleTimeString(), left, h - 4);
  ctx.textAlign = "right"; ctx.fillText(new Date(t1).toLocaleTimeString(), w - right, h - 4);
  series.forEach((s, k) => {
    ctx.fillStyle = s.color; ctx.textAlign = "left";
    const x0 = left + 4 + k * 130;
    ctx.fillRect(x0, 4, 10, 3);
    ctx.fillText(s.label.length > 18 ? "…" + s.label.slice(-17) : s.label, x0 + 14, 9);
    ctx.strokeStyle = s.color; ctx.lineWidth = 2; ctx.lineJoin = "round"; ctx.beginPath();
    s.points.forEach(([t, v], i) => { if (i === 0) ctx.moveTo(x(t), y(v)); else ctx.lineTo(x(t), y(v)); });
    ctx.stroke();
    if (s.points.length === 1) { ctx.beginPath(); ctx.arc(x(s.points[0][0]), y(s.points[0][1]), 3, 0, 7); ctx.fill(); }
  });
}
