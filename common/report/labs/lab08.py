"""Lab 08 (feeding GPUs from a shared file system): formats, opens, bytes, waiting for data, predicted and measured.

``labs/lab08_data_at_scale`` writes:

- ``02_read_formats.py`` (method ``imagefolder``, ``webdataset`` or ``array``, with ``+latency``,
  ``+read-only``, ``+decode-on-device`` added as they apply): ``metrics.epochs_io``, one entry per epoch with
  ``samples``, ``epoch_s``, ``samples_per_s``, ``opens``, ``stats``, ``bytes``, ``data_wait_share`` and
  ``predicted_epoch_s``; ``metrics.cluster_prediction`` (per node count: ``epoch_s`` and its ``bound``);
  ``config.metadata_latency`` (ms added before every open);
- ``03_shards_exactly_once.py`` (method ``shards-pad``, ``shards-drop`` or ``shards-uneven``):
  ``metrics.epochs_io`` (per epoch: ``plan``, ``samples``, ``padded``, ``distinct_all_ranks``), ``exactly_once``,
  ``skipped_samples``.

Tables: one row per epoch of every format run (the last epoch), and the shard runs.
"""

from __future__ import annotations

import pandas as pd

from common.report.runs import entries, numbers, texts
from common.report.sections import Section, SectionContext, fmt, register_section, table_from_frame


def _last_epochs(runs: pd.DataFrame, *keep: str) -> pd.DataFrame:
    """The last epoch of every run that ended ok, one row each: its keys (``plan.slots``) beside the run's ``keep``."""
    return entries(runs[runs["status"] == "ok"], "metrics.epochs_io", *keep).drop_duplicates("_run", keep="last")


def _cluster(runs: pd.DataFrame) -> pd.Series:
    """Per run, its predicted epoch on each node count: ``1: 12.3 s (metadata); 4: ...``."""
    nodes = entries(runs, "metrics.cluster_prediction")
    lines = [f"{n}: {fmt(s, '{:.3g}')} s ({b})" for n, s, b in zip(texts(nodes, "nodes"), numbers(nodes, "epoch_s"),
                                                                   texts(nodes, "bound"))]
    return pd.Series(lines, index=nodes.index, dtype=object).groupby(nodes["_run"]).agg("; ".join)


@register_section("lab08", scaling=False)  # input pipelines on one machine: no speed-up columns
def data_at_scale(ctx: SectionContext) -> Section | None:
    runs, tables = ctx.runs, []
    formats = _last_epochs(runs[runs["script"].fillna("").str.endswith("02_read_formats.py")], "run_id", "method",
                           "machine", "config.format", "config.num_workers", "config.metadata_latency")
    if not formats.empty:
        formats = formats.assign(latency=numbers(formats, "config.metadata_latency"),
                                 cluster=formats["_run"].map(_cluster(runs)).fillna(""),
                                 ratio=numbers(formats, "epoch_s") / numbers(formats, "predicted_epoch_s").where(
                                     lambda predicted: predicted > 0))
        tables.append(table_from_frame(formats.sort_values(["latency", "config.format"], na_position="first"), {
            "run": "method", "machine": "machine", "wait per open (ms)": ("latency", "{:.3g}"),
            "workers": ("config.num_workers", "int"), "samples": ("samples", "int"),
            "samples/s (whole epoch)": ("samples_per_s", "int"), "files opened": ("opens", "int"),
            "stat calls": ("stats", "int"),
            "bytes read": ("bytes", "bytes"), "waiting for data": ("data_wait_share", "%1"),
            "epoch s measured": ("epoch_s", "{:.3g}"), "epoch s predicted": ("predicted_epoch_s", "{:.3g}"),
            "measured ÷ predicted": ("ratio", "{:.3g}"), "predicted on N Lustre-like nodes": "cluster",
        }, id="lab08-formats", caption="The last epoch of each run of 02_read_formats.py: what the dataset's code "
           "opened, stat-ed and read (summed over the loader workers), the share of step time spent waiting for a "
           "batch, and the cost model's epoch time"))
    shards = _last_epochs(runs[runs["method"].fillna("").str.startswith("shards-")], "run_id", "machine", "world_size",
                          "metrics.skipped_samples", "metrics.exactly_once")
    if not shards.empty:
        shards = shards.assign(once=shards["metrics.exactly_once"].map({True: "yes", False: "no"}))
        tables.append(table_from_frame(shards, {
            "policy": "plan.policy", "machine": "machine", "ranks": ("world_size", "int"),
            "reader slots": ("plan.slots", "int"), "samples": ("plan.samples", "int"),
            "distinct read (last epoch)": ("distinct_all_ranks", "int"), "blanks": ("plan.padded", "int"),
            "left out": ("plan.dropped", "int"), "skipped (bad)": ("metrics.skipped_samples", "int"),
            "every sample once": "once", "waiting for data": ("data_wait_share", "%1"),
        }, id="lab08-shards", caption="03_shards_exactly_once.py: the shards dealt over ranks x workers, and what the "
                                      "policy cost in the last epoch"))
    if not tables:
        return None
    return Section("Lab 08: feeding the GPUs from a shared file system", paragraphs=[
        "The same images as small files, tar shards and one array file, read by the same loader workers for the same "
        "model. A small file costs an open per image, and on a shared file system each open is a round trip to the "
        "metadata servers every user shares; a shard costs one open per thousand images. Stage the shards to "
        "node-local storage once per job, and the shared file system serves one sequential read per node."],
        tables=tables)
