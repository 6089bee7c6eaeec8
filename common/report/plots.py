"""Throughput, memory and scaling-efficiency plots, drawn off-screen and embedded as PNG.

The Agg backend draws into memory: no display is needed, so this works on a compute node and in
CI. Figures are built with ``matplotlib.figure.Figure`` rather than ``pyplot`` so no figure is
kept alive in pyplot's global list between reports.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure as MplFigure  # noqa: E402  (after choosing the backend)

import pandas as pd  # noqa: E402

from common.report.checks import DDP_MIN_EFFICIENCY  # noqa: E402
from common.report.sections import Figure, is_missing  # noqa: E402

#: More bars than this make an unreadable plot; the tables still list every configuration.
MAX_BARS = 40
_DPI = 100


def png_figure(fig: MplFigure, alt: str, caption: str = "") -> Figure:
    """Render a matplotlib figure to PNG and wrap it for the report (labs use this for their own plots)."""
    buffer = io.BytesIO()
    # zlib's fastest level: the same pixels, a smaller file than the default level 6 (plots are
    # large flat areas), and a sixth of a report's plotting time less.
    fig.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight", pil_kwargs={"compress_level": 1})
    return Figure(png_base64=base64.b64encode(buffer.getvalue()).decode("ascii"), alt=alt, caption=caption)


def plain(label: str) -> str:
    """Text matplotlib draws as-is: a ``$`` in a run name would otherwise start a formula."""
    return label.replace("$", r"\$")


def _labels(data: pd.DataFrame) -> list[str]:
    """What each bar ran: method, devices, model, machine (and lab when there are several)."""
    several_labs = data["lab"].nunique() > 1
    labels = []
    for row in data.to_dict("records"):
        parts = [row["method"], f"{row['devices']} dev", row["model"], row["machine"]]
        if several_labs:
            parts.insert(0, row["lab"])
        labels.append(plain(" · ".join(str(p) for p in parts if not is_missing(p))))
    return labels


def _first(configs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """At most MAX_BARS rows, and a caption that says when some were left out."""
    if len(configs) <= MAX_BARS:
        return configs, ""
    note = f" Showing the first {MAX_BARS} of {len(configs)} configurations; the tables list all."
    return configs.head(MAX_BARS), note


def _configuration_axes(data: pd.DataFrame, inches_per_bar: float = 0.32) -> tuple[MplFigure, Any]:
    """A figure with one labelled row per configuration, first at the top."""
    fig = MplFigure(figsize=(9, 1.2 + inches_per_bar * len(data)))
    ax = fig.add_subplot()
    ax.set_yticks(list(range(len(data))), _labels(data))
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    return fig, ax


def _method_colors(data: pd.DataFrame) -> list[Any]:
    palette = matplotlib.colormaps["tab10"]
    methods = sorted(set(map(str, data["method"])))
    return [palette(methods.index(str(method)) % 10) for method in data["method"]]


def throughput_figure(configs: pd.DataFrame) -> Figure | None:
    """Median samples/s per configuration, with the range over repeats as an error bar."""
    data, note = _first(configs[configs["samples_per_s"].notna()])
    if data.empty:
        return None
    fig, ax = _configuration_axes(data)
    median = data["samples_per_s"].to_numpy()
    low = (median - data["samples_per_s_min"].to_numpy()).clip(min=0)
    high = (data["samples_per_s_max"].to_numpy() - median).clip(min=0)
    ax.barh(range(len(data)), median, xerr=[low, high], color=_method_colors(data), capsize=3)
    ax.set_xlabel("throughput (samples/s, whole job)")
    return png_figure(fig, alt="Bar chart of throughput in samples per second for each configuration",
                      caption="Throughput per configuration: median over repeats, bar = min to max." + note)


def memory_figure(configs: pd.DataFrame) -> Figure | None:
    """Peak memory of every device of each configuration, side by side, so an imbalance shows."""
    data, note = _first(configs[configs["memory_per_device"].map(len) > 0])
    if data.empty:
        return None
    widest = max(len(memory) for memory in data["memory_per_device"])
    shown_devices = min(widest, 8)
    fig, ax = _configuration_axes(data, inches_per_bar=0.2 + 0.08 * shown_devices)
    palette = matplotlib.colormaps["tab10"]
    height = 0.8 / shown_devices
    for position in range(shown_devices):
        ys, peaks = [], []
        for row, memory in enumerate(data["memory_per_device"]):
            if position < len(memory):
                ys.append(row - 0.4 + height * (position + 0.5))
                peaks.append(memory[position][1] / 1024**3)
        label = "first device" if position == 0 else f"device {position + 1}"
        ax.barh(ys, peaks, height=height, color=palette(position % 10), label=label)
    ax.set_xlabel("peak memory per device (GiB)")
    if widest > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    if widest > shown_devices:
        note += f" Only the first {shown_devices} devices of each configuration are drawn."
    sources = sorted({s for s in data["memory_source"] if s})
    return png_figure(fig, alt="Bar chart of peak memory per device for each configuration",
                      caption=f"Peak memory per device ({'; '.join(sources) or 'source not recorded'})." + note)


def efficiency_figure(configs: pd.DataFrame) -> Figure | None:
    """Scaling efficiency of multi-device configurations against the ideal and the expected floor."""
    data, note = _first(configs[configs["scaling_efficiency"].notna()])
    if data.empty:
        return None
    fig, ax = _configuration_axes(data)
    ax.barh(range(len(data)), data["scaling_efficiency"] * 100, color=_method_colors(data))
    ax.axvline(100, color="black", linewidth=1, label="ideal (100%)")
    ax.axvline(DDP_MIN_EFFICIENCY * 100, color="tab:red", linestyle="--", linewidth=1,
               label=f"expected for DDP (≥ {DDP_MIN_EFFICIENCY:.0%})")
    ax.set_xlabel("scaling efficiency (%) = throughput / (devices × baseline throughput)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return png_figure(fig, alt="Bar chart of scaling efficiency for each multi-device configuration",
                      caption="Scaling efficiency against the single-device baseline on the same machine." + note)
