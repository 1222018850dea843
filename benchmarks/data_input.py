"""Your own data through `fit` against the hand-written DataLoader loop, on the same model and data.

Three cases, each timed whole (from the data object to the last optimizer step, setup included):

  map-samples    a map-style Dataset of N samples (dicts: a float feature vector and a label) with a
                 collate_fn that stacks them, 4 epochs; fit(dataset, collate_fn=...) against
                 `for batch in DataLoader(dataset, batch_size, shuffle=True, collate_fn=...)`.
  hf-rows        a Hugging Face map-style Dataset of token rows of varied length with a collate_fn
                 that pads them (the DataCollatorWithPadding pattern), 2 epochs;
                 fit(dataset, collate_fn=...) against
                 `for batch in DataLoader(dataset, batch_size, shuffle=True, collate_fn=...)`.
  stream-tokens  a Hugging Face streaming dataset of token sequences read from a local JSON-lines
                 file (nothing downloaded); fit(stream) (a StatefulDataLoader, gputrain's column
                 collate, the data position checkpointable) against
                 `for batch in DataLoader(stream, batch_size, collate_fn=<stack the rows>)`.

All loops use the same optimizer (AdamW, fused, as fit's default) and the same learning rate, read
no loss per step (fit reads it at log points, every 50 steps) and run on the CPU, workers 0. What
differs is the data path: gputrain's stream, sampler, batch checks and collate against the plain
DataLoader. Repeats are interleaved (hand, fit, hand, fit, ...) after one burn-in run of each; the
figure is the median of the per-repeat ratios of samples/s (fit / hand; >= 1.0: fit is as fast).
Clock: this process's CPU time (workers 0: all the work is in this process), so that the time the
OS gives the 2 shared cores to other jobs is not counted; --clock wall for elapsed time.

`--allocator-ab N` compares glibc's malloc as it comes with fixed thresholds (the setting the run
summary advises past 256 page faults a step, runtime/host_memory.py): N rounds, each running this
script (with --repeats, its medians) once with each environment in turn (A B, B A, ...; an allocator setting takes effect only
when a process starts, so the two cannot share one), and reports per case the median over rounds of
samples/s with the setting over samples/s without, for the hand loop and for fit.

Usage:
  python benchmarks/data_input.py                 # every case, 5 repeats, table + JSON in benchmarks/results/
  python benchmarks/data_input.py --repeats 3 --json out.json
  python benchmarks/data_input.py --cases hf-rows,stream-tokens --allocator-ab 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gputrain

SAMPLES, FEATURES, CLASSES, MAP_BATCH, EPOCHS = 4096, 32, 10, 64, 4
SEQUENCES, SEQ_LEN, VOCAB, STREAM_BATCH = 4096, 64, 256, 32
ROWS, ROWS_EPOCHS = 2048, 2


class Samples(Dataset):
    """N samples as dicts, made on the fly from their index (as a decoder would)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = self.x[:, :CLASSES].argmax(1)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"x": self.x[i], "y": int(self.y[i])}


def collate(samples):
    return {"x": torch.stack([s["x"] for s in samples]), "y": torch.tensor([s["y"] for s in samples])}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 64), nn.Linear(64, VOCAB)

    def forward(self, input_ids):
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def write_tokens(folder: Path) -> str:
    path = folder / "tokens.jsonl"
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (SEQUENCES,), generator=g).tolist()
    with open(path, "w") as f:
        for s in starts:
            f.write(json.dumps({"input_ids": [(s + i) % VOCAB for i in range(SEQ_LEN)]}) + "\n")
    return str(path)


def stack_rows(rows):
    return {"input_ids": torch.tensor([r["input_ids"] for r in rows])}


def token_rows():
    """A Hugging Face Dataset of ROWS token sequences of 16..SEQ_LEN tokens (a tokenized corpus)."""
    import datasets

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, SEQ_LEN + 1, (ROWS,), generator=g).tolist()
    starts = torch.randint(0, VOCAB, (ROWS,), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": [[(s + i) % VOCAB for i in range(n)]
                                                     for s, n in zip(starts, lengths)]})


def pad_rows(rows):
    """Pads a batch's rows to its longest with token 0, as a tokenizer's DataCollatorWithPadding does."""
    longest = max(len(r["input_ids"]) for r in rows)
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * (longest - len(r["input_ids"])) for r in rows])}


def hand_loop(model, loader, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model.train()
    done = 0
    while done < steps:
        for batch in loader:
            loss = model(**batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break


def run_case(case: str, contender: str, token_file: str | None, clock) -> tuple[float, int]:
    """(seconds, samples) of one whole run."""
    torch.manual_seed(0)
    if case == "map-samples":
        model, steps, batch = Classifier(), EPOCHS * SAMPLES // MAP_BATCH, MAP_BATCH
        start = clock()
        if contender == "hand":
            hand_loop(model, DataLoader(Samples(), batch_size=batch, shuffle=True, collate_fn=collate), steps)
        else:
            gputrain.fit(model, Samples(), collate_fn=collate,
                         config=gputrain.TrainConfig(device="cpu", batch_size=batch, steps=steps, cuda_graphs=False))
        return clock() - start, steps * batch
    if case == "hf-rows":
        rows = token_rows()  # built before the clock: a tokenized corpus on disk, as users have
        model, steps, batch = NextToken(), ROWS_EPOCHS * ROWS // STREAM_BATCH, STREAM_BATCH
        start = clock()
        if contender == "hand":
            hand_loop(model, DataLoader(rows, batch_size=batch, shuffle=True, collate_fn=pad_rows), steps)
        else:
            gputrain.fit(model, rows, collate_fn=pad_rows,
                         config=gputrain.TrainConfig(device="cpu", batch_size=batch, steps=steps))
        return clock() - start, steps * batch
    import datasets

    model, steps, batch = NextToken(), SEQUENCES // STREAM_BATCH, STREAM_BATCH
    start = clock()
    stream = datasets.load_dataset("json", data_files=token_file, split="train", streaming=True)
    if contender == "hand":
        hand_loop(model, DataLoader(stream, batch_size=batch, collate_fn=stack_rows), steps)
    else:
        gputrain.fit(model, stream, config=gputrain.TrainConfig(device="cpu", batch_size=batch, steps=steps))
    return clock() - start, steps * batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default="map-samples,hf-rows,stream-tokens")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="where to write the results (default: benchmarks/results/...)")
    parser.add_argument("--allocator-ab", type=int, metavar="ROUNDS", default=0,
                        help="compare the default malloc with fixed thresholds, in this many alternating rounds")
    args = parser.parse_args(argv)
    if args.allocator_ab:
        return allocator_ab(args)
    torch.set_num_threads(args.threads)
    logging.getLogger("gputrain").setLevel(logging.ERROR)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cases = args.cases.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        token_file = write_tokens(Path(tmp)) if "stream-tokens" in cases else None
        for case in cases:
            for contender in ("hand", "fit"):  # burn-in: imports, allocator, the dataset cache
                run_case(case, contender, token_file, clock)
            rates: dict[str, list[float]] = {"hand": [], "fit": []}
            ratios = []
            for r in range(args.repeats):
                order = ("hand", "fit") if r % 2 == 0 else ("fit", "hand")
                this = {}
                for contender in order:
                    seconds, samples = run_case(case, contender, token_file, clock)
                    this[contender] = samples / seconds
                    rates[contender].append(this[contender])
                ratios.append(this["fit"] / this["hand"])
            rows.append({"case": case, "hand_samples_per_s": statistics.median(rates["hand"]),
                         "fit_samples_per_s": statistics.median(rates["fit"]),
                         "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "repeats": args.repeats})
    print(f"{'case':<15} {'hand loop':>12} {'fit':>12} {'fit / hand':>11}  (samples/s, {args.clock} clock, "
          f"median of {args.repeats}; range of the ratio)")
    for row in rows:
        print(f"{row['case']:<15} {row['hand_samples_per_s']:>12,.0f} {row['fit_samples_per_s']:>12,.0f} "
              f"{row['ratio']:>10.2f}x  [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]")
    import datasets as hf_datasets
    import torchdata

    result = {"benchmark": "data_input", "date": time.strftime("%Y-%m-%d"), "device": "cpu",
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
              "clock": args.clock, "torch": torch.__version__, "datasets": hf_datasets.__version__,
              "torchdata": getattr(torchdata, "__version__", "?"), "gputrain": gputrain.__version__,
              "config": {"samples": SAMPLES, "epochs": EPOCHS, "features": FEATURES, "map_batch": MAP_BATCH,
                         "sequences": SEQUENCES, "seq_len": SEQ_LEN, "stream_batch": STREAM_BATCH,
                         "hf_rows": ROWS, "hf_rows_epochs": ROWS_EPOCHS}, "rows": rows}
    out = Path(args.json) if args.json else (Path(__file__).parent / "results"
                                             / f"data_input_cpu-{os.cpu_count()}core_{result['date']}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def allocator_ab(args) -> int:
    """Rounds of this script in subprocesses, with glibc's malloc as it comes and with TUNABLES."""
    import subprocess
    import sys

    from gputrain.runtime.host_memory import TUNABLES

    envs = {"default": {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
            "tuned": {**os.environ, "GLIBC_TUNABLES": TUNABLES}}
    rates: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.allocator_ab):
            for name in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
                out = Path(tmp) / f"{name}-{r}.json"
                subprocess.run([sys.executable, __file__, "--cases", args.cases, "--repeats", str(args.repeats), "--clock", args.clock,
                                "--threads", str(args.threads), "--json", str(out)], env=envs[name], check=True,
                               stdout=subprocess.DEVNULL)
                for row in json.loads(out.read_text())["rows"]:
                    for who in ("hand", "fit"):
                        rates.setdefault((row["case"], who, name), []).append(row[f"{who}_samples_per_s"])
    rows = []
    for case in args.cases.split(","):
        row: dict = {"case": case, "rounds": args.allocator_ab}
        for who in ("hand", "fit"):
            ratios = [t / d for t, d in zip(rates[(case, who, "tuned")], rates[(case, who, "default")])]
            row[f"{who}_tuned_over_default"] = statistics.median(ratios)
            row[f"{who}_range"] = [min(ratios), max(ratios)]
        rows.append(row)
        print(f"{case:<15} tuned / default malloc: hand loop {row['hand_tuned_over_default']:.2f}x "
              f"[{row['hand_range'][0]:.2f}, {row['hand_range'][1]:.2f}], fit {row['fit_tuned_over_default']:.2f}x "
              f"[{row['fit_range'][0]:.2f}, {row['fit_range'][1]:.2f}]  (median of {args.allocator_ab} rounds)")
    result = {"benchmark": "data_input --allocator-ab", "date": time.strftime("%Y-%m-%d"), "device": "cpu",
              "cores": os.cpu_count(), "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
              "tunables": TUNABLES, "rows": rows}
    out = Path(args.json) if args.json else (Path(__file__).parent / "results"
                                             / f"data_input_allocator_cpu-{os.cpu_count()}core_{result['date']}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
