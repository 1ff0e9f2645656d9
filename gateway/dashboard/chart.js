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

function drawChart(canvas, series, colors, labels, fmt = fmtNum, floor = 1) {
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || canvas.width, cssH = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(cssW * dpr)) {
    canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  const w = cssW, h = cssH, left = 52, top = 18, bottom = 6;
  ctx.clearRect(0, 0, w, h);
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
