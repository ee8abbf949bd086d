"""
Train a nanoroute GPT on a prepared dataset: one CPU or GPU, or several under torchrun (DDP).

    python train.py                                            # demo data, Block AttnRes, minutes
    python train.py --residual prenorm --out_dir out_prenorm   # the same run without depth routing
    python train.py --preset rd_s --seed 1 --out_dir out/rd_s_seed1
    torchrun --nproc_per_node=8 train.py -- --preset rd_s --out_dir out/rd_s

Every field of TrainSettings and of GPTConfig is a flag of the same name (--help). The batches
depend only on --seed and the step, and the model is initialised right after manual_seed(seed):
runs with the same seed are paired across variants (SPEC: Paired experiments). A run writes
metrics.jsonl, last.pt, best.pt and summary.json into --out_dir. Read top to bottom: settings,
data, schedule, the loop, the end; below the banner, what keeps a run safe.
"""

import dataclasses
import math
import os
import re
import signal
import sys
import time
import typing
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import common
import prepare_data
from common import UsageError, command, count, write_json
from diagnostics import routing_stats, source_legend
from nanoroute import (CONFIG_FIELDS, GPT, VARIANTS, GPTConfig, missing_need, routing_fields,
                       variant)

# -----------------------------------------------------------------------------
# Settings: every training flag is a TrainSettings field, every model flag a GPTConfig field

# train.py's small model (the other GPTConfig fields keep their defaults): Block AttnRes, the base
# that WAV and RD modify, so that the first run shows what this project is about.
MODEL_DEFAULTS = dict(sequence_len=256, n_layer=4, n_head=4, n_embd=128, residual="attnres")

# The papers' set-ups (SPEC.md); flags override them. WAV v1's width and schedule are ours (not
# public). RD-AttnRes: 0.5M tokens a step on any GPU count, in forwards of 16 x 1024 tokens.
_WAV = dict(variant("wav"), data="tinystories", n_embd=256, n_head=4, sequence_len=256,
            batch_size=64, lr=1e-3, warmup_iters=500, max_iters=20000, eval_interval=1000,
            eval_tokens=1 << 20)
_RD = dict(variant("rd"), data="fineweb_edu", sequence_len=1024, batch_size=64, grad_accum=8,
           micro_batch=16, lr=6e-4, warmup_iters=200, max_tokens=2_000_000_000, eval_interval=250,
           eval_tokens=1 << 20, milestones="0.25B,0.5B,1B,2B", log_interval=10)
PRESETS = {
    "wav12": dict(_WAV, n_layer=12),
    "wav24": dict(_WAV, n_layer=24),
    "wav48": dict(_WAV, n_layer=48),
    # the paper's S and M have 120M and 343M parameters; this GPT (tied embeddings) 93M and 241M
    "rd_s": dict(_RD, n_layer=16, n_embd=576, n_head=9),
    "rd_m": dict(_RD, n_layer=24, n_embd=832, n_head=13, lr=3e-4),
}

def option(default, help, low=None, high=math.inf, parse=None, choices=None, runtime=False,
           needs=None, fixed=False, output=False):
    """A TrainSettings field: its --help, range [low, high) or choices, a parse for a text not of
    its type; runtime: how this invocation runs (not from last.pt); needs: as GPTConfig's; fixed:
    what the run began with (its seed made its weights), which a --resume may not change; output:
    what the run writes, not what it trains (kept by --resume, yet no change of the run there,
    and no report groups by it)."""
    if needs not in (None, "attnres", *CONFIG_FIELDS):  # e.g. another training setting's name
        raise ValueError(f"needs={needs!r}: not a GPTConfig field. needs= marks a setting of the "
                         "depth routing (the paired baseline drops it); check a setting that needs "
                         "another training setting in check_settings")
    return dataclasses.field(default=default, metadata=dict(
        help=help, low=low, high=high, parse=parse, choices=choices, runtime=runtime, needs=needs,
        fixed=fixed, output=output))

@dataclasses.dataclass
class TrainSettings:
    """Every training flag. The defaults learn on two CPU cores in minutes (~1.6M demo tokens)."""
    data: str = option("demo", "a prepared dataset folder, or NAME: data/NAME (demo: made here)",
                       parse=common.folder_name)
    out_dir: str = option("out", "output folder of the run", runtime=True, parse=common.folder_name)
    preset: str | None = option(None, "a paper's set-up; flags override it", choices=PRESETS,
                                runtime=True)
    batch_size: int = option(16, "sequences per micro-step, all processes together", low=1)
    grad_accum: int = option(1, "micro-steps per optimizer step", low=1)
    micro_batch: int = option(0, "most sequences a process runs per forward (0: all)", low=0)
    lr: float = option(2e-3, "peak learning rate", low=0)
    min_lr: float | None = option(None, "end of the cosine decay (default: lr/10)", low=0)
    warmup_iters: int = option(20, "steps of linear warmup", low=0)
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)", low=0)
    beta1: float = option(0.9, "AdamW beta1", low=0, high=1)
    beta2: float = option(0.95, "AdamW beta2", low=0, high=1)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: off)", low=0)
    route_entropy_coef: float = option(0.0, "add this x the mean entropy (nats) of the depth "
                                       "routes to the loss", low=0, needs="attnres")
    max_iters: int = option(400, "optimizer steps (the schedule's length)", low=1)
    max_tokens: int | None = option(None, "a token budget instead: 2B, 500M", low=1, parse=count)
    eval_interval: int = option(100, "evaluate and save every this many steps", low=1)
    eval_tokens: int = option(32768, "tokens per split (train, val) in each evaluation, in whole "
                              "batches", low=1, high=1e9, parse=count)
    milestones: str | None = option(None, "also evaluate where the token count crosses these, "
                                    "e.g. 0.25B,0.5B,1B,2B")
    log_interval: int = option(20, "print and log the train loss every this many steps", low=1,
                               output=True)
    seed: int = option(1337, "data order and initial weights", low=0, high=2 ** 63, fixed=True)
    device: str = option("auto", "auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps", runtime=True)
    # not runtime: a --resume goes on at the run's precision (a change of it is noted)
    dtype: str = option("auto", "auto: bf16 autocast on a GPU with native bf16, else float32",
                        choices=("auto", "float32", "bfloat16"))
    compile: bool = option(False, "torch.compile the model", runtime=True)
    resume: bool = option(False, "continue the run in --out_dir from its last.pt", runtime=True)
    stop_after: int | None = option(None, "stop after this step (then --resume)", low=1,
                                    runtime=True)
    wandb_project: str | None = option(None, "also log the metrics to this Weights & Biases "
                                       "project (pip install wandb)", runtime=True)
    wandb_run: str | None = option(None, "the wandb run's name", runtime=True)

    @property
    def end_lr(self):  # where the cosine decay ends
        return self.lr / 10 if self.min_lr is None else self.min_lr

# what a run writes, not what it trains (output=True): --resume and the report leave them out
OUTPUT = {f.name for f in dataclasses.fields(TrainSettings) if f.metadata["output"]}

def build_parser():
    """One flag per field of TrainSettings, then of GPTConfig: its type, help and default."""
    p = common.ArgumentParser(description=__doc__.strip().split("\n")[0],
                                    epilog="Bool flags take True/False/1/0; alone they mean True.")
    for cls, title in ((TrainSettings, "training"), (GPTConfig, "model (GPTConfig's fields)")):
        group, hints = p.add_argument_group(title), typing.get_type_hints(cls)
        for f in [f for f in dataclasses.fields(cls) if f.name != "vocab_size"]:  # the data's
            kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)),
                        hints[f.name])
            # --help shows the default train.py runs with (MODEL_DEFAULTS), not GPTConfig's
            default = MODEL_DEFAULTS.get(f.name, f.default) if cls is GPTConfig else f.default
            parse = f.metadata.get("parse") or (common.true_or_false if kind is bool else kind)
            group.add_argument(
                f"--{f.name}", type=parse, choices=f.metadata.get("choices"),
                help=f.metadata["help"] + ("" if default is None else f" (default: {default})"),
                **dict(nargs="?", const=True, metavar="BOOL") if kind is bool else {})
    return p

def resolve_settings(explicit, ckpt=None):
    """defaults < checkpoint (--resume) < preset < explicit flags (a model flag that differs from
    the checkpoint is an error): (TrainSettings, the model's settings, vocab_size None)."""
    # a preset counts as given: resuming refuses one that differs from the run (below), as a flag
    given = {**PRESETS.get(explicit.get("preset"), {}), **explicit}
    config_defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    train_defaults = dataclasses.asdict(TrainSettings())
    settings = {**config_defaults, **train_defaults, **MODEL_DEFAULTS, "vocab_size": None}
    if ckpt is not None:
        # a model field or setting added since the run was made is at its default there (as the
        # model it loads into): another value given with --resume differs from the run, not new
        # to it, and a fixed one is refused
        ckpt = dict(ckpt, config=config_defaults | ckpt["config"])
        run = {**train_defaults, **ckpt["settings"], **ckpt["config"]}
        fixed = {f.name for f in dataclasses.fields(TrainSettings) if f.metadata["fixed"]}
        for name, value in given.items():
            if name not in run or value == run[name] or name == "data":  # data: open_data's
                continue
            # a model flag or a fixed setting may not change the run; a preset's training
            # settings neither: its batch and schedule would silently replace the run's
            if name in explicit and (name in ckpt["config"] or name in fixed):
                raise UsageError(f"--{name} {value} differs from the run's {name}={run[name]}: "
                                 "drop it to resume the run, or start one in another --out_dir")
            if name not in explicit:
                raise UsageError(f"--preset {explicit['preset']} sets {name}={value}, the run's "
                                 f"is {run[name]}: drop --preset to resume the run")
        # --device, --out_dir, --compile...: how this invocation runs; never last.pt's
        runtime = {f.name for f in dataclasses.fields(TrainSettings) if f.metadata["runtime"]}
        settings.update({k: v for k, v in ckpt["settings"].items() if k not in runtime})
        settings.update(ckpt["config"])
    # only the user's two clash: a preset's or the run's budget yields to --max_iters (below)
    if "max_iters" in explicit and "max_tokens" in explicit:
        raise UsageError("give --max_iters or --max_tokens, not both")
    settings.update(given)
    for f in [*dataclasses.fields(TrainSettings), *dataclasses.fields(GPTConfig)]:
        # an explicit --residual prenorm also drops the preset's routing (its --rd, its --wav)
        missing = missing_need(f.metadata.get("needs"), settings)
        if missing and f.name in given and f.name not in explicit:
            settings[f.name] = f.default
    if "max_iters" in explicit:
        settings["max_tokens"] = None  # an explicit step count beats a preset's or run's budget
    a = TrainSettings(**{f.name: settings[f.name] for f in dataclasses.fields(TrainSettings)})
    return a, {f.name: settings[f.name] for f in dataclasses.fields(GPTConfig)}

def check_settings(a, world, model):
    """Every setting in its range and where the model has use for it, from flag, preset or run;
    the model's settings as GPTConfig checks them."""
    for f in dataclasses.fields(TrainSettings):
        value, low, high = getattr(a, f.name), f.metadata["low"], f.metadata["high"]
        if low is not None and value is not None and not low <= value < high:  # nan fails too
            span = f"in [{low}, {high:g})" if high < math.inf else f"at least {low} and finite"
            raise UsageError(f"--{f.name} {value}: must be {span}")
        # a setting off its default where the model has no use for it fails, not silently idles
        missing = missing_need(f.metadata["needs"], model)
        if missing and value != f.default:
            needs = f.metadata["needs"]
            where = [name for name in VARIANTS if missing_need(needs, variant(name)) is None]
            raise UsageError(f"--{f.name} {value}: {missing} (the variants it applies to: "
                             f"{', '.join(where)})")
    try:
        # parsed now: a typo is a --milestones line before any data or model is built
        count(a.milestones or 0)
    except ValueError as e:
        raise UsageError(f"--milestones {a.milestones}: {e}") from None
    if a.wandb_run is not None and a.wandb_project is None:
        raise UsageError("--wandb_run needs --wandb_project NAME")
    # equal shares in equal forwards: the mean of the forwards' losses is that of every crop
    share = a.batch_size // world
    if a.batch_size % world or (a.micro_batch and share % a.micro_batch and a.micro_batch < share):
        raise UsageError(f"--batch_size {a.batch_size} over {world} process(es), --micro_batch "
                         f"{a.micro_batch}: each process takes an equal share, in equal forwards: "
                         "choose a --micro_batch that divides its share")
    try:  # the model's own checks, before any data is prepared (its vocabulary is the data's)
        GPTConfig(**dict(model, vocab_size=1))
    except ValueError as e:
        raise UsageError(str(e)) from None

# -----------------------------------------------------------------------------
# Data: random crops at offsets that depend only on (seed, step, micro-step)

def open_data(a, ckpt, run_dir, master, given):
    """The dataset's folder and meta.json (--resume: the run's own, unless --data is given)."""
    if ckpt is not None:
        folder, meta = checkpoint.open_data(ckpt, run_dir, a.data if given else None)
        # as the run named it (demo) where that still names the folder here, else its path
        if prepare_data.dataset_folder(a.data).resolve() != folder.resolve():
            a.data = str(folder)
        return folder, meta
    folder = prepare_data.dataset_folder(a.data)
    if folder.name == "demo" and not (folder / "meta.json").exists() and master:
        prepare_data.prepare("demo", folder)  # refuses a folder that holds files it did not make
    if dist.is_initialized():
        dist.barrier()  # the other processes wait for rank 0 to prepare it
    return folder, prepare_data.load_meta(folder)

def batch_offsets(seed, step, micro, n_tokens, T, rows):
    """Where a micro-batch's crops start: a function of the position in the schedule alone, the
    same for every model and any number of processes (process r of W takes rows r::W)."""
    # seeded by position, no state to save: --resume draws the crops it would have drawn
    return np.random.default_rng([seed, step, micro]).integers(0, n_tokens - T, size=rows)

EVAL_SEED = 20260501  # evaluation crops ignore --seed: every run is scored on the same text

def eval_offsets(n_tokens, T, rows, eval_tokens, split):
    # whole batches of the training batch's rows: each process's share splits as in training
    n_batches = max(1, math.ceil(eval_tokens / (rows * T)))
    rng = np.random.default_rng([EVAL_SEED, split])  # split 0, 1, 2: train, val, test
    return rng.integers(0, n_tokens - T, size=(n_batches, rows))

def get_batch(data, offsets, T, device, micro_batch=0):
    """The (x, y) crops at offsets, in forwards of micro_batch rows (0: one forward)."""
    # the memmap holds uint8 or uint16 ids; the embedding and the loss want int64
    x = torch.from_numpy(np.stack([data[o:o + T] for o in offsets]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[o + 1:o + 1 + T] for o in offsets]).astype(np.int64))
    if device.type == "cuda":
        x, y = (t.pin_memory().to(device, non_blocking=True) for t in (x, y))
    return list(zip(x.split(micro_batch or len(offsets)), y.split(micro_batch or len(offsets))))

# -----------------------------------------------------------------------------
# The device, the precision and the learning-rate schedule

def pick_device(name, local_rank=0, world=1):
    """auto: CUDA, else Apple's MPS, else the CPU. Under torchrun "cuda" is LOCAL_RANK's GPU."""
    have = dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    name = next(k for k in ("cuda", "mps", "cpu") if have[k]) if name == "auto" else name
    kind = re.fullmatch(r"(cpu|mps|cuda)(:\d+)?", name)
    if not kind or (kind[2] and kind[1] != "cuda"):
        raise UsageError(f"--device {name}: choose auto, cpu, cuda, cuda:N or mps")
    if not have[kind[1]]:
        raise UsageError(f"--device {name}: {kind[1]} is not available here; use --device cpu")
    if kind[2] and world > 1 and torch.cuda.device_count() > 1:
        raise UsageError(f"--device {name} under torchrun puts every process on one GPU: give "
                         "--device cuda (each process takes its LOCAL_RANK's)")
    return torch.device(f"cuda:{local_rank}" if name == "cuda" else name)

def pick_dtype(name, device):
    """auto: bf16 autocast on a CUDA GPU with native bf16 (capability 8.0 on), else float32."""
    if name == "auto":
        native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
        return torch.bfloat16 if native else torch.float32
    # no float16: it would need a GradScaler; bf16 has float32's range and needs none
    return getattr(torch, name)

def autocast(dtype, device):  # bf16: the forward under autocast, the weights stay float32
    return torch.autocast(device.type, dtype=dtype) if dtype == torch.bfloat16 else nullcontext()

def get_lr(step, a):
    """Linear warmup over warmup_iters steps, then cosine decay to min_lr at the last step."""
    if step < a.warmup_iters:
        return a.lr * (step + 1) / a.warmup_iters  # step + 1: the first step already learns
    # max(1, ...): no division by zero when warmup fills (almost) the whole run
    progress = min(1.0, (step - a.warmup_iters) / max(1, a.max_iters - 1 - a.warmup_iters))
    return a.end_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (a.lr - a.end_lr)

# -----------------------------------------------------------------------------
# The run: setup, the loop, one step, evaluation, the end

@dataclasses.dataclass
class Run:
    """What the loop and its parts share (checkpoint.save and restore take plain parts of it)."""
    settings: TrainSettings
    config: GPTConfig
    meta: dict  # the dataset's meta.json
    data_dir: Path
    out_dir: Path
    splits: list  # train, val
    raw_model: GPT
    model: torch.nn.Module  # what the loop calls: raw_model, compiled or in DDP
    optimizer: torch.optim.Optimizer
    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    world: int = 1
    progress: checkpoint.Progress = dataclasses.field(default_factory=checkpoint.Progress)
    stop: list = None  # the stop signals received
    wandb: object = None

    def __post_init__(self):
        a, T = self.settings, self.config.sequence_len
        self.tokens_per_step = tokens_per_step(a, T)
        self.master, self.t_start = self.rank == 0, time.time()
        self.ctx = autocast(self.dtype, self.device)
        self.peak = peak_flops(self.device, self.dtype)  # for MFU, None if unknown: checked once
        # drawn once: every evaluation of the run (and of a paired run) scores the same crops
        self.eval_batches = [eval_offsets(len(d), T, a.batch_size, a.eval_tokens, split)
                             for split, d in enumerate(self.splits)]
        self.milestones = [(x, count(x)) for x in a.milestones.split(",")] if a.milestones else []

    def log(self, text):
        if self.master:
            print(text, flush=True)

    @property
    def precision(self):  # "float32" or "bfloat16": what summary.json and last.pt record
        return str(self.dtype)[6:]

    def elapsed(self):  # seconds, over every invocation of the run
        return self.progress.seconds + time.time() - self.t_start

@common.cli
def main(argv=None):
    common.keep_freed_memory()  # a step's freed memory reused by the next, not mapped afresh
    stop, handlers = checkpoint.catch_stop_signals()
    try:
        run = setup(argv, stop)
        if run is not None:  # None: a finished run, nothing to add
            train(run)
    except RuntimeError as e:  # CUDA's OutOfMemoryError, or the CPU's (a plain RuntimeError)
        if not isinstance(e, torch.OutOfMemoryError) and "DefaultCPUAllocator" not in str(e):
            raise
        raise UsageError("out of memory: lower --micro_batch (the same batches in smaller forwards)"
                         ", --batch_size or --sequence_len; --resume continues last.pt") from None
    finally:
        # the caller's handlers back, even after an error: train.main may be called from Python
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if dist.is_initialized():
            dist.destroy_process_group()
        checkpoint.release()
    if "RANK" in os.environ:
        # a torchrun worker: exit at once (checkpoint.leave says why)
        checkpoint.leave(0)

def start(argv):
    """The explicit flags, this process's rank, the world size and device (and process group)."""
    # a lone "--" is dropped: `torchrun train.py -- --rd off` keeps torchrun off train.py's flags
    argv = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg != "--"]
    explicit = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    rank, world, local_rank = (int(os.environ.get(k, 1 if k == "WORLD_SIZE" else 0))
                               for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = pick_device(explicit.get("device", "auto"), local_rank, world)
    if device.type == "cuda":  # also for one process on cuda:1: pinned memory and NCCL follow it
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return explicit, rank, world, device

def budget_steps(a, T, progress):
    """--max_tokens as steps: those done, then enough of this batch's to reach the budget (rounded
    up: the run sees at least it), whatever the batch of the steps it resumes from."""
    left = max(0, a.max_tokens - progress["tokens"])
    return progress["step"] + math.ceil(left / tokens_per_step(a, T))

def tokens_per_step(a, T):
    """A step's tokens, which every token count reads (docs/training.md): --max_tokens' steps, the
    milestones, tok/s, MFU, the training: line."""
    return a.batch_size * a.grad_accum * T

def setup(argv, stop):
    """Everything before the first step: settings, processes, data, model, --resume. None: a
    finished run resumed with nothing to add."""
    explicit, rank, world, device = start(argv)
    out_dir = Path(explicit.get("out_dir", TrainSettings.out_dir))
    # first: --resume's settings come from last.pt, and a new run must not write over one
    ckpt = checkpoint.check_out_dir(out_dir, explicit.get("resume", False))
    a, model_settings = resolve_settings(explicit, ckpt)
    # every setting checked before the data is prepared or a model built: a mistake costs nothing
    check_settings(a, world, model_settings)
    data_dir, meta = open_data(a, ckpt, out_dir, rank == 0, "data" in explicit)
    try:
        config = GPTConfig(**dict(model_settings, vocab_size=meta["vocab_size"]))
    except ValueError as e:
        raise UsageError(str(e)) from None
    splits = [prepare_data.open_split(data_dir, s, meta) for s in ("train", "val")]
    T = config.sequence_len
    # each split must hold a crop and its shifted target; the train split a whole batch's tokens
    if min(map(len, splits)) < T + 2 or a.batch_size * T > len(splits[0]):
        raise UsageError(f"--batch_size {a.batch_size} x --sequence_len {T} does not fit in "
                         f"{data_dir} (train / val: {len(splits[0])} / {len(splits[1])} tokens)")
    if a.max_tokens:
        a.max_iters = budget_steps(a, T, ckpt["progress"] if ckpt else dict(step=0, tokens=0))
    if finished(out_dir, ckpt, a.max_iters, rank):
        return None
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(a.seed)  # right before GPT(): paired runs share their initial weights
    raw_model = GPT(config).to(device)
    # compile and DDP wrap raw_model below: saved state_dict keys carry no _orig_mod./module.
    optimizer = make_optimizer(raw_model, a, device.type)
    if ckpt is None:
        checkpoint.make_out_dir(out_dir)
    model = torch.compile(raw_model) if a.compile else raw_model
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    run = Run(a, config, meta, data_dir, out_dir, splits, raw_model, model, optimizer, device,
              pick_dtype(a.dtype, device), rank, world, stop=stop)
    if ckpt is not None:
        # also each process's RNG states: dropout continues as if the run had never stopped
        run.progress = checkpoint.restore(ckpt, out_dir, raw_model, optimizer, a.seed, device, rank,
                                          world)
        run.log(f"resuming {out_dir / 'last.pt'} at step {run.progress.step}")
        note_changes(run, ckpt)
    else:
        torch.manual_seed(a.seed + rank)  # each process its own dropout stream
    describe(run)
    run.wandb = start_wandb(run)
    return run

def finished(out_dir, ckpt, max_iters, rank):
    """A finished run (summary.json: only with --resume) with nothing to add: say so, and the
    caller rewrites nothing."""
    if not (out_dir / "summary.json").exists() or ckpt["progress"]["step"] < max_iters:
        return False
    if rank == 0:
        print(f"{out_dir} holds a finished run (step {ckpt['progress']['step']}, --max_iters "
              f"{max_iters}): nothing to add; a larger --max_iters continues it", flush=True)
    return True

def note_changes(run, ckpt):
    """A training setting that --resume gives anew changes the run from this step on: recorded in
    its progress (summary.json's changes: the report groups the run by them) and said, since a
    run started with it, its paired baseline included, is not this run."""
    saved = ckpt["settings"]
    # data: its folder may move; output=True: what it writes (how often it prints); under
    # --max_tokens the steps are the budget's (its batch is what changed); dtype: by the precision
    # it gives (below)
    skip = {"data", "dtype", *OUTPUT, *["max_iters"] * bool(run.settings.max_tokens)}
    # a setting newer than the run: at its default there (the behaviour from before it)
    settings = [(f.name, saved.get(f.name, f.default), getattr(run.settings, f.name))
                for f in dataclasses.fields(TrainSettings)
                if not f.metadata["runtime"] and f.name not in skip]
    # --dtype auto is bf16 on one device and float32 on another: a resume elsewhere changes the
    # run too (a checkpoint that predates "precision": its --dtype unless auto, else unknown)
    was = ckpt.get("precision", saved.get("dtype", "auto").replace("auto", ""))
    settings += [("dtype", was, run.precision)] * bool(was)
    step = run.progress.step
    for name, was, now in settings:
        if now != was:
            run.progress.changes.append(dict(step=step, setting=name, was=was, now=now))
            run.log(f"note: --{name} {now} from step {step} on (was {was}): summary.json records "
                    "the change; runs that pair with this one must change alike")

def describe(run):
    """What the run trains: the data, the model, the schedule and where it runs. Every setting off
    its default is named, a new one too, but those that say how this invocation runs."""
    a, config, meta, (train_split, val_split) = run.settings, run.config, run.meta, run.splits
    ours, plain = {**dataclasses.asdict(config), **dataclasses.asdict(a)}, plain_settings()

    def off(names):  # ", name value" of each setting off its default
        return "".join(f", {name} {ours[name]}" for name in names if ours[name] != plain[name])
    # the routing's settings (needs=): the model's, then training's (its "residual" repeated)
    routed = [*routing_fields(type(config)), *routing_fields(TrainSettings)[1:]]
    shown = {"n_layer", "n_embd", "n_head", "sequence_len", "vocab_size", "data", "batch_size",
             "grad_accum", "lr", "min_lr", "warmup_iters", "max_iters", "max_tokens", *routed}
    model = off(f.name for f in dataclasses.fields(config) if f.name not in shown)
    training = off(f.name for f in dataclasses.fields(a)
                   if f.name not in shown and not f.metadata["runtime"])
    training = f" ({training[2:]})" if training else ""
    routing = ""
    if config.residual == "attnres":  # the block, then every routing setting off its default
        settings = off(name for name in routed if name not in ("residual", "attnres_block"))
        routing = f" (block {config.routing_block}{settings})"
    run.log(f"data: {run.data_dir} ({meta['dataset']}, {meta['level']} level, vocab "
            f"{config.vocab_size}; train {len(train_split):,} / val {len(val_split):,} tokens)\n"
            f"model: {config.n_layer} layers x {config.n_embd}, {config.n_head} heads, "
            f"sequence_len {config.sequence_len}{model}, residual {config.residual}{routing}; "
            f"{run.raw_model.get_num_params() / 1e6:.2f}M parameters\n"
            f"training: {a.max_iters} steps x {run.tokens_per_step:,} tokens (batch {a.batch_size}"
            f" x accum {a.grad_accum} x {config.sequence_len}); lr {a.lr:g} warmup "
            f"{a.warmup_iters} cosine to {a.end_lr:g}{training}; {run.world} process(es) on "
            f"{run.device} ({torch.get_num_threads()} threads each), {run.precision}")
    if a.warmup_iters >= a.max_iters:  # a short trial run with the default warmup
        run.log(f"note: --warmup_iters {a.warmup_iters} >= --max_iters {a.max_iters}: the "
                "learning rate only warms up, it never decays")

def train(run):
    """The loop: steps, log lines, evaluations with checkpoints; it may stop early (stop_early)."""
    a, p = run.settings, run.progress
    if not p.lines:  # a checkpoint, even of step 0, comes after its evaluation (--resume: done)
        evaluate_and_save(run, get_lr(0, a))
    first, seconds, steps = p.step + 1, 0.0, 0  # this invocation's first step warms up: untimed
    while p.step < a.max_iters:
        t0, lr = time.time(), get_lr(p.step, a)
        loss = train_step(run, lr)
        p.step, p.tokens = p.step + 1, p.tokens + run.tokens_per_step
        if p.step > first:
            seconds, steps = seconds + time.time() - t0, steps + 1
        if p.step % a.log_interval == 0 or p.step == 1:  # dt: None for the first step alone
            log_step(run, loss, lr, seconds / steps if steps else None)
            seconds, steps = 0.0, 0
        crossed = [label for label, n in run.milestones
                   if p.tokens - run.tokens_per_step < n <= p.tokens]
        if p.step % a.eval_interval == 0 or p.step == a.max_iters or crossed:
            evaluate_and_save(run, lr, crossed)
        if stop_early(run):
            return
    finish(run)

def train_step(run, lr):
    """One AdamW step on the mean loss of --grad_accum micro-steps (all processes); returns it."""
    a, T, data = run.settings, run.config.sequence_len, run.splits[0]
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    # summed on the device: one .item() (a GPU sync) per step, not one per forward
    loss = torch.zeros((), device=run.device)
    for micro in range(a.grad_accum):
        # each process draws the whole batch and takes its rows: any process count, the same crops
        rows = batch_offsets(a.seed, run.progress.step, micro, len(data), T, a.batch_size)
        mine = get_batch(data, rows[run.rank::run.world], T, run.device, a.micro_batch)
        for i, (x, y) in enumerate(mine):
            last = micro == a.grad_accum - 1 and i == len(mine) - 1
            # DDP: all-reduce the gradients only on the last backward of the step
            with run.model.no_sync() if run.world > 1 and not last else nullcontext():
                with run.ctx:
                    total, cross_entropy = step_loss(run.model, x, y, a)
                # scaled: the summed gradients are those of the step's mean loss
                (total / (len(mine) * a.grad_accum)).backward()
            loss += (cross_entropy / (len(mine) * a.grad_accum)).detach().float()  # logged
    if run.world > 1:
        dist.all_reduce(loss)
        loss /= run.world  # for the log: DDP averaged the gradients already
    loss = loss.item()
    if not math.isfinite(loss):  # before the update: no checkpoint is written after this
        raise diverged(run, "loss", run.progress.step + 1)
    update(run.raw_model, run.optimizer, a)
    return loss

def update(model, optimizer, a):
    """The update after a step's backward, of settings `a`: the clip, the optimizer's step.
    bench.py and tools/routing_time.py time this same one: change the update here."""
    if a.grad_clip > 0:
        # after DDP's all-reduce: every process clips the same gradients alike
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # frees the gradients' memory until the next backward

def make_optimizer(model, a, device_type):
    """The optimizer of settings `a`. bench.py and tools/routing_time.py time this same one at
    train.py's defaults: build another optimizer, or pass it another setting, here."""
    return model.configure_optimizers(a.weight_decay, a.lr, (a.beta1, a.beta2), device_type)

def step_loss(model, x, y, a):
    """(what the backward runs on, the cross-entropy logged) of one micro-batch: the model's
    loss and what settings `a` add to it. bench.py times this same loss: add a term here."""
    coef = a.route_entropy_coef
    # the routes only with a coef: they keep their weights' graph
    _, cross_entropy, *routes = model(x, y, return_routes=coef != 0)
    if not coef:
        return cross_entropy, cross_entropy
    return cross_entropy + coef * route_entropy(routes[0]), cross_entropy

def route_entropy(routes):
    """Each read's entropy (nats) over its sources, mean over B, T, H; mean over the reads of 2+."""
    reads = {id(r["weights"]): r["weights"] for r in routes}  # RD tied: one read, two names
    weights = [w.float() for w in reads.values() if len(w) > 1]  # (S, B, T, H)
    return torch.stack([-torch.xlogy(w, w).sum(0).mean() for w in weights]).mean()

def log_step(run, loss, lr, dt):
    """A train line; dt: seconds per step since the last one, but this invocation's first step."""
    n, peak, p = run.tokens_per_step, run.peak, run.progress
    # one device's MFU: its process's share of the tokens against one device's peak
    mfu = run.raw_model.estimate_mfu(n / run.world, dt, peak) if peak and dt else None
    speed = f" | {n / dt / 1e3:.1f}k tok/s | {1000 * dt:.1f} ms/step" if dt else ""
    record(run, dict(type="train", step=p.step, tokens=p.tokens, loss=loss, lr=lr,
                     tok_per_s=round(n / dt, 1) if dt else None,
                     ms_per_step=round(1000 * dt, 2) if dt else None, mfu=mfu),
           f"step {p.step} | loss {loss:.4f} | lr {lr:.1e}{speed}"
           + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""))

def evaluate_and_save(run, lr, crossed=()):
    """Losses on the fixed evaluation crops, routing diagnostics, an eval line, the checkpoints."""
    p, T, micro = run.progress, run.config.sequence_len, run.settings.micro_batch
    train_loss, val_loss = (evaluate(run.model, data, batches, T, run.device, run.ctx, micro,
                                     run.rank, run.world)
                            for data, batches in zip(run.splits, run.eval_batches))
    if not (math.isfinite(val_loss) and math.isfinite(train_loss)):
        raise diverged(run, "validation loss", p.step)
    # raw_model on rank 0 alone: a DDP forward on one process could wait on the others
    stats = routes(run.raw_model, run.splits[1], run.eval_batches[1][0][:8], run.device, run.ctx) \
        if run.master else None  # 8 fixed val crops
    for label in crossed:
        p.milestones[label] = dict(step=p.step, tokens=p.tokens, val_loss=val_loss)
    unit, in_unit = prepare_data.LEVELS[run.meta["level"]]  # bpc for characters
    val_in_unit, js = in_unit(val_loss), stats and stats["js_mean"]
    record(run, dict(type="eval", step=p.step, tokens=p.tokens, train_loss=train_loss,
                     val_loss=val_loss, **{f"val_{unit}": val_in_unit}, lr=lr,
                     elapsed_s=round(run.elapsed(), 3), milestone=",".join(crossed) or None,
                     routes=stats),
           f"eval step {p.step} | train {train_loss:.4f} | val {val_loss:.4f}"
           + f" | {unit} {val_in_unit:.4f}"
           + (f" | js_mean {js:.4f}" if js is not None else "")
           + (f" | milestone {','.join(crossed)}" if crossed else ""))
    improved, p.best_val_loss = val_loss < p.best_val_loss, min(p.best_val_loss, val_loss)
    # checked before the save: non-finite weights never replace last.pt, the last good step
    if not all(param.isfinite().all() for param in run.raw_model.parameters()):
        raise diverged(run, "weights", p.step)
    save(run, improved)

def save(run, improved):
    """checkpoint.save of what --resume needs: weights, optimizer, settings, data, progress."""
    state = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                 params=checkpoint.param_names(run.raw_model, run.optimizer),
                 config=dataclasses.asdict(run.config), settings=dataclasses.asdict(run.settings),
                 data_dir=run.data_dir, dataset=checkpoint.dataset_identity(run.meta),
                 precision=run.precision)  # --dtype auto's, as it ran (note_changes)
    progress = dataclasses.replace(run.progress, seconds=run.elapsed())  # the run's time so far
    checkpoint.save(run.out_dir, state, progress, improved, run.device, run.rank, run.world)

@torch.no_grad()
def evaluate(model, data, batches, T, device, ctx=nullcontext(), micro_batch=0, rank=0, world=1):
    """Mean loss (eval mode) of data's crops at each batch of offsets; process rank: its rows."""
    training, losses = model.training, []
    model.eval()
    for offsets in batches:
        for x, y in get_batch(data, offsets[rank::world], T, device, micro_batch):
            with ctx:
                losses.append(model(x, y)[1].float())
    model.train(training)
    loss = torch.stack(losses).mean()  # equal forwards (check_settings): the mean of every crop
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return loss.item()

@torch.no_grad()
def routes(model, data, offsets, device, ctx=nullcontext()):
    """routing_stats (eval mode) of data's crops at offsets; None: no routes or learned mixing."""
    training = model.training
    model.eval()
    (x, y), = get_batch(data, offsets, model.config.sequence_len, device)
    with ctx:
        stats = routing_stats(model(x, y, return_routes=True)[2])
    model.train(training)
    return stats if stats["reads"] else None

def finish(run):
    """The end: the test loss, summary.json, then how the model routes and what to try next."""
    a, T, meta, p = run.settings, run.config.sequence_len, run.meta, run.progress
    test_loss = None
    if meta["splits"].get("test", 0) >= T + 2:
        test = prepare_data.open_split(run.data_dir, "test", meta)
        batches = eval_offsets(len(test), T, a.batch_size, a.eval_tokens, 2)
        test_loss = evaluate(run.model, test, batches, T, run.device, run.ctx, a.micro_batch,
                             run.rank, run.world)
    last = next(line for line in reversed(p.lines) if line["type"] == "eval")
    unit, in_unit = prepare_data.LEVELS[meta["level"]]
    final = {"val_loss": last["val_loss"], f"val_{unit}": in_unit(last["val_loss"]),
             "test_loss": test_loss,
             f"test_{unit}": None if test_loss is None else in_unit(test_loss)}
    summary = dict(config=dataclasses.asdict(run.config), train=dataclasses.asdict(a),
                   dataset=meta["dataset"], level=meta["level"], data_sha256=meta.get("sha256"),
                   precision=run.precision, step=p.step, tokens_seen=p.tokens,
                   best_val_loss=p.best_val_loss, milestones=p.milestones, changes=p.changes,
                   final=final, wall_time_s=round(run.elapsed(), 3), routes=last["routes"])
    if run.master:
        write_json(run.out_dir / "summary.json", summary)
    run.log(f"done: {p.step} steps, {p.tokens:,} tokens, val {last['val_loss']:.4f}"
            + (f", test {test_loss:.4f}" if test_loss is not None else "")
            + f", {summary['wall_time_s']:.0f} s; wrote {run.out_dir / 'summary.json'}")
    if run.wandb:
        run.wandb.finish()
    summary = routing_summary(last["routes"]) + "\n\n" if last["routes"] else ""
    run.log("\n" + summary + next_commands(run))

def routing_summary(stats, top=3):
    """The sources each read leans on most (mean weight over 8 val crops and route heads)."""
    lines = [f"routing (mean weight per source, 8 val crops; {source_legend(stats['sources'])})"]
    for name, read in stats["reads"].items():
        # equal weights (fixed ones, say) in pool order, not by name
        ranked = sorted(zip(read["mean_weight"], read["sources"]), key=lambda ws: -ws[0])[:top]
        lines.append(f"  {name:<14}" + "  ".join(f"{s} {w:.2f}" for w, s in ranked)
                     + ("  ..." if len(read["sources"]) > top else ""))
    if stats["js_mean"] is not None:
        q, v = stats["js_pair"].split("‖")  # what each route feeds, from RD_MODES
        lines.append(f"  RD: JS divergence between the {q} and {v} routes, mean over layers "
                     f"{stats['js_mean']:.4f} nats")
    return "\n".join(lines)

def next_commands(run):
    """Commands to paste after a run: text, routes, the paired baseline and the comparison."""
    a, config = run.settings, run.config
    here = [] if a.out_dir == TrainSettings.out_dir else ["--out_dir", a.out_dir]
    commands = [(command("sample.py", here), "text from best.pt")]
    if any(line.get("routes") for line in run.progress.lines):  # routing or learned mixing
        commands.append((command("sample.py", [*here, "--routes"]), "how each read routes"))
    if config.residual != "prenorm":
        flags, baseline, why = paired_baseline(run)
        commands += [(command("train.py", flags, run.world), why),
                     (command("experiments.py", ["report", a.out_dir, baseline]),
                      "compare the two once both have finished")]
    width = min(60, max(len(line) for line, _ in commands))
    return "\n".join(["next:"] + [f"  {line:<{width}}  # {why}" for line, why in commands])

def paired_baseline(run):
    """The paired baseline's flags, its --out_dir and what to say of it. A run whose settings a
    --resume changed: the baseline starts as the run started (each one's first value), then is
    resumed alike; the routing's own settings aside (the baseline has none)."""
    changes = [c for c in run.progress.changes
               if c["setting"] not in routing_fields(TrainSettings)]
    start = dataclasses.replace(run.settings, **{c["setting"]: c["was"] for c in reversed(changes)})
    flags, out = baseline_flags(start, run.config)
    resumes = {}  # step: the flags its --resume gave
    for c in changes:
        resumes.setdefault(c["step"], []).append(f"--{c['setting']} {c['now']}")
    alike = "; ".join(f"--stop_after {step}, then --resume {' '.join(given)}"
                      for step, given in resumes.items())
    why = "the baseline: same seed, batches" + f"; as this run: {alike}" * bool(alike)
    return flags, out, why

def plain_settings():
    """{name: value} of every setting, the model's and training's, as a plain train.py has it."""
    plain, plain_model = resolve_settings({})
    return {**dataclasses.asdict(plain), **plain_model}

def baseline_flags(a, config):
    """The flags and --out_dir of the paired run without routing: --residual prenorm and every other
    setting a plain train.py would not give it (a preset's too), but the routing fields."""
    defaults = plain_settings()
    # the depth routing's settings, the model's and training's (needs=); max_tokens sets max_iters
    skip = {*routing_fields(), *routing_fields(TrainSettings), "vocab_size", "out_dir", "preset",
            "resume", "stop_after", "wandb_run"} | ({"max_iters"} if a.max_tokens else set())
    flags = ["--residual", "prenorm"]
    for name, value in {**dataclasses.asdict(a), **dataclasses.asdict(config)}.items():
        if name not in skip and value != defaults[name]:
            flags += [f"--{name}", value]
    if a.wandb_run:
        flags += ["--wandb_run", f"{a.wandb_run}_prenorm"]
    out = f"{Path(a.out_dir)}_prenorm"
    return flags + ["--out_dir", out], out

def stop_early(run):
    """After --stop_after or a signal: save last.pt, say how to continue; a signal exits 128 + N."""
    # a collective under DDP: every process calls it after every step, or they hang
    signum = checkpoint.stop_signal(run.stop, run.device, run.world)
    a, step = run.settings, run.progress.step
    # at max_iters the run finishes (summary.json) instead, --stop_after or not
    if not signum and not (a.stop_after is not None and a.stop_after <= step < a.max_iters):
        return False
    # an eval step has saved already: only another step needs its last.pt
    if run.progress.lines[-1]["type"] != "eval" or run.progress.lines[-1]["step"] != step:
        save(run, improved=False)
    flags = ["--out_dir", a.out_dir, "--resume"]  # --resume takes the rest from last.pt
    for f in dataclasses.fields(TrainSettings):
        value = getattr(a, f.name)
        if f.metadata["runtime"] and f.name not in ("out_dir", "resume", "stop_after", "preset") \
                and value != f.default:
            flags += [f"--{f.name}", value]
    why = f"stopped by {signal.Signals(signum).name}" if signum else "stopped (--stop_after)"
    run.log(f"{why} after step {step}; continue with: {command('train.py', flags, run.world)}")
    if run.wandb:
        run.wandb.finish()
    if signum:
        checkpoint.leave(128 + signum)
    return True

def record(run, line, text):
    """A line of metrics.jsonl (written whole with each checkpoint), printed, and sent to wandb."""
    run.progress.lines.append(line)
    run.log(text)
    if run.wandb:
        # the routes' run-level numbers too (entropy_norm_mean, js_mean, any a user adds to
        # routing_stats), as routes/<name>
        routes = {f"routes/{k}": v for k, v in (line.get("routes") or {}).items()}
        numbers = {}
        for k, v in {**line, **routes}.items():  # numbers alone
            if k != "step" and common.is_number(v):
                numbers[f"{line['type']}/{k}"] = v
        run.wandb.log(numbers, step=line["step"])  # our step is wandb's step

def diverged(run, what, step):
    kept = "last.pt is the last good step" if (run.out_dir / "last.pt").exists() else "none saved"
    return UsageError(f"non-finite {what} at step {step}; {kept} (lower --lr or raise "
                      "--warmup_iters)")

def start_wandb(run):
    """The wandb run of --wandb_project (rank 0); a missing package is one line, before training."""
    a = run.settings
    if not (a.wandb_project and run.master):
        return None
    try:
        import wandb  # optional: imported only when asked for
    except ImportError:
        raise UsageError("--wandb_project needs the wandb package: pip install wandb") from None
    return wandb.init(project=a.wandb_project, name=a.wandb_run, dir=run.out_dir,
                      config=dict(dataclasses.asdict(a), **dataclasses.asdict(run.config)))

# Dense peak FLOP/s (bf16, TF32) from NVIDIA's data sheets, for MFU; other GPUs get no MFU
PEAK_FLOPS = {r"\bA100\b": (312e12, 156e12), r"\bH[12]00\b(?!.*(PCIe|NVL))": (989e12, 494e12)}

def peak_flops(device, dtype):
    """One device's dense peak FLOP/s for MFU: NANOROUTE_PEAK_FLOPS if set (any device), else
    PEAK_FLOPS's for this GPU; None: no MFU."""
    given = os.environ.get("NANOROUTE_PEAK_FLOPS")
    if given:
        try:
            peak = float(given)
        except ValueError:
            peak = math.nan
        if not 0 < peak < math.inf:
            raise UsageError(f"NANOROUTE_PEAK_FLOPS={given}: give one device's dense peak "
                             "FLOP/s, a number such as 312e12")
        return peak
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peaks = next((v for pattern, v in PEAK_FLOPS.items() if re.search(pattern, name)), None)
    return peaks and peaks[dtype != torch.bfloat16]  # float32 runs in TF32

if __name__ == "__main__":
    main()
