"""Where the routing's time goes inside a training step (docs/speed.md): each part of the fast
kernel timed in place, in bench.py's steps of the real model. Timed alone, a part runs up to three
times faster: its tensors stay in the cache and its memory is reused.

    python tools/routing_time.py                                  # s12: prenorm and block
    python tools/routing_time.py --variants prenorm,block,wav,rd --steps 12
    python tools/routing_time.py --variants block -- --grad_clip 0     # train.py's flags, as bench

Per variant, the median over the timed steps of each part's time in a step, in ms. A part inside
another is in both (phase 1's forward is part of setting up a block's reads); the timers add a
few microseconds a call. Steps of the variants alternate, as in bench.py.
"""
import argparse
import contextlib
import functools
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import nanoroute  # noqa: E402
import train  # noqa: E402
from bench import SHAPES, VARIANTS, StepSettings, model_fields  # noqa: E402

# (owner, its function, the part's name)
PARTS = [(nanoroute.DepthRouting, "block_reads", "a block's reads set up"),
         (nanoroute.CompletedReads, "forward", "phase 1 forward"),
         (nanoroute.BlockReads, "_store", "sources into the buffer"),
         (nanoroute.BlockReads, "_block_state", "the partial block's sources"),
         (nanoroute.PartialMerge, "forward", "phase 2 forward"),
         (nanoroute.DepthRouting, "complete", "a block completes"),
         (nanoroute.CompletedReads, "backward", "phase 1 backward"),
         (nanoroute.PartialMerge, "backward", "phase 2 backward")]

def timed(seconds, name, fn):  # fn, adding its time to seconds[name]
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    return run

@contextlib.contextmanager
def timers(seconds):
    """Inside it, each part of PARTS adds its time to seconds[name]; after it, the kernel is as
    it was."""
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in PARTS]
    try:
        for (owner, attr, fn), (*_, name) in zip(saved, PARTS):
            if isinstance(fn, staticmethod):
                setattr(owner, attr, staticmethod(timed(seconds, name, fn.__func__)))
            else:
                setattr(owner, attr, timed(seconds, name, fn))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)

def step(model, opt, x, y, settings, seconds):
    """One training step, as bench.py's: its forward (and loss), backward and update (the clip,
    AdamW) timed."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # pages mapped afresh
    t0 = time.perf_counter()
    loss = train.step_loss(model, x, y, settings)[0]
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    train.update(model, opt, settings)
    seconds.update(forward=t1 - t0, backward=t2 - t1, update=time.perf_counter() - t2)
    seconds["page faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="s12", choices=SHAPES)
    p.add_argument("--variants", default="prenorm,block", help="bench.py's (full: Full AttnRes)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant (2 more first)")
    p.add_argument("--threads", type=int, default=2)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # then train.py's flags, as bench.py's
    args = p.parse_args(argv[:cut])
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: {', '.join(unknown)}: not one of {', '.join(VARIANTS)}")
    shape = SHAPES[args.shape]
    settings = StepSettings(argv[cut + 1:], shape, names)
    torch.set_num_threads(args.threads)
    common.keep_freed_memory()  # as train.py's steps
    x = torch.randint(0, shape["vocab_size"], (shape["batch_size"], shape["sequence_len"]))
    y = torch.roll(x, -1, 1)
    models = {}
    for name in names:
        torch.manual_seed(0)
        config = nanoroute.GPTConfig(**model_fields(shape), **VARIANTS[name])
        model = nanoroute.GPT(config)
        models[name] = model, train.make_optimizer(model, settings, "cpu")
    seconds, steps = {}, {name: [] for name in names}
    with timers(seconds):
        for i in range(args.steps + 2):
            for name, (model, opt) in models.items():
                seconds.clear()
                step(model, opt, x, y, settings, seconds)
                if i >= 2:
                    steps[name].append(dict(seconds))
            settings.check_read()  # a flag after -- that no step read is refused
    parts = ["forward", "backward", "update"] + [name for *_, name in PARTS]
    flags = " ".join(argv[cut + 1:])
    print(f"ms a step, median of {args.steps} ({args.shape}, {args.threads} threads"
          + (f"; train.py's {flags})" if flags else ")"))
    print("| part | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for part in parts:
        cells = [statistics.median(s.get(part, 0.0) for s in steps[n]) * 1e3 for n in names]
        print(f"| {part} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    faults = [statistics.median(s.get("page faults", 0) for s in steps[n]) for n in names]
    print("| page faults (a count) | " + " | ".join(f"{f:.0f}" for f in faults) + " |")

if __name__ == "__main__":
    common.cli(main)()
