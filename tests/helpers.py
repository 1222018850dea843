"""What more than one test file uses, written once (pytest puts tests/ on the path: `from helpers import data`).

- what tests train: `data`, `batches`, `DataRows`, `DataStream`, `mlp`, `DictNet`, `tiny_workload`, `sgd`
  (seeded: two calls with the same arguments give the same tensors and weights);
- models that misbehave on cue: `SignalAt` (a signal mid-step), `OOMAbove` (a fake memory limit);
- what tests compare: `params`, `modes`, `records_without_timings` (`TIMING_KEYS` left out),
  `assert_same_tensors`;
- files: `file_names`, `flip_a_byte`, `png_size`, `fork_child` (a child process to kill mid-write);
- what a test may change in its process: `process_state`, `put_back` (the conftest's `_no_leaks` checks it);
- the command line in this process: `cli`;
- subprocesses of the gputrain under test: `subprocess_env` (`launcher_variable`: what it leaves out;
  `unmeasured_env`: without `make coverage`'s measurement, for a child under a file-size limit),
  `free_port`, `server_home` (a throwaway database server's folder and user) and
  `fresh_password`, `start_process`, `process_descendants`, `finish_process`, `torchrun`, `run_python`,
  `TORCHRUN`, `DIST_SCRIPTS`;
- the documentation: `docs_page` (a page of docs/ with its included example files, as the site shows
  it), `DOCS`;
- a real browser: `Browser` (headless Chromium over the DevTools protocol: a page's text, images, console
  errors, network requests and a screenshot), `chromium_binary` (where one is), `browser_session` (a
  fixture's body: a browser for the module's tests, skipped with how to install one where there is none).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, IterableDataset

import gputrain
from gputrain.workloads.base import DataSplits, Workload


def data(n: int = 96, d: int = 6, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): n samples of d standard-normal features, labelled by a random linear map (an MLP
    learns it). x (n, d) float32, y (n,) int64 in [0, classes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    return x, (x @ w).argmax(1)


def batches(n: int = 96, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`data(n)` cut in order into a list of (x, y) batches of `size` samples (the last one shorter)."""
    x, y = data(n)
    return [(x[i:i + size], y[i:i + size]) for i in range(0, n, size)]


class DataRows(Dataset):
    """`data(n)` as a map-style Dataset: one (x, y) sample per index."""

    def __init__(self, n: int = 48):
        self.x, self.y = data(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class DataStream(IterableDataset):
    """`data(n)` as an IterableDataset: the samples in order, no length (what a new user writes)."""

    def __init__(self, n: int = 96):
        self.x, self.y = data(n)

    def __iter__(self):
        return ((self.x[i], self.y[i]) for i in range(len(self.x)))


def mlp(d: int = 6, classes: int = 3, hidden: int = 16, dropout: float | None = None, seed: int = 0) -> nn.Module:
    """d -> hidden (ReLU, then Dropout(dropout) when given) -> classes, with weights from `seed`."""
    torch.manual_seed(seed)
    middle = [nn.Dropout(dropout)] if dropout is not None else []
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), *middle, nn.Linear(hidden, classes))


class DictNet(nn.Module):
    """Takes a dict batch (`features`, `labels`) and returns its own loss (the third way a batch becomes
    a loss)."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, features, labels):
        return {"loss": F.cross_entropy(self.net(features), labels)}


def tiny_workload() -> Workload:
    """uint8 (256, 1, 8, 8) 'images' normalized on the device, 4 classes, a small conv net: exercises
    the whole step (normalization, channels_last, a conv) in milliseconds."""

    def make_data():
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (256, 1, 8, 8), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 4, (256,), generator=g)
        return DataSplits(train=(x, y), mean=(127.5,), std=(64.0,))

    def make_model():
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))

    return Workload(name="tiny", description="test", make_data=make_data, make_model=make_model,
                    loss_fn=nn.CrossEntropyLoss(), defaults={"batch_size": 32})


def sgd(lr: float = 0.1) -> Callable[..., torch.optim.Optimizer]:
    """An optimizer factory for fit's `optimizer=`: plain SGD at `lr` (no momentum, no weight decay)."""
    return lambda p: torch.optim.SGD(p, lr=lr)


class SignalAt(nn.Module):
    """Sends this process `sig` (SIGTERM by default) during the forward of training call `at`
    (mid-step, as a scheduler would); `at=-1`: never (the same module, for resuming its checkpoint)."""

    def __init__(self, inner: nn.Module, at: int, sig: int | None = None):
        super().__init__()
        self.inner, self.at, self.sig, self.n = inner, at, signal.SIGTERM if sig is None else sig, 0

    def forward(self, x):
        if self.training:
            self.n += 1
            if self.n == self.at:
                os.kill(os.getpid(), self.sig)
        return self.inner(x)


class OOMAbove(nn.Module):
    """Raises the allocator's OOM error for training batches larger than `limit` (a fake memory limit;
    evaluation does not split, so it is let through); `ooms` counts the refusals."""

    def __init__(self, inner: nn.Module, limit: int):
        super().__init__()
        self.inner, self.limit, self.ooms = inner, limit, 0

    def forward(self, x):
        if self.training and x.shape[0] > self.limit:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} samples")
        return self.inner(x)


def params(m: nn.Module) -> torch.Tensor:
    """All parameters of `m` as one flat tensor (to compare two models)."""
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def modes(model: nn.Module) -> dict[str, bool]:
    """{submodule name: whether it is in training mode}, for every submodule of `model` ("" is the model)."""
    return {name: m.training for name, m in model.named_modules()}


# What a step's record holds that depends on the machine's speed or memory: left out where runs are compared.
TIMING_KEYS = ("samples_per_s", "wall_time_s", "step_page_faults", "peak_memory_bytes")


def records_without_timings(history) -> list[dict]:
    """`history.records` without TIMING_KEYS: what two runs of the same training must agree on."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in history.records]


def assert_same_tensors(a: dict, b: dict, atol: float = 1e-6) -> None:
    """`a` and `b` (name -> tensor, e.g. state dicts) hold the same names and values within `atol`."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol), (k, (a[k].float() - b[k].float()).abs().max())


# ---------------------------------------------------------------- files


def file_names(folder: Path) -> list[str]:
    """The names in `folder`, sorted."""
    return sorted(p.name for p in folder.iterdir())


def flip_a_byte(path: Path, at: int | None = None) -> None:
    """Damage `path` in place: invert the byte at offset `at` (the middle one by default)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of the PNG image `data` (from its IHDR chunk); fails on anything not a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    return struct.unpack(">II", data[16:24])


def fork_child(run: Callable[[int], object], error_file: Path) -> tuple[int, int]:
    """Fork a child that calls `run(ready_fd)` (it writes a byte to ready_fd once ready) and then exits, never
    returning into pytest; an exception in it goes to `error_file` (exit status 70). Returns (pid, read_fd) to
    the parent, which reads the ready byte from read_fd, closes it and waits for the pid."""
    read_fd, ready_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_fd)
            run(ready_fd)
        except BaseException:  # noqa: BLE001
            with open(error_file, "w") as f:
                traceback.print_exc(file=f)
            code = 70
        finally:
            os._exit(code)
    os.close(ready_fd)
    return pid, read_fd


# ---------------------------------------------------------------- what a test may change in its process

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                 if hasattr(signal, n))


def process_state() -> dict[str, object]:
    """What one test could change for the tests after it on the same worker (under pytest-xdist a
    worker runs another share of the suite on each run): the folder, the handlers of the stop
    signals, torch's thread count, determinism, matmul precision, default dtype and grad mode."""
    return {"cwd": os.getcwd(), "signals": {s: signal.getsignal(s) for s in _SIGNALS},
            "threads": torch.get_num_threads(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "matmul": torch.get_float32_matmul_precision(), "dtype": torch.get_default_dtype(),
            "grad": torch.is_grad_enabled()}


def put_back(state: dict) -> None:
    """Undo what changed since `state = process_state()`."""
    os.chdir(state["cwd"])
    for sig, handler in state["signals"].items():
        if handler is not None:
            signal.signal(sig, handler)
    torch.set_num_threads(state["threads"])
    torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    torch.set_float32_matmul_precision(state["matmul"])
    torch.set_default_dtype(state["dtype"])
    torch.set_grad_enabled(state["grad"])


# ---------------------------------------------------------------- the command line and subprocesses


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`gputrain ARGV...` in this process: (exit status, stdout, stderr); argparse's refusals included."""
    from gputrain.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


DIST_SCRIPTS = Path(__file__).parent / "dist_scripts"  # the programs the multi-process tests launch
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# What a launcher (torchrun, SLURM) sets: a subprocess must not inherit the one the tests run under.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_variable(key: str) -> bool:
    """Whether `key` is set by a launcher (torchrun, Slurm): a subprocess must not inherit it."""
    return key in _LAUNCHER_VARS or key.startswith(("TORCHELASTIC_", "SLURM_"))


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a subprocess of the gputrain under test: no launcher variables, one
    OpenMP thread (the machine is shared), unbuffered output, gloo on loopback, this checkout's src first on
    PYTHONPATH (absolute: it survives a cwd of tmp_path); then `extra`."""
    env = {k: v for k, v in os.environ.items() if not launcher_variable(k)}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    src = str(Path(gputrain.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def unmeasured_env(**extra: str) -> dict[str, str]:
    """subprocess_env without `make coverage`'s measurement of the child: for a child under a file-size
    limit (a full disk), where coverage cannot write its data at exit and would add its own traceback
    to the one line the test reads."""
    env = subprocess_env(**extra)
    for k in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START"):
        env.pop(k, None)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_home(prefix: str, *users: str) -> tuple[Path, str | None]:
    """(a fresh temporary folder for a throwaway database server's files, the user it runs as). Under
    root the user is the first of `users` this machine has (PostgreSQL and MariaDB refuse to run as
    root), and owns the folder; otherwise None (the server runs as ourselves)."""
    import pwd
    import tempfile

    owner = None
    if os.geteuid() == 0:
        owner = next((name for name in users if _is_user(name, pwd)), None)
        if owner is None:
            raise RuntimeError(f"no unprivileged user ({', '.join(users)}) to run the server as")
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if owner is not None:
        shutil.chown(folder, owner)
    return folder, owner


def _is_user(name: str, pwd) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def fresh_password() -> str:
    """A password no other string shares: a grep for it finds only leaks."""
    import uuid

    return "pw-" + uuid.uuid4().hex


def start_process(cmd, **kwargs) -> subprocess.Popen:
    """Start `cmd` in a session of its own (killed whole by `finish_process`), text pipes, `subprocess_env()` unless
    `env=` is given."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=kwargs.pop("env", None) or subprocess_env(), **kwargs)


def process_descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc; [] elsewhere)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def finish_process(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for proc; on a timeout kill it and everything below it, and fail.

    torchrun starts each worker in a session of its own, so killing torchrun's session is not
    enough: the orphaned workers would keep running, and keep stdout/stderr open, so that
    communicate() would wait for them however long they hang.
    """
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        below = process_descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(output unavailable: something below the job still holds its pipes)"
        pytest.fail(f"{proc.args[:6]}... still running after {timeout} s (a hang):\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def torchrun(args, nproc: int = 2, extra=(), timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node=NPROC ARGS` on a free loopback port, to its end (see `finish_process`)."""
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", *extra, *args]
    return finish_process(start_process(cmd, **kwargs), timeout)


def run_python(args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python ARGS` (one process, no launcher), to its end (see `finish_process`)."""
    return finish_process(start_process([sys.executable, *args]), timeout)


# ---------------------------------------------------------------- a real browser

def chromium_binary() -> str | None:
    """A Chromium for the browser tests: $GPUTRAIN_CHROMIUM, else the first on PATH (Debian's `chromium`)."""
    for name in (os.environ.get("GPUTRAIN_CHROMIUM"), "chromium", "chromium-browser", "google-chrome",
                 "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4)."""

    def __init__(self, binary: str, profile_dir: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        # Chromium's ends above fd 9, so that moving them to 3 and 4 cannot overwrite one another.
        cmd_r, resp_w = (_high_fd(fd) for fd in (cmd_r, resp_w))
        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-background-networking", "--disable-extensions", "--hide-scrollbars",
                f"--user-data-dir={profile_dir}", "about:blank"]
        # A small exec shim moves our pipe ends to the fds Chromium reads (3) and writes (4).
        shim = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); os.execv(sys.argv[3], sys.argv[3:])"
        self.proc = subprocess.Popen([sys.executable, "-c", shim, str(cmd_r), str(resp_w), *args],
                                     pass_fds=(cmd_r, resp_w), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(resp_w)
        self._id = 0
        self._replies: dict[int, dict] = {}
        self.events: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=True)

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._resp_r, 1 << 16)
            if not chunk:
                with self._cond:
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    self.events.put(msg)

    def send(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"Chromium did not answer {method} (exit code {self.proc.poll()})")
                self._cond.wait(left)
            reply = self._replies.pop(self._id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def evaluate(self, expression: str):
        r = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"evaluate failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, path: Path | str, screenshot: Path | None = None, width: int = 1200) -> dict:
        """Load a file (or a URL, given as a string); return its text, images, console errors and network
        requests (and screenshot)."""
        while not self.events.empty():
            self.events.get_nowait()
        self.send("Emulation.setDeviceMetricsOverride", session=True, width=width, height=900,
                  deviceScaleFactor=1, mobile=False)
        self.send("Page.navigate", session=True, url=path if isinstance(path, str) else path.resolve().as_uri())
        events = self._until("Page.loadEventFired")
        # decode() rejects an image the browser cannot fully decode (a truncated PNG still has a size)
        decoded = self.evaluate("Promise.all(Array.from(document.images).map(i => i.decode().then(() => true, "
                                "() => false)))")
        time.sleep(0.2)  # late console messages
        while not self.events.empty():
            events.append(self.events.get_nowait())
        images = self.evaluate("Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, "
                               "width: i.naturalWidth, height: i.naturalHeight}))")
        result = {
            "text": self.evaluate("document.body.innerText"),
            "images": [{**i, "decoded": ok} for i, ok in zip(images, decoded)],
            "errors": _errors(events),
            "requests": [e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"],
        }
        if screenshot is not None:
            size = self.send("Page.getLayoutMetrics", session=True)["cssContentSize"]
            shot = self.send("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                             clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1})
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        return result

    def _until(self, method: str, timeout: float = 30) -> list[dict]:
        seen, deadline = [], time.monotonic() + timeout
        while True:
            try:
                e = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"Chromium sent no {method} within {timeout} s") from None
            seen.append(e)
            if e["method"] == method:
                return seen

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except RuntimeError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)


def _high_fd(fd: int) -> int:
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def _errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and browser log errors (failed loads, blocked content)."""
    out = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif e["method"] == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
    return out


# ---------------------------------------------------------------- the documentation

DOCS = Path(__file__).resolve().parents[1] / "docs"
_SNIPPET = re.compile(r'^([ \t]*)--8<-- "([^"]+)"[ \t]*$', re.MULTILINE)
_SECTION_MARK = re.compile(r"^\s*# --8<-- \[(start|end):(\w+)\]\s*$")


def _snippet(ref: str) -> str:
    """The text pymdownx.snippets puts for `--8<-- "ref"`: a file of the repository, or the lines between
    its `# --8<-- [start:NAME]` and `[end:NAME]` markers for "file:NAME"; marker lines left out."""
    file, _, section = ref.partition(":")
    lines = (DOCS.parent / file).read_text().splitlines()
    if section:
        start = next(i for i, line in enumerate(lines) if _SECTION_MARK.match(line) and f"[start:{section}]" in line)
        end = next(i for i, line in enumerate(lines) if i > start and f"[end:{section}]" in line)
        lines = lines[start + 1:end]
    return "\n".join(line for line in lines if not _SECTION_MARK.match(line)).strip("\n")


def docs_page(path: str) -> str:
    """docs/PATH as the site shows it: each snippet line (`--8<-- "docs/examples/x.py"`) replaced by the
    file it names, indented as the line is."""
    return _SNIPPET.sub(lambda m: textwrap.indent(_snippet(m.group(2)), m.group(1)), (DOCS / path).read_text())


def browser_session(tmp_path_factory):
    """A module fixture's body (`yield from browser_session(tmp_path_factory)`): one headless Chromium for the
    module's tests, closed after them; the tests are skipped, saying how to install one, without it."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium on this machine: install Debian's `chromium` (apt-get install chromium; "
                    "`make test` does it when run as root) or set GPUTRAIN_CHROMIUM to a Chromium binary")
    b = Browser(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()
