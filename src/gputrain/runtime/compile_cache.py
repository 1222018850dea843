"""Compiled artifacts that outlive the process: a run, its resume and a sweep's trials start warm.

torch's "mega-cache" (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`) packs what
inductor and AOTAutograd compiled in this process (FX graph cache, autograd cache, Triton
autotuning) into one byte string; loaded into a new process before its first compile, the compile
finds its kernels there instead of generating and building them. Dynamo still traces the model.

The artifacts are kept in a folder (TrainConfig.compile_cache, else $GPUTRAIN_COMPILE_CACHE, else
RUN_DIR/compile_cache), one pair of files per key: `<key>.bin` (the bytes) and `<key>.json` (what
the key was made of). The key is the torch version, the device (type and name), the model's
fingerprint (class, parameter names, shapes and dtypes) and how it is compiled; a file whose
description differs from this run's is never loaded, and the run log says so.

The mega-cache holds inductor's generated code but not what that code builds when it loads: on a
CPU every C++ kernel is compiled again from its source (on a first-step profile of the 12-block
GPT-mini, nearly all of a warm start's compile time). Those libraries live in inductor's on-disk
cache, TORCHINDUCTOR_CACHE_DIR, keyed by torch itself (source, compiler and flags, torch's own
hash), which PyTorch's caching guide recommends pointing at a persistent folder. So a folder that
is named (TrainConfig.compile_cache, $GPUTRAIN_COMPILE_CACHE; a sweep names SWEEP_DIR/compile_cache
for its trials) also holds inductor's cache, `inductor/`, as this process's TORCHINDUCTOR_CACHE_DIR,
unless the environment names one (then that choice stands, and the run log says so). The default
RUN_DIR/compile_cache does not: inductor's own default folder (shared by every run on the machine,
where a new run of the same model finds its kernels) stays, and the mega-cache alone is kept with
the run (complete on a GPU, where inductor bundles the Triton kernels into it; on a CPU the C++
kernels are built again on a resume that has not the machine's folder). Nor does a named folder
whose path holds a space: inductor's C++ build splits its compiler's command line at spaces, so its
kernels stay in its default folder and the mega-cache alone goes into the named one.

Before anything is compiled or written (`check_folders`), a folder that cannot be one is refused in
one line: the named folder or the TORCHINDUCTOR_CACHE_DIR the user set when it is a file, below a
file or not writable, and that TORCHINDUCTOR_CACHE_DIR when its path holds a space (on the CPU).
A blank $GPUTRAIN_COMPILE_CACHE or TORCHINDUCTOR_CACHE_DIR is taken as unset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from gputrain.errors import ConfigError

log = logging.getLogger("gputrain")

ENV = "GPUTRAIN_COMPILE_CACHE"
RUN_DIR_FOLDER = "compile_cache"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # torch's own variable (torch/_inductor/runtime/cache_dir_utils.py)
INDUCTOR_FOLDER = "inductor"
# The TORCHINDUCTOR_CACHE_DIR this module set in this process (None: it set none): a later run with
# another folder may move it; one the user set is never moved.
_set_here: str | None = None


def _env(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The variable's value, None when unset or blank (a blank value names no folder)."""
    value = env.get(name)
    return value if value is not None and value.strip() else None


def check_folders(setting: str | bool | None, device: torch.device | None,
                  env: Mapping[str, str] = os.environ) -> None:
    """Refuse (ConfigError, one line), before anything is compiled or written, a folder the compile
    cache would write in that cannot take it: the named folder (`setting`, else $GPUTRAIN_COMPILE_CACHE)
    or the user's TORCHINDUCTOR_CACHE_DIR when it is a file, below a file or not writable (nothing is
    created to find out); on a CPU `device`, a TORCHINDUCTOR_CACHE_DIR whose path holds a space."""
    from gputrain.io.preflight import check_output_dir

    if isinstance(setting, str) and setting:
        check_output_dir(setting, "[train] compile_cache")
    elif setting is not False and _env(ENV, env) is not None:
        check_output_dir(env[ENV], ENV)
    inductor = _env(INDUCTOR_ENV, env)
    if inductor is None or inductor == _set_here:
        return
    check_output_dir(inductor, INDUCTOR_ENV)
    if device is not None and device.type == "cpu" and _has_space(inductor):
        raise ConfigError(f"{INDUCTOR_ENV}={inductor!r} holds a space, which inductor's C++ build on the CPU cannot "
                          "take (it splits its compiler's command line at spaces): set it to a folder without "
                          "spaces, or unset it")


def _has_space(path: str) -> bool:
    return any(c.isspace() for c in os.path.abspath(path))


def use_for_inductor(folder: Path) -> Path | None:
    """Point inductor's on-disk cache at `folder`/inductor for this process (before its first
    compile: torch reads the variable on each use), unless the environment names another. Returns
    the folder now in use, or None when the user's TORCHINDUCTOR_CACHE_DIR stands."""
    from gputrain.torch_compat import inductor_default_cache_dir

    global _set_here
    current = _env(INDUCTOR_ENV)
    # inductor's first use writes its default folder into the variable: that one is not the user's
    if current and current != _set_here and os.path.abspath(current) != inductor_default_cache_dir():
        return None
    target = str((folder / INDUCTOR_FOLDER).resolve())
    os.environ[INDUCTOR_ENV] = _set_here = target
    return Path(target)


def named_folder(setting: str | bool | None) -> bool:
    """Whether the cache folder is one the user named (a folder in `setting`, or
    $GPUTRAIN_COMPILE_CACHE) rather than the run's own RUN_DIR/compile_cache."""
    return setting is not False and (bool(isinstance(setting, str) and setting) or _env(ENV) is not None)


def keeps_kernels(setting: str | bool | None, folder: Path) -> bool:
    """Whether inductor's on-disk cache goes into `folder` too: a named folder whose path holds no
    space (inductor's C++ build splits its command line at spaces)."""
    return named_folder(setting) and not _has_space(str(folder))


def cache_folder(setting: str | bool | None, run_dir: str | None) -> Path | None:
    """Where the artifacts live: `setting` (a folder; False: nowhere), $GPUTRAIN_COMPILE_CACHE,
    RUN_DIR/compile_cache; None when none applies."""
    if setting is False:
        return None
    if isinstance(setting, str) and setting:
        return Path(setting)
    if (named := _env(ENV)) is not None:
        return Path(named)
    return Path(run_dir) / RUN_DIR_FOLDER if run_dir else None


def key_parts(model: nn.Module, device: torch.device, how: str) -> dict[str, str]:
    """What a cache must match to be loaded: torch, device, model fingerprint, how it is compiled."""
    from gputrain.runtime.devices import device_name

    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    fingerprint = hashlib.sha256(repr((type(model).__qualname__, params)).encode()).hexdigest()[:16]
    return {"torch": torch.__version__, "device": f"{device.type}:{device_name(device)}",
            "model": f"{type(model).__name__} {fingerprint}", "compile": how}


def _digest(parts: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class CompileCache:
    """One run's compile cache: `load()` before the first compile, `save()` after the first step."""

    folder: Path
    parts: dict[str, str]
    loaded: bool = False  # artifacts were loaded into this process
    saved: bool = False
    load_s: float = 0.0  # seconds reading and loading them (perf_counter)
    keep_kernels: bool = False  # a named folder: inductor's on-disk cache goes into it (use_for_inductor)
    inductor: Path | None = None  # inductor's on-disk cache when it is kept in the folder
    ignored: list[str] = field(default_factory=list)  # why other caches in the folder were not used

    @property
    def key(self) -> str:
        return _digest(self.parts)

    def _paths(self) -> tuple[Path, Path]:
        return self.folder / f"{self.key}.bin", self.folder / f"{self.key}.json"

    def load(self) -> bool:
        """Load this key's artifacts when the folder holds them and their description matches;
        log why a cache there was ignored. Returns whether artifacts were loaded."""
        import time

        t0 = time.perf_counter()
        # first: the artifacts loaded below are written into inductor's cache
        self.inductor = use_for_inductor(self.folder) if self.keep_kernels else None
        if not self.keep_kernels and _has_space(str(self.folder)):
            log.info("compile cache: inductor's kernels stay in its default folder, not in %s (a path with a space, "
                     "which its C++ build cannot take)", self.folder)
        if self.keep_kernels and self.inductor is None:
            log.info("compile cache: inductor's kernels stay in %s=%s (set in the environment), not in %s",
                     INDUCTOR_ENV, os.environ.get(INDUCTOR_ENV), self.folder)
        blob, meta = self._paths()
        if blob.is_file() and meta.is_file() and self._matches(meta):
            try:
                torch.compiler.load_cache_artifacts(blob.read_bytes())
            except Exception as exc:  # noqa: BLE001 - a damaged file costs a cold compile, never the run
                self._ignore(meta, f"unreadable artifacts ({type(exc).__name__}: {exc})")
            else:
                self.loaded = True
                log.info("compile cache: loaded %s (%d bytes) from %s", blob.name, blob.stat().st_size, self.folder)
        else:
            self._note_others()
        self.load_s = time.perf_counter() - t0
        return self.loaded

    def _matches(self, meta: Path) -> bool:
        try:
            stored = json.loads(meta.read_text())
        except (OSError, ValueError):
            stored = None
        if stored == self.parts:
            return True
        self._ignore(meta, stored)
        return False

    def _note_others(self) -> None:
        """Every description in the folder made for another torch, device or model: one line each."""
        if not self.folder.is_dir():
            return
        for meta in sorted(self.folder.glob("*.json")):
            if meta.stem == self.key:
                continue
            try:
                stored = json.loads(meta.read_text())
            except (OSError, ValueError):
                stored = None
            self._ignore(meta, stored)

    def _ignore(self, meta: Path, stored: Any) -> None:
        if isinstance(stored, dict):
            differs = [f"{k} {stored.get(k)!r} here {v!r}" for k, v in self.parts.items() if stored.get(k) != v]
            why = "made for another " + "; ".join(differs) if differs else "description does not match its name"
        else:
            why = stored if isinstance(stored, str) else "unreadable description"
        line = f"compile cache {meta.with_suffix('.bin').name} in {self.folder} ignored: {why}"
        self.ignored.append(line)
        log.info("%s", line)

    def save(self) -> bool:
        """Write what this process compiled (after the first step: forward and backward are compiled),
        unless it was loaded unchanged. Returns whether a file was written."""
        from gputrain.io.atomic import atomic_file

        if self.loaded:
            return False  # the same artifacts are there already
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        data, _info = artifacts
        blob, meta = self._paths()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_file(blob, "wb") as f:
                f.write(data)
            with atomic_file(meta, "w") as f:  # the description last: a blob without one is never loaded
                json.dump(self.parts, f, indent=1, sort_keys=True)
        except OSError as exc:  # a full or read-only disk costs the next start its warm compile, not this run
            log.warning("compile cache: could not write to %s (%s); the next start compiles again", self.folder, exc)
            return False
        self.saved = True
        log.info("compile cache: saved %s (%d bytes) to %s", blob.name, len(data), self.folder)
        return True

    def describe(self) -> str:
        state = "loaded" if self.loaded else "saved after the first step" if self.saved else "empty"
        kernels = "; kernels kept" if self.inductor is not None else ""
        return f"{state} ({self.folder}{kernels})"
