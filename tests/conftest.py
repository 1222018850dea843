"""Shared test setup: the `gpu` marker skips without CUDA; no test leaks a process group, an env var, its
folder, a signal handler or a torch setting; `-n auto` starts one worker per core (tests/README.md)."""

import os
import sys

import pytest
import torch
from helpers import process_state, put_back

# One thread: on a busy 2-core machine OpenMP threads that spin-wait for a core make small steps
# 100x slower; tests need correctness, not speed.
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (make test): one pytest-xdist worker per CPU core this process may use (its affinity:
    a container's or taskset's share, not the host's count). Most tests run one torch thread, so a
    worker per core keeps every core busy; tests that start processes of their own wait on them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    _group_by_shared_fixture(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none visible to this PyTorch "
                                   f"({torch.__version__}); run `make test-gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's hook, which writes each group into the test's node id
def pytest_collection_finish(session):
    """Under --dist loadgroup (a worker of make test) every grouped test must carry its group in its node
    id, which is what the scheduler reads; a pytest that xdist does not follow drops it silently
    (constraints.txt pins the pair), and the groups would be spread over the workers."""
    if not session.config.getoption("loadgroup", False):  # set in a worker only
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        why = (f"{len(lost)} tests lost their xdist_group (first: {lost[0]}): this pytest and pytest-xdist do "
               "not group; install the versions constraints.txt pins")
        print(f"conftest: {why}", file=sys.__stderr__)  # xdist shows a worker's exception as its own error
        raise pytest.UsageError(why)


def _group_by_shared_fixture(items) -> None:
    """Under `make test` (--dist loadgroup) a test that uses a fixture of module or class scope (one
    Ray run, one torchrun world, one trained run directory shared by its file's tests) joins the
    xdist_group of its file: one worker runs those tests in a row and builds the fixture once. Spread
    over the workers, or run between other files' tests, each return to the file would build it again.
    A test that names its own xdist_group keeps it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        shared = info is not None and any(d.scope in ("module", "class", "package")
                                          for defs in info.name2fixturedefs.values() for d in defs)
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


_WATCHED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
@pytest.fixture(autouse=True)
def _no_leaks():
    import logging

    before = dict(os.environ)
    # The CLI gives the "gputrain" logger its own handler (and stops propagation) for the run log,
    # also when a module-scoped fixture runs it: every test starts and ends with the logger plain, so
    # caplog sees its records.
    logger = logging.getLogger("gputrain")

    def plain():
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)

    plain()
    state = process_state()
    yield
    plain()
    after = process_state()
    changed = sorted(k for k in state if after[k] != state[k])
    if changed:
        put_back(state)
    import torch.distributed as dist

    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    added = {k for k in os.environ if k not in before}
    for k in added:
        os.environ.pop(k, None)
    bad = sorted(k for k in added if k in _WATCHED or k.startswith("GPUTRAIN_"))
    assert not leaked_pg, "test left a torch.distributed process group initialized"
    assert not bad, f"test leaked environment variables: {bad}"
    assert not changed, f"test left the process changed (put back now): {changed}"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private gputrain cache dir (mnist1d etc.) so tests never touch the user's."""
    d = tmp_path / "cache"
    monkeypatch.setenv("GPUTRAIN_CACHE", str(d))
    return d


# ---------------------------------------------------------------- a CUDA stand-in (torch.cuda's queries, never kernels)

GiB = 2**30

# capability -> (name, total memory, SMs) of the GPU a test gets when it names only a capability.
_GPU_PRESETS = {
    (9, 0): ("NVIDIA H100 80GB HBM3", 80 * GiB, 132),
    (8, 0): ("NVIDIA A100-SXM4-80GB", 80 * GiB, 108),
    (7, 0): ("Tesla V100-SXM2-32GB", 32 * GiB, 80),
}


class FakeDeviceProperties:
    """What torch.cuda.get_device_properties(i) returns: the fields gputrain reads, and a few more."""

    def __init__(self, name: str, total_memory: int, major: int, minor: int, multi_processor_count: int,
                 index: int):
        self.name, self.total_memory = name, total_memory
        self.major, self.minor, self.multi_processor_count = major, minor, multi_processor_count
        self.uuid = f"00000000-0000-0000-0000-{index:012d}"
        self.is_integrated, self.is_multi_gpu_board = False, False
        self.L2_cache_size = 50 * 2**20

    def __repr__(self) -> str:
        return (f"FakeDeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count})")


class FakeGpu:
    """One fake device: its facts and the caching allocator's counters (bytes), which tests move."""

    def __init__(self, index: int, name: str, capability: tuple[int, int], total_memory: int, free_memory: int,
                 multiprocessors: int):
        self.index, self.name, self.capability = index, name, tuple(capability)
        self.total_memory, self.free_memory = int(total_memory), int(free_memory)
        self.properties = FakeDeviceProperties(name, self.total_memory, capability[0], capability[1],
                                               multiprocessors, index)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def free_now(self) -> int:
        """What mem_get_info reports free: the free memory given, less what this process's cache holds."""
        return max(0, self.free_memory - self.reserved)


class FakeCuda:
    """The machine `fake_cuda(...)` makes torch.cuda report. See the fixture for what is patched.

    gpus: one FakeGpu per device; current: the current device's index; calls: how often each no-op
    (set_device, synchronize, empty_cache) and gputrain's probe allocation ran.
    """

    def __init__(self, *, name: str | None = None, capability: tuple[int, int] = (9, 0),
                 total_memory: int | None = None, free_memory: int | None = None, count: int = 1,
                 multiprocessors: int | None = None, cuda_version: str = "12.6", cudnn_version: int = 90100,
                 probe_error: str | None = None):
        import collections

        major, minor = capability
        preset = _GPU_PRESETS.get((major, minor), (f"Fake GPU sm_{major}{minor}", 16 * GiB, 40))
        name = name or preset[0]
        total = int(total_memory if total_memory is not None else preset[1])
        free = int(free_memory if free_memory is not None else max(0, total - GiB))  # the driver's context: ~1 GiB
        if free > total:
            raise ValueError(f"free_memory {free} > total_memory {total}")
        self.gpus = [FakeGpu(i, name, capability, total, free, multiprocessors or preset[2]) for i in range(count)]
        self.current = 0
        self.cuda_version, self.cudnn_version, self.probe_error = cuda_version, cudnn_version, probe_error
        self.calls: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------ devices as torch.cuda takes them

    def index(self, device=None, what: str = "query") -> int:
        """The device index torch.cuda would use for `device` (None, int, "cuda:N", torch.device);
        raises as torch does for a device that is not CUDA or does not exist."""
        if device is None:
            idx = self.current
        elif isinstance(device, (str, torch.device)):
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            idx = self.current if device.index is None else device.index
        else:
            idx = int(device)
        if not 0 <= idx < len(self.gpus):
            if what == "properties":
                raise AssertionError("Invalid device id")
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{idx} on a machine with "
                               f"{len(self.gpus)} device{'s' if len(self.gpus) != 1 else ''})")
        return idx

    def gpu(self, device=None) -> FakeGpu:
        return self.gpus[self.index(device)]

    # ------------------------------------------------ a step's memory, as a test wants the counters

    def allocate(self, nbytes: int, device=None) -> None:
        """Tensors of `nbytes` come alive on `device`: allocated, reserved (2 MiB blocks) and the peaks move."""
        g = self.gpu(device)
        g.allocated += int(nbytes)
        g.reserved = max(g.reserved, -(-g.allocated // (2 * 2**20)) * 2 * 2**20)
        g.peak_allocated = max(g.peak_allocated, g.allocated)
        g.peak_reserved = max(g.peak_reserved, g.reserved)

    def release(self, nbytes: int, device=None) -> None:
        """Tensors of `nbytes` are freed; the cache keeps their blocks reserved (as PyTorch's does)."""
        g = self.gpu(device)
        g.allocated = max(0, g.allocated - int(nbytes))

    # ------------------------------------------------ the torch.cuda functions

    def _memory_stats(self, device=None) -> dict:
        g = self.gpu(device)
        return {"allocated_bytes.all.current": g.allocated, "allocated_bytes.all.peak": g.peak_allocated,
                "reserved_bytes.all.current": g.reserved, "reserved_bytes.all.peak": g.peak_reserved,
                "active_bytes.all.current": g.allocated, "num_alloc_retries": 0, "num_ooms": 0}

    def _reset_peak(self, device=None) -> None:
        g = self.gpu(device)
        g.peak_allocated, g.peak_reserved = g.allocated, g.reserved

    def _set_device(self, device) -> None:
        self.calls["set_device"] += 1
        if isinstance(device, int) and device < 0:
            return  # torch: a no-op for a negative index
        self.current = self.index(device)

    def _is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # As torch answers it: True at 8.0+; below, with emulation allowed (the default), whether a
        # bf16 tensor can be made on the device, which on a real V100/T4 succeeds, so: True.
        return self.gpu().capability[0] >= 8 or bool(including_emulation)

    def _probe(self, device: torch.device) -> None:
        """gputrain's test allocation (devices._probe): checks the index, allocates nothing."""
        self.calls["probe"] += 1
        self.index(device)
        if self.probe_error:
            raise RuntimeError(self.probe_error)

    def install(self, monkeypatch) -> "FakeCuda":
        from gputrain.runtime import devices

        def count(name):
            def no_op(*args, **kwargs):
                self.calls[name] += 1
            return no_op

        cuda = {
            "is_available": lambda: True,
            "device_count": lambda: len(self.gpus),
            "current_device": lambda: self.current,
            "set_device": self._set_device,
            "synchronize": count("synchronize"),
            "empty_cache": count("empty_cache"),
            "get_device_name": lambda device=None: self.gpus[self.index(device, "properties")].name,
            "get_device_capability": lambda device=None: self.gpus[self.index(device, "properties")].capability,
            "get_device_properties": lambda device=None: self.gpus[self.index(device, "properties")].properties,
            "mem_get_info": lambda device=None: (self.gpu(device).free_now(), self.gpu(device).total_memory),
            "memory_allocated": lambda device=None: self.gpu(device).allocated,
            "memory_reserved": lambda device=None: self.gpu(device).reserved,
            "max_memory_allocated": lambda device=None: self.gpu(device).peak_allocated,
            "max_memory_reserved": lambda device=None: self.gpu(device).peak_reserved,
            "memory_stats": self._memory_stats,
            "reset_peak_memory_stats": self._reset_peak,
            "is_bf16_supported": self._is_bf16_supported,
            "get_arch_list": lambda: ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
        }
        for attr, fn in cuda.items():
            assert hasattr(torch.cuda, attr), f"torch.cuda.{attr} does not exist: the stand-in must only replace"
            monkeypatch.setattr(torch.cuda, attr, fn)
        monkeypatch.setattr(torch.version, "cuda", self.cuda_version)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: self.cudnn_version)
        monkeypatch.setattr(devices, "_probe", self._probe)
        return self


@pytest.fixture
def fake_cuda(monkeypatch):
    """A factory that makes torch.cuda REPORT CUDA devices on a CPU-only machine, undone after the test.

        gpu = fake_cuda()                                  # one NVIDIA H100 80GB HBM3, capability 9.0
        gpu = fake_cuda(capability=(7, 0), count=4)        # four Tesla V100-SXM2-32GB
        gpu = fake_cuda(total_memory=16 * GiB, free_memory=2 * GiB, name="Tesla T4", capability=(7, 5))
        gpu.allocate(3 * GiB); gpu.release(1 * GiB)        # move the allocator's counters (and peaks)
        gpu.gpus[0].free_memory = 10 * GiB                 # change a fact mid-test; gpu.current, gpu.calls

    Patched (monkeypatch): torch.cuda's queries (is_available, device_count, current_device,
    get_device_name / _capability / _properties, mem_get_info, memory_allocated / _reserved,
    max_memory_allocated / _reserved, memory_stats, reset_peak_memory_stats, is_bf16_supported,
    get_arch_list), set_device / synchronize / empty_cache as counted no-ops, torch.version.cuda
    (a CUDA build), torch.backends.cudnn.version, and gputrain's test allocation `devices._probe`.
    gputrain's other probes (_cuda_built, _cuda_available, _cuda_count, _cuda_name) are left real:
    they read the patched torch, so a broken probe fails here too.

    Never faked: tensors, streams, events, graphs, generators, autocast kernels. Anything that makes a
    real CUDA tensor still fails ("Torch not compiled with CUDA enabled"); that code stays in `gpu` tests.
    torch.cuda.is_initialized() stays False (nothing real was initialized), so torch's lazy CUDA
    calls (seeding) are queued, never run.
    """
    def make(**kwargs) -> FakeCuda:
        return FakeCuda(**kwargs).install(monkeypatch)

    return make


class SideStreamOnCpu:
    """The device feed's side stream (data/device_feed.py), stood in for on the CPU: a copy and a
    hand-over give the batch back as it is and are recorded in `events`, in order, as ("copy", batch)
    and ("hand over", batch); `streams` counts the side streams made (one per pass over a source)."""

    def __init__(self):
        self.streams = 0
        self.events: list[tuple[str, object]] = []

    def __call__(self, device: torch.device):
        self.streams += 1

        def start_copy(batch):
            self.events.append(("copy", batch))
            return batch

        def hand_over(batch):
            self.events.append(("hand over", batch))
            return batch

        return start_copy, hand_over


@pytest.fixture
def side_stream_on_cpu(monkeypatch) -> SideStreamOnCpu:
    """The device feed reads ahead on the CPU, as it does on CUDA: its side stream (CUDA's stream,
    non_blocking copies, record_stream) is replaced by `SideStreamOnCpu`, for every device. The order of
    reads, copies and hand-overs, and the read-ahead rule (which sources read ahead), are then the CUDA
    run's; the batches stay where they are."""
    from gputrain.data import device_feed

    stand_in = SideStreamOnCpu()
    monkeypatch.setattr(device_feed, "side_stream", stand_in)
    return stand_in


# ---------------------------------------------------------------- CUDA graphs with capture semantics, on the CPU


@pytest.fixture
def capture_graphs(monkeypatch):
    """`fit` on the CPU takes the CUDA-graph path (runtime/speed.py lets "cpu" capture), through the
    stand-in of tests/graph_capture.py: capture records the step's ops, replay re-issues them and runs
    no Python. Call the returned function with EagerGraphs for the eager reference (every capture
    fails, every step runs eagerly on the same optimizer). `CaptureGraphs.instances` lists the
    backends made."""
    import gputrain.runtime.speed as speed
    import gputrain.train.step.graphs as graphs
    from graph_capture import CaptureGraphs

    monkeypatch.setattr(speed, "GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    CaptureGraphs.instances.clear()

    def use(backend=CaptureGraphs):
        monkeypatch.setattr(graphs, "CudaGraphs", backend)
        return backend

    use()
    yield use
    CaptureGraphs.instances.clear()
