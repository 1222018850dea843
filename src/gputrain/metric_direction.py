"""Which way a metric improves: one rule for the summary, report.html, EarlyStopping, the best
checkpoint and any sweep.

The first of these that applies:
1. the user stated it: `TrainConfig.metric_modes={"eval_margin": "min"}` (or `best_mode`,
   `EarlyStopping(mode=...)` for their own metric): "min" or "max";
2. a torchmetrics metric's own `higher_is_better` (the metric given as `metrics={"name": m}` gives
   `eval_name` and the EMA's `eval_ema_name`);
3. gputrain's own losses (`loss`, `eval_loss`, `eval_ema_loss`): lower; its accuracy: higher;
4. a name that says loss, error, MSE, MAE, perplexity or the like: lower is better;
5. else higher is better.
Rules 4 and 5 are guesses; the summary says where it guessed. Imports nothing of gputrain's, so
io/, train/ and report/ all use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
import math
from typing import Any, Callable, Iterable, Mapping

MIN, MAX = "min", "max"
MODES = (MIN, MAX)

# Words of a name that say lower is better (a name's words are split at "_", "-", "." and camelCase).
LOWER_IS_BETTER = frozenset({
    "loss", "losses", "error", "errors", "err", "mse", "mae", "rmse", "msle", "rmsle", "mape", "smape", "wmape",
    "perplexity", "ppl", "nll", "wer", "cer", "mer", "ter", "distance", "divergence", "kl", "bpc", "bpd", "bpb",
    "regret", "cost", "eer", "fid", "fpr", "fnr", "hamming",
})
# Word endings that say it inside a longer word ("valloss", "l1error").
LOWER_ENDINGS = ("loss", "error")
BUILT_IN = {"loss": MIN, "eval_loss": MIN, "eval_ema_loss": MIN, "eval_accuracy": MAX, "eval_ema_accuracy": MAX}


@dataclass(frozen=True)
class Direction:
    """mode: "min" (lower is better) or "max"; by: what decided it ("stated", "metric", "built-in",
    "name" or "default"; the last two are guesses)."""

    mode: str
    by: str

    @property
    def words(self) -> str:
        """"lower is better" / "higher is better"."""
        return "lower is better" if self.mode == MIN else "higher is better"

    @property
    def best_word(self) -> str:
        """"lowest" / "highest": what "best" is for this metric."""
        return "lowest" if self.mode == MIN else "highest"

    def why(self) -> str:
        """Why this direction, for people: "lower is better: guessed from the name"."""
        return {"stated": f"{self.words}: stated",
                "metric": f"{self.words}: the metric's higher_is_better",
                "built-in": f"{self.words}: gputrain's own metric",
                "name": f"{self.words}: guessed from the name",
                "default": f"{self.words}: guessed, nothing in the name says otherwise (state it with "
                           "TrainConfig(metric_modes={...}))"}[self.by]

    def better(self, value: float, than: float) -> bool:
        return value < than if self.mode == MIN else value > than

    def best(self, values: Iterable[float]) -> float:
        return min(values) if self.mode == MIN else max(values)


def name_words(name: str) -> list[str]:
    """A name's words in lower case: "eval_meanSquaredError" -> ["eval", "mean", "squared", "error"]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def says_lower_is_better(name: str) -> bool:
    """True when a word of the name says loss, error, MSE, MAE, perplexity or the like."""
    return any(w in LOWER_IS_BETTER or w.endswith(LOWER_ENDINGS) for w in name_words(name))


def check_mode(mode: Any, what: str) -> str:
    """`mode` when it is "min" or "max"; else a ValueError naming `what`."""
    if mode not in MODES:
        raise ValueError(f"{what} must be 'min' or 'max', got {mode!r}")
    return mode


def _metric_keys(name: str) -> tuple[str, str]:
    return f"eval_{name}", f"eval_ema_{name}"


def metric_direction(key: str, stated: Mapping[str, str] | None = None,
                     metrics: Mapping[str, Any] | None = None) -> Direction:
    """The direction of record key `key` (e.g. "eval_mse", "eval_ema_loss") by the rule above.

    stated: {key: "min" | "max"} the user gave (a key without "ema_" covers its EMA twin too).
    metrics: the run's metrics {name: metric} (torchmetrics objects carry `higher_is_better`).
    """
    stated = stated or {}
    for k in (key, key.replace("eval_ema_", "eval_", 1)):
        if k in stated:
            return Direction(check_mode(stated[k], f"the mode stated for {k!r}"), "stated")
    for name, metric in (metrics or {}).items():
        higher = getattr(metric, "higher_is_better", None)
        if key in _metric_keys(name) and isinstance(higher, bool):
            return Direction(MAX if higher else MIN, "metric")
    if key in BUILT_IN:
        return Direction(BUILT_IN[key], "built-in")
    if says_lower_is_better(key):
        return Direction(MIN, "name")
    return Direction(MAX, "default")


def metric_figures(records: list[dict[str, Any]],
                   direction_of: Callable[[str], Direction] = metric_direction) -> dict[str, Any]:
    """What a summary says of a run's metrics, from its log points' records: "evaluations" (records
    with an eval_ value), "final_loss", and for every eval_<name> key final_<key> (its last value),
    best_<key> (the best finite value by `direction_of(key)`; None: none finite) and its direction
    under "metric_directions" ({key: {"mode", "by"}})."""
    out: dict[str, Any] = {"evaluations": sum(1 for r in records if any(k.startswith("eval_") for k in r)),
                           "metric_directions": {}}
    if not records:
        return out
    out["final_loss"] = records[-1].get("loss")
    for key in sorted({k for r in records for k in r if k.startswith("eval_")}):
        values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        if not values:
            continue
        way = direction_of(key)
        out["metric_directions"][key] = {"mode": way.mode, "by": way.by}
        out[f"final_{key}"] = values[-1]
        finite = [v for v in values if math.isfinite(v)]
        out[f"best_{key}"] = way.best(finite) if finite else None
    return out
