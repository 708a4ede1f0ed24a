"""A small loss-per-epoch chart as inline SVG (no plotting library needed)."""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def loss_svg(series: Mapping[str, Sequence[float]], width: int = 320, height: int = 140) -> str:
    """Draws each series (e.g. `loss`, `val_loss`) against the epoch number.

    Args:
        series: name → one value per epoch; non-finite values are skipped.
        width / height: the chart's size in pixels.

    Returns:
        An `<svg>` element, or an empty string when there is nothing to draw.
    """
    clean = {name: [(i + 1, float(v)) for i, v in enumerate(values) if math.isfinite(float(v))]
             for name, values in series.items()}
    clean = {name: points for name, points in clean.items() if points}
    if not clean:
        return ""
    left, right, top, bottom = 48, 10, 10, 26
    epochs = max(x for points in clean.values() for x, _ in points)
    values = [y for points in clean.values() for _, y in points]
    low, high = min(values), max(values)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    plot_w, plot_h = width - left - right, height - top - bottom

    def at(x: float, y: float) -> str:
        px = left + (plot_w * (x - 1) / (epochs - 1) if epochs > 1 else plot_w / 2)
        py = top + plot_h * (high - y) / (high - low)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'class="tpu-magic-loss" font-family="sans-serif" font-size="10">',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ccc"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{high:.3g}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">{low:.3g}</text>',
        f'<text x="{left}" y="{height - 6}">epoch 1</text>',
        f'<text x="{left + plot_w}" y="{height - 6}" text-anchor="end">{epochs}</text>',
    ]
    for index, (name, points) in enumerate(clean.items()):
        colour = COLOURS[index % len(COLOURS)]
        coords = " ".join(at(x, y) for x, y in points)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}"/>')
        for x, y in points:
            cx, cy = at(x, y).split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}"/>')
        parts.append(f'<text x="{left + 6 + 70 * index}" y="{top + plot_h - 6}" '
                     f'fill="{colour}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
