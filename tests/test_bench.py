"""`gputrain bench`: every benchmark in quick mode on the CPU, the files it writes, and the GPU paths.

The whole `bench all --quick` run happens once (module fixture); the other tests read its results
or run cheap single configurations. GPU tests carry @pytest.mark.gpu.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time

import pytest
import torch

from gputrain import cli
from gputrain.bench import common
from gputrain.bench.common import result_stem, saved_tensor_bytes
from gputrain.runtime.timing import measure
from gputrain.bench.crossover import mlp, step_flops
from gputrain.bench.matmul import matmul_flops, run_matmul
from gputrain.bench.transfer import HOST_MEMCPY, run_transfer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CUDA = torch.cuda.is_available()


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def bench_all(tmp_path_factory):
    """`gputrain bench all --quick --out DIR --json` once: (parsed stdout, out dir, seconds)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("bench")
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["bench", "all", "--quick", "--out", str(out), "--json"])
    assert rc == 0
    return json.loads(buf.getvalue()), out, time.perf_counter() - t0


def _result(bench_all, name):
    return next(r for r in bench_all[0]["results"] if r["benchmark"] == name)


# ---------------------------------------------------------------- counting


@pytest.mark.parametrize("n", [1, 3, 64])
def test_matmul_flops_are_2n3_as_torch_counts_them(n):
    from torch.utils.flop_counter import FlopCounterMode

    a, b = torch.randn(n, n), torch.randn(n, n)
    with FlopCounterMode(display=False) as counter:
        torch.mm(a, b)
    assert matmul_flops(n) == counter.get_total_flops() == 2 * n**3


@pytest.mark.parametrize("features,width,classes,batch", [(4, 16, 3, 150), (784, 64, 10, 32)])
def test_crossover_step_flops_match_torch_flop_counter(features, width, classes, batch):
    from torch.utils.flop_counter import FlopCounterMode

    model = mlp(features, width, classes)
    x, y = torch.randn(batch, features), torch.randint(0, classes, (batch,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert step_flops(features, width, classes, batch) == counter.get_total_flops()


def test_saved_tensor_bytes_counts_activations_not_weights():
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    # Linear saves its input (4x8 fp32 = 128 B) and relu its output (4x16 fp32 = 256 B); the weight is excluded.
    assert saved_tensor_bytes(lambda: torch.relu(layer(x)), exclude=list(layer.parameters())) == 128 + 256


def test_measure_reports_median_min_max_n():
    t = measure(lambda: time.sleep(0.002), torch.device("cpu"), warmup=1, repeats=4, min_sample_s=0.0)
    assert t["n"] == 4 and t["inner"] == 1
    assert 0.002 <= t["min_s"] <= t["median_s"] <= t["max_s"] < 1.0


def test_result_file_name_uses_gpu_name_and_date(monkeypatch):
    monkeypatch.setattr(common, "device_name", lambda d: "NVIDIA H100 80GB HBM3")
    assert common.device_slug(torch.device("cuda", 0)) == "nvidia-h100-80gb-hbm3"
    assert common.device_slug(torch.device("cpu")) == "cpu"
    result = {"benchmark": "matmul", "device_slug": "nvidia-h100-80gb-hbm3", "environment": {"date": "2025-01-31"}}
    assert result_stem(result) == "matmul_nvidia-h100-80gb-hbm3_2025-01-31"


# ---------------------------------------------------------------- matmul


def test_matmul_cpu_rows_and_cap():
    r = run_matmul(device="cpu", quick=True, sizes=[32, 64], cpu_max_size=32)
    rows = {(x["device"], x["dtype"], x["size"]): x for x in r["rows"]}
    for dtype in ("fp32", "bf16"):
        m = rows[("cpu", dtype, 32)]
        assert m["status"] == "measured" and m["flops"] == 2 * 32**3
        assert _finite_positive(m["tflops"]) and m["tflops"] == pytest.approx(m["flops"] / m["median_s"] / 1e12)
        assert m["pct_of_peak"] is None  # no made-up CPU peak
    # without a GPU, sizes above the CPU cap would measure nothing: not run, and said so
    assert r["config"]["sizes"] == [32] and any("64 not run" in n for n in r["notes"])
    for dtype in ("tf32", "fp16"):
        assert rows[("cpu", dtype, 32)]["status"].startswith("n/a")
        assert "tflops" not in rows[("cpu", dtype, 32)]
    assert r["gpu"]["status"] == "no GPU: --device cpu was asked for"
    assert all(s["speedup"] is None and s["status"].startswith("no GPU") for s in r["summary"]["speedup"])
    only_big = run_matmul(device="cpu", quick=True, sizes=[64], cpu_max_size=32)
    assert [x["status"].split(":")[0] for x in only_big["rows"]] == ["skipped", "n/a", "skipped", "n/a"]
    assert "CPU sizes capped at 32" in only_big["rows"][0]["status"]


def test_bench_all_matmul(bench_all):
    r = _result(bench_all, "matmul")
    env = r["environment"]
    for key in ("date", "time", "command", "devices", "driver", "torch", "cuda", "python"):
        assert key in env
    assert env["devices"][0]["device"] == "cpu" and env["torch"] == torch.__version__
    assert r["config"]["quick"] is True and r["config"]["sizes"]
    measured = [x for x in r["rows"] if x["status"] == "measured"]
    assert {x["dtype"] for x in measured if x["device"] == "cpu"} == {"fp32", "bf16"}
    for x in measured:
        assert x["flops"] == 2 * x["size"] ** 3
        assert all(_finite_positive(x[k]) for k in ("median_s", "min_s", "max_s", "tflops"))
        assert x["min_s"] <= x["median_s"] <= x["max_s"] and x["n"] >= 3


# ---------------------------------------------------------------- transfer


def test_transfer_counts_bytes_and_reports_no_gpu_numbers():
    sizes = [4096, 12345]
    r = run_transfer(device="cpu", quick=True, sizes=sizes)
    host = [x for x in r["rows"] if x["label"] == HOST_MEMCPY]
    assert sorted(x["bytes"] for x in host) == sizes
    for x in host:
        assert x["status"] == "measured" and x["direction"] == "h2h"
        assert x["gb_per_s"] == pytest.approx(x["bytes"] / x["median_s"] / 1e9)
        assert _finite_positive(x["gb_per_s"])
    device_rows = [x for x in r["rows"] if x["label"] != HOST_MEMCPY]
    assert len(device_rows) == len(sizes) * 8  # h2d/d2h x pageable/pinned x blocking/non_blocking
    for x in device_rows:
        assert x["status"].startswith("no GPU") and "gb_per_s" not in x and "median_s" not in x
    assert set(r["summary"]["peak_gb_per_s"]) == {HOST_MEMCPY}


# ---------------------------------------------------------------- crossover, precision, memory


@pytest.mark.skipif(CUDA, reason="checks the CPU-only output")
def test_bench_all_crossover_cpu_only(bench_all):
    r = _result(bench_all, "crossover")
    assert r["rows"] and r["summary"]["crossover"].startswith("no GPU")
    for row in r["rows"]:
        assert _finite_positive(row["times"]["cpu"]["median_s"])
        for mode in ("gpu_eager", "gpu_graph", "gpu_eager_sync"):
            assert row["times"][mode] == {"status": r["gpu"]["status"]}
            assert row["speedup"][mode] is None
    assert {(row["data"], row["width"]) for row in r["rows"]} == {
        (d["label"], w) for d in r["config"]["data"] for w in r["config"]["widths"]}


def test_bench_all_precision(bench_all):
    r = _result(bench_all, "precision")
    rows = {(x["workload"], x["precision"]): x for x in r["rows"]}
    assert {w for w, _ in rows} == {"cifar-cnn", "wide-mlp"}
    for (w, p), x in rows.items():
        if x["status"] != "measured":
            assert not CUDA or p in ("tf32", "bf16")  # CPU: tf32/fp16 impossible; old GPUs: tf32/bf16
            assert p in x["status"]  # resolve_precision's reason names the precision
            continue
        assert _finite_positive(x["samples_per_s"]) and math.isfinite(x["final_loss"])
        assert _finite_positive(x["saved_activation_bytes"])
    for w in ("cifar-cnn", "wide-mlp"):
        assert rows[(w, "fp32")]["speedup_vs_fp32"] == 1.0
    if not CUDA:
        assert rows[("cifar-cnn", "fp16")]["status"].startswith("skipped")
        assert rows[("cifar-cnn", "fp32")]["peak_memory_bytes"] is None
        # bf16 autocast keeps the conv activations in bf16: fewer bytes saved for backward.
        assert rows[("cifar-cnn", "bf16")]["activations_vs_fp32"] < 0.9


def test_bench_all_memory(bench_all):
    r = _result(bench_all, "memory")
    plain = [x for x in r["rows"] if not x["recompute"]]
    ckpt = [x for x in r["rows"] if x["recompute"]]
    assert [x["batch"] for x in plain] == r["config"]["batch_sizes"]
    saved = [x["saved_activation_bytes"] for x in plain]
    assert all(b > a for a, b in zip(saved, saved[1:]))  # grows with the batch
    # the same bytes per sample at every batch size (activations are linear in the batch)
    per = [x["saved_bytes_per_sample"] for x in plain]
    assert max(per) / min(per) < 1.2
    assert ckpt, "gputrain.train.step.recompute.apply_recompute should be available"
    assert all(x["activations_vs_plain"] < 0.8 for x in ckpt)
    if not CUDA:
        assert all(x["peak_bytes"] is None for x in r["rows"])
        assert all(v["largest_batch"] is None for v in r["summary"]["largest_batch"].values())


# ---------------------------------------------------------------- files


def test_bench_all_writes_plots_json_and_index(bench_all):
    results, out, _ = bench_all
    assert {r["benchmark"] for r in results["results"]} == {"matmul", "transfer", "crossover", "precision", "memory"}
    for r in results["results"]:
        js = out / r["files"]["json"]
        assert js.name == f"{r['benchmark']}_{r['device_slug']}_{r['environment']['date']}.json"
        assert json.loads(js.read_text())["benchmark"] == r["benchmark"]
        assert r["files"]["plots"], f"{r['benchmark']} wrote no plot"
        for png in r["files"]["plots"]:
            data = (out / png).read_bytes()
            assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    index = (out / "index.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", index)
    assert links and all((out / link).is_file() for link in links)
    for r in results["results"]:
        assert r["files"]["json"] in links and all(p in links for p in r["files"]["plots"])


def test_matmul_cli_json_and_out(tmp_path, capsys):
    rc = cli.main(["bench", "matmul", "--quick", "--sizes", "32", "--json", "--out", str(tmp_path), "--device", "cpu"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["sizes"] == [32] and result["gpu"]["available"] is False
    assert (tmp_path / result["files"]["json"]).is_file()
    assert (tmp_path / result["files"]["plots"][0]).read_bytes().startswith(PNG_MAGIC)


def test_the_training_benchmarks_take_their_declared_settings(capsys):
    """bench precision and bench memory: their flags are generated from their settings
    (gputrain/bench/settings.py) and reach the benchmark; a precision outside the declared choices
    (torch's own list, less auto) is refused by the parser in one line."""
    rc = cli.main(["bench", "precision", "--quick", "--workloads", "wide-mlp", "--precisions", "fp32", "bf16",
                   "--steps", "2", "--batch-size", "8", "--device", "cpu", "--json"])
    config = json.loads(capsys.readouterr().out)["config"]
    assert rc == 0 and (config["workloads"], config["precisions"], config["steps"], config["batch_size"]) == (
        ["wide-mlp"], ["fp32", "bf16"], 2, 8)
    rc = cli.main(["bench", "memory", "--quick", "--workload", "wide-mlp", "--batch-sizes", "4", "2", "--device", "cpu",
                   "--json"])
    config = json.loads(capsys.readouterr().out)["config"]
    assert rc == 0 and (config["workload"], config["batch_sizes"]) == ("wide-mlp", [2, 4])
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "precision", "--precisions", "auto"])
    assert exc.value.code == 2 and "invalid choice: 'auto'" in capsys.readouterr().err


def test_cli_table_says_no_gpu(capsys):
    assert cli.main(["bench", "transfer", "--quick", "--sizes", "4K", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "host memcpy" in out


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "matmul", "--dtypes", "fp64"])
    assert exc.value.code == 2 and "fp64" in capsys.readouterr().err
    assert cli.main(["bench"]) == 2  # no benchmark named: help, exit 2
    assert cli.main(["bench", "matmul", "--device", "gpu", "--quick"]) == 2  # DeviceError, one line
    assert "unknown device 'gpu'" in capsys.readouterr().err


def _as_if_on_a_gpu(results: list[dict]) -> list[dict]:
    """CPU results rewritten as a GPU run would fill them: exercises the GPU branches of the tables,
    plots and index on a machine without one (the numbers are made up; nothing is measured)."""
    import copy

    from gputrain.bench.crossover import GPU_MODES, _crossover

    out = []
    for r in copy.deepcopy(results):
        r["gpu"] = {"available": True, "devices": ["cuda:0"], "status": "measured"}
        r["environment"]["devices"].append({"device": "cuda:0", "name": "NVIDIA H100 80GB HBM3"})
        name = r["benchmark"]
        if name == "matmul":
            cpu = [x for x in r["rows"] if x["status"] == "measured"]
            r["rows"] += [{**x, "device": "cuda:0", "tflops": x["tflops"] * 100, "pct_of_peak": 42.0} for x in cpu]
            r["summary"]["speedup"] = [{"size": x["size"], "dtype": x["dtype"], "gpu": "cuda:0", "cpu_s": x["median_s"],
                                        "gpu_s": x["median_s"] / 100, "speedup": 100.0, "status": "measured"} for x in cpu]
        elif name == "transfer":
            for x in r["rows"]:
                if x["label"] != HOST_MEMCPY:
                    x.update(status="measured", device="cuda:0", median_s=x["bytes"] / 20e9, gb_per_s=20.0)
        elif name == "crossover":
            for i, x in enumerate(r["rows"]):
                for k, mode in enumerate(GPU_MODES):
                    g = x["times"]["cpu"]["median_s"] * (0.5 + i) / (k + 1)
                    x["times"][mode] = {"status": "measured", "median_s": g}
                    x["speedup"][mode] = x["times"]["cpu"]["median_s"] / g
            r["summary"]["crossover"] = _crossover(r["rows"], r["config"])
        elif name == "precision":
            for x in r["rows"]:
                if x["status"] == "measured":
                    x["peak_memory_bytes"] = 123 * 2**20
        elif name == "memory":
            for x in r["rows"]:
                x["peak_bytes"] = x["batch"] * 2**20
            r["summary"]["device_total_bytes"] = 80 * 2**30
            r["summary"]["largest_batch"] = {"plain": {"largest_batch": 16, "hit_out_of_memory": True,
                                                      "note": "16 fits, 32 does not"}}
        out.append(r)
    return out


def test_gpu_shaped_results_render_plot_and_index(bench_all, tmp_path, capsys):
    from gputrain.bench.index import write_index
    from gputrain.bench.plots import plot
    from gputrain.commands.bench import render

    results = _as_if_on_a_gpu(bench_all[0]["results"])
    for r in results:
        r["files"] = {}
        render(r)
        paths = plot(r, tmp_path)
        assert paths and all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    matmul = next(r for r in results if r["benchmark"] == "matmul")
    assert any(p.endswith("_speedup.png") for p in matmul["files"]["plots"])
    out = capsys.readouterr().out
    assert "100.0x" in out and "(42%)" in out  # speed-up and % of peak columns
    cross = next(r for r in results if r["benchmark"] == "crossover")
    first = cross["summary"]["crossover"][0]
    assert first["gpu_eager_wins_from_width"] == min(
        x["width"] for x in cross["rows"] if x["data"] == first["data"] and x["speedup"]["gpu_eager"] > 1)
    index = write_index(results, tmp_path).read_text()
    assert "wins from width" in index and "- GPU: no GPU" not in index


# ---------------------------------------------------------------- GPU paths (skipped without CUDA)


@pytest.mark.gpu
def test_gpu_matmul_bf16_8192_agrees_with_triton_do_bench():
    triton_testing = pytest.importorskip("triton.testing")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def theirs_ms():
        return triton_testing.do_bench(lambda: torch.mm(a, b, out=c), warmup=100, rep=500, return_mode="median")

    # do_bench before and after ours: the clock of a power-limited GPU drifts between runs.
    before = theirs_ms()
    r = run_matmul(device="cuda", sizes=[n], dtypes=["bf16"], cpu_max_size=1)
    after = theirs_ms()
    ours = next(x for x in r["rows"] if x["device"].startswith("cuda") and x["status"] == "measured")
    theirs = 2 * n**3 / (statistics.mean([before, after]) / 1e3) / 1e12
    assert ours["tflops"] == pytest.approx(theirs, rel=0.05), (ours["tflops"], before, after)
    assert ours["pct_of_peak"] is None or 0 < ours["pct_of_peak"] < 110


@pytest.mark.gpu
def test_gpu_matmul_all_dtypes_measured_with_speedup():
    r = run_matmul(device="cuda", quick=True, sizes=[1024], cpu_max_size=1024)  # quick caps the CPU at 256
    gpu_rows = [x for x in r["rows"] if x["device"].startswith("cuda")]
    major, _ = torch.cuda.get_device_capability()
    expected = {"fp32", "fp16"} | ({"tf32", "bf16"} if major >= 8 else set())
    assert {x["dtype"] for x in gpu_rows if x["status"] == "measured"} == expected
    speed = {s["dtype"]: s for s in r["summary"]["speedup"]}
    assert speed["fp32"]["speedup"] > 1  # a 1024^3 fp32 product: any CUDA GPU beats the CPU


@pytest.mark.gpu
def test_gpu_transfer_pinned_beats_pageable_for_large_copies():
    r = run_transfer(device="cuda", sizes=[64 * 2**20])
    get = {x["label"]: x for x in r["rows"] if x["status"] == "measured"}
    assert len([x for x in get if x != HOST_MEMCPY]) == 8
    for direction in ("h2d", "d2h"):
        assert get[f"{direction} pinned non_blocking"]["gb_per_s"] > get[f"{direction} pageable blocking"]["gb_per_s"]
        assert get[f"{direction} pinned blocking"]["bytes"] == 64 * 2**20


@pytest.mark.gpu
def test_gpu_crossover_graphs_help_small_steps():
    r = run_crossover_small()
    iris = next(x for x in r["rows"] if x["data"] == "iris" and x["width"] == 16)
    assert iris["times"]["gpu_graph"]["status"] == "measured"
    # one graph launch instead of ~30 kernel launches: the tiny step gets faster
    assert iris["times"]["gpu_graph"]["median_s"] < iris["times"]["gpu_eager"]["median_s"]
    assert isinstance(r["summary"]["crossover"], list)


def run_crossover_small():
    from gputrain.bench.crossover import run_crossover

    return run_crossover(device="cuda", quick=True, widths=[16, 256])


@pytest.mark.gpu
def test_gpu_precision_reports_peak_memory_and_ratios():
    from gputrain.bench.precision import run_precision

    r = run_precision(device="cuda", quick=True, workloads=["cifar-cnn"], batch_size=256)
    rows = {x["precision"]: x for x in r["rows"]}
    assert rows["fp32"]["status"] == "measured" and rows["fp16"]["status"] == "measured"
    assert all(_finite_positive(x["peak_memory_bytes"]) for x in rows.values() if x["status"] == "measured")
    # fp16 halves what autograd saves; the peak also holds cuDNN workspaces, which differ by
    # algorithm and can outweigh a small model's activations, so the peak is not compared.
    # (Not exactly half: max-pool indices stay int64.) Seen on an H100: 53.8 MB vs 84.0 MB.
    assert rows["fp16"]["saved_activation_bytes"] < 0.8 * rows["fp32"]["saved_activation_bytes"]


@pytest.mark.gpu
def test_gpu_memory_finds_largest_batch_under_a_memory_cap():
    from gputrain.bench.memory import run_memory

    torch.cuda.set_per_process_memory_fraction(0.02)  # ~1.6 GB of an 80 GB card
    try:
        r = run_memory(device="cuda", max_batch=2**20)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    for mode, v in r["summary"]["largest_batch"].items():
        assert v["hit_out_of_memory"] and v["largest_batch"] >= 64, (mode, v)
    plain = r["summary"]["largest_batch"]["plain"]["largest_batch"]
    assert r["summary"]["largest_batch"]["recompute"]["largest_batch"] >= plain
    assert any(x["status"] == "out of memory" for x in r["rows"])
