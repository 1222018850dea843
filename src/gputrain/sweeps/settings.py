"""What a sweep is: the [sweep] table of a config file, checked, and its search space.

    [sweep]
    trials = 8                  # the study ends with this many finished trials (a resumed one counts its own)
    workers = 2                 # trials at once: one per GPU; on the CPU, processes sharing the cores
    metric = "eval_loss"        # a key of the run's records: loss, eval_loss, eval_accuracy, eval_<yours>
    direction = "min"           # optional: else gputrain's rule (gputrain/metric_direction.py)
    value = "final"             # a trial's value: its last evaluation's ("final") or its best ("best")
    pruner = "median"           # stop a trial whose evaluation is worse than the median of earlier trials' at
                                # the same step ("none": never); only after `startup_trials` have finished
    sampler = "tpe"             # or "random"; `seed` seeds it (worker i: seed + i)
    storage = "postgresql://USER@HOST/DB"  # optional: a study that workers on several machines join
                                # (or a journal file's path); default SWEEP_DIR/study.db (SQLite)
    study = "lr-search"         # the study's name in that storage (default "gputrain")
    heartbeat = 30              # seconds between a running trial's heartbeats on a database server

    [sweep.space]               # TrainConfig fields, [fit] flags and options.NAME for the workload's
    lr = {loguniform = [1e-4, 1e-1]}
    weight_decay = {uniform = [0.0, 0.1]}          # step = 0.01 for a grid
    steps = {int = [20, 100], step = 20}           # log = true for a log scale
    batch_size = {choices = [16, 32, 64]}
    compile = {choices = [false, true, "regional"]}  # off, the whole model, its repeated block once
    options.n = {choices = [1000, 4000]}
    optimizers.generator.lr = {loguniform = [1e-4, 1e-2]}   # a step of your own: a named optimizer's setting

Every value a distribution can give is checked against what the run takes (its type, TrainConfig's
own checks) before anything is written: a space that cannot be sampled is one line naming the key
and its line in the file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from gputrain.errors import ConfigError
from gputrain.fields import positive_int_arg, setting
from gputrain.io.toml_file import dumps
from gputrain.runs.stated import RunConfig, check_value, field_types, merge, option_text
from gputrain.sweeps.storage import check_storage, has_password, without_password

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

SWEEP_FILE = "sweep.toml"  # SWEEP_DIR/sweep.toml: the sweep's resolved config
KINDS = ("loguniform", "uniform", "int", "choices")
IDENTITY_FREE = ("trials", "workers", "sweep_dir", "heartbeat")  # what a resumed sweep may change
STUDY_FREE = ("storage", "study")  # where the study lives: not part of what the study records of itself
MAX_SEED = 2**32 - 1  # Optuna's samplers seed numpy's RandomState, which takes 0 to 2**32 - 1


# ---------------------------------------------------------------- the checks of [sweep]'s keys
#
# Each is called with "[sweep] KEY" as the name, so that a bad value is one line naming the key.


def _kind(kind: type) -> Callable[[str, Any], None]:
    """An int (not a bool) or a str; None passes (a setting left to its rule: direction, workers)."""

    def check(name: str, value: Any) -> None:
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a string'}, got {value!r}")

    return check


def _choice(*choices: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        _kind(str)(name, value)
        if value is not None and value not in choices:
            raise ConfigError(f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}")

    return check


def _at_least(low: int, said: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        _kind(int)(name, value)
        if value is not None and value < low:
            raise ConfigError(f"{name} must be {said}, got {value}")

    return check


def _seed(name: str, value: Any) -> None:
    _kind(int)(name, value)
    if not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{name} must be an integer from 0 to {MAX_SEED} (what Optuna's samplers take), got {value}")


def _study_name(name: str, value: Any) -> None:
    _kind(str)(name, value)
    if not value or not value.isprintable() or len(value) > 512:
        raise ConfigError(f"{name} must be a name of 1 to 512 printable characters, got {value!r}")


@dataclass(frozen=True)
class Param:
    """One searched setting: its name in the study ("lr", "options.n"), where it goes in the run's
    config (section "train" | "fit" | "options", key) and its distribution."""

    name: str
    section: str
    key: str
    kind: str  # one of KINDS
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple = ()

    def spec(self) -> dict[str, Any]:
        """The distribution as the config file writes it: {"loguniform": [1e-4, 0.1]}."""
        if self.kind == "choices":
            return {"choices": list(self.choices)}
        out: dict[str, Any] = {self.kind: [self.low, self.high]}
        if self.step is not None:
            out["step"] = self.step
        if self.log and self.kind == "int":
            out["log"] = True
        return out

    def distribution(self) -> BaseDistribution:
        """The Optuna distribution that samples this setting."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choices":
            return CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return IntDistribution(int(self.low or 0), int(self.high or 0), log=self.log, step=int(self.step or 1))
        return FloatDistribution(float(self.low or 0), float(self.high or 0), log=self.kind == "loguniform",
                                 step=self.step)


@dataclass
class SweepSettings:
    """The [sweep] table, checked: each key declared once with its check (and the flag of
    `gputrain sweep` that sets it, generated as fit's are: gputrain/runs/flags.py); `space`: the
    searched settings, in the file's order."""

    trials: int = setting(flag="--trials", parse=positive_int_arg, check=_at_least(1, "at least 1"),
                          help="the budget: finished trials the study ends with")  # no default: a sweep states it
    workers: int | None = setting(None, flag="--workers", parse=positive_int_arg, check=_at_least(1, "at least 1"),
                                  help="trials at once (default: one per GPU; on the CPU, 1): processes, never two on "
                                       "one GPU")  # None: one per GPU, else one
    metric: str = setting("eval_loss", flag="--metric", check=_kind(str),
                          help="the value each trial is judged by (default eval_loss)")
    direction: str | None = setting(None, flag="--direction", choices=("min", "max"), choices_first=True,
                                    check=_choice("min", "max"),
                                    help="which way the metric improves (default: gputrain's rule for its name)")
    value: str = setting("final", check=_choice("final", "best"))
    pruner: str = setting("median", check=_choice("median", "none"))
    startup_trials: int = setting(5, check=_at_least(0, "0 or more"))
    sampler: str = setting("tpe", check=_choice("tpe", "random"))
    seed: int = setting(0, check=_seed)
    storage: str | None = setting(None, flag="--storage", metavar="URL", check=check_storage,
                                  help="where the study lives, for workers on several machines to join: "
                                       "postgresql://USER@HOST/DB, mysql://USER@HOST/DB or a journal file on a shared "
                                       "filesystem (default: SWEEP_DIR/study.db, this machine); the password from "
                                       "PGPASSWORD, ~/.pgpass or GPUTRAIN_SWEEP_STORAGE, never written")
    study: str = setting("gputrain", flag="--study", metavar="NAME", check=_study_name,
                         help="the study's name in --storage (default gputrain): the same on every machine")
    heartbeat: int = setting(30, check=_at_least(1, "at least 1 (seconds)"))
    sweep_dir: str | None = setting(None, flag="--sweep-dir", check=_kind(str),
                                    help="the sweep's folder (default sweeps/NAME for --config NAME.toml: the same "
                                         "command again resumes); alone, resumes the sweep in it")
    space: list[Param] = field(default_factory=list)

    def table(self) -> dict[str, Any]:
        """The settings as [sweep] writes them (sweep_dir left out: the directory is where it is)."""
        out = {k: getattr(self, k) for k in _KEYS if k != "sweep_dir"}
        if self.storage is not None and "://" in self.storage:
            out["storage"] = without_password(self.storage)  # the password is never written
        out["space"] = {p.name: p.spec() for p in self.space}
        return out

    def identity(self) -> dict[str, Any]:
        """What makes two sweeps one study: all but the budget and the workers."""
        return {k: v for k, v in self.table().items() if k not in IDENTITY_FREE}

    def study_identity(self) -> dict[str, Any]:
        """What the study records of itself (the identity, less where it lives)."""
        return {k: v for k, v in self.identity().items() if k not in STUDY_FREE}


_FIELDS = {f.name: f for f in dataclasses.fields(SweepSettings) if f.name != "space"}
_KEYS = tuple(_FIELDS)  # the keys of [sweep], besides the table [sweep.space]


def check_sweep(rc: RunConfig, overrides: dict[str, Any] | None = None) -> SweepSettings:
    """The SweepSettings of `rc.sweep` with `overrides` (the command line's --trials, --metric...)
    over it. Raises ConfigError naming the key and its line for an unknown key, a wrong type or
    value, and a space that cannot be sampled or that sets what a sweep decides (run_dir)."""
    table = dict(rc.sweep or {})
    where = rc.where
    for key, value in table.items():
        if key == "space":
            if not isinstance(value, dict):
                raise ConfigError(f"{where('sweep', key)}: [sweep] space must be a table ([sweep.space])")
            continue
        if key not in _FIELDS:
            raise ConfigError(f"{where('sweep', key)}: unknown key {key!r} in [sweep]: the keys are "
                              f"{', '.join(_KEYS)} and the table [sweep.space]")
        _check_setting(key, value, where("sweep", key))
        if key == "storage" and has_password(value):
            raise ConfigError(f"{where('sweep', key)}: [sweep] storage holds a password: a config file is no place "
                              "for it; remove it from the URL and set PGPASSWORD, ~/.pgpass or GPUTRAIN_SWEEP_STORAGE")
    defaults = {k: None if f.default is dataclasses.MISSING else f.default for k, f in _FIELDS.items()}
    values = {**defaults, **{k: v for k, v in table.items() if k != "space"}}
    for key, value in (overrides or {}).items():
        if value is not None:
            _check_setting(key, value, "the command line")
            values[key] = value
    if values["trials"] is None:
        raise ConfigError("a sweep needs a budget: trials = N in [sweep], or --trials N")
    metric = values["metric"]
    if metric != "loss" and not metric.startswith("eval_"):
        said = f"--metric {metric}" if (overrides or {}).get("metric") is not None else \
            f"{where('sweep', 'metric')}: [sweep] metric {metric!r}"  # the flag, or the file's line
        raise ConfigError(f"{said} is no value a run reports: runs report loss and eval_* values (eval_loss, "
                          "eval_accuracy, eval_<your metric>)")
    _check_base(rc)
    space = [_param(name, spec, rc) for name, spec in _flat_space(table.get("space") or {})]
    if not space:
        raise ConfigError(f"{where('sweep')}: the sweep has no search space: add [sweep.space] with, e.g., "
                          "lr = {loguniform = [1e-4, 1e-1]}")
    return SweepSettings(space=space, **values)


def _check_setting(key: str, value: Any, where: str) -> None:
    """[sweep] `key`'s own check (declared beside its field), with `where` it was written."""
    try:
        _FIELDS[key].metadata["check"](f"[sweep] {key}", value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_base(rc: RunConfig) -> None:
    """What a sweep decides itself cannot be set for its trials."""
    for key in ("run_dir", "resume"):
        if rc.train.get(key):
            raise ConfigError(f"{rc.where('train', key)}: [train] {key}: a sweep puts each trial in its own run "
                              "directory under SWEEP_DIR/trials; remove it (the sweep's folder is --sweep-dir)")
    if (rc.fit.get("nproc") or 1) > 1:
        raise ConfigError(f"{rc.where('fit', 'nproc')}: [fit] nproc: a trial trains in one process (a sweep runs "
                          "trials side by side instead, [sweep] workers); remove it")
    if rc.fit.get("no_save"):
        raise ConfigError(f"{rc.where('fit', 'no_save')}: [fit] no_save: every trial is a run directory; remove it")


def _flat_space(space: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """[(name, spec)]: `options.n = {...}` (a nested table in TOML) becomes ("options.n", {...})."""
    out = []
    for key, value in space.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not (set(value) & set(KINDS)) and value and \
                all(isinstance(v, dict) for v in value.values()) and (not prefix or prefix.count(".") == 1 and
                                                                      prefix.startswith("optimizers.")):
            out += _flat_space(value, f"{name}.")
        else:
            out.append((name, value))
    return out


def _param(name: str, spec: Any, rc: RunConfig) -> Param:
    keys = ("sweep", "space", *name.split("."))
    where = rc.where(*keys)

    def fail(message: str) -> ConfigError:
        return ConfigError(f"{where}: [sweep.space] {name}: {message}")

    section, key = _target(name, fail)
    if not isinstance(spec, dict) or len(set(spec) & set(KINDS)) != 1:
        raise fail("give one distribution as a table: {loguniform = [low, high]}, {uniform = [low, high]}, "
                   "{int = [low, high]} or {choices = [a, b, ...]}")
    kind = next(k for k in KINDS if k in spec)
    extra = set(spec) - {kind, "step", "log"}
    if extra or (kind != "int" and "log" in spec) or (kind in ("choices", "loguniform") and "step" in spec):
        raise fail(f"{kind} takes {'no other keys' if kind in ('choices', 'loguniform') else 'step' if kind == 'uniform' else 'step and log'}, "
                   f"got {', '.join(sorted(set(spec) - {kind}))}")
    if kind == "choices":
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise fail("choices must be a non-empty list of values")
        if any(not isinstance(c, (str, int, float, bool)) for c in choices):
            raise fail("each choice must be a string, number or true/false (Optuna stores those)")
        if len({(type(c), c) for c in choices}) != len(choices):
            raise fail(f"choices repeat a value: {choices!r}")
        kinds = {"a string" if isinstance(c, str) else "true/false" if isinstance(c, bool) else "a number"
                 for c in choices}
        if len(kinds) > 1 and not _takes_each(section, key, choices):
            raise fail(f"choices mix {' and '.join(sorted(kinds))} values ({choices!r}): a setting takes one kind; "
                       "give choices of one kind")
        param = Param(name, section, key, kind, choices=tuple(choices))
        samples = list(choices)
    else:
        bounds = spec[kind]
        number = int if kind == "int" else (int, float)
        if not (isinstance(bounds, list) and len(bounds) == 2 and
                all(isinstance(b, number) and not isinstance(b, bool) for b in bounds)):
            raise fail(f"{kind} takes [low, high], two {'integers' if kind == 'int' else 'numbers'}; got {bounds!r}")
        low, high = bounds
        if not (math.isfinite(low) and math.isfinite(high)) or not low < high:
            raise fail(f"{kind} = [{low}, {high}] cannot be sampled: low must be below high (a fixed value goes "
                       f"under [{section}])")
        if kind == "loguniform" and low <= 0:
            raise fail(f"loguniform = [{low}, {high}] cannot be sampled: a log scale needs low > 0")
        step = spec.get("step")
        log = spec.get("log", False)
        if not isinstance(log, bool):
            raise fail(f"log must be true or false, got {log!r}")
        if step is not None:
            if not isinstance(step, number) or isinstance(step, bool) or not step > 0 or not math.isfinite(step):
                raise fail(f"step must be a positive {'integer' if kind == 'int' else 'number'}, got {step!r}")
            n = (high - low) / step
            if abs(n - round(n)) > 1e-9 * max(1.0, abs(n)):
                raise fail(f"step {step} does not divide [{low}, {high}] into whole steps")
            if log:
                raise fail("int takes step or log = true, not both (Optuna samples a log scale without steps)")
        param = Param(name, section, key, kind, low=low, high=high, step=step, log=log)
        middle = (low + high) // 2 if kind == "int" else (low + high) / 2
        samples = [low, middle, high]
    for value in samples:
        _check_sample(section, key, value, fail)
    return param


def _target(name: str, fail) -> tuple[str, str]:
    """("train" | "fit" | "options", key) of a space name: a TrainConfig field, a [fit] flag, or
    options.NAME (train.NAME and fit.NAME are accepted too)."""
    head, _, rest = name.partition(".")
    if head == "optimizers":
        if rest.count(".") != 1:
            raise fail("a named optimizer's setting is optimizers.NAME.KEY, e.g. optimizers.generator.lr")
        return head, rest
    if rest:
        if head in ("train", "fit", "options") and "." not in rest:
            if head != "options" and rest not in field_types(head):
                raise fail(f"[{head}] has no key {rest!r}")
            return head, rest
        raise fail("a searched name is a [train] or [fit] key, or options.NAME for a workload option")
    if name in ("run_dir", "resume", "workload"):
        raise fail(f"{name} is not searched: a sweep decides where each trial runs, and trains one workload")
    for section in ("train", "fit"):
        if name in field_types(section):
            return section, name
    raise fail(f"no such setting: a searched name is a [train] key (TrainConfig's fields), a [fit] key, or "
               f"options.NAME for a workload option")


def _takes_each(section: str, key: str, choices: list[Any]) -> bool:
    """Whether a TrainConfig field or [fit] setting takes every one of `choices` though they are of
    more than one kind (compile: false, true or "regional")."""
    if section not in ("train", "fit"):
        return False
    try:
        for choice in choices:
            check_value(section, key, choice)
    except ConfigError:
        return False
    return True


def _check_sample(section: str, key: str, value: Any, fail) -> None:
    if section == "options":
        option_text(value)
        return
    if section == "optimizers":
        from gputrain.train.optim.by_name import check_optimizer_setting

        try:
            optimizer, setting = key.split(".")
            check_optimizer_setting(optimizer, setting, value)
        except ConfigError as exc:
            raise fail(f"can sample {value!r}, which the run refuses: {exc}") from None
        return
    try:
        check_value(section, key, value)
    except ConfigError as exc:
        raise fail(f"can sample {value!r}, which the run refuses: {exc}") from None


def trial_config(rc: RunConfig, settings: SweepSettings, params: dict[str, Any]) -> RunConfig:
    """A trial's config: the sweep's run config with the sampled `params` laid over it (a sampled
    steps drops the file's epochs, and the other way round), each value checked as a file's is."""
    over = RunConfig(workload=rc.workload)
    by_name = {p.name: p for p in settings.space}
    for name, value in params.items():
        p = by_name[name]
        if p.section == "options":
            over.options[p.key] = value
        elif p.section == "optimizers":
            from gputrain.train.optim.by_name import check_optimizer_setting

            optimizer, key = p.key.split(".")
            over.optimizers.setdefault(optimizer, {})[key] = check_optimizer_setting(optimizer, key, value)
        else:
            getattr(over, p.section)[p.key] = check_value(p.section, p.key, value)
    return merge(RunConfig(workload=rc.workload, options=dict(rc.options), optimizers=dict(rc.optimizers),
                           train=dict(rc.train), fit=dict(rc.fit)), over)


def tree_text(rc: RunConfig, header: list[str]) -> str:
    """A RunConfig as a config file (what `gputrain fit --config` reads back)."""
    optimizers = {name: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
                  for name, values in rc.optimizers.items()}
    tables = {"options": rc.options, **({"optimizers": optimizers} if optimizers else {}), "train": {k: list(v) if isinstance(v, tuple) else v for k, v in rc.train.items()},
              "fit": rc.fit}
    return dumps({"workload": rc.workload}, tables, header=header)
