// A minimal line chart on a canvas: series of numbers, auto-scaled, newest on the right.
"use strict";
function drawChart(canvas, series, colors) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const all = series.flat();
  const max = Math.max(1, ...all);
  ctx.strokeStyle = "#e3e5ea"; ctx.fillStyle = "#889"; ctx.font = "10px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = pad / 2 + (h - pad) * i / 4;
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(String(Math.round(max * (4 - i) / 4)), 0, y + 3);
  }
  series.forEach((points, k) => {
    if (points.length < 2) return;
    ctx.strokeStyle = colors[k]; ctx.lineWidth = 2; ctx.beginPath();
    points.forEach((v, i) => {
      const x = pad + (w - pad) * i / (points.length - 1);
      const y = pad / 2 + (h - pad) * (1 - v / max);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  });
}
