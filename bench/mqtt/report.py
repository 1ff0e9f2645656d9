"""What a run leaves behind: latest.json, a bar chart per scenario (main figure per broker,
ratio to Mosquitto) and the summary table on stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import progress
from .scenarios import SCENARIOS


def write(rows: list[dict[str, Any]], out: Path) -> None:
    """latest.json (the rows, as printed) and the PNGs in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plots")
        return
    for scenario, (_, figure, higher) in SCENARIOS.items():
        mine = [r for r in rows if r["scenario"] == scenario]
        if not mine:  # a chart from an earlier run would not match latest.json
            (out / f"{scenario}.png").unlink(missing_ok=True)
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        values = [r.get(figure) or 0 for r in mine]
        colors = ["#888888" if r["broker"] == "mosquitto" else
                  "#d9534f" if r.get("error") else "#2b7de9" for r in mine]
        bars = ax.bar([r["broker"] for r in mine], values, color=colors)
        for bar, r in zip(bars, mine, strict=True):
            ratio = r.get("ratio_vs_mosquitto")
            text = ("error" if r.get(figure) is None else
                    f"{r[figure]:,.6g}\n{ratio:.2f}x mosquitto" if ratio is not None else
                    f"{r[figure]:,.6g}")
            if r.get("expected") and (r.get("received") or 0) < r["expected"]:
                text += f"\n({(r.get('received') or 0) / r['expected']:.0%} delivered)"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(values + [1]) * 1.25)
        ax.set_ylabel(figure)
        over = (" on mutual TLS" if all(r.get("mutual_tls") for r in mine) else
                " on TLS" if all(r.get("tls") for r in mine) else "")
        ax.set_title(f"{scenario}{over}: {figure} ({'higher' if higher else 'lower'} is "
                     "better)")
        ax.tick_params(axis="x", labelsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{scenario}.png", dpi=100)
        plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'scenario':<20} {'broker':<20} {'main figure':>22} {'vs mosquitto':>12} "
             f"{'CPU us/msg':>10} {'vs trio floor':>13}"]
    for r in rows:
        figure = SCENARIOS[r["scenario"]][1]
        value = r.get(figure)
        ratio = r.get("ratio_vs_mosquitto")
        shown = f"{figure}={value}" if value is not None else f"error: {r.get('error', '?')}"
        cpu = r.get("cpu_us_per_msg")
        floor = r.get("ratio_vs_trio_floor")
        lines.append(f"{r['scenario']:<20} {r['broker']:<20} {shown[:60]:>22} "
                     f"{(f'{ratio:.3f}x' if ratio is not None else '-'):>12} "
                     f"{(f'{cpu:.1f}' if cpu is not None else '-'):>10} "
                     f"{(f'{floor:.2f}x' if floor is not None else ''):>13}")
    return "\n".join(lines)
