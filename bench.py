"""
bench.py: speed and memory of every variant at one shape, measured in one run.

Every variant's training step is timed round-robin, A B C A B C ..., in one process, from one seed
on one fixed batch, so that machine noise falls on all alike; per-round ratios (round i over the
baseline's round i, which ran next to it) do not move with a drifting machine. See docs/speed.md.

    python bench.py --shape s12 --iters 15 --gen_tokens 0
    python bench.py --shape gpu12 --device cuda --compile         # bf16 autocast, MFU
    python bench.py --preset rd_m --variants block,rd --iters 1 --gen_tokens 0   # its peak memory
    python bench.py --shape s12 --variants block --gen_tokens 0 --profile block
    python bench.py --shape s12 --variants block,wav -- --route_entropy_coef 0.01  # train.py's
    git show main:nanoroute.py > /tmp/main_nanoroute.py          # the model before your change
    python bench.py --shape s12 --variants block,rd --gen_tokens 0 --against /tmp/main_nanoroute.py
"""

import contextlib
import importlib.util
import json
import platform
import shlex
import statistics
import sys
import time
import weakref
from collections import namedtuple
from pathlib import Path

import torch

import common
import nanoroute
import prepare_data
import train
from common import UsageError, write_json

SHAPES = {  # batch_size is B; sequence_len is the context and the T of the training batch
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, sequence_len=32, vocab_size=256, batch_size=2),
    "demo": dict(n_layer=4, n_embd=128, n_head=4, sequence_len=256, vocab_size=256, batch_size=16),
    "s12": dict(n_layer=12, n_embd=256, n_head=4, sequence_len=256, vocab_size=256, batch_size=8),
    "s48": dict(n_layer=48, n_embd=128, n_head=4, sequence_len=128, vocab_size=256, batch_size=8),
    "gpu12": dict(n_layer=12, n_embd=768, n_head=12, sequence_len=1024, vocab_size=50304,
                  batch_size=16),
}
# a shape's GPTConfig fields; batch_size is the bench's own
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "sequence_len", "vocab_size")
# Also timed: Full AttnRes, the reference read (what the fast kernel saves), learned WAV bases
VARIANTS = {**nanoroute.VARIANTS, "full": dict(nanoroute.VARIANTS["block"], attnres_block=1),
            "naive": dict(nanoroute.VARIANTS["block"], fast_routing=False),
            "wav_learned": dict(nanoroute.VARIANTS["wav"], wav_learned_bases=True)}
DEFAULT_VARIANTS = "prenorm,block,full,wav,rd"
class StepSettings:
    """train.py's settings of the timed step (step_loss, update, make_optimizer read them): its
    defaults, or its training flags given after `--`, checked as train.py checks them against each
    variant's model. Each read is noted: a flag the step never reads (a batch, a schedule) is
    refused after the first steps, not ignored. A setting added to the step needs no edit here."""

    def __init__(self, flags, shape, variants):
        given, unknown = train.build_parser().parse_known_args(flags)
        if unknown:
            raise UsageError(f"{' '.join(unknown)} after --: not train.py's (bench.py's own flags "
                             "go before --)")
        self.given = {k: v for k, v in vars(given).items() if v is not None}
        model = [k for k in self.given if k in nanoroute.CONFIG_FIELDS]
        if model:
            raise UsageError(f"--{model[0]} after --: a model field; bench.py builds the rows of "
                             "--variants at --shape (a field of its own: a row of its VARIANTS)")
        self.settings, self.read = train.TrainSettings(**self.given), set()
        defaults = {name: field.default for name, field in nanoroute.CONFIG_FIELDS.items()}
        refused = {}
        for v in variants:  # as train.py checks a run of each variant
            try:
                train.check_settings(self.settings, 1, {**defaults, **model_fields(shape),
                                                        **VARIANTS[v]})
            except UsageError as e:
                refused[v] = str(e)
        if refused:  # the variants to leave out, unless every one refuses it (a setting's error)
            leave = f"; here: leave {', '.join(refused)} out of --variants"
            raise UsageError(next(iter(refused.values())) + leave * (refused.keys() < {*variants}))

    def __getattr__(self, name):  # what the step reads of the settings
        self.read.add(name)
        return getattr(self.settings, name)

    def check_read(self):
        unread = [f"--{name}" for name in self.given if name not in self.read]
        if unread:
            raise UsageError(f"{', '.join(unread)} after --: the timed step does not read it "
                             "(bench.py's batch is its --shape's, its length --iters; a value "
                             "train_step sets on the model: set it where the models are built, "
                             "bench.build and routing_time's main)")

def build_parser():
    p = common.ArgumentParser(description=__doc__.strip().split("\n")[0],
                              epilog="After --: train.py's training flags for the timed step.")
    p.add_argument("--shape", choices=SHAPES, help="model and batch (default s12)")
    p.add_argument("--preset", choices=train.PRESETS, help="a train.py preset's shape instead: "
                   "its model (each variant's fields from --variants), B = its --micro_batch (or "
                   "its batch), its data's vocabulary")
    for name in (*MODEL_FIELDS, "batch_size"):
        p.add_argument(f"--{name}", type=int, help="overrides the shape's value")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list, in timing order "
                   f"(default {DEFAULT_VARIANTS}); any of {', '.join(VARIANTS)}")
    p.add_argument("--iters", type=int, help="timed rounds (default 10 on a CPU, 20 on a GPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before them (default 2)")
    p.add_argument("--gen_tokens", type=int, help="new tokens per generation; 0 skips it "
                   "(default min(256, sequence_len))")
    p.add_argument("--gen_variants", help="the variants whose generation is timed (default: "
                   "--variants)")
    p.add_argument("--gen_repeats", type=int, default=3, help="generations per variant (median)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: as it is)")
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument("--compile_backend", default="inductor", help="its backend (aot_eager: no "
                   "code generation, quick on a CPU)")
    p.add_argument("--profile", metavar="VARIANT", choices=VARIANTS,
                   help="the top ops of 3 training steps of VARIANT, under torch.profiler")
    p.add_argument("--against", type=common.file_name, metavar="PATH",
                   help="another nanoroute.py, or a folder holding one: its variants timed in "
                   "the same rounds, as VARIANT@against")
    p.add_argument("--json", type=common.file_name, metavar="PATH",
                   help="every number, rewritten as they come")
    return p

# A timed model: the module, what its steps call (compiled or itself), its AdamW, --compile's counts
Model = namedtuple("Model", "model step_model opt counts", defaults=[None])

class Bench:
    """The flags, checked, and what every measurement reads; out: the numbers so far (--json)."""

    def __init__(self, args, argv, flags=()):
        self.args, self.against = args, load_against(args.against) if args.against else None
        self.variants = names(args.variants, "--variants")
        self.gen_variants = names(args.gen_variants or args.variants, "--gen_variants")
        # every variant's config checked before a model is built: a shape one refuses fails now
        self.shape = check_flags(args, self.variants + self.gen_variants)
        self.train = StepSettings(flags, self.shape, self.variants)
        self.device = train.pick_device(args.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)  # cuda:1 too: synchronize and memory follow it
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        # CUDA runs asynchronously: a timer without a sync measures the launch, not the work
        self.sync = torch.cuda.synchronize if self.cuda else lambda: None
        if args.threads:
            torch.set_num_threads(args.threads)
        self.dtype = train.pick_dtype("auto", self.device)  # as train.py's --dtype auto
        bf16 = self.dtype == torch.bfloat16
        # disabled, not absent, in float32: `with b.amp` reads the same either way
        self.amp = torch.autocast(self.device.type, self.dtype, enabled=bf16)
        self.B, self.T = self.shape["batch_size"], self.shape["sequence_len"]
        # each variant beside its --against twin in every round: their ratio is paired too
        self.versions = ("", "@against") if self.against else ("",)
        self.names = [name + v for name in self.variants for v in self.versions]  # timing order
        self.iters = args.iters or (20 if self.cuda else 10)
        self.n_new = min(256, self.T) if args.gen_tokens is None else args.gen_tokens
        self.peak = train.peak_flops(self.device, self.dtype)  # None: MFU unknown
        # one fixed batch of random tokens: every variant steps on the same input, with no dataset;
        # its own generator leaves the global seed to build()
        data = torch.randint(self.shape["vocab_size"], (self.B, self.T + 1),
                             generator=torch.Generator().manual_seed(1)).to(self.device)
        self.x, self.y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        name = torch.cuda.get_device_name(self.device) if self.cuda else cpu_name()
        argv = map(str, sys.argv[1:] if argv is None else argv)
        machine = dict(device_name=name, device=str(self.device), torch=torch.__version__,
                       threads=torch.get_num_threads(), dtype="bf16 autocast" if bf16 else "fp32",
                       freed_memory_kept=common.keep_freed_memory(),  # as train.py's steps
                       compiled=args.compile_backend if args.compile else None,
                       command=shlex.join(["python", "bench.py", *argv]))
        self.out = dict(machine=machine, args=vars(args), shape=self.shape, iters=self.iters,
                        train_flags=self.train.given, complete=False, first_steps={},
                        rounds_ms={}, variants={}, generation={})
        print(f"bench: {machine['device_name']}, torch {torch.__version__}, {machine['threads']} "
              f"threads, {machine['dtype']}, {machine['compiled'] or 'eager'} | "
              f"{machine['command']}\n{args.preset or args.shape}: "
              + ", ".join(f"{k}={v}" for k, v in self.shape.items()), flush=True)
        self.out["routing_blocks"] = routing_blocks(self.shape, self.variants)
        if args.json:  # rewritten as results come: never over a file that is not a bench's
            common.own_file(args.json, bench_file)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        self.save()  # now: an earlier bench's file there would say complete for this one

    def save(self):
        """--json rewritten whole with what is measured so far: a run cut short keeps it."""
        if self.args.json:
            write_json(self.args.json, self.out)

    # a sync on each side: the previous step's kernels stay out, all of this one's are in
    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - t0, result

    def step(self, m):
        """One training step, as train.py's at its settings (StepSettings): its loss (step_loss: a
        term added there is timed here), backward, the update (train.update: the clip, AdamW)."""
        with self.amp:
            loss = train.step_loss(m.step_model, self.x, self.y, self.train)[0]
        loss.backward()
        train.update(m.model, m.opt, self.train)

def routing_blocks(shape, variants):
    """{variant: its automatic routing block} of the AttnRes variants (full's is 1, its own);
    where they differ (WAV needs 4 where Block AttnRes takes 2), a note: a ratio between them is
    also one of block size."""
    blocks = {v: nanoroute.GPTConfig(**model_fields(shape), **VARIANTS[v]).routing_block
              for v in variants
              if VARIANTS[v]["residual"] == "attnres" and "attnres_block" not in VARIANTS[v]}
    if len(set(blocks.values())) > 1:
        print("note: routing blocks " + ", ".join(f"{v} {m}" for v, m in blocks.items())
              + ": a ratio between these variants is also one of block size", flush=True)
    return blocks

def check_flags(args, variants):
    lows = dict.fromkeys((*MODEL_FIELDS, "batch_size", "iters", "gen_repeats", "threads"), 1)
    for name, low in dict(lows, warmup=0, gen_tokens=0).items():
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise UsageError(f"--{name} {getattr(args, name)}: must be at least {low}")
    # exclude_tags=(): every registered backend, the debugging ones too
    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.compile and args.compile_backend not in backends:
        raise UsageError(f"--compile_backend {args.compile_backend}: not a torch.compile "
                         f"backend; choose one of {', '.join(backends)}")
    if args.shape and args.preset:
        raise UsageError(f"--shape {args.shape} and --preset {args.preset}: give one")
    args.shape = None if args.preset else args.shape or "s12"  # what the JSON says was timed
    if args.shape:
        base = SHAPES[args.shape]
    else:  # its model; B, the sequences one GPU runs per forward; its data's vocabulary
        preset = train.PRESETS[args.preset]
        # fineweb_edu is GPT-2 tokens; the WAV presets' character data fit in 256
        vocab = prepare_data.GPT2_VOCAB if preset["data"] == "fineweb_edu" else 256
        # every model field of the preset (bias, dropout, ...) but a variant's, from --variants
        model = {k: v for k, v in preset.items()
                 if k in nanoroute.CONFIG_FIELDS and k not in nanoroute.variant("block")}
        base = dict(model, vocab_size=vocab,
                    batch_size=preset.get("micro_batch") or preset["batch_size"])
    # a flag overrides the shape's value, or adds a field the shape lacks (a new MODEL_FIELDS name)
    given = {k: getattr(args, k) for k in (*MODEL_FIELDS, "batch_size")
             if getattr(args, k) is not None}
    shape = {**base, **given}
    # each variant once, in order: it may be in --variants and --gen_variants
    for name in dict.fromkeys(variants):
        clash = [f"{k}={VARIANTS[name][k]!r}" for k in given if k in VARIANTS[name]]
        if clash:  # the flag or the variant: neither is the one to drop silently
            raise UsageError(f"{name} sets {', '.join(clash)} itself: leave out its flag or it")
        try:
            nanoroute.GPTConfig(**model_fields(shape), **VARIANTS[name])
        except ValueError as e:
            raise UsageError(f"{name} at this shape: {e}") from None
    return shape

def model_fields(shape):  # the GPTConfig fields of a shape: all but the bench's batch_size
    return {k: v for k, v in shape.items() if k != "batch_size"}

def names(text, flag):
    found = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in found if v not in VARIANTS]
    if unknown or not found:
        raise UsageError(f"{flag} {text!r}: unknown variant(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(VARIANTS)}")
    return found

def load_against(path):
    file = Path(path) / "nanoroute.py" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise UsageError(f"--against {path}: no such file; give another version's nanoroute.py "
                         "(git show main:nanoroute.py > /tmp/main_nanoroute.py)")
    try:
        # under its own module name: both versions live side by side in this process
        spec = importlib.util.spec_from_file_location("nanoroute_against", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # a half-edited file: which one, and why
        raise UsageError(f"--against {path}: importing {file} failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    if not (hasattr(module, "GPT") and hasattr(module, "GPTConfig")):
        # empty: a `git show BRANCH:nanoroute.py > FILE` whose BRANCH does not exist
        why = "it is empty (did the command that wrote it fail?)" if not file.stat().st_size \
            else "is it a nanoroute.py?"
        raise UsageError(f"--against {path}: {file} has no GPT and GPTConfig: {why}")
    return module

def bench_file(text):  # a file bench.py wrote: JSON with its machine and rounds
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        return isinstance(data, dict) and {"machine", "rounds_ms"} <= data.keys()
    return False

def cpu_name():
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return platform.processor() or platform.machine()

# --- The measurements: the rounds, each model's record, the ratios, generation, profile. ---

@common.cli
def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    cut = argv.index("--") if "--" in argv else len(argv)  # then train.py's flags
    b = Bench(build_parser().parse_args(argv[:cut]), argv, argv[cut + 1:])
    # torch._dynamo compiles at most recompile_limit versions of a function (8), counted over all
    # models, and runs the others eager: raised for the run, so that every model compiles
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(b.names))
    with torch._dynamo.config.patch(recompile_limit=limit):
        models = {name: build(b, name) for name in b.names}
        times = {name: [] for name in models}  # seconds of each timed step
        # each model's first step (with --compile, it compiles), then round-robin, A B C A B C ...
        for r in range(1 + b.args.warmup + b.iters):
            for name, m in models.items():
                # round 0 is each model's first step (--compile: it compiles), then the warm-up
                # rounds: neither is timed
                dt, _ = b.timed(lambda: b.step(m))
                if r > b.args.warmup:
                    times[name].append(dt)
                elif r == 0:
                    graphs = m.counts and m.counts["graphs"]
                    b.out["first_steps"][name] = dict(first_step_s=dt, graphs=graphs)
                    print(f"{name}: first step {dt:.2f} s"
                          + (f", {graphs} graph(s) compiled" if m.counts else ""), flush=True)
                    b.save()
            if r == 0:
                b.train.check_read()  # a flag after -- that no first step read is refused
            if r > b.args.warmup:
                # saved each round: a bench stopped midway keeps every round so far
                b.out["rounds_ms"] = {name: [1e3 * t for t in ts] for name, ts in times.items()}
                b.save()
        for name, m in models.items():
            b.out["variants"][name] = record(b, name, m, times[name])
            b.save()
        add_ratios(b, times)
        print_training(b)
        if b.n_new:
            b.out["generation"] = time_generation(b, models)
        if b.args.profile:
            profile(b, models.get(b.args.profile) or build(b, b.args.profile))
    # a --json of a bench cut short says so: complete stays False
    b.out["complete"] = True
    b.save()

def build(b, name):
    """VARIANT (or VARIANT@against, from the --against file), seeded alike: paired weights."""
    module = b.against if name.endswith("@against") else nanoroute
    torch.manual_seed(0)
    try:
        model = module.GPT(module.GPTConfig(**model_fields(b.shape),
                                            **VARIANTS[name.removesuffix("@against")]))
    except Exception as e:
        if module is nanoroute:  # checked in Bench: a bug here, let it show
            raise
        raise UsageError(f"{name}: the --against version cannot build it: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}: time it without --against, or "
                         "leave out the variant or flag that sets the field") from None
    model.to(b.device)
    # train.py's optimizer, at the step's settings: its step is timed, its state part of the memory
    opt = train.make_optimizer(model, b.train, b.device.type)
    if not b.args.compile:
        return Model(model, model, opt)
    # a backend of its own (--compile_backend's, wrapped): shares no graphs; 0 calls: eager fallback
    counts, inner = dict(graphs=0, calls=0), torch._dynamo.lookup_backend(b.args.compile_backend)

    def backend(graph, example_inputs):
        counts["graphs"] += 1
        compiled = inner(graph, example_inputs)

        def run(*args):
            counts["calls"] += 1
            return compiled(*args)
        return run
    return Model(model, torch.compile(model, backend=backend), opt, counts)

def record(b, name, m, times):
    median, first = statistics.median(times), b.out["first_steps"][name]["first_step_s"]
    # the median: a step the machine slowed moves it least
    r = dict(ms_median=1e3 * median, ms_min=1e3 * min(times), ms_all=[1e3 * t for t in times],
             tokens_per_s=b.B * b.T / median, params=m.model.get_num_params(), first_step_s=first)
    if m.counts:  # every step ran the model's own graphs, or it fell back
        r.update(compiled=m.counts["calls"] >= 1 + b.args.warmup + b.iters, **m.counts)
        # the first step less a steady one: about the time compiling took
        r["compile_s"] = max(0.0, first - median) if r["compiled"] else None
    r["memory"] = memory_parts(b, m)
    r["memory_bytes"] = sum(r["memory"].values())
    r["mfu"] = b.peak and m.model.estimate_mfu(b.B * b.T, median, b.peak)
    return r

def memory_parts(b, m):
    """Bytes of one training step by part (print_training's "memory:" line); they add up.
    Parameters and AdamW state are counted here for every device, then the step's own bytes."""
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in m.model.parameters()}  # unique storages: the tied embedding counts once
    adamw = sum(t.untyped_storage().nbytes() for state in m.opt.state.values()
                for t in state.values() if torch.is_tensor(t))
    return dict(params=sum(params.values()), adamw=adamw, **step_memory(b, m, set(params)))

def step_memory(b, m, params):
    """The step's bytes beyond the parameters (data pointers `params`) and AdamW state."""
    if b.cuda:  # the allocator's statistics are kept on the host: no synchronize needed
        torch.cuda.reset_peak_memory_stats(b.device)
        # the peak above what was resident before: the step's activations and temporaries
        before = torch.cuda.memory_allocated(b.device)
        b.timed(lambda: b.step(m))
        return dict(step_peak=torch.cuda.max_memory_allocated(b.device) - before)
    # a CPU has no allocator peak to read: the parts are summed instead (print_training says so)
    grads = sum(p.numel() * p.element_size() for p in m.model.parameters() if p.requires_grad)
    # parameters and buffers are counted above or not at all, never as saved tensors
    exclude = params | {t.untyped_storage().data_ptr() for t in m.model.buffers()}
    # the eager model: saved-tensor hooks do not see inside compiled graphs
    return dict(grads=grads, saved=saved_bytes(m.model, b.x, b.y, b.amp, exclude, b.train))

def saved_bytes(model, x, y, amp, exclude, settings=train.TrainSettings()):
    """Bytes the step's forward and loss (step_loss of `settings`) save for backward (unique
    storages, held at its end), but `exclude`'s."""
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))  # weak: a freed storage's reused address counts once
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        loss = train.step_loss(model, x, y, settings)[0]
    # alive at the forward's end: what the graph holds for backward, not the temporaries
    alive = [t.untyped_storage() for t in (r() for r in saved) if t is not None]
    del loss  # frees the graph
    return sum({s.data_ptr(): s.nbytes() for s in alive if s.data_ptr() not in exclude}.values())

def paired_ratio(times, base):
    """Round i over the baseline's round i (side by side: drift cancels): median [quartiles]."""
    ratios = [t / b for t, b in zip(times, base)]
    # one round: no quartiles; its ratio stands for all three
    if len(ratios) == 1:
        return ratios * 3
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [statistics.median(ratios), q1, q3]

def add_ratios(b, times):
    res = b.out["variants"]
    for name, r in res.items():
        version = "@against" if name.endswith("@against") else ""
        # each version against its own baselines: --against's rows use its own prenorm and block
        for base in ("prenorm", "block"):
            ref = res.get(base + version)
            r[f"ratio_{base}"] = ref and r["ms_median"] / ref["ms_median"]
            r[f"paired_ratio_{base}"] = ref and paired_ratio(times[name], times[base + version])
        ref = res.get("prenorm" + version)
        r["memory_ratio_prenorm"] = ref and r["memory_bytes"] / ref["memory_bytes"]
        if b.against and not version:
            r["paired_ratio_against"] = paired_ratio(times[name], times[name + "@against"])
            r["memory_ratio_against"] = r["memory_bytes"] / res[name + "@against"]["memory_bytes"]
    b.save()

def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])

def fmt(x):
    return "-" if x is None else f"{x:.3f}"

def quartiles(x):  # a paired ratio: median [quartiles]
    return "-" if x is None else "{:.3f} [{:.3f}, {:.3f}]".format(*x)

def print_training(b):
    header = ["variant", "params", "median ms", "min ms", "tokens/s", "/ prenorm", "/ block",
              "per round / prenorm", "per round / block", "memory MB", "memory / prenorm"]
    header += ["MFU"] * bool(b.peak) + ["first step s"] + ["compiled"] * b.args.compile
    rows = []
    for name, r in b.out["variants"].items():
        rows.append([name, f"{r['params'] / 1e6:.2f}M", f"{r['ms_median']:.1f}",
                     f"{r['ms_min']:.1f}", f"{r['tokens_per_s']:.0f}", fmt(r["ratio_prenorm"]),
                     fmt(r["ratio_block"]), quartiles(r["paired_ratio_prenorm"]),
                     quartiles(r["paired_ratio_block"]), f"{r['memory_bytes'] / 2**20:.1f}",
                     fmt(r["memory_ratio_prenorm"])])
        rows[-1] += ([f"{100 * r['mfu']:.1f}%"] if b.peak else []) + [f"{r['first_step_s']:.2f}"]
        if b.args.compile:
            rows[-1].append(f"yes: {r['graphs']} graph(s), {r['compile_s']:.1f} s"
                            if r["compiled"] else "NO: eager fallback")
    print(f"\n### Training step: B={b.B}, T={b.T}, {b.iters} interleaved rounds after "
          f"{b.args.warmup} warm-up; per round: median [quartiles] of round i / round i")
    print("memory: " + ("allocator peak of a step + parameters + AdamW state" if b.cuda else
                        "parameters + gradients + AdamW state + tensors saved for backward"))
    if b.cuda and not b.peak:
        print(f"note: no MFU: no peak FLOP/s known for {b.out['machine']['device_name']} "
              f"(train.PEAK_FLOPS): give it as NANOROUTE_PEAK_FLOPS")
    print(md_table(header, rows))
    if b.against:
        res = b.out["variants"]
        print(f"\nthis code / --against {b.args.against}, per round: median [quartiles]; below 1: "
              "this code is faster")
        print(md_table(["variant", "time this / against", "memory this / against"],
                       [[v, quartiles(res[v]["paired_ratio_against"]),
                         fmt(res[v]["memory_ratio_against"])] for v in b.variants]))

@torch.no_grad()
def generate_recompute(model, idx, max_new_tokens):
    """Greedy decoding without a cache, nanoGPT style: re-run the whole (cropped) context."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.sequence_len:])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx

def time_generation(b, models):
    if b.n_new > b.T:
        print(f"\nnote: --gen_tokens {b.n_new} > sequence_len {b.T}: past the context both "
              "re-encode the last sequence_len tokens at every step")
    # with --against each variant beside its twin, as in the training rounds
    names = [v + version for v in b.gen_variants for version in b.versions]
    gen = {v: (models[v] if v in models else build(b, v)).model.eval() for v in names}
    # one token of id 0: the time does not depend on what the text says
    prompt = torch.zeros((1, 1), dtype=torch.long, device=b.device)
    ways = dict(kv=lambda m, n: m.generate(prompt, n, top_k=1),
                recompute=lambda m, n: generate_recompute(m, prompt, n))
    times, tokens = {(v, w): [] for v in gen for w in ways}, {}
    with b.amp:
        for v, w in times:  # warm-up
            ways[w](gen[v], 2)
        for _ in range(b.args.gen_repeats):
            for (v, w), ts in times.items():
                dt, tokens[v, w] = b.timed(lambda: ways[w](gen[v], b.n_new))
                ts.append(dt)
    out, rows = {}, []
    for v in gen:
        kv, full = (statistics.median(times[v, w]) for w in ways)
        # greedy both ways: the same tokens, the same work timed. Not a test of the cache: at
        # init the model hardly uses positions (test_nanoroute.py compares the logits)
        same = torch.equal(tokens[v, "kv"], tokens[v, "recompute"])
        # per token against PreNorm's KV cache (of the same version), where PreNorm is timed too
        prenorm = "prenorm" + "@against" * v.endswith("@against")
        base = statistics.median(times[prenorm, "kv"]) if prenorm in gen else None
        out[v] = dict(kv_ms=1e3 * kv, recompute_ms=1e3 * full, speedup=full / kv,
                      kv_tokens_per_s=b.n_new / kv, same_tokens=same,
                      kv_ratio_prenorm=base and kv / base)
        if b.against and not v.endswith("@against"):  # the KV cache's time, this / against
            out[v]["kv_ratio_against"] = kv / statistics.median(times[v + "@against", "kv"])
        rows.append([v, f"{1e3 * kv:.1f}", fmt(base and kv / base), f"{1e3 * full:.1f}",
                     f"{full / kv:.2f}x", f"{b.n_new / kv:.0f}", "yes" if same else "NO"])
    print(f"\n### Generation: {b.n_new} new tokens, B=1, greedy, median of {b.args.gen_repeats}")
    print(md_table(["variant", "KV cache ms", "KV / prenorm", "recompute ms", "speed-up",
                    "KV tokens/s", "same tokens"], rows))
    print("same tokens: the same work timed both ways; a model at init hardly uses positions, so "
          "it does not test the KV cache (the tests do)")
    if b.against:
        print("KV cache this / against: " + ", ".join(
            f"{v} {fmt(out[v]['kv_ratio_against'])}" for v in b.gen_variants))
    return dict(new_tokens=b.n_new, repeats=b.args.gen_repeats, variants=out)

def profile(b, m):
    kinds = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * b.cuda
    sort_by = "self_device_time_total" if b.cuda else "self_cpu_time_total"
    # train mode again after generation's eval(); a step outside the profile takes the
    # first call's costs out of it
    m.model.train()
    b.step(m)
    with torch.profiler.profile(activities=kinds) as prof:
        for _ in range(3):
            b.step(m)
        b.sync()
    ops = prof.key_averages()
    calls = sum(e.count for e in ops if e.key.startswith("aten::")) / 3
    print(f"\n### Profile: {b.args.profile}, 3 training steps ({calls:.0f} aten calls a step), "
          f"top ops by {sort_by}\n{ops.table(sort_by=sort_by, row_limit=20)}")

if __name__ == "__main__":
    main()
