"""The same three PyTorch calls on different model and optimizer objects: how much a tiny CPU step
moves with where its tensors land (the noise floor under step_overhead.py's iris and MLP cases).

Each contender runs forward + backward, `opt.step()` and `zero_grad` on one fixed batch; only the
objects differ: the minimal loop's model and fused AdamW, the Trainer's model and optimizer, and two
fresh copies built the same way (one through gputrain's `make_optimizer`). Rounds are interleaved
in a shuffled order; CPU time; medians. Run it a few times: the ranking changes from process to
process.

  python -m benchmarks.step_layout_probe [--case iris-mlp|mlp] [--rounds 21]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks import step_overhead as so


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="iris-mlp")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--steps", type=int, default=200, help="steps per timed chunk")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from gputrain.train.optim.build import make_optimizer
    from gputrain.train.loop.trainer import Trainer

    case = so.cases(False)[args.case]
    torch.manual_seed(0)
    trainer = Trainer(case.make_model(), so._data(case), loss_fn=case.loss_fn, config=so._config(case, 10**7, 10**7))
    minimal = so.Minimal(case)
    x, y = next(iter(trainer.parts.data.stream.loader))

    def fresh(make_opt):
        torch.manual_seed(0)
        model = case.make_model()
        return model, make_opt(model)

    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=so.LR, weight_decay=so.WEIGHT_DECAY, fused=True)  # noqa: E731
    ours = lambda m: make_optimizer(None, m.parameters(), lr=so.LR, weight_decay=so.WEIGHT_DECAY,  # noqa: E731
                                    device=torch.device("cpu"))[0]
    pairs = {"minimal loop's model + AdamW": (minimal.model, minimal.opt),
             "Trainer's model + optimizer": (trainer.parts.model.module, trainer.parts.optim.optimizer),
             "fresh model + AdamW": fresh(adamw),
             "fresh model + make_optimizer": fresh(ours)}

    def step(model, opt):
        def run():
            case.loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    fns = {name: step(*pair) for name, pair in pairs.items()}
    for fn in fns.values():
        for _ in range(100):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        order = list(fns.items())
        random.shuffle(order)
        for name, fn in order:
            t0 = time.process_time()
            for _ in range(args.steps):
                fn()
            times[name].append((time.process_time() - t0) / args.steps * 1e6)
    print(f"# {args.case}: us per step (CPU time, median of {args.rounds} interleaved rounds of {args.steps})")
    for name, ts in times.items():
        print(f"{name:32s} {statistics.median(ts):8.1f}   [{min(ts):.0f}, {max(ts):.0f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
