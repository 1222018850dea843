"""The documentation cannot drift from the code (docs/, README.md; the site: mkdocs.yml and its hook,
scripts/docs_site.py):

- every Python block of a page runs, at the sizes a CPU allows: a page's blocks in order, in one namespace,
  in a folder of their own (a tutorial builds on its earlier blocks as a reader's session does); a block
  that includes an example file (`--8<-- "docs/examples/x.py"`) is that file, which a test runs: its own
  (EXAMPLE_TESTS), or this file's, under torchrun or on a local Ray cluster;
- every `gputrain ...` line of a shell block is a command the CLI's own parser takes (the `--print-config`
  and `--list` ones are run), and every TOML block is a config file gputrain reads;
- the generated reference names every subcommand, flag and config key, and each [train] and [fit] key
  says what it is;
- the site builds with warnings as errors, so a broken link or anchor fails it (shown on a page made
  broken on purpose), and the README's links lead to files that exist;
- the home page and a tutorial render in Chromium, served from the built folder on a local port as
  `mkdocs serve` or any static server serves them: their text, no console error, nothing asked of any
  other server; the screenshots are kept under pytest's tmp dir, as the report's are (test_report_html.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from helpers import DOCS, browser_session, docs_page, png_size, subprocess_env, torchrun

ROOT = DOCS.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_site  # noqa: E402  (the site's hook: the generated pages)

EXAMPLES = DOCS / "examples"
# Each example file a page includes, and the test file that runs it (this one: under torchrun or Ray, below).
EXAMPLE_TESTS = {
    "byo_pair.py": "test_any_model.py", "byo_huggingface.py": "test_any_model.py",
    "byo_two_inputs.py": "test_any_model.py", "byo_streaming.py": "test_hf_data.py",
    "callbacks_and_tracking.py": "test_use_trained.py", "use_the_trained_model.py": "test_use_trained.py",
    "finetune_lora.py": "test_frozen_and_adapters.py", "own_step.py": "test_own_step.py",
    "gan_workload.py": "test_own_step_workload.py", "run.toml": "test_config_file.py",
    "sweep.toml": "test_sweep.py", "sweep_from_python.py": "test_sweep.py",
    "own_loop_ddp.py": "test_docs.py", "ray_train_func.py": "test_docs.py",
}
# Source listings, not programs: the block after this mark is the code of TrainStep, kept equal to the
# source by test_test_map.py (here it is only compiled).
LISTING_MARK = "<!-- the step: TrainStep.run and TrainStep.gradients -->"
FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*$")
SNIPPET_LINE = re.compile(r'^\s*--8<-- "([^"]+)"\s*$')
SHELLS = ("bash", "sh", "shell", "console", "")


def _pages() -> list[str]:
    """Every page of the docs (relative to docs/) and the README (as "../README.md")."""
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if EXAMPLES not in p.parents)
    return pages + ["../README.md"]


def blocks(text: str) -> list[dict]:
    """The fenced code blocks of a Markdown text: language, code (dedented), first line, the line before."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j])
            j += 1
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        out.append({"lang": lang, "code": textwrap.dedent("\n".join(body)), "line": i + 1, "before": before.strip()})
        i = j + 1
    return out


def _text(page: str) -> str:
    return (DOCS / page).read_text()


def _python_pages() -> list[str]:
    return [p for p in _pages() if any(b["lang"] in ("python", "py") and not SNIPPET_LINE.match(b["code"])
                                       and b["before"] != LISTING_MARK for b in blocks(_text(p)))]


# ---------------------------------------------------------------- every Python block runs


def _run_blocks(page: str, namespace: dict) -> str:
    """Run the page's inline Python blocks in order in `namespace`; what they printed."""
    out = io.StringIO()
    for b in blocks(_text(page)):
        if b["lang"] not in ("python", "py") or SNIPPET_LINE.match(b["code"]):
            continue
        code = compile(b["code"], f"docs/{page}:{b['line']}", "exec")
        if b["before"] == LISTING_MARK:
            continue  # a listing of methods: compiled above, kept equal to the source by test_test_map.py
        with contextlib.redirect_stdout(out):
            exec(code, namespace)
    return out.getvalue()


@pytest.mark.parametrize("page", _python_pages())
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write runs/, predictions.pt, ...: here, not in the repository
    shutil.copytree(EXAMPLES, tmp_path / "docs" / "examples")  # for the blocks that name an example file
    printed = _run_blocks(page, {"__name__": "__main__"})
    assert printed.strip(), f"docs/{page}: its blocks printed nothing (each example shows its result)"


def test_a_block_that_raises_fails_with_its_page_and_line(tmp_path, monkeypatch):
    """The check above can fail: a block that raises names its page and line in the traceback."""
    page = tmp_path / "broken.md"
    page.write_text("# A page\n\n```python\nimport gputrain\n\ngputrain.TrainConfig(lr=-1)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path)
    import gputrain

    with pytest.raises(gputrain.ConfigError) as caught:
        _run_blocks("broken.md", {"__name__": "__main__"})
    import traceback

    assert "docs/broken.md:3" in [f.filename for f in traceback.extract_tb(caught.value.__traceback__)]


def test_every_included_example_is_run_by_a_test_and_every_example_is_shown():
    included = set()
    for page in _pages():
        for b in blocks(_text(page)):
            m = SNIPPET_LINE.match(b["code"])
            if m:
                file = m.group(1).split(":")[0]
                assert (ROOT / file).is_file(), f"docs/{page}:{b['line']} includes {file}, which does not exist"
                included.add(Path(file).name)
    unrun = sorted(n for n in included if n not in EXAMPLE_TESTS)
    assert not unrun, f"examples the docs include that no test runs (add each to EXAMPLE_TESTS with its test): {unrun}"
    for name, test in EXAMPLE_TESTS.items():
        assert name.split(".")[0] in (ROOT / "tests" / test).read_text(), f"{test} does not run {name}"
    unshown = sorted(p.name for p in EXAMPLES.iterdir() if p.is_file() and p.name not in included)
    assert not unshown, f"docs/examples files no page shows: {unshown}"


@pytest.mark.processes
def test_the_own_loop_example_trains_under_torchrun(tmp_path):
    proc = torchrun([str(EXAMPLES / "own_loop_ddp.py")], nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 15: loss" in proc.stdout and "saved ['0.bias', '0.weight', '2.bias', '2.weight']" in proc.stdout, \
        proc.stdout[-2000:]


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ray") is None and not (Path(sys.executable).parent / "ray").exists(),
                    reason="needs Ray (pip install 'gputrain[ray]')")
def test_the_ray_example_trains_on_a_local_ray_cluster(tmp_path):
    """Slow: a local Ray cluster and its 2-worker group start and stop (about a minute on 2 cores)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "ray_train_func.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=subprocess_env(HOME=str(tmp_path), RAY_ADDRESS="local"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray's latest checkpoint: ['step-000020.dcp']" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------- every command line is valid


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv after `gputrain`) of each gputrain command in the shell blocks of a page: comments,
    line continuations, environment assignments, redirections and `&&` chains taken apart as a shell
    would; `torchrun ... -m gputrain` and `python -m gputrain` count too."""
    out = []
    for b in blocks(text):
        if b["lang"] not in SHELLS:
            continue
        joined = re.sub(r"\\\n\s*", " ", b["code"])
        for offset, line in enumerate(joined.splitlines()):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            chain, part = [], []
            for w in words + ["&&"]:
                if w in ("&&", "||", ";", "|"):
                    chain.append(part)
                    part = []
                else:
                    part.append(w)
            for part in chain:
                while part and re.match(r"^[A-Z_][A-Z0-9_]*=", part[0]):
                    part = part[1:]
                cut = next((i for i, w in enumerate(part) if w.startswith((">", "<", "2>"))), len(part))
                part = part[:cut]
                if part[:1] == ["gputrain"]:
                    out.append((b["line"] + offset, part[1:]))
                elif "-m" in part and part[part.index("-m") + 1:part.index("-m") + 2] == ["gputrain"]:
                    out.append((b["line"] + offset, part[part.index("-m") + 2:]))
    return out


def _parse(argv: list[str]) -> str | None:
    """None when the CLI's parser takes `argv`, else what it said."""
    from gputrain.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return err.getvalue().strip() or f"exit {exc.code}"
    return None


def test_every_gputrain_command_line_of_the_docs_parses():
    found, bad = 0, []
    for page in _pages():
        for line, argv in commands(_text(page)):
            found += 1
            said = _parse(argv)
            if said is not None:
                bad.append(f"docs/{page}:{line}: gputrain {shlex.join(argv)}: {said}")
    assert found >= 60, f"only {found} command lines found: the extractor has stopped seeing them"
    assert not bad, "\n".join(bad)


def test_an_invalid_command_line_is_caught():
    """The check above can fail: a misspelled flag, an unknown subcommand, a bad choice."""
    text = "```bash\ngputrain fit digits-cnn --batchsize 32\nFOO=1 gputrain fitt x > out.txt\n" \
           "torchrun --nproc-per-node 2 -m gputrain fit x --precision fp8\n```\n"
    found = commands(text)
    assert [argv[0] for _, argv in found] == ["fit", "fitt", "fit"]
    said = [_parse(argv) for _, argv in found]
    assert all(said), said
    assert "unrecognized arguments: --batchsize" in said[0] and "invalid choice: 'fitt'" in said[1]


def test_the_cheap_commands_of_the_docs_run(tmp_path, monkeypatch, capsys):
    """`--print-config` lines (they resolve the run and train nothing) and `fit --list` run for real."""
    from gputrain import cli

    shutil.copytree(EXAMPLES, tmp_path / "docs" / "examples")
    monkeypatch.chdir(tmp_path)
    ran = 0
    for page in _pages():
        for line, argv in commands(_text(page)):
            if argv[-1:] == ["--print-config"] or argv == ["fit", "--list"]:
                assert cli.main(argv) == 0, f"docs/{page}:{line}: {capsys.readouterr().err}"
                ran += 1
    assert ran >= 3
    assert "[train]" in capsys.readouterr().out


def test_every_toml_block_is_a_config_gputrain_reads(tmp_path):
    from gputrain.runs.stated import load_run_config

    seen = 0
    for page in _pages():
        for b in blocks(docs_page(page) if page != "../README.md" else _text(page)):
            if b["lang"] != "toml":
                continue
            path = tmp_path / "block.toml"
            path.write_text(b["code"])
            tomllib.loads(b["code"])
            load_run_config(path)
            seen += 1
    assert seen >= 3


# ---------------------------------------------------------------- the reference is the code


def test_the_cli_reference_names_every_subcommand_and_flag():
    text = docs_site.cli_reference()
    for title, parser in docs_site.cli_commands():
        assert f"## `{title}`" in text, title
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # -h, --help: every command has it; the page says so once
            for flag in action.option_strings:
                assert f"`{flag}`" in text, f"{title} {flag}"
    assert len(docs_site.cli_commands()) >= 18  # 12 subcommands, bench's 6


def test_the_config_reference_names_every_key_and_says_what_train_and_fit_keys_are():
    import dataclasses

    text = docs_site.config_reference()
    for table, dotted in docs_site.CONFIG_TABLES:
        cls = docs_site._load(dotted)
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"[{table}] {f.name}"
        if table in ("train", "fit"):
            cells = [re.split(r"(?<!\\)\|", r)[1:-1] for r in docs_site.fields_table(dotted).splitlines()
                     if r.startswith("| `")]  # key, type, default, flag, what
            assert len(cells) == len(dataclasses.fields(cls)) and all(len(c) == 5 for c in cells)
            unsaid = [c[0].strip() for c in cells if not c[4].strip()]
            assert not unsaid, f"[{table}] keys with no help and no comment beside their field: {unsaid}"


# ---------------------------------------------------------------- the site builds, and links are checked


def _build(config: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300,
                          env=subprocess_env(NO_MKDOCS_2_WARNING="1"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = _build(ROOT / "mkdocs.yml", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.processes
def test_the_site_builds_with_every_generated_page(site):
    for page in ("index.html", "reference/api.html", "reference/cli.html", "reference/config.html",
                 "results/index.html", "results/log.html", "tutorials/profiling.html"):
        assert (site / page).is_file(), page
    for result in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert (site / "results" / f"{result.stem}.html").is_file(), result.name
    api = (site / "reference" / "api.html").read_text()
    assert 'id="gputrain.fit"' in api and 'id="gputrain.train.step.own_step.StepContext"' in api
    assert "scheduler_interval" in api  # TrainConfig's fields, from their declarations


@pytest.mark.processes
def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The project's link checks (mkdocs.yml's validation) turn a link to a missing page or heading
    into a failed build."""
    import yaml

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the guide](guide.md) and [a part](#nowhere).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "docs_dir": "docs", "validation": _validation()}))
    proc = _build(config, tmp_path / "site")
    assert proc.returncode != 0
    assert "guide.md" in proc.stderr and "nowhere" in proc.stderr, proc.stderr[-2000:]


def _validation() -> dict:
    """mkdocs.yml's `validation:` table, as the project's build applies it."""
    import yaml

    text = (ROOT / "mkdocs.yml").read_text()
    block = "validation:" + text.split("\nvalidation:", 1)[1].split("\n\n", 1)[0]
    return yaml.safe_load(block)["validation"]


def test_the_readmes_links_lead_to_files():
    generated = set(docs_site.generated_pages())
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 20
    missing = [link for link in links if not link.startswith(("http:", "https:")) and not (ROOT / link).exists()
               and not (link.startswith("docs/") and link[len("docs/"):] in generated)]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: it is the landing page, the rest goes to docs/"
    text = "\n".join(lines)
    assert "make fit" in text and "make test" in text and "make docs" in text


# ---------------------------------------------------------------- in a real browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    yield from browser_session(tmp_path_factory)


@pytest.fixture(scope="module")
def served(site):
    """The built site on a local port (a thread of this process), as a static server serves it."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.processes
@pytest.mark.parametrize("page, says", [
    ("index.html", ("Train PyTorch models on the GPU correctly and fast", "Where to go", "Getting started")),
    ("tutorials/profiling.html", ("Why a GPU is or is not fast", "Count what makes the host wait",
                                  "gputrain profile iris-mlp --device cpu")),
])
def test_the_site_renders_in_a_browser(browser, served, page, says, tmp_path):
    shot = tmp_path / (page.replace("/", "-").replace(".html", ".png"))
    got = browser.open(served + page, screenshot=shot)
    for text in says:
        assert text in got["text"], f"{text!r} is not on the rendered {page}"
    assert got["errors"] == [], got["errors"]
    assert [u for u in got["requests"] if not u.startswith((served, "data:", "blob:"))] == [], got["requests"]
    assert all(i["decoded"] for i in got["images"]), got["images"]
    data = shot.read_bytes()
    assert png_size(data)[0] == 1200 and png_size(data)[1] > 900
