"""
Train a nanoroute GPT on a prepared dataset: one CPU or GPU, or several under torchrun (DDP).

    python train.py                                            # demo data, small Block AttnRes model, minutes
    python train.py --residual prenorm --out_dir out_prenorm   # the same run without depth routing
    python train.py --residual attnres --rd decoupled --out_dir out/rd
    python train.py --preset rd_s --seed 1 --out_dir out/rd_s_seed1
    torchrun --nproc_per_node=8 train.py --preset rd_s --rd off --out_dir out/rd_s_off

Every GPTConfig field is a flag of the same name (`python train.py --help`). The batches depend only
on --seed and the step, never on the model or the number of processes, and the model is initialised
right after torch.manual_seed(seed): runs with the same seed are paired across routing variants
(SPEC: Paired experiments). Output in --out_dir: metrics.jsonl, last.pt, best.pt, summary.json (and
train.lock while a run writes there). Ctrl-C or SIGTERM stops at the end of the step and saves last.pt.
"""

import argparse
import dataclasses
import json
import math
import os
import pickle
import re
import signal
import sys
import threading
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from nanoroute import GPT, VARIANTS, GPTConfig, routing_fields, routing_stats
from prepare_data import UsageError

# -----------------------------------------------------------------------------
# Settings: defaults, presets, flags

# Training defaults: a run that learns on two CPU cores in a few minutes (the demo data, ~1.6M tokens).
TRAIN_DEFAULTS = dict(
    data="data/demo", out_dir="out", preset=None,
    batch_size=16, grad_accum=1,  # sequences per micro-step (the global batch, split over processes)
    lr=2e-3, min_lr=None, warmup_iters=20, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
    max_iters=400, max_tokens=None, eval_interval=100, eval_tokens=None, milestones=None,
    log_interval=20, seed=1337, device="auto", dtype="auto", compile=False, resume=False, stop_after=None,
    wandb_project=None, wandb_run=None)
# --eval_tokens when not given: 32K per split; 8K on CPU with a large vocabulary (GPT-2's 50,257 tokens),
# where the output layer makes an evaluated token ~8x dearer than at char level with train.py's model
# (128 x 50257 multiply-adds a token against ~0.9M for the 4 layers): 32K took ~30% of a CPU run there.
EVAL_TOKENS, EVAL_TOKENS_CPU_LARGE_VOCAB, LARGE_VOCAB = 32768, 8192, 1024
# train.py's small model; the other GPTConfig fields keep the dataclass defaults. Routed by default
# (Block AttnRes): the first run shows what this project is about. Not WAV or RD: Block AttnRes is
# the base both modify, its summary is the easiest to read, and each is one flag away (--wav, --rd).
MODEL_DEFAULTS = dict(sequence_len=256, n_layer=4, n_head=4, n_embd=128, residual="attnres")
# flags that say how this invocation runs, not what the run is: never taken from a checkpoint
RUNTIME_ARGS = ("out_dir", "preset", "device", "dtype", "compile", "resume", "stop_after", "wandb_project",
                "wandb_run")

# The papers' set-ups (SPEC.md). Explicit flags override them. WAV v1 (char level, 12/24/48 layers):
# SPEC.md does not give the paper's width or schedule, so these are our choices (head size 64).
# Compare with --wav False (Block AttnRes), --residual rezero or --residual layerscale.
_WAV = dict(VARIANTS["wav"], data="data/tinystories", n_embd=256, n_head=4, sequence_len=256,
            batch_size=64, lr=1e-3, warmup_iters=500, max_iters=20000, eval_interval=1000, eval_tokens=1 << 20)
# RD-AttnRes (FineWeb-Edu, GPT-2 tokens, 2.0B tokens, milestones as in the paper); batch 0.5M tokens.
# Compare with --rd off (the parent), tied, average, frozen_v; pair with --seed.
_RD = dict(VARIANTS["rd"], data="data/fineweb_edu", sequence_len=1024, batch_size=64,
           grad_accum=8, lr=6e-4, warmup_iters=200, max_tokens=2_000_000_000, eval_interval=250,
           eval_tokens=1 << 20, milestones="0.25B,0.5B,1B,2B", log_interval=10)
PRESETS = {
    "wav12": dict(_WAV, n_layer=12),
    "wav24": dict(_WAV, n_layer=24),
    "wav48": dict(_WAV, n_layer=48),
    # the paper's S and M have 120M and 343M parameters; this GPT (tied embeddings, 4x MLP) has 93M and 241M
    "rd_s": dict(_RD, n_layer=16, n_embd=576, n_head=9),
    "rd_m": dict(_RD, n_layer=24, n_embd=832, n_head=13, lr=3e-4),
}

TRAIN_HELP = dict(
    data="prepared dataset folder (python prepare_data.py NAME); data/demo is prepared automatically",
    out_dir="output folder: metrics.jsonl, last.pt, best.pt, summary.json",
    preset="named paper set-up: " + ", ".join(PRESETS) + "; explicit flags override it",
    batch_size="sequences per micro-step, for all processes together (each takes batch_size/world)",
    grad_accum="micro-steps per optimizer step; a step sees batch_size*grad_accum sequences",
    lr="peak learning rate", min_lr="floor of the cosine decay, reached at the last step (default: lr/10)",
    warmup_iters="steps of linear warmup", weight_decay="AdamW weight decay (matrices only)",
    beta1="AdamW beta1", beta2="AdamW beta2", grad_clip="clip the gradient norm to this (0: off)",
    max_iters="optimizer steps (the schedule length)",
    max_tokens="token budget instead of --max_iters: 2B, 500M, 64K or an integer",
    eval_interval="evaluate and write last.pt (best.pt if better) every this many steps",
    eval_tokens=f"tokens per split (train, val) in each evaluation (default: {EVAL_TOKENS}; "
                f"{EVAL_TOKENS_CPU_LARGE_VOCAB} on CPU with a vocabulary over {LARGE_VOCAB} tokens)",
    milestones="also evaluate when the token count crosses these, e.g. 0.25B,0.5B,1B,2B",
    log_interval="print and log the train loss every this many steps", seed="data order and init",
    device="auto (cuda if available, else mps, else cpu), cpu, cuda, cuda:N, mps (Apple silicon)",
    dtype="auto (bfloat16 autocast on CUDA, float32 elsewhere), float32, bfloat16",
    compile="torch.compile the model", resume="continue from OUT_DIR/last.pt",
    stop_after="stop after this step, saving last.pt (then --resume); the schedule still ends at --max_iters",
    wandb_project="also log metrics.jsonl's numbers to this Weights & Biases project (pip install wandb)",
    wandb_run="name of the wandb run (default: wandb's)")


def _bool(text):
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True/False/1/0, got {text!r}")


def count(text):
    """'0.25B' -> 250_000_000; also M, K and plain integers."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmb]?)\s*", str(text), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count such as 2B, 500M, 64K or 10000")
    return int(round(float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m[2].lower()]))


def _milestones(text):
    for label in text.split(","):
        count(label)  # check now, so a typo fails before training
    return text


METAVARS = {int: "N", float: "X", str: "S", count: "N", _milestones: "LIST"}


def build_parser():
    p = prepare_data.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                epilog="Bool flags take True/False/1/0; alone they mean True.")
    # default=None everywhere: then we know what was given, for presets and for --resume
    g = p.add_argument_group("training")
    types = dict(data=str, out_dir=str, preset=str, lr=float, min_lr=float, weight_decay=float, beta1=float,
                 beta2=float, grad_clip=float, max_tokens=count, eval_tokens=count, milestones=_milestones,
                 device=str, dtype=str, compile=_bool, resume=_bool, wandb_project=str, wandb_run=str)
    for name, default in TRAIN_DEFAULTS.items():
        kind = types.get(name, int)
        extra = dict(nargs="?", const=True, metavar="BOOL") if kind is _bool else dict(metavar=METAVARS[kind])
        if name == "preset":
            extra = dict(choices=list(PRESETS), metavar="NAME")
        shown = "" if default is None else f" (default: {default})"
        g.add_argument(f"--{name}", type=kind, help=TRAIN_HELP[name] + shown, **extra)
    g = p.add_argument_group("model (GPTConfig fields)")
    for f in dataclasses.fields(GPTConfig):
        if f.name == "vocab_size":
            default = "the dataset's"
        elif f.name in MODEL_DEFAULTS:
            default = f"{MODEL_DEFAULTS[f.name]} here; GPTConfig's is {f.default}"
        else:
            default = f.default
        extra = dict(type=_bool, nargs="?", const=True, metavar="BOOL") if f.type is bool else \
            dict(type=f.type, metavar=METAVARS[f.type])
        g.add_argument(f"--{f.name}", help=f"{f.metadata['help']} (default: {default})", **extra)
    return p


def resolve_settings(explicit, ckpt, ckpt_path):
    """defaults < checkpoint (--resume) < preset < explicit flags. With --resume the checkpoint's
    config wins: a config flag (or preset value) that differs from it is an error."""
    preset = PRESETS.get(explicit.get("preset"), {})
    given = {**preset, **explicit}
    config_defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    settings = {**TRAIN_DEFAULTS, **config_defaults, **MODEL_DEFAULTS, "vocab_size": None}
    if ckpt is not None:
        for name, value in ckpt["config"].items():
            if name in given and given[name] != value:
                raise UsageError(f"--{name} {given[name]} conflicts with {ckpt_path}'s {name}={value}: drop the "
                                 "flag to resume that run, or start a new one in another --out_dir")
        restored = {k: v for k, v in ckpt["train_args"].items() if k not in RUNTIME_ARGS}
        settings.update(restored, **ckpt["config"])
    if "max_iters" in explicit and "max_tokens" in explicit:
        raise UsageError("give --max_iters or --max_tokens, not both")
    settings.update(given)
    if "max_iters" in explicit:
        settings["max_tokens"] = None  # an explicit step count beats a preset's or checkpoint's budget
    return argparse.Namespace(**settings), preset


def check_settings(a, world):
    positive = ("batch_size", "grad_accum", "max_iters", "eval_interval", "log_interval")
    for name in positive + tuple(n for n in ("eval_tokens", "stop_after") if getattr(a, n) is not None):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name} {getattr(a, name)}: must be a positive integer")
    for name in ("lr", "weight_decay", "grad_clip", "warmup_iters", "seed") + ("min_lr",) * (a.min_lr is not None):
        if not getattr(a, name) >= 0:
            raise UsageError(f"--{name} {getattr(a, name)}: must be >= 0")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise UsageError(f"--max_tokens {a.max_tokens}: must be positive")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(a, name) < 1:
            raise UsageError(f"--{name} {getattr(a, name)}: must be in [0, 1), e.g. 0.9 / 0.95")
    if a.dtype not in ("auto", "float32", "bfloat16"):
        raise UsageError(f"--dtype {a.dtype}: choose auto, float32 or bfloat16")
    if a.wandb_run is not None and a.wandb_project is None:
        raise UsageError("--wandb_run needs --wandb_project NAME")
    if a.batch_size % world:
        raise UsageError(f"--batch_size {a.batch_size} is not divisible by the {world} processes: "
                         "each process takes an equal share of the batch")


def default_eval_tokens(vocab_size, device):
    """--eval_tokens when not given (see EVAL_TOKENS)."""
    return EVAL_TOKENS_CPU_LARGE_VOCAB if device.type == "cpu" and vocab_size > LARGE_VOCAB else EVAL_TOKENS


def block_note(config):
    """A note when the automatic routing block differs from the one Block AttnRes (the parent variant)
    gets at this depth: a comparison with it would then also compare block sizes. None otherwise."""
    if config.residual != "attnres" or config.attnres_block:
        return None
    parent = GPTConfig(n_layer=config.n_layer, **VARIANTS["block"]).routing_block
    if config.routing_block == parent:
        return None
    return (f"note: the automatic routing block is {config.routing_block} sublayers here (WAV needs at least 4) "
            f"but {parent} for Block AttnRes at {config.n_layer} layers; to compare the two like for like, give "
            f"both --attnres_block {config.routing_block} (experiments.py sweeps do)")


def pick_device(name, local_rank=0):
    """auto: CUDA, else Apple's MPS, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        raise UsageError(f"--device {name}: choose auto, cpu, cuda, cuda:N or mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps: MPS (Apple silicon GPU) is not available here; use --device cpu")
    if name == "cuda":
        name = f"cuda:{local_rank}"  # under torchrun: one GPU per process
    return torch.device(name)


# -----------------------------------------------------------------------------
# Data: random crops at offsets that depend only on (seed, step, micro-step)


def open_dataset(data_dir, master=True):
    """meta.json of data_dir; the demo dataset is prepared on the spot if missing (only the demo:
    every other dataset is a download, and load_meta names the command that fetches it)."""
    if Path(data_dir).name == "demo" and not (Path(data_dir) / "meta.json").exists() and master:
        print(f"preparing the demo dataset in {data_dir}")
        prepare_data.prepare("demo", data_dir)
    if dist.is_initialized():
        dist.barrier()  # the other processes wait for rank 0 to prepare it
    meta = prepare_data.load_meta(data_dir)
    prepare_data.check_tokens(data_dir, meta, meta["splits"])  # ids < vocab_size; cached after the first run
    return meta


def batch_offsets(seed, step, micro, n_tokens, T, rows):
    """Start positions of the global micro-batch `rows` crops for (step, micro). A function of the
    position alone: the same for every model and every number of processes, and resume needs only
    the step. Process r of W takes rows r::W."""
    return np.random.default_rng([seed, step, micro]).integers(0, n_tokens - T, size=rows)


EVAL_SEED = 20260501  # evaluation crops ignore --seed: every run is scored on the same text


def eval_offsets(n_tokens, T, rows, eval_tokens, split_id):
    n_batches = max(1, math.ceil(eval_tokens / (rows * T)))
    return np.random.default_rng([EVAL_SEED, split_id]).integers(0, n_tokens - T, size=(n_batches, rows))


def get_batch(data, offsets, T, device):
    x = torch.from_numpy(np.stack([data[o:o + T] for o in offsets]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[o + 1:o + 1 + T] for o in offsets]).astype(np.int64))
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# -----------------------------------------------------------------------------
# Schedule, evaluation, checkpoints


def get_lr(step, a, max_iters):
    """Linear warmup over warmup_iters steps, then cosine decay to min_lr at the last step."""
    min_lr = a.lr / 10 if a.min_lr is None else a.min_lr
    if step < a.warmup_iters:
        return a.lr * (step + 1) / a.warmup_iters
    progress = min(1.0, (step - a.warmup_iters) / max(1, max_iters - 1 - a.warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (a.lr - min_lr)


@torch.no_grad()
def evaluate(model, data, batches, T, device, ctx, rank, world):
    """Mean loss over fixed crops; each process takes its rows of every batch."""
    model.eval()
    losses = []
    for offsets in batches:
        x, y = get_batch(data, offsets[rank::world], T, device)
        with ctx:
            losses.append(model(x, y)[1].float())
    model.train()
    loss = torch.stack(losses).mean()
    if world > 1:
        dist.all_reduce(loss)  # equal shares: the mean of the means is the global mean
        loss /= world
    return loss.item()


@torch.no_grad()
def batch_routing_stats(model, data, offsets, T, device, ctx):
    """routing_stats of one eval batch (8 rows); None for a model without depth routing."""
    if model.config.residual != "attnres":
        return None
    model.eval()
    x, y = get_batch(data, offsets[:8], T, device)
    with ctx:
        routes = model(x, y, return_routes=True)[2]
    model.train()
    return routing_stats(routes)


def routes_block(model, data, offsets, T, device, ctx):
    """Routing diagnostics of one eval batch for metrics.jsonl: entropy per read (nats, and normalised by
    the log of the number of sources), RD's JS divergence."""
    stats = batch_routing_stats(model, data, offsets, T, device, ctx)
    if stats is None:
        return None
    return dict(entropy={name: r["entropy"] + 0.0 for name, r in stats["reads"].items()},
                entropy_norm={name: r["entropy_norm"] for name, r in stats["reads"].items()}, js=stats["js"],
                js_mean=stats["js_mean"])


def routing_summary(stats, top=3):
    """A few lines for the end of a run: the sources each read leans on most (mean weight)."""
    lines = ["routing (mean weight per source, one val batch; emb: embedding, C<i>: completed block i, "
             "P: partial block)"]
    for name, read in stats["reads"].items():
        ranked = sorted(zip(read["mean_weight"], read["sources"]), reverse=True)[:top]
        lines.append(f"  {name:<14}" + "  ".join(f"{source} {weight:.2f}" for weight, source in ranked)
                     + ("  ..." if len(read["sources"]) > top else ""))
    if stats["js_mean"] is not None:
        lines.append(f"  RD: JS divergence between the QK and V routes, mean over layers {stats['js_mean']:.4f} nats")
    return "\n".join(lines)


def next_commands(a, routed, device):
    """What to try after a run, as commands for its --out_dir; the baseline repeats every setting
    that is not a default (a preset's too) except the routing, so that it is paired with this run."""
    at = "" if Path(a.out_dir) == Path(TRAIN_DEFAULTS["out_dir"]) else f" --out_dir {a.out_dir}"
    commands = [(f"python sample.py{at}", "text from best.pt")]
    if routed:
        defaults = {**TRAIN_DEFAULTS, **{f.name: f.default for f in dataclasses.fields(GPTConfig)}, **MODEL_DEFAULTS,
                    "eval_tokens": default_eval_tokens(a.vocab_size, device)}  # what the baseline gets when not given
        same = "".join(f" --{k} {getattr(a, k)}" for k in defaults if k not in routing_fields() + RUNTIME_ARGS
                       and k != "vocab_size" and getattr(a, k) != defaults[k]
                       and not (k == "max_iters" and a.max_tokens))  # max_iters was computed from max_tokens
        commands += [(f"python sample.py{at} --routes", "how each read routes over a val crop"),
                      (f"python train.py --residual prenorm{same} --out_dir {a.out_dir}_prenorm",
                       "the baseline without routing: same seed, same batches")]
    width = min(60, max(len(command) for command, _ in commands))
    return "\n".join(["next:"] + [f"  {command:<{width}}  # {why}" for command, why in commands])


def save_atomic(obj, path):
    """A checkpoint (torch.save) or a JSON file, written with prepare_data.write_atomic: a crash, a full
    disk or Ctrl-C never leaves a half-written file under the real name, nor a .tmp."""
    if isinstance(obj, dict) and "model" in obj:
        prepare_data.write_atomic(path, lambda f: torch.save(obj, f))
    else:
        prepare_data.write_json(path, obj)


CKPT_KEYS = ("model", "optimizer", "step", "tokens", "best_val_loss", "config", "train_args", "meta", "rng")


def load_checkpoint(path, missing, keys=CKPT_KEYS, mmap=False):
    """A checkpoint as plain tensors and Python types (weights_only: never unpickles objects), with
    at least `keys`; `missing` is the message when the file does not exist. A damaged or foreign
    file is one line in our words: torch's own text is long and suggests weights_only=False, which
    would run whatever code a malicious file holds."""
    path = Path(path)
    if not path.exists():
        raise UsageError(missing)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        absent = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    except pickle.UnpicklingError:  # weights_only refused an object: not a checkpoint train.py wrote
        why = "it holds Python objects, not only tensors and plain values (it was not written by train.py)"
    except Exception as e:  # torch raises many kinds for a damaged zip or pickle stream
        why = f"not a complete torch checkpoint ({type(e).__name__})"
    else:
        if not absent:
            return ckpt
        why = f"it has no {', '.join(absent)}"
    raise UsageError(f"checkpoint {path} is corrupt or truncated: {why}; delete it or retrain")


def rng_states(device, world):
    """Each process's torch RNG state (dropout), gathered so rank 0 can save them all."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if world == 1:
        return [state]
    states = [None] * world
    dist.all_gather_object(states, state)
    return [{k: v.cpu() for k, v in s.items()} for s in states]


def strip_prefixes(state_dict):  # torch.compile adds _orig_mod., DDP adds module.
    return {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in state_dict.items()}


def write_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def import_wandb():
    """wandb, for --wandb_project; checked before any training, so a missing package costs nothing."""
    try:
        import wandb
    except ImportError:
        raise UsageError("--wandb_project needs the wandb package: pip install wandb (or drop the flag)") from None
    return wandb


def wandb_numbers(record):
    """A metrics.jsonl record as wandb metrics: its numbers, named type/field (nested: type/field/key)."""
    numbers = {}

    def walk(name, value):
        if isinstance(value, dict):
            for key, v in value.items():
                walk(f"{name}/{key}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[name] = value

    for key, value in record.items():
        if key not in ("type", "step"):  # the step is wandb's own axis
            walk(f"{record['type']}/{key}", value)
    return numbers


def keep_metrics_until(path, step):
    """On resume: drop the lines an interrupted run wrote after its checkpoint, and lines that do not
    parse (cut by a kill, or bytes damaged on disk: no reader can use them, so resuming recovers
    rather than stops); returns how many did not parse. The file is rewritten atomically: a kill
    during the rewrite leaves the old file whole."""
    kept, unreadable = [], 0
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            if json.loads(line.decode("utf-8"))["step"] <= step:
                kept.append(line + b"\n")
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            unreadable += bool(line.strip())
    if path.exists():
        prepare_data.write_atomic(path, lambda f: f.write(b"".join(kept)))
    return unreadable


def lock_out_dir(out_dir, cleanup):
    """One run per --out_dir: OUT_DIR/train.lock holds the pid of the train.py writing there, and goes
    when it ends (cleanup). A lock left by a process that no longer runs (kill -9) is taken over."""
    path, mine = out_dir / "train.lock", out_dir / f"train.lock.{os.getpid()}"
    mine.write_text(f"{os.getpid()}\n")
    try:
        for attempt in range(2):
            try:
                os.link(mine, path)  # atomic: the lock appears with the pid already in it
                break
            except FileExistsError:
                pid = lock_pid(path)
                if attempt or pid is None or process_alive(pid):
                    raise UsageError(f"--out_dir {out_dir} is in use by another train.py (pid {pid}, see {path}): "
                                     "wait for it to finish or choose another --out_dir; if that process no "
                                     f"longer runs, delete {path}") from None
                print(f"note: taking over {path} from process {pid}, which no longer runs")
                remove_dead_lock(path, pid)
    finally:
        mine.unlink()

    def release():
        if lock_pid(path) == os.getpid():
            path.unlink(missing_ok=True)
    cleanup.callback(release)


def lock_pid(path):
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def remove_dead_lock(path, pid):
    """Remove the lock of dead process pid. Two runs may find it at once, and the first may already have
    made its own lock there: only the run that creates PATH.takeover (atomic) may remove the lock, and only
    while it still names pid. The other run's next link then fails as "in use"."""
    claim = path.with_name(path.name + ".takeover")
    try:
        claim.touch(exist_ok=False)  # O_CREAT | O_EXCL
    except FileExistsError:
        return  # another run is taking it over
    try:
        if lock_pid(path) == pid:
            path.unlink(missing_ok=True)
    finally:
        claim.unlink()


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: training stopped at the end of a step, with last.pt saved."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.signum = signum


def stop_requested(received, ddp, device):
    """Whether to stop now; under DDP all processes stop at the same step if any got a signal."""
    if not ddp:
        return bool(received)
    flag = torch.tensor(float(bool(received)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def catch_stop_signals(cleanup):
    """SIGINT (Ctrl-C) and SIGTERM only set a flag (the returned list), which the training loop reads
    at the end of each step; a second signal a second or more later interrupts at once (sooner, it is
    the same Ctrl-C, which torchrun forwards to processes that got it from the terminal already).
    The old handlers return at cleanup."""
    received, first = [], []

    def handler(signum, frame):
        if received and time.monotonic() - first[0] >= 1:
            raise KeyboardInterrupt
        received.append(signum)
        first[:] = first or [time.monotonic()]
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for sig in (signal.SIGINT, signal.SIGTERM):
            cleanup.callback(signal.signal, sig, signal.signal(sig, handler))
    return received


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    try:
        with ExitStack() as cleanup:  # the out_dir lock and the signal handlers, released however train ends
            train(argv, cleanup)
        if dist.is_initialized():
            dist.barrier()  # finish together: a process leaving early can abort the others' gloo threads
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk, a folder gone read-only: files written so far are whole (atomic)
        print(f"error: {prepare_data.os_error_line(e, '--out_dir')} (with --resume if last.pt exists)",
              file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        if str(e):
            print(e, file=sys.stderr)
        sys.exit(128 + e.signum)  # 130 for SIGINT, 143 for SIGTERM: what a shell reports for them
    except KeyboardInterrupt:  # Ctrl-C before training starts, or a second one while last.pt is saved
        print("error: interrupted; checkpoints saved before are whole (continue with --resume if last.pt exists)",
              file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(argv, cleanup):
    """The run; cleanup (an ExitStack) releases the out_dir lock and the signal handlers when it ends."""
    # a lone "--" is dropped: `torchrun train.py -- --rd off` keeps torchrun from reading --rd as its --rdzv_*
    argv = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg != "--"]
    explicit = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}

    # processes: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK
    ddp = "RANK" in os.environ
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) if ddp else (0, 1, 0)
    master = rank == 0
    log = print if master else (lambda *args, **kwargs: None)
    device = pick_device(explicit.get("device", "auto"), local_rank)
    if ddp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    # settings, from a checkpoint too with --resume
    out_dir = Path(explicit.get("out_dir", TRAIN_DEFAULTS["out_dir"]))
    ckpt_path, ckpt = out_dir / "last.pt", None
    if explicit.get("resume"):
        ckpt = load_checkpoint(ckpt_path, f"--resume: no checkpoint at {ckpt_path}; train without --resume first")
    elif ckpt_path.exists():
        raise UsageError(f"{out_dir} already holds a run ({ckpt_path}): add --resume to continue it, or choose "
                         "another --out_dir (or delete that folder)")
    a, preset = resolve_settings(explicit, ckpt, ckpt_path)
    check_settings(a, world)
    wandb = import_wandb() if a.wandb_project and master else None
    if preset:
        log(f"preset {a.preset}: " + " ".join(f"{k}={v}" + (f" (overridden: {explicit[k]})" if k in explicit else "")
                                             for k, v in preset.items()))

    # data and model config
    meta = open_dataset(a.data, master)
    train_data, val_data = prepare_data.open_split(a.data, "train", meta), prepare_data.open_split(a.data, "val", meta)
    if ckpt is not None and ckpt["config"]["vocab_size"] != meta["vocab_size"]:
        raise UsageError(f"dataset {a.data} has vocab_size {meta['vocab_size']} but {ckpt_path} was trained with "
                         f"{ckpt['config']['vocab_size']}: resume with the --data it was trained on")
    if a.vocab_size is not None and a.vocab_size != meta["vocab_size"]:
        raise UsageError(f"--vocab_size {a.vocab_size} differs from dataset {a.data}'s vocab_size "
                         f"{meta['vocab_size']}: drop the flag (it defaults to the dataset's)")
    a.vocab_size = meta["vocab_size"]
    if a.eval_tokens is None:
        a.eval_tokens = default_eval_tokens(a.vocab_size, device)
    try:
        config = GPTConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(GPTConfig)})
    except ValueError as e:
        raise UsageError(str(e)) from None
    T, char_level = config.sequence_len, meta["level"] == "char"
    for split, data in (("train", train_data), ("val", val_data)):
        if len(data) < T + 2:
            raise UsageError(f"--sequence_len {T} is longer than the {split} split of {a.data} "
                             f"({len(data)} tokens): lower --sequence_len")
    if a.batch_size * T > len(train_data):
        raise UsageError(f"a batch of --batch_size {a.batch_size} x sequence_len {T} = {a.batch_size * T} tokens "
                         f"is larger than the training data ({len(train_data)} tokens): lower --batch_size")
    tokens_per_step = a.batch_size * a.grad_accum * T
    a.max_iters = math.ceil(a.max_tokens / tokens_per_step) if a.max_tokens else a.max_iters
    milestones = [(m.strip(), count(m)) for m in a.milestones.split(",")] if a.milestones else []
    has_test = meta["splits"].get("test", 0) >= T + 2

    # model and optimizer: torch.manual_seed right before GPT() gives paired runs identical shared weights
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(a.seed)
    raw_model = GPT(config).to(device)
    optimizer = raw_model.configure_optimizers(a.weight_decay, a.lr, (a.beta1, a.beta2), device.type)
    step, tokens, best_val, wall_before, reached = 0, 0, math.inf, 0.0, {}
    if master:  # before anything is written there
        prepare_data.writable_folder(out_dir, "--out_dir")
        lock_out_dir(out_dir, cleanup)
    if ckpt is None:
        torch.manual_seed(a.seed + rank)  # dropout: a different stream per process
        if master:
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    else:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, tokens, best_val = ckpt["step"], ckpt["tokens"], ckpt["best_val_loss"]
        if (out_dir / "best.pt").exists():  # a step ahead of last.pt after a crash between the two renames
            best_val = min(best_val, load_checkpoint(out_dir / "best.pt", "", ("best_val_loss",), mmap=True)
                           ["best_val_loss"])
        wall_before, reached = ckpt.get("wall_time_s", 0.0), ckpt.get("milestones", {})
        if len(ckpt["rng"]) == world:
            torch.set_rng_state(ckpt["rng"][rank]["torch"])
            if "cuda" in ckpt["rng"][rank] and device.type == "cuda":
                torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"], device)
        else:
            log(f"note: {ckpt_path} was written by {len(ckpt['rng'])} processes, not {world}: dropout is "
                "reseeded (the data order is unaffected)")
            torch.manual_seed(a.seed + 1000 * step + rank)
        if master and (unreadable := keep_metrics_until(out_dir / "metrics.jsonl", step)):
            log(f"note: dropped {unreadable} line(s) of {out_dir / 'metrics.jsonl'} that do not parse "
                "(cut by an interruption, or damaged)")
        log(f"resuming {ckpt_path} at step {step} ({tokens:,} tokens)")
    model = torch.compile(raw_model) if a.compile else raw_model
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None) if ddp else model

    train_args = {k: getattr(a, k) for k in TRAIN_DEFAULTS}
    val_batches = eval_offsets(len(val_data), T, a.batch_size, a.eval_tokens, 1)
    train_batches = eval_offsets(len(train_data), T, a.batch_size, a.eval_tokens, 0)
    log(f"data: {a.data} ({meta['dataset']}, {meta['level']} level, vocab {meta['vocab_size']}; "
        f"train {len(train_data):,} / val {len(val_data):,} tokens)")
    log(f"model: {config.n_layer} layers x {config.n_embd}, {config.n_head} heads, sequence_len {T}, residual "
        f"{config.residual}" + (f" (block {config.routing_block}, wav {config.wav}, rd {config.rd})"
                                if config.residual == "attnres" else "")
        + f"; {raw_model.get_num_params() / 1e6:.2f}M parameters")
    if block_note(config):
        log(block_note(config))
    log(f"training: {a.max_iters} steps x {tokens_per_step:,} tokens (batch {a.batch_size} x accum {a.grad_accum} "
        f"x {T}) = {a.max_iters * tokens_per_step / 1e6:.1f}M tokens; lr {a.lr:g} warmup {a.warmup_iters} cosine "
        f"to {a.lr / 10 if a.min_lr is None else a.min_lr:g}; {world} process(es) on {device}, "
        f"{str(dtype).removeprefix('torch.')}; evaluation: {a.eval_tokens:,} tokens per split every "
        f"{a.eval_interval} steps")

    t_start, last_eval = time.time(), ckpt.get("last_eval") if ckpt else None
    wandb_run = wandb.init(project=a.wandb_project, name=a.wandb_run, dir=out_dir,
                           config=dict(train_args, **dataclasses.asdict(config))) if wandb else None

    def record(line):  # one line of metrics.jsonl; the same numbers to wandb with --wandb_project
        write_metrics(out_dir / "metrics.jsonl", line)
        if wandb_run:
            wandb_run.log(wandb_numbers(line), step=line["step"])

    def checkpoint(improved):
        if not all(p.isfinite().all() for p in raw_model.parameters()):
            raise diverged("weights", step)
        state = dict(model=strip_prefixes(raw_model.state_dict()), optimizer=optimizer.state_dict(), step=step,
                     tokens=tokens, best_val_loss=best_val, milestones=reached, last_eval=last_eval,
                     rng=rng_states(device, world),
                     wall_time_s=wall_before + time.time() - t_start, config=dataclasses.asdict(config),
                     train_args=train_args, meta=dict(dataset=meta["dataset"], vocab_size=meta["vocab_size"],
                                                      level=meta["level"]))
        # best.pt first: last.pt then never counts a best that best.pt does not hold. A crash between
        # the two renames leaves best.pt a step ahead, and --resume takes the lower best_val_loss of
        # the two files, so summary.json's best_val_loss is always best.pt's.
        if master:  # the step is the data position: batches are a function of (seed, step)
            try:
                if improved:
                    save_atomic(state, out_dir / "best.pt")
                save_atomic(state, ckpt_path)
            except OSError as e:
                kept = f"the previous {ckpt_path} is kept" if ckpt_path.exists() else "no checkpoint was written"
                why = prepare_data.os_error_line(e, "--out_dir")
                raise UsageError(f"saving a checkpoint in {out_dir} failed: {why} "
                                 f"({kept}; continue with --resume)") from None

    def diverged(what, at_step):
        kept = f"last good checkpoint kept at {ckpt_path}" if ckpt_path.exists() else "no checkpoint was written"
        return UsageError(f"non-finite {what} at step {at_step}; {kept} (lower --lr or raise --warmup_iters)")

    def eval_and_save(lr, crossed=()):
        nonlocal best_val, last_eval
        train_loss = evaluate(model, train_data, train_batches, T, device, ctx, rank, world)
        val_loss = evaluate(model, val_data, val_batches, T, device, ctx, rank, world)
        if not (math.isfinite(val_loss) and math.isfinite(train_loss)):
            raise diverged("validation loss", step)
        routes = routes_block(raw_model, val_data, val_batches[0], T, device, ctx) if master else None
        for label in crossed:
            reached[label] = dict(step=step, tokens=tokens, val_loss=val_loss)
        last_eval = dict(type="eval", step=step, tokens=tokens, train_loss=train_loss, val_loss=val_loss,
                         val_bpc=val_loss / math.log(2) if char_level else None, lr=lr,
                         elapsed_s=round(wall_before + time.time() - t_start, 3),
                         milestone=",".join(crossed) or None, routes=routes)
        if master:
            record(last_eval)
        log(f"eval step {step} | train {train_loss:.4f} | val {val_loss:.4f}"
            + (f" | bpc {last_eval['val_bpc']:.4f}" if char_level else "")
            + (f" | js_mean {routes['js_mean']:.4f}" if routes and routes["js_mean"] is not None else "")
            + (f" | milestone {last_eval['milestone']}" if crossed else ""))
        improved, best_val = val_loss < best_val, min(best_val, val_loss)
        checkpoint(improved)

    stop_signals = catch_stop_signals(cleanup)
    if ckpt is None:  # a checkpoint, even of step 0, comes after its evaluation
        eval_and_save(get_lr(0, a, a.max_iters))
    train_time, steps_since_log = 0.0, 0  # time in training steps since the last log line (no evals)
    while step < a.max_iters:
        t0 = time.time()
        lr = get_lr(step, a, a.max_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(a.grad_accum):
            offsets = batch_offsets(a.seed, step, micro, len(train_data), T, a.batch_size)[rank::world]
            x, y = get_batch(train_data, offsets, T, device)
            # DDP: all-reduce the gradients only on the last micro-step
            sync = model.no_sync() if ddp and micro < a.grad_accum - 1 else nullcontext()
            with sync:
                with ctx:
                    _, loss = model(x, y)
                (loss / a.grad_accum).backward()
            loss_sum += loss.detach().float()
        loss = loss_sum / a.grad_accum
        if ddp:
            dist.all_reduce(loss)
            loss /= world
        loss = loss.item()
        if not math.isfinite(loss):  # before the update, and no checkpoint is written after this
            raise diverged("loss", step + 1)
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), a.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens, steps_since_log = step + 1, tokens + tokens_per_step, steps_since_log + 1
        train_time += time.time() - t0  # loss.item() above waited for the GPU

        if step % a.log_interval == 0 or step == 1:
            dt = train_time / steps_since_log
            mfu = raw_model.estimate_mfu(tokens_per_step / world, dt) if device.type == "cuda" else None
            if master:
                record(dict(
                    type="train", step=step, tokens=tokens, loss=loss, lr=lr, tok_per_s=round(tokens_per_step / dt, 1),
                    ms_per_step=round(1000 * dt, 2), mfu=mfu))
            log(f"step {step} | loss {loss:.4f} | lr {lr:.1e} | {tokens_per_step / dt / 1e3:.1f}k tok/s | "
                f"{1000 * dt:.1f} ms/step" + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""))
            train_time, steps_since_log = 0.0, 0
        crossed = [label for label, n in milestones if tokens - tokens_per_step < n <= tokens]
        if step % a.eval_interval == 0 or step == a.max_iters or crossed:
            eval_and_save(lr, crossed)
        if a.stop_after is not None and step >= a.stop_after and step < a.max_iters:
            if last_eval is None or last_eval["step"] != step:
                checkpoint(improved=False)
            log(f"stopped after step {step} (--stop_after); continue with --resume")
            if wandb_run:
                wandb_run.finish()
            return
        if stop_requested(stop_signals, ddp, device):
            if last_eval is None or last_eval["step"] != step:
                checkpoint(improved=False)
            signum = stop_signals[0] if stop_signals else signal.SIGTERM  # DDP: another process got it
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} after step {step}, {ckpt_path} "
                              f"saved; continue with: python train.py --out_dir {out_dir} --resume" if master else "")

    # the end: final losses (val from the last evaluation, test if the dataset has one) and summary.json
    if last_eval is None or last_eval["step"] != step:
        eval_and_save(get_lr(step - 1, a, a.max_iters))
    test_loss = None
    if has_test:
        test_data = prepare_data.open_split(a.data, "test", meta)
        test_batches = eval_offsets(len(test_data), T, a.batch_size, a.eval_tokens, 2)
        test_loss = evaluate(model, test_data, test_batches, T, device, ctx, rank, world)
    bpc = (lambda v: v / math.log(2) if char_level and v is not None else None)
    summary = dict(config=dataclasses.asdict(config), train=train_args,
                   final=dict(val_loss=last_eval["val_loss"], val_bpc=bpc(last_eval["val_loss"]),
                              test_loss=test_loss, test_bpc=bpc(test_loss)),
                   best_val_loss=best_val, step=step, tokens_seen=tokens,
                   wall_time_s=round(wall_before + time.time() - t_start, 3), milestones=reached,
                   routes=last_eval["routes"], dataset=meta["dataset"], level=meta["level"])
    if master:
        save_atomic(summary, out_dir / "summary.json")
    log(f"done: {step} steps, {tokens:,} tokens, val {last_eval['val_loss']:.4f}"
        + (f", test {test_loss:.4f}" if test_loss is not None else "")
        + f", {summary['wall_time_s']:.0f} s; wrote {out_dir}/summary.json")
    if wandb_run:
        wandb_run.finish()
    if master:
        stats = batch_routing_stats(raw_model, val_data, val_batches[0], T, device, ctx)
        log("\n" + (routing_summary(stats) + "\n\n" if stats else "") + next_commands(a, stats is not None, device))


if __name__ == "__main__":
    main()
