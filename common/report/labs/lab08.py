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

from typing import Any, Callable, Iterator

import pandas as pd

from common.report.runs import get, number
from common.report.sections import (
    LABS_WITHOUT_SCALING, Section, SectionContext, fmt_bytes, fmt_int, fmt_number, fmt_percent, fmt_text, num,
    register_section, table_from_frame,
)

#: Lab-08 compares input pipelines on one machine: no speed-up columns in the summary.
LABS_WITHOUT_SCALING.add("lab08")


def _with_epochs(runs: pd.DataFrame, keep: Callable[[dict], bool]) -> Iterator[tuple[dict, Any, list]]:
    """(run, record, its epochs) of every run that ended ok, that ``keep(run)`` keeps and that has epochs."""
    for run in runs.to_dict("records"):
        epochs = get(run["record"], "metrics", "epochs_io")
        if run["status"] == "ok" and keep(run) and epochs:
            yield run, run["record"], epochs


def _format_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run, record, epochs in _with_epochs(runs, lambda run: str(run["script"]).endswith("02_read_formats.py")):
        last = epochs[-1] if isinstance(epochs[-1], dict) else {}
        cluster = get(record, "metrics", "cluster_prediction")
        cluster = [row for row in cluster if isinstance(row, dict)] if isinstance(cluster, list) else []
        rows.append({
            "run_id": run["run_id"], "machine": run["machine"], "method": run["method"],
            "format": get(record, "config", "format"), "latency": number(get(record, "config", "metadata_latency")),
            "workers": number(get(record, "config", "num_workers")), "samples": number(last.get("samples")),
            "rate": number(last.get("samples_per_s")), "epoch_s": number(last.get("epoch_s")),
            "predicted": number(last.get("predicted_epoch_s")), "opens": number(last.get("opens")),
            "stats": number(last.get("stats")), "bytes": number(last.get("bytes")),
            "wait": number(last.get("data_wait_share")),
            "cluster": "; ".join(f"{row.get('nodes')}: {fmt_number(number(row.get('epoch_s')), 3)} s ({row.get('bound')})"
                                 for row in cluster),
        })
    return pd.DataFrame(rows)


def _ratio(measured: Any, predicted: Any) -> str:
    return fmt_number(measured / predicted, 3) if measured and predicted and not pd.isna(predicted) else "—"


def _shard_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run, record, epochs in _with_epochs(runs, lambda run: str(run["method"]).startswith("shards-")):
        plan = epochs[-1].get("plan") or {}
        rows.append({"run_id": run["run_id"], "machine": run["machine"], "policy": plan.get("policy"),
                     "world_size": run["world_size"], "slots": number(plan.get("slots")),
                     "samples": number(plan.get("samples")),
                     "read": number(epochs[-1].get("distinct_all_ranks")), "padded": number(plan.get("padded")),
                     "dropped": number(plan.get("dropped")), "skipped": number(get(record, "metrics", "skipped_samples")),
                     "once": get(record, "metrics", "exactly_once"), "wait": number(epochs[-1].get("data_wait_share"))})
    return pd.DataFrame(rows)


@register_section("lab08")
def data_at_scale(ctx: SectionContext) -> Section | None:
    formats, shards = _format_rows(ctx.runs), _shard_rows(ctx.runs)
    if formats.empty and shards.empty:
        return None
    tables = []
    if not formats.empty:
        tables.append(table_from_frame(formats.sort_values(["latency", "format"], na_position="first"), [
            ("run", lambda r: fmt_text(r["method"])),
            ("machine", lambda r: fmt_text(r["machine"])),
            ("wait per open (ms)", lambda r: num(fmt_number(r["latency"], 3))),
            ("workers", lambda r: num(fmt_int(r["workers"]))),
            ("samples", lambda r: num(fmt_int(r["samples"]))),
            ("samples/s", lambda r: num(fmt_number(r["rate"], 4))),
            ("files opened", lambda r: num(fmt_int(r["opens"]))),
            ("stat calls", lambda r: num(fmt_int(r["stats"]))),
            ("bytes read", lambda r: num(fmt_bytes(r["bytes"]))),
            ("waiting for data", lambda r: num(fmt_percent(r["wait"], 1))),
            ("epoch s measured", lambda r: num(fmt_number(r["epoch_s"], 3))),
            ("epoch s predicted", lambda r: num(fmt_number(r["predicted"], 3))),
            ("measured ÷ predicted", lambda r: num(_ratio(r["epoch_s"], r["predicted"]))),
            ("predicted on N Lustre-like nodes", lambda r: fmt_text(r["cluster"])),
        ], id="lab08-formats", caption="The last epoch of each run of 02_read_formats.py: what the dataset's code opened, "
                                       "stat-ed and read (summed over the loader workers), the share of step time spent "
                                       "waiting for a batch, and the cost model's epoch time"))
    if not shards.empty:
        tables.append(table_from_frame(shards, [
            ("policy", lambda r: fmt_text(r["policy"])),
            ("machine", lambda r: fmt_text(r["machine"])),
            ("ranks", lambda r: num(fmt_int(r["world_size"]))),
            ("reader slots", lambda r: num(fmt_int(r["slots"]))),
            ("samples", lambda r: num(fmt_int(r["samples"]))),
            ("distinct read (last epoch)", lambda r: num(fmt_int(r["read"]))),
            ("blanks", lambda r: num(fmt_int(r["padded"]))),
            ("left out", lambda r: num(fmt_int(r["dropped"]))),
            ("skipped (bad)", lambda r: num(fmt_int(r["skipped"]))),
            ("every sample once", lambda r: fmt_text({True: "yes", False: "no"}.get(r["once"]))),
            ("waiting for data", lambda r: num(fmt_percent(r["wait"], 1))),
        ], id="lab08-shards", caption="03_shards_exactly_once.py: the shards dealt over ranks x workers, and what the "
                                      "policy cost in the last epoch"))
    return Section("Lab 08: feeding the GPUs from a shared file system", paragraphs=[
        "The same images as small files, tar shards and one array file, read by the same loader workers for the same "
        "model. A small file costs an open per image, and on a shared file system each open is a round trip to the "
        "metadata servers every user shares; a shard costs one open per thousand images. Stage the shards to "
        "node-local storage once per job, and the shared file system serves one sequential read per node."],
        tables=tables)
