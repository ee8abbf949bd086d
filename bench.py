"""
bench.py: speed and memory of every residual variant at one shape, measured in one run.

Training: the step (forward + backward + AdamW step + zero_grad) of every variant is timed round-robin,
A B C A B C ... after warm-up, so that machine noise falls on all variants alike. Every model starts
from the same seed and trains on the same fixed random batch. Reported: median and min ms/step,
tokens/s (B·T / median), memory, and the ratios of medians to PreNorm and to Block AttnRes.
Generation: greedy decoding of --gen_tokens tokens after a 1-token prompt, model.generate (KV cache)
against a full-recompute loop (nanoGPT style: re-run the whole context for every new token), with a
check that both produce the same tokens.

Each model's first step is timed apart: with --compile it is where torch.compile compiles (reported
as compile time, never in the step times). Every model of the run gets its own compiled function,
and torch._dynamo's recompile limit (8 versions of GPT.forward by default) is raised for the run, so
that all of them compile; the report says per model whether it ran compiled, counted by its own
backend (a model that fell back to eager says so). --json is rewritten as each model and variant is
measured, so a run stopped early keeps what it measured.

Memory (a separate, untimed step per variant, after warm-up):
- cuda: allocator peak of one training step (torch.cuda.max_memory_allocated) above what was allocated
  just before it, plus the model's own parameters and AdamW state. All models stay resident, so the
  raw peak would count the other variants too.
- cpu: there is no allocator statistic, so an exact count instead: bytes of parameters + gradients +
  AdamW state + the tensors saved for backward by one (eager) forward pass, as unique storages recorded
  with torch.autograd.graph.saved_tensors_hooks, parameter storages excluded. That is the training-step
  footprint at its usual peak, the end of the forward; temporaries are not counted.
- both: train.py's estimate of the peak (train.estimate_memory), next to it.

Before and after a change to the model: --against PATH (another nanoroute.py, or a folder holding one)
builds every variant from that file too, as VARIANT@against, and times both versions in the same rounds;
the report adds the per-round ratio of this code to that code, variant by variant, and the ratios to
Block AttnRes within each version.

Variants: prenorm, rezero, layerscale; block (Block AttnRes, auto routing block), full (Full AttnRes,
one sublayer per block), wav (WAV v1, both bases), rd (RD-AttnRes, decoupled), naive (block with
fast_routing=False: the readable reference read, to show what the fast path saves).

Usage:
    python bench.py --shape s12                            # 12 layers, d=256, T=256, B=8, CPU
    python bench.py --shape s48 --variants prenorm,block,wav,rd --iters 20 --json out/bench_s48.json
    python bench.py --shape demo --variants prenorm --gen_variants prenorm,block,wav,rd
    python bench.py --shape gpu12 --device cuda --compile  # bf16 autocast, reports MFU
    python bench.py --preset rd_m --variants block,rd --iters 2 --gen_tokens 0  # a preset's forward
    python bench.py --memory_table                         # every preset's estimated memory per GPU
    python bench.py --shape s12 --variants block --gen_tokens 0 --profile block
    git show main:nanoroute.py > /tmp/main_nanoroute.py   # the model before your change
    python bench.py --shape s12 --variants block,rd --gen_tokens 0 --against /tmp/main_nanoroute.py
    python bench.py --n_layer 6 --n_embd 192 --n_head 6 --sequence_len 128 --batch_size 4
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import platform
import statistics
import sys
import time
import typing
import weakref

import torch

import nanoroute
import prepare_data
import train
from prepare_data import UsageError, write_json
from train import pick_device

SHAPES = {  # batch_size is B; sequence_len is both the context and the T of the training batch
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, sequence_len=32, batch_size=2, vocab_size=256),
    "demo": dict(n_layer=4, n_embd=128, n_head=4, sequence_len=256, batch_size=16, vocab_size=256),
    "s12": dict(n_layer=12, n_embd=256, n_head=4, sequence_len=256, batch_size=8, vocab_size=256),
    "s48": dict(n_layer=48, n_embd=128, n_head=4, sequence_len=128, batch_size=8, vocab_size=256),
    "gpu12": dict(n_layer=12, n_embd=768, n_head=12, sequence_len=1024, batch_size=16, vocab_size=50304),
}
# the compared variants (nanoroute.VARIANTS), plus Full AttnRes and the readable reference read; only
# the values that differ from GPTConfig's defaults, so that an --against version without a field builds them
_DEFAULTS = nanoroute.GPTConfig()
VARIANTS = {name: {k: v for k, v in values.items() if getattr(_DEFAULTS, k) != v} for name, values in dict(
    **{k: nanoroute.VARIANTS[k] for k in ("prenorm", "rezero", "layerscale", "block")},
    full=dict(nanoroute.VARIANTS["block"], attnres_block=1), wav=nanoroute.VARIANTS["wav"],
    rd=nanoroute.VARIANTS["rd"], naive=dict(nanoroute.VARIANTS["block"], fast_routing=False),
    wav_learned=dict(nanoroute.VARIANTS["wav"], wav_learned_bases=True)).items()}
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "sequence_len", "vocab_size")

# -----------------------------------------------------------------------------
# small helpers (the test imports these)


def median(xs):
    return statistics.median(xs)


def ratios(values, base):
    """{variant: value / values[base]}, or {} when base was not run."""
    return {k: v / values[base] for k, v in values.items()} if base in values else {}


def paired_ratios(times, base):
    """Per-round ratios to `base` (the rounds are interleaved, so round i of every variant ran side by
    side): {variant: (median, lower quartile, upper quartile)}, or {} when base was not run. Their spread
    says how far one run can be trusted; a slow drift of the machine cancels out of each ratio."""
    if base not in times:
        return {}
    out = {}
    for name, ts in times.items():
        rs = [t / b for t, b in zip(ts, times[base])]
        q1, _, q3 = statistics.quantiles(rs, n=4, method="inclusive") if len(rs) > 1 else (rs[0], None, rs[0])
        out[name] = (median(rs), q1, q3)
    return out


def summarize(times_s, tokens_per_step):
    """Timing summary of one variant from its per-step times in seconds."""
    med = median(times_s)
    return dict(ms_median=1e3 * med, ms_min=1e3 * min(times_s), ms_all=[1e3 * t for t in times_s],
                tokens_per_s=tokens_per_step / med)


def parse_list(text, flag):
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise UsageError(f"{flag}={text!r}: unknown variant(s) {', '.join(bad)}; choose from {','.join(VARIANTS)}")
    return names


def load_against(path):
    """The nanoroute module in `path` (a .py file, or a folder holding nanoroute.py), for --against."""
    file = os.path.join(path, "nanoroute.py") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UsageError(f"--against={path!r}: no such file; give another version's nanoroute.py "
                         f"(e.g. git show main:nanoroute.py > /tmp/main_nanoroute.py)")
    spec = importlib.util.spec_from_file_location("nanoroute_against", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's other version: say which file failed, and how
        raise UsageError(f"--against={path!r}: importing {file} failed: {type(e).__name__}: {e}")
    if not (hasattr(module, "GPT") and hasattr(module, "GPTConfig")):
        raise UsageError(f"--against={path!r}: {file} has no GPT and GPTConfig; is it a nanoroute.py?")
    return module


def sync(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()


def train_step(model, opt, x, y, amp):
    with amp:
        loss = model(x, y)[1]  # as train.py: the logits are freed before the backward
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def static_bytes(model, opt):
    """Bytes of the parameters (unique storages: the tied embedding counts once) and of the optimizer state."""
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return params, state


def saved_bytes(model, x, y, amp, exclude):
    """Bytes of the unique storages saved for backward by one forward pass and still held by the graph
    at its end (weak references, so a freed storage whose address is reused is not counted twice),
    minus the storages whose data_ptr is in `exclude`."""
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        _, loss = model(x, y)
    alive = [t.untyped_storage() for t in (r() for r in saved) if t is not None]
    del loss  # frees the graph
    return sum({s.data_ptr(): s.nbytes() for s in alive if s.data_ptr() not in exclude}.values())


def memory_bytes(model, step_model, opt, x, y, amp, device_type):
    """Training-step footprint in bytes; see the docstring at the top for the method on each device."""
    params, state = static_bytes(model, opt)
    if device_type == "cuda":
        sync(device_type)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        train_step(step_model, opt, x, y, amp)
        sync(device_type)
        return torch.cuda.max_memory_allocated() - before + sum(params.values()) + state
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    return sum(params.values()) + grads + state + saved_bytes(model, x, y, amp, set(params) | buffers)


@torch.no_grad()
def generate_recompute(model, idx, max_new_tokens):
    """Greedy decoding without a cache, nanoGPT style: re-run the whole (cropped) context per token."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.sequence_len:])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


def timed(fn, device_type):
    sync(device_type)
    t0 = time.perf_counter()
    out = fn()
    sync(device_type)
    return time.perf_counter() - t0, out


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def compiled_cell(r):
    """Whether a model ran compiled, for the table: its graphs and compile time, or that it did
    not."""
    if not r["compiled"]:
        return "NO: eager fallback"
    return f"yes: {r['graphs']} graph(s), {r['compile_s']:.1f} s"


# -----------------------------------------------------------------------------
# The benchmark, by job: parse, build, time the training step, report, time generation, profile


def main(argv=None):
    try:
        return run_bench(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run_bench(argv=None):
    """Every measurement of one bench.py command; returns its numbers (bench.out), written to --json
    as they come."""
    args = build_parser().parse_args(argv)
    if args.memory_table:
        print(memory_table())
        return None
    bench = setup(args, argv)
    out = bench.out
    with compile_limit(bench):
        models = {}
        for name in bench.timed:  # one at a time: a model's first step compiles it (--compile)
            models[name] = build(bench, name)
            first_step(bench, name, models[name])
        times = time_training(bench, models)
        for name, m in models.items():
            out["variants"][name] = variant_result(bench, name, m, times[name])
            print_progress(bench, name, out["variants"][name])
            save(bench)
        add_ratios(bench, out["variants"], times)
        print_training(bench, out["variants"])
        generation = time_generation(bench, models) if bench.n_new > 0 else {}
        if bench.args.profile:
            profile(bench, models)
    out["generation"] = dict(new_tokens=bench.n_new, prompt_len=1, repeats=bench.args.gen_repeats,
                             variants=generation)
    out["complete"] = True
    save(bench)
    if bench.args.json:
        print(f"\nwrote {bench.args.json}")
    return out


def build_parser():
    p = prepare_data.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="s12", choices=SHAPES)
    p.add_argument("--preset", default=None, choices=train.PRESETS,
                   help="the shape of a train.py preset instead: its model, B = the sequences one\n"
                        "GPU runs per forward (its --micro_batch), its data's vocabulary")
    for f in (*MODEL_FIELDS, "batch_size"):
        p.add_argument(f"--{f}", type=int, default=None, help="overrides the shape's value")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list, in timing order")
    p.add_argument("--iters", type=int, default=None, help="timed steps per variant (default 10 cpu, 20 cuda)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds after each model's first step (timed apart: compiling)")
    p.add_argument("--gen_tokens", type=int, default=None,
                   help="new tokens per generation, 0 = skip; default min(256, sequence_len), the most that fit the"
                        " context after the 1-token prompt (past it, both methods re-encode the window every step)")
    p.add_argument("--gen_variants", default="prenorm,block,wav,rd")
    p.add_argument("--gen_repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile each model for the training step")
    p.add_argument("--compile_backend", default="inductor", metavar="NAME",
                   help="torch.compile's backend for --compile (aot_eager or eager: the compile\n"
                        "path without inductor's code generation, quick on a CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--profile", default=None, choices=VARIANTS,
                   help="variant to run under torch.profiler: 3 training steps, and a cached generation "
                        "unless --gen_tokens 0")
    p.add_argument("--against", default=None, metavar="PATH",
                   help="another nanoroute.py (or a folder holding one): time every variant from it too, in the"
                        " same rounds, and report this code / that code")
    p.add_argument("--json", default=None, help="write every number to this path, as they come")
    p.add_argument("--memory_table", action="store_true",
                   help="print the estimated peak memory per GPU of every train.py preset and\n"
                        "variant on 1 and 8 GPUs (train.estimate_memory), and exit")
    return p


@dataclasses.dataclass
class Bench:
    """One benchmark, as its flags set it up: what every job below reads. out: the numbers so far
    (what --json holds)."""
    args: argparse.Namespace
    variants: list  # the timed variants of this code, in timing order
    gen_variants: list
    against: object  # the --against nanoroute module, or None
    device: str
    shape: dict  # SHAPES[--shape] (or the --preset's) with the flags' overrides
    iters: int
    machine: dict
    dtype: torch.dtype  # as train.py's --dtype auto: bf16 autocast on a GPU with native bf16, else float32

    def __post_init__(self):
        self.device_type = torch.device(self.device).type
        self.B, self.T = self.shape["batch_size"], self.shape["sequence_len"]
        self.amp = (torch.autocast(self.device_type, dtype=self.dtype) if self.dtype == torch.bfloat16
                    else contextlib.nullcontext())
        # the timed names: each variant, and VARIANT@against right after it with --against
        versions = ("", "@against") if self.against else ("",)
        self.timed = [name + version for name in self.variants for version in versions]
        gen = torch.Generator().manual_seed(1)
        data = torch.randint(self.shape["vocab_size"], (self.B, self.T + 1), generator=gen)
        data = data.to(self.device)
        # the same fixed batch for every variant and step
        self.x, self.y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        self.n_new = min(256, self.T) if self.args.gen_tokens is None else self.args.gen_tokens
        # MFU's peak FLOP/s: a GPU in train.PEAK_FLOPS, else None (no CPU's name is in it)
        self.peak = train.peak_flops(self.machine["device_name"], self.dtype)
        self.out = dict(machine=self.machine, args=vars(self.args), shape=self.shape,
                        iters=self.iters, complete=False, first_steps={}, variants={},
                        generation={})


def setup(args, argv):
    """The flags, checked, as a Bench; prints the machine and the shape."""
    variants = parse_list(args.variants, "--variants")
    against = load_against(args.against) if args.against else None
    gen_variants = parse_list(args.gen_variants, "--gen_variants")
    if args.compile:
        check_backend(args.compile_backend)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = str(pick_device(args.device))  # a clear error for a typo, or CUDA asked for where there is none
    device_type = torch.device(device).type
    if device_type == "cuda":
        torch.cuda.set_device(device)  # cuda:1 too: synchronize and the memory counts follow it
        torch.backends.cuda.matmul.allow_tf32 = True  # as train.py
        torch.backends.cudnn.allow_tf32 = True
    dtype = train.pick_dtype("auto", torch.device(device))
    base = preset_shape(args.preset) if args.preset else SHAPES[args.shape]
    shape = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    iters = args.iters or (20 if device_type == "cuda" else 10)
    compiled = f"compiled ({args.compile_backend})" if args.compile else "eager"
    machine = dict(torch=torch.__version__, python=platform.python_version(), device=device,
                   device_name=torch.cuda.get_device_name(device) if device_type == "cuda"
                   else cpu_name(),
                   cpu_count=os.cpu_count(), threads=torch.get_num_threads(),
                   dtype="bf16 autocast" if dtype == torch.bfloat16 else "fp32", compiled=args.compile,
                   compile_backend=args.compile_backend if args.compile else None,
                   command="python bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"bench: {machine['device_name']} ({machine['cpu_count']} CPUs, {machine['threads']} threads), "
          f"torch {machine['torch']}, {machine['dtype']}, {compiled} | {machine['command']}")
    print(f"{'preset ' + args.preset if args.preset else 'shape ' + args.shape}: "
          + ", ".join(f"{k}={v}" for k, v in shape.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    return Bench(args, variants, gen_variants, against, device, shape, iters, machine, dtype)


def preset_shape(name):
    """A train.py preset as a shape: its model; batch_size, the sequences one GPU runs per forward
    (its --micro_batch, or its whole batch); the vocabulary of its data: GPT-2's tokens, or at most
    256 characters (a char-level dataset's own is smaller)."""
    preset = train.PRESETS[name]
    vocab = prepare_data.GPT2_VOCAB if "fineweb" in preset["data"] else 256
    rows = train.rows_per_forward(preset["batch_size"], preset.get("micro_batch", 0), 1)
    return dict({k: preset[k] for k in MODEL_FIELDS[:-1]}, batch_size=rows, vocab_size=vocab)


def check_backend(name):
    """--compile_backend must name one of torch.compile's backends."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise UsageError(f"--compile_backend {name}: not a torch.compile backend; choose one of "
                         f"{', '.join(known)}")


class Model(typing.NamedTuple):
    """One timed model: the module, what the training step calls (compiled with --compile), its
    AdamW, and with --compile its own backend's counts: {"graphs": compiled, "calls": run}."""
    model: torch.nn.Module
    step_model: object
    opt: torch.optim.Optimizer
    compiled: dict = None


def build(bench, name):
    """The Model of one variant; VARIANT@against from the --against version of nanoroute.py."""
    module, variant = (nanoroute, name)
    if name.endswith("@against"):
        module, variant = (bench.against, name[:-len("@against")])
    torch.manual_seed(0)  # paired: every variant starts from the same shared weights
    try:
        config = module.GPTConfig(**{k: bench.shape[k] for k in MODEL_FIELDS}, **VARIANTS[variant])
        model = module.GPT(config)
    except Exception as e:
        if module is nanoroute:  # a bug here: let it show
            raise
        # the other version may not have this variant's flags
        raise UsageError(f"{name}: the --against version cannot build it: {type(e).__name__}: {e}")
    model.to(bench.device)
    opt = model.configure_optimizers(0.1, 1e-3, device_type=bench.device_type)
    if not bench.args.compile:
        return Model(model, model, opt)
    step_model, counts = compile_counted(model, bench.args.compile_backend)
    return Model(model, step_model, opt, counts)


def compile_counted(model, backend_name):
    """torch.compile(model) with a backend of its own (backend_name's, wrapped): the model compiles
    its own graphs, never shares another model's, and the counts say how many it compiled and how
    often the steps ran them (0: dynamo fell back to eager)."""
    counts = dict(graphs=0, calls=0)
    inner = torch._dynamo.lookup_backend(backend_name)

    def backend(graph, example_inputs):
        counts["graphs"] += 1
        compiled = inner(graph, example_inputs)

        def run(*args):
            counts["calls"] += 1
            return compiled(*args)
        return run
    return torch.compile(model, backend=backend), counts


def compile_limit(bench):
    """torch._dynamo keeps at most recompile_limit compiled versions of one function (8 by
    default), counted over every model, and runs the others eager: GPT.forward of --against's 16
    models, or of more than 8 variants, would fall back. Raised for the run, to twice the models."""
    if not bench.args.compile:
        return contextlib.nullcontext()
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(bench.timed))
    return torch._dynamo.config.patch(recompile_limit=limit)


def first_step(bench, name, m):
    """A model's first training step, timed apart: with --compile it compiles. Recorded, printed and
    saved at once (compiling every variant of a large shape takes minutes)."""
    step = lambda: train_step(m.step_model, m.opt, bench.x, bench.y, bench.amp)  # noqa: E731
    dt, _ = timed(step, bench.device_type)
    record = dict(first_step_s=dt, graphs=m.compiled["graphs"] if m.compiled else None)
    bench.out["first_steps"][name] = record
    what = f", {record['graphs']} graph(s) compiled" if m.compiled else ""
    print(f"{name}: first step {dt:.2f} s{what}", flush=True)
    save(bench)


def time_training(bench, models):
    """Seconds per training step of every model, {name: [per round]}: round-robin, A B C A B C ...,
    after --warmup untimed rounds, so that machine noise falls on all variants alike. The rounds so
    far are saved after each."""
    times = {name: [] for name in models}
    for r in range(bench.args.warmup + bench.iters):
        for name, m in models.items():
            dt, _ = timed(lambda: train_step(m.step_model, m.opt, bench.x, bench.y, bench.amp),
                          bench.device_type)
            if r >= bench.args.warmup:
                times[name].append(dt)
        if r >= bench.args.warmup:
            bench.out["rounds_ms"] = {name: [1e3 * t for t in ts] for name, ts in times.items()}
            save(bench)
    return times


def variant_result(bench, name, m, times):
    """One variant's record: its step times, whether they ran compiled, parameters, routing block,
    memory (measured, and train.py's estimate) and MFU (a GPU in train.PEAK_FLOPS)."""
    cuda, model = bench.device_type == "cuda", m.model
    res = summarize(times, bench.B * bench.T)
    res.update(bench.out["first_steps"][name])
    # compiled: every step so far ran the model's own compiled graphs (None: no --compile)
    steps = 1 + bench.args.warmup + bench.iters
    res["compiled"] = m.compiled["calls"] >= steps if m.compiled else None
    compile_s = max(0.0, res["first_step_s"] - res["ms_median"] / 1e3)
    res["compile_s"] = compile_s if res["compiled"] else None
    res["params"] = model.get_num_params()
    routed = model.config.residual == "attnres"
    res["routing_block"] = model.config.routing_block if routed else None
    # CPU: count on the eager model (saved-tensor hooks and compiled graphs do not mix)
    res["memory_bytes"] = memory_bytes(model, m.step_model if cuda else model, m.opt, bench.x,
                                       bench.y, bench.amp, bench.device_type)
    config = nanoroute.GPTConfig(**{k: bench.shape[k] for k in MODEL_FIELDS},
                                 **VARIANTS[name.removesuffix("@against")])
    estimate = train.estimate_memory(config, bench.B * bench.T, bench.dtype)
    res["memory_estimate_bytes"] = estimate["total"]
    res["mfu"] = None
    if bench.peak:
        res["mfu"] = model.estimate_mfu(bench.B * bench.T, res["ms_median"] / 1e3, bench.peak)
    return res


def print_progress(bench, name, r):
    """One line as soon as a variant's record is complete."""
    compiled = {None: "", True: ", compiled",
                False: ", NOT compiled: dynamo fell back to eager"}[r["compiled"]]
    mfu = f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
    memory, estimate = r["memory_bytes"] / 2**20, r["memory_estimate_bytes"] / 2**20
    print(f"{name}: {r['ms_median']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s{mfu}, memory "
          f"{memory:,.0f} MB (estimated {estimate:,.0f}), first step {r['first_step_s']:.2f} s"
          f"{compiled}", flush=True)


def save(bench):
    """--json rewritten (atomically) with what is measured so far: a run stopped early keeps it."""
    if bench.args.json:
        write_json(bench.args.json, bench.out)


def add_ratios(bench, results, times):
    """The ratios of medians (time, memory) to PreNorm and Block AttnRes, and the per-round ratios,
    within each version of the code; with --against, this code to that code, round by round."""
    variants, against = bench.variants, bench.against
    medians = {k: v["ms_median"] for k, v in results.items()}
    mems = {k: v["memory_bytes"] for k, v in results.items()}
    bases = ("prenorm", "block")
    for suffix in ("", "@against")[:2 if against else 1]:  # ratios within each version of the code
        med, mem, ts = ({name: d[name + suffix] for name in variants} for d in (medians, mems, times))
        to_prenorm, to_block, mem_to_prenorm = ratios(med, "prenorm"), ratios(med, "block"), ratios(mem, "prenorm")
        paired = {base: paired_ratios(ts, base) for base in bases}
        for name in variants:
            results[name + suffix].update(ratio_prenorm=to_prenorm.get(name), ratio_block=to_block.get(name),
                                          memory_ratio_prenorm=mem_to_prenorm.get(name),
                                          **{f"paired_ratio_{base}": paired[base].get(name) for base in bases})
            if against and not suffix:  # this code against that code, round by round
                results[name]["paired_ratio_against"] = paired_ratios(
                    {"this": times[name], "that": times[name + "@against"]}, "that")["this"]


def print_training(bench, results):
    """The training-step tables: every variant, per-round ratios, this code against --against."""
    cuda, compiled = bench.device_type == "cuda", bench.args.compile
    mem_kind = "peak MB" if cuda else "counted MB"
    header = ["variant", "params", "median ms/step", "min ms", "tokens/s", "/ prenorm", "/ block",
              f"memory ({mem_kind})", "estimated MB", "memory / prenorm"]
    header += ["MFU"] * bool(bench.peak) + ["first step s"] + ["compiled"] * compiled
    rows = [[name, f"{r['params'] / 1e6:.2f}M", f"{r['ms_median']:.1f}", f"{r['ms_min']:.1f}",
             f"{r['tokens_per_s']:.0f}", fmt(r["ratio_prenorm"]), fmt(r["ratio_block"]),
             f"{r['memory_bytes'] / 2**20:.1f}", f"{r['memory_estimate_bytes'] / 2**20:.1f}",
             fmt(r["memory_ratio_prenorm"])] + ([f"{100 * r['mfu']:.1f}%"] if bench.peak else [])
            + [f"{r['first_step_s']:.2f}"] + ([compiled_cell(r)] if compiled else [])
            for name, r in results.items()]
    print(f"\n### Training step: B={bench.B}, T={bench.T}, {bench.iters} interleaved steps per "
          f"variant after {bench.args.warmup} warm-up rounds; ratios are of medians")
    if not cuda:
        print("memory (counted) = params + grads + AdamW state + tensors saved for backward (unique storages),"
              " not an allocator peak")
    if cuda and not bench.peak:
        print(f"note: MFU left out: no peak FLOP/s known for {bench.machine['device_name']} in "
              f"{str(bench.dtype).removeprefix('torch.')} (train.PEAK_FLOPS)")
    print("estimated = train.estimate_memory, the eager step's peak; first step: its own time, "
          "with --compile its compiling (never in ms/step)")
    print(md_table(header, rows))
    run_bases = [base for base in ("prenorm", "block") if base in bench.variants]
    if run_bases:
        print("\nper-round ratios (round i of each variant against round i of the baseline): median [quartiles]")
        print(md_table(["variant"] + [f"/ {base}" for base in run_bases],
                       [[name] + ["{:.3f} [{:.3f}, {:.3f}]".format(*r[f"paired_ratio_{base}"]) for base in run_bases]
                        for name, r in results.items()]))
    if bench.against:
        print(f"\nthis code against --against {bench.args.against}, per-round ratios (round i "
              f"against round i): median [quartiles]; below 1 means this code is faster")
        print(md_table(["variant", "this / against", "memory this / against"],
                       [[name, "{:.3f} [{:.3f}, {:.3f}]".format(*r["paired_ratio_against"]),
                         f"{r['memory_bytes'] / results[name + '@against']['memory_bytes']:.3f}"]
                        for name, r in results.items() if not name.endswith("@against")]))


def time_generation(bench, models):
    """Greedy decoding of --gen_tokens tokens after a 1-token prompt: model.generate (KV cache)
    against a full recompute, median of --gen_repeats rounds, checked to give the same tokens."""
    n_new, T = bench.n_new, bench.T
    if n_new > T:  # prompt (1) + n_new - 1 fed tokens exceed the context
        print(f"\nnote: --gen_tokens={n_new} > sequence_len={T}: past the context both methods "
              f"re-encode the last {T} tokens at every step, so the KV-cache speed-up shrinks")
    gen_models = {name: (models[name][0] if name in models else build(bench, name)[0]).eval()
                  for name in bench.gen_variants}
    prompt = torch.zeros((1, 1), dtype=torch.long, device=bench.device)
    kv = lambda m, n: m.generate(prompt, n, top_k=1)  # noqa: E731  (top_k=1: greedy)
    full = lambda m, n: generate_recompute(m, prompt, n)  # noqa: E731
    gen_times = {name: ([], []) for name in gen_models}
    outputs = {}
    with bench.amp:
        for model in gen_models.values():  # warm-up
            kv(model, 2)
            full(model, 2)
        for _ in range(bench.args.gen_repeats):
            for name, model in gen_models.items():
                dt_kv, out_kv = timed(lambda: kv(model, n_new), bench.device_type)
                dt_full, out_full = timed(lambda: full(model, n_new), bench.device_type)
                gen_times[name][0].append(dt_kv)
                gen_times[name][1].append(dt_full)
                outputs[name] = (out_kv, out_full)
    generation = {name: generation_result(name, *gen_times[name], *outputs[name], n_new)
                  for name in gen_models}
    print(f"\n### Generation: {n_new} new tokens, B=1, 1-token prompt, greedy, median of "
          f"{bench.args.gen_repeats}")
    header = ["variant", "KV cache ms", "recompute ms", "speed-up", "KV tokens/s", "same tokens"]
    print(md_table(header,
                   [[k, f"{g['kv_ms']:.1f}", f"{g['recompute_ms']:.1f}", f"{g['speedup']:.2f}x",
                     f"{g['kv_tokens_per_s']:.0f}", "yes" if g["same_tokens"] else "NO"]
                    for k, g in generation.items()]))
    return generation


def generation_result(name, t_kv, t_full, out_kv, out_full, n_new):
    """One variant's generation record; a warning when the two methods' tokens differ."""
    same = torch.equal(out_kv, out_full)
    if not same:
        first = (out_kv != out_full).nonzero()[0, 1].item()
        print(f"WARNING: {name}: KV-cache and recompute tokens differ from position {first} "
              f"(near-tied logits or a cache bug)")
    return dict(kv_ms=1e3 * median(t_kv), recompute_ms=1e3 * median(t_full),
                speedup=median(t_full) / median(t_kv), kv_tokens_per_s=n_new / median(t_kv),
                same_tokens=same)


def profile(bench, models):
    """--profile VARIANT: the top ops of 3 training steps under torch.profiler, and of a cached
    generation (what one generated token costs) unless --gen_tokens 0."""
    name = bench.args.profile
    model, step_model, opt, _ = models[name] if name in models else build(bench, name)
    model.train()
    for _ in range(bench.args.warmup):
        train_step(step_model, opt, bench.x, bench.y, bench.amp)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if bench.device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            train_step(step_model, opt, bench.x, bench.y, bench.amp)
        sync(bench.device_type)
    sort_by = "self_device_time_total" if bench.device_type == "cuda" else "self_cpu_time_total"
    print(f"\n### Profile: {name}, 3 training steps, top ops by {sort_by}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=20))
    if bench.n_new > 0:  # and a cached decode: what one generated token costs
        model.eval()
        prompt = torch.zeros((1, 1), dtype=torch.long, device=bench.device)
        n = min(32, bench.n_new)
        with bench.amp:
            model.generate(prompt, n, top_k=1)  # warm-up
            with torch.profiler.profile(activities=activities) as prof:
                model.generate(prompt, n, top_k=1)
                sync(bench.device_type)
        ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        print(f"\n### Profile: {name}, KV-cache generation of {n} tokens: "
              f"{sum(e.count for e in ops) / n:.0f} aten calls per token, top ops by {sort_by}")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=12))


def memory_table(gpus=(1, 8)):
    """train.estimate_memory of every train.py preset and variant in GiB per GPU, on 1 and 8 GPUs,
    in bf16: a Markdown table (docs/training.md and docs/speed.md hold it, as a test checks)."""
    rows = []
    for preset in train.PRESETS:
        shape, settings = preset_shape(preset), train.PRESETS[preset]
        T = shape["sequence_len"]
        for world in gpus:
            per_forward = train.rows_per_forward(settings["batch_size"], settings.get("micro_batch", 0), world)
            cells = []
            for values in nanoroute.VARIANTS.values():
                config = nanoroute.GPTConfig(**{k: shape[k] for k in MODEL_FIELDS}, **values)
                estimate = train.estimate_memory(config, per_forward * T, torch.bfloat16, world)
                cells.append(f"{estimate['total'] / train.GIB:.1f}")
            rows.append([preset, world, f"{per_forward} x {T}", *cells])
    return md_table(["preset", "GPUs", "sequences x tokens per forward", *nanoroute.VARIANTS], rows)


if __name__ == "__main__":
    main()
