"""report.html (and bench's index.html): what the page says, that it is self-contained, and how a real
browser renders it.

The browser tests drive headless Chromium (Debian's `chromium` package) over the DevTools protocol
on a pipe (--remote-debugging-pipe: no port, no websocket library, no browser download). They check
the rendered text, that every image decodes, that the console shows no error, that the page asks
the network for nothing, and keep a full-page screenshot under pytest's tmp dir. Without Chromium
they skip and say how to install it (`make test` installs it as root on Debian).
"""

import base64
import json
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import browser_session, png_size

from gputrain import cli
from gputrain.report.html import render_report, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"  # the IEND chunk and its CRC: the file is whole

# A profile summary as `gputrain profile --out RUN_DIR` writes it (the keys the report reads).
PROFILE = {
    "workload": "digits-cnn", "device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "precision": "bf16",
    "batch_size": 64, "date": "2026-11-23T09:05:41", "timed_steps": 20, "step_ms": 2.5, "samples_per_s": 25600.0,
    "breakdown": [{"phase": "data", "ms": 0.05, "share": 0.02}, {"phase": "forward", "ms": 0.8, "share": 0.32},
                  {"phase": "backward", "ms": 1.4, "share": 0.56}, {"phase": "optimizer", "ms": 0.25, "share": 0.10}],
    "top_ops": [{"name": "aten::convolution_backward", "calls_per_step": 2, "self_device_ms_per_step": 0.6,
                 "share": 0.24}],
    "top_ops_by": "self device time", "flops_per_step": 4.6e8, "achieved_tflops": 0.18, "peak_tflops": 989.0,
    "mfu": 0.0002,
    "verdict": {"verdict": "launch-bound", "evidence": ["median kernel 4.1 us; GPU busy 23% of the profiled steps"],
                "suggestions": ["CUDA graphs (`--cuda-graphs on`)"], "also": ["a larger batch"]},
}

# What a GPU run's summary adds (the decision log, warnings, device memory, ...).
GPU_EXTRAS = {
    "device_memory_bytes": 80 * 2**30,
    "peak_memory_bytes": int(1.5 * 2**30),
    "decisions": [{"name": "cuda_graphs", "value": "on", "reason": "static shapes, capturable optimizer"},
                  {"name": "data", "value": "device-resident", "reason": "the data set takes 2% of free memory"},
                  {"name": "precision", "value": "bf16", "reason": "auto: bf16 autocast on an sm_90 GPU"},
                  {"name": "channels_last", "value": "on", "reason": "2D convolutions run faster in NHWC"}],
    "warnings": ["out of memory at step 12: micro-batch halved"],
    "oom_splits": 2,
    "nonfinite_steps": [17, 18],
    "loss_spikes": [{"step": 20, "loss": 9.5}],
    "recompilations": 3,
}


# ---------------------------------------------------------------- a real run directory

@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    """`gputrain fit digits-cnn --run-dir D --steps 30`: a real run directory (a few seconds)."""
    d = tmp_path_factory.mktemp("fit") / "run"
    # The summary's one measured warning, the page-fault advice, depends on how loaded the machine is
    # (runtime/host_memory.py): said to be set, the allocator is not advised on, so the page has no
    # warnings on any machine (the warnings' rendering has tests of its own below).
    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.trim_threshold=268435456"
    try:
        rc = cli.main(["fit", "digits-cnn", "--run-dir", str(d), "--steps", "30", "--log-every", "10",
                       "--quiet", "--progress", "off", "--json"])
    finally:
        if saved is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = saved
    assert rc == 0 and (d / "history.json").is_file()
    return d


@pytest.fixture
def run_copy(fit_run, tmp_path):
    """A private copy of the run directory (without its checkpoint) that a test may change."""
    d = tmp_path / "run"
    d.mkdir()
    for name in ("history.json", "metrics.jsonl"):
        shutil.copy(fit_run / name, d / name)
    return d


def _history(d: Path) -> dict:
    return json.loads((d / "history.json").read_text())


def _with_summary(d: Path, **extra) -> dict:
    h = _history(d)
    h["summary"].update(extra)
    (d / "history.json").write_text(json.dumps(h))
    return h


class _Page(HTMLParser):
    """Tags, attributes and visible text of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.text = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def all(self, tag):
        return [a for t, a in self.tags if t == tag]

    def handle_endtag(self, tag):
        if tag in ("td", "th", "tr", "p", "li", "div", "h1", "h2", "h3", "figcaption", "summary", "table"):
            self.text.append(" ")  # a block's or a cell's end separates words; inline tags do not

    @property
    def plain(self) -> str:
        return " ".join("".join(self.text).split())


def _assert_self_contained(page: _Page) -> list[bytes]:
    """No script, stylesheet link, frame or remote URL; every image an inline PNG. Returns the PNGs."""
    assert not page.all("script") and not page.all("link") and not page.all("iframe")
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            url = attrs.get(name) or ""
            assert not url.startswith(("http:", "https:", "//")), f"<{tag} {name}={url[:60]}> reaches the network"
    pngs = []
    for img in page.all("img"):
        src = img["src"]
        assert src.startswith("data:image/png;base64,"), src[:40]
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_MAGIC) and len(data) > 1000 and data.endswith(PNG_END), "not a whole PNG"
        pngs.append(data)
    return pngs


# ---------------------------------------------------------------- the page's content

def test_report_of_a_fit_run_shows_summary_curves_and_decisions(fit_run, tmp_path):
    path = write_report(fit_run, out=tmp_path / "report.html")
    h = _history(fit_run)
    s, last = h["summary"], h["records"][-1]
    page = _Page(path.read_text())
    text = page.plain
    pngs = _assert_self_contained(page)
    # curves: loss, eval accuracy, lr, samples/s (a CPU run has no peak memory series)
    assert len(pngs) == 4 and all(png_size(p)[0] >= 400 for p in pngs)
    assert {i["alt"] for i in page.all("img")} == {"loss curve", "eval_accuracy curve", "learning rate curve",
                                                    "samples/s curve"}
    # the title: the workload (where the summary names it) or the run directory's name
    assert f"gputrain run: {s.get('workload') or fit_run.name}" in text and s["device"] in text
    assert f"{s['samples_per_s']:,.0f}" in text
    assert f"{s['final_loss']:.4g}" in text
    assert f"{s['final_eval_accuracy']:.4f} / {s['best_eval_accuracy']:.4f}" in text  # the summary table's row
    assert f"{last['eval_accuracy']:.6g}" in text  # the log points table
    for d in s["decisions"]:  # every decision and its reason
        assert d["name"] in text and d["reason"] in text
    assert "not measured on this device" in text
    assert "No warnings" in text
    assert "No profile in this run directory" in text and "gputrain profile WORKLOAD --out RUN_DIR" in text


def test_report_shows_memory_warnings_and_profile_when_present(run_copy):
    _with_summary(run_copy, **GPU_EXTRAS)
    (run_copy / "profile_summary.json").write_text(json.dumps(PROFILE))
    page = _Page(write_report(run_copy).read_text())
    text = page.plain
    pngs = _assert_self_contained(page)
    assert len(pngs) == 5  # the four curves and the time breakdown (no memory series in the records)
    assert "1.5 GiB of 80.0 GiB (1.9%)" in text
    bar = [a for _, a in page.tags if a.get("title") == "peak memory / device memory"]
    assert bar, "no memory bar"
    assert "static shapes, capturable optimizer" in text and "device-resident" in text
    assert "out of memory at step 12: micro-batch halved" in text
    assert "micro-batches were split 2x" in text
    assert "non-finite loss (NaN/inf), steps: 2 (17, 18)" in text
    assert "loss spikes, steps: 1" in text and "torch.compile recompilations: 3" in text
    assert "launch-bound" in text and "median kernel 4.1 us" in text and "--cuda-graphs on" in text
    assert all(p in text for p in ("forward", "backward", "optimizer", "56.0%", "1.40 ms"))
    assert "MFU: 0.0%" in text and "aten::convolution_backward" in text


def test_report_of_an_older_or_unfinished_run(run_copy):
    h = _history(run_copy)
    for key in ("decisions", "warnings", "device_memory_bytes", "nonfinite_steps", "loss_spikes", "recompilations"):
        h["summary"].pop(key, None)
    h["records"][1]["loss"] = float("nan")
    (run_copy / "history.json").write_text(json.dumps(h))
    text = _Page(write_report(run_copy).read_text()).plain
    assert "has no decision log" in text and "AdamW" in text
    assert f"non-finite train loss (NaN/inf) at log points, steps: 1 ({h['records'][1]['step']})" in text

    (run_copy / "history.json").unlink()  # a run that crashed before its end: metrics.jsonl only
    page = _Page(write_report(run_copy).read_text())
    assert "history.json is missing" in page.plain and "No summary" in page.plain
    assert len(_assert_self_contained(page)) == 4


def test_long_runs_keep_the_page_small():
    from gputrain.report.html import MAX_TABLE_RECORDS

    records = [{"step": i, "loss": 1.0 / i} for i in range(1, 1201)]
    page = _Page(render_report(records, {}))
    rows = [a for t, a in page.tags if t == "tr"]
    assert len(rows) == MAX_TABLE_RECORDS + 1  # and the header
    assert "of 1200 log points" in page.plain and len(_assert_self_contained(page)) == 1


def test_render_report_escapes_what_it_shows():
    out = render_report([{"step": 1, "loss": 1.0}], {"device": "<script>alert(1)</script>",
                                                     "warnings": ["<img src=x onerror=alert(1)>"]})
    assert "<script>alert" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    assert "<img src=x" not in out


def test_report_command(fit_run, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert cli.main(["report", str(fit_run), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out and out.read_text().startswith("<!DOCTYPE html>")
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such run directory" in err and "missing" in err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no history.json or metrics.jsonl" in err and "--run-dir" in err


def _bench_results(out: Path) -> list[dict]:
    """Two bench results shaped as `bench all` makes them, each with one real PNG plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = []
    for name in ("memory", "transfer"):
        fig = Figure(figsize=(4, 3), dpi=100)
        FigureCanvasAgg(fig)
        fig.add_subplot(1, 1, 1).plot([1, 2, 3], [3, 1, 2])
        fig.savefig(out / f"{name}.png")
        (out / f"{name}.json").write_text("{}")
        results.append({
            "benchmark": name, "title": f"the {name} benchmark", "notes": [f"{name} note with `code`"],
            "summary": ({"largest_batch": {"plain": {"largest_batch": 16, "note": "16 fits, 32 does not"}}}
                        if name == "memory" else {"peak_gb_per_s": {"host->device": 20.5}}),
            "gpu": {"status": "measured"}, "files": {"plots": [f"{name}.png"], "json": f"{name}.json"},
            "environment": {"time": "2026-11-23 09:00", "devices": [{"device": "cuda:0", "name": "H100"}],
                            "torch": "2.13", "cuda": "13.0", "cudnn": "9", "driver": "580", "python": "3.11",
                            "command": "gputrain bench all"},
        })
    return results


def test_bench_index_html_is_self_contained(tmp_path):
    from gputrain.bench.index import write_index

    results = _bench_results(tmp_path)
    write_index(results, tmp_path)
    page = _Page((tmp_path / "index.html").read_text())
    pngs = _assert_self_contained(page)
    assert pngs == [(tmp_path / "memory.png").read_bytes(), (tmp_path / "transfer.png").read_bytes()]
    assert [a["href"] for a in page.all("a")] == ["memory.json", "transfer.json"]
    text = page.plain
    assert "memory: the memory benchmark" in text and "16 fits, 32 does not" in text and "20.5" in text
    assert [t for t, _ in page.tags].count("table") == 1 and "host->device" in text


# ---------------------------------------------------------------- in a real browser

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    yield from browser_session(tmp_path_factory)


@pytest.mark.processes
def test_browser_renders_the_report(browser, run_copy, tmp_path):
    h = _with_summary(run_copy, **GPU_EXTRAS)
    (run_copy / "profile_summary.json").write_text(json.dumps(PROFILE))
    path = write_report(run_copy)
    shot = tmp_path / "report.png"
    got = browser.open(path, screenshot=shot)
    s = h["summary"]
    text = got["text"]
    for value in (f"gputrain run: {s.get('workload') or run_copy.name}", s["device"], f"{s['samples_per_s']:,.0f}", f"{s['final_loss']:.4g}",
                  f"{s['final_eval_accuracy']:.4g}", "1.5 GiB of 80.0 GiB", "static shapes, capturable optimizer",
                  "launch-bound", "out of memory at step 12"):
        assert value in text, f"{value!r} is not on the rendered page"
    assert len(got["images"]) == 5
    assert all(i["decoded"] and i["width"] >= 400 and i["height"] >= 100 for i in got["images"]), got["images"]
    assert got["errors"] == []
    assert [u for u in got["requests"] if not u.startswith(("file:", "data:"))] == []
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and png_size(data)[0] == 1200 and png_size(data)[1] > 2000


def test_browser_renders_the_bench_index(browser, tmp_path):
    from gputrain.bench.index import write_index

    write_index(_bench_results(tmp_path), tmp_path)
    got = browser.open(tmp_path / "index.html", screenshot=tmp_path / "index.png")
    assert "memory: the memory benchmark" in got["text"] and "16 fits, 32 does not" in got["text"]
    assert [(i["decoded"], i["width"], i["height"]) for i in got["images"]] == [(True, 400, 300), (True, 400, 300)]
    assert got["errors"] == [] and [u for u in got["requests"] if not u.startswith(("file:", "data:"))] == []


@pytest.mark.processes
def test_browser_check_catches_broken_pages(browser, tmp_path):
    """The checks above can fail: a broken image, a console error, an exception and a remote URL are seen."""
    _bench_results(tmp_path)  # writes memory.png, a real plot
    png = (tmp_path / "memory.png").read_bytes()
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><p>broken</p>"
                   "<img alt='corrupt' src='data:image/png;base64,iVBORw0KGgoAAAA='>"
                   "<img alt='remote' src='http://127.0.0.1:9/x.png'>"
                   "<script>console.error('boom'); undefinedFunction();</script></body></html>")
    got = browser.open(bad)
    assert got["text"].strip() == "broken"
    assert [(i["alt"], i["decoded"]) for i in got["images"]] == [("corrupt", False), ("remote", False)]
    # A truncated PNG still decodes in Chromium (partly drawn): the page checks catch it instead.
    truncated = f"<img src='data:image/png;base64,{base64.b64encode(png[:len(png) - 100]).decode()}'>"
    with pytest.raises(AssertionError, match="not a whole PNG"):
        _assert_self_contained(_Page(truncated))
    assert any("boom" in e for e in got["errors"]) and any("undefinedFunction" in e for e in got["errors"])
    assert "http://127.0.0.1:9/x.png" in got["requests"]
