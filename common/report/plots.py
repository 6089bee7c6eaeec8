"""The summary's plots and the helpers the labs' figures use (:func:`axes`, :func:`png_figure`, :func:`plain`).

matplotlib is imported when a figure is drawn, so a report without plots never loads it; figures are not pyplot's,
so none stays alive between reports, and Agg draws the PNG in memory with no display (compute nodes, CI).
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any

import pandas as pd

from common.report.runs import DDP_MIN_EFFICIENCY
from common.report.sections import Figure, is_missing

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure

#: More bars than this make an unreadable plot; the tables still list every configuration.
MAX_BARS = 40


def axes(width: float, height: float, panels: int = 1, rows: int = 1, **subplots: Any) -> tuple[MplFigure, Any]:
    """A figure of ``width`` x ``height`` inches and its axes (one, a row of ``panels`` or a column of ``rows``)."""
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height))
    return fig, fig.subplots(rows, panels, **subplots)


def png_figure(fig: MplFigure, alt: str, caption: str = "") -> Figure:
    """Render a matplotlib figure to PNG and wrap it for the report."""
    buffer = io.BytesIO()
    # zlib's fastest level: the same pixels, a smaller file than the default level 6 (plots are large flat
    # areas), and a sixth of a report's plotting time less.
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", pil_kwargs={"compress_level": 1})
    return Figure(png_base64=base64.b64encode(buffer.getvalue()).decode("ascii"), alt=alt, caption=caption)


def plain(label: str) -> str:
    """Text matplotlib draws as-is: a ``$`` in a run name would otherwise start a formula."""
    return label.replace("$", r"\$")


def _configuration_axes(configs: pd.DataFrame,
                        inches_per_bar: float = 0.32) -> tuple[pd.DataFrame, str, MplFigure, Any]:
    """At most MAX_BARS configurations (of one lab), a caption's note when some were left out, and a figure with a
    labelled row per configuration, first at the top."""
    note = f" Showing the first {MAX_BARS} of {len(configs)} configurations; the tables list all." \
        if len(configs) > MAX_BARS else ""
    data = configs.head(MAX_BARS)
    parts = {"method": "{}", "devices": "{} dev", "model": "{}", "global_batch_size": "batch {:.0f}", "machine": "{}"}
    labels = [plain(" · ".join(form.format(v) for form, v in zip(parts.values(), row) if not is_missing(v)))
              for row in data[list(parts)].itertuples(index=False)]  # the batch: Lab-07's pp-gpipe at 4, 8, 16, 32
    fig, ax = axes(9, 1.2 + inches_per_bar * len(data))
    ax.set_yticks(list(range(len(data))), labels)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    return data, note, fig, ax


def _method_colors(data: pd.DataFrame) -> list[str]:
    methods = sorted(set(map(str, data["method"])))
    return [f"C{methods.index(str(method)) % 10}" for method in data["method"]]  # tab10's ten colours


def throughput_figure(configs: pd.DataFrame, lab: str) -> Figure | None:
    """Median samples/s per configuration, with the range over repeats as an error bar."""
    if configs["samples_per_s"].isna().all():
        return None
    data, note, fig, ax = _configuration_axes(configs[configs["samples_per_s"].notna()])
    median = data["samples_per_s"]
    errors = [(median - data["samples_per_s_min"]).clip(lower=0), (data["samples_per_s_max"] - median).clip(lower=0)]
    ax.barh(range(len(data)), median, xerr=errors, color=_method_colors(data), capsize=3)
    ax.set_xlabel("throughput (samples/s, whole job)")
    return png_figure(fig, alt=f"Bar chart of throughput in samples per second for each configuration of {lab}",
                      caption=f"{lab}: throughput per configuration, median over repeats, bar = min to max." + note)


def memory_figure(configs: pd.DataFrame, lab: str) -> Figure | None:
    """Peak memory of every device of each configuration, side by side, so an imbalance shows."""
    measured = configs[configs["memory_per_device"].map(len) > 0]
    if measured.empty:
        return None
    widest = max(len(memory) for memory in measured["memory_per_device"].head(MAX_BARS))
    shown = min(widest, 8)
    data, note, fig, ax = _configuration_axes(measured, inches_per_bar=0.2 + 0.08 * shown)
    height = 0.8 / shown
    for position in range(shown):
        bars = [(row - 0.4 + height * (position + 0.5), memory[position][1] / 1024**3)
                for row, memory in enumerate(data["memory_per_device"]) if position < len(memory)]
        ax.barh(*zip(*bars), height=height, color=f"C{position % 10}",
                label="first device" if position == 0 else f"device {position + 1}")
    ax.set_xlabel("peak memory per device (GiB)")
    if widest > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    note += f" Only the first {shown} devices of each configuration are drawn." if widest > shown else ""
    sources = "; ".join(sorted({s for s in data["memory_source"] if s})) or "source not recorded"
    return png_figure(fig, alt=f"Bar chart of peak memory per device for each configuration of {lab}",
                      caption=f"{lab}: peak memory per device ({sources})." + note)


def efficiency_figure(configs: pd.DataFrame, lab: str) -> Figure | None:
    """Scaling efficiency of multi-device configurations against the ideal, and DDP's floor where GPUs ran: processes
    sharing a CPU's cores are not expected to reach it (the warnings exempt them too)."""
    if configs["scaling_efficiency"].isna().all():
        return None
    data, note, fig, ax = _configuration_axes(configs[configs["scaling_efficiency"].notna()])
    ax.barh(range(len(data)), data["scaling_efficiency"] * 100, color=_method_colors(data))
    ax.axvline(100, color="black", linewidth=1, label="ideal (100%)")
    if (data["device_type"].fillna("cpu") != "cpu").any():
        ax.axvline(DDP_MIN_EFFICIENCY * 100, color="tab:red", linestyle="--", linewidth=1,
                   label=f"expected for DDP on GPUs (≥ {DDP_MIN_EFFICIENCY:.0%})")
    ax.set_xlabel("scaling efficiency (%) = throughput / (devices × baseline throughput)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    caption = f"{lab}: scaling efficiency against the single-device baseline on the same machine." + note
    return png_figure(fig, alt=f"Bar chart of scaling efficiency for each multi-device configuration of {lab}",
                      caption=caption)


def finish_axes(ax: Any, grid: str = "both", legend: str = "best", **settings: Any) -> None:
    """A lab plot's last steps: ``ax.set(**settings)``, a light grid along ``grid``, a small legend of any labels."""
    ax.set(**settings)
    ax.grid(axis=grid, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc=legend)
