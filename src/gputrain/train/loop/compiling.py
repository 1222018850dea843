"""torch.compile for a Trainer: whole or regional (runtime/compile_regions.py), with the compile
cache loaded first (runtime/compile_cache.py) and dynamo's compilations watched (runtime/recompiles.py)."""

from __future__ import annotations

from typing import Any, cast

from torch import nn


def compile_for_run(trainer: Any) -> None:
    """Compile `trainer.model` as TrainConfig.compile says (True: whole; "regional"), after loading
    the compile cache that applies; the decision's reason goes into the speed decisions."""
    from gputrain.runtime.compile_cache import CompileCache, cache_folder, key_parts, named_folder
    from gputrain.runtime.compile_regions import compile_model
    from gputrain.runtime.recompiles import RecompileWatcher

    cfg = trainer.config
    regional = cfg.compile == "regional"
    folder = cache_folder(cfg.compile_cache, cfg.run_dir)
    trainer.compile_cache = None
    if folder is not None:
        how = f"{'regional' if regional else 'whole'} {cfg.compile_mode or 'default'}"
        trainer.compile_cache = CompileCache(folder, key_parts(trainer.module, trainer.device, how),
                                             keep_kernels=named_folder(cfg.compile_cache))
        trainer.compile_cache.load()
        trainer.startup.mark("compile cache load")
    done = compile_model(trainer.model, regional=regional, mode=cfg.compile_mode)
    trainer.model = cast(nn.Module, done.model)
    trainer.compiled = done
    # after decide_speed's "requested (mode ...; inside gputrain's whole-step CUDA graph)"
    trainer.speed.reasons["compile"] = f"{trainer.speed.reasons['compile']}; {done.reason}" + (
        f"; compile cache {trainer.compile_cache.describe()}" if trainer.compile_cache is not None else "")
    trainer.recompiles = RecompileWatcher().start()


def after_first_step(trainer: Any) -> None:
    """Keep what the first step compiled (its forward and backward) in the compile cache."""
    cache = getattr(trainer, "compile_cache", None)
    if cache is not None and trainer.is_main:
        cache.save()
        trainer.speed.reasons["compile"] = trainer.speed.reasons["compile"].split("; compile cache")[0] + \
            f"; compile cache {cache.describe()}"


def compile_seconds(trainer: Any) -> float:
    """Seconds torch.compile has spent since the run's compile began (0.0 when not compiled)."""
    if trainer.recompiles is None:
        return 0.0
    trainer.recompiles.poll()
    return trainer.recompiles.compile_time_s


def compile_counts(trainer: Any) -> dict[str, int]:
    """A log point's recompilations and graph breaks so far (runtime/recompiles.py); {} without compile."""
    watcher = trainer.recompiles
    if watcher is None:
        return {}
    watcher.poll()
    return {"recompilations": watcher.recompilations, "graph_breaks": watcher.graph_breaks}

