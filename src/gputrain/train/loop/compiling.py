"""torch.compile for a run: whole or regional (runtime/compile_regions.py), with the compile cache
loaded first (runtime/compile_cache.py) and dynamo's compilations watched (runtime/recompiles.py).

`compile_for_run` compiles the model and returns it with a `RunCompile`, what the run keeps of the
compile: the cache (saved after the first step), the watcher (its counts at log points, its seconds
in the time to the first step) and the reason the speed decisions show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from gputrain.config import TrainConfig
    from gputrain.runtime.compile_cache import CompileCache
    from gputrain.runtime.compile_regions import CompiledModel
    from gputrain.runtime.recompiles import RecompileWatcher
    from gputrain.runtime.speed import SpeedSwitches
    from gputrain.train.loop.startup_costs import StartupClock


@dataclass
class RunCompile:
    """What a compiled run keeps of its compile (see the module docstring). compiled: the model as
    compiled (whole, or its repeated blocks); reason: the compile's own words, without the cache's."""

    compiled: CompiledModel
    watcher: RecompileWatcher
    cache: CompileCache | None
    reason: str

    def describe(self) -> str:
        """The compile decision's reason with the cache's state (loaded, saved)."""
        return f"{self.reason}; compile cache {self.cache.describe()}" if self.cache is not None else self.reason

    def after_first_step(self, is_main: bool) -> None:
        """Keep what the first step compiled (its forward and backward) in the compile cache."""
        if self.cache is not None and is_main:
            self.cache.save()

    def seconds(self) -> float:
        """Seconds torch.compile has spent since the run's compile began."""
        self.watcher.poll()
        return self.watcher.compile_time_s

    def counts(self) -> dict[str, int]:
        """A log point's recompilations and graph breaks so far."""
        self.watcher.poll()
        return {"recompilations": self.watcher.recompilations, "graph_breaks": self.watcher.graph_breaks}


def compile_for_run(config: TrainConfig, module: nn.Module, model: nn.Module, device: torch.device,
                    speed: SpeedSwitches, startup: StartupClock) -> tuple[nn.Module, RunCompile]:
    """`model` compiled as TrainConfig.compile says (True: whole; "regional"), after loading the
    compile cache that applies (keyed by the plain `module`); the decision's reason goes into the
    speed decisions (`speed.reasons["compile"]`, kept up to date by `RunCompile.describe`)."""
    from gputrain.runtime.compile_cache import CompileCache, cache_folder, check_folders, keeps_kernels, key_parts
    from gputrain.runtime.compile_regions import compile_model
    from gputrain.runtime.recompiles import RecompileWatcher

    check_folders(config.compile_cache, device)  # before anything is compiled or written
    regional = config.compile == "regional"
    folder = cache_folder(config.compile_cache, config.run_dir)
    cache = None
    if folder is not None:
        how = f"{'regional' if regional else 'whole'} {config.compile_mode or 'default'}"
        cache = CompileCache(folder, key_parts(module, device, how), keep_kernels=keeps_kernels(config.compile_cache,
                                                                                                folder))
        cache.load()
        startup.mark("compile cache load")
    done = compile_model(model, regional=regional, mode=config.compile_mode)
    # after decide_speed's "requested (mode ...; inside gputrain's whole-step CUDA graph)"
    run = RunCompile(done, RecompileWatcher().start(), cache, f"{speed.reasons['compile']}; {done.reason}")
    speed.reasons["compile"] = run.describe()
    return cast(nn.Module, done.model), run
