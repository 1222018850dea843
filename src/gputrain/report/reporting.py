"""Temporary re-exports: this module was split into format, metrics_log, plots, summary and progress.

Import from those modules. This shim stays only until every importer (gputrain.train.trainer) has
moved; then delete it.
"""

from gputrain.report.format import format_bytes, format_duration
from gputrain.report.metrics_log import CSV_COLUMNS, MetricsLog
from gputrain.report.plots import plot_history
from gputrain.report.progress import TrainProgress
from gputrain.report.summary import render_summary, summary_rows, summary_table

__all__ = ["CSV_COLUMNS", "MetricsLog", "TrainProgress", "format_bytes", "format_duration", "plot_history",
           "render_summary", "summary_rows", "summary_table"]
