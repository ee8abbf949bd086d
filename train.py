"""
Train a nanoroute GPT on a prepared dataset: one CPU or GPU, or several under torchrun (DDP).

    python train.py                                            # demo data, small Block AttnRes model, minutes
    python train.py --residual prenorm --out_dir out_prenorm   # the same run without depth routing
    python train.py --residual attnres --rd decoupled --out_dir out/rd
    python train.py --preset rd_s --seed 1 --out_dir out/rd_s_seed1
    torchrun --nproc_per_node=8 train.py -- --preset rd_s --rd off --out_dir out/rd_s_off

Every GPTConfig field is a flag of the same name (`python train.py --help`). The batches depend only
on --seed and the step, never on the model or the number of processes, and the model is initialised
right after torch.manual_seed(seed): runs with the same seed are paired across routing variants
(SPEC: Paired experiments). Output in --out_dir: metrics.jsonl, last.pt, best.pt, summary.json (and
train.lock while a run writes there). Ctrl-C or SIGTERM stops at the end of the step and saves last.pt.

Read top to bottom: the settings (TrainSettings, presets, flags), the data, the model and the
schedule, then the run: main, setup, the loop, evaluation, the end. Below the banner at the end:
what keeps a run safe (the out_dir lock, signals, checkpoints, RNG states, metrics repair, wandb).
"""

import argparse
import atexit
import dataclasses
import json
import math
import os
import pickle
import re
import shlex
import signal
import sys
import threading
import time
import typing
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from nanoroute import GPT, VARIANTS, GPTConfig, routing_fields, routing_stats
from prepare_data import UsageError

# -----------------------------------------------------------------------------
# Settings: train.py's model, the papers' presets, the training settings, the flags

# train.py's small model; the other GPTConfig fields keep the dataclass defaults. Routed by default
# (Block AttnRes): the first run shows what this project is about. Not WAV or RD: Block AttnRes is
# the base both modify, its summary is the easiest to read, and each is one flag away (--wav, --rd).
MODEL_DEFAULTS = dict(sequence_len=256, n_layer=4, n_head=4, n_embd=128, residual="attnres")

# The papers' set-ups (SPEC.md). Explicit flags override them. WAV v1 (char level, 12/24/48 layers):
# SPEC.md does not give the paper's width or schedule, so these are our choices (head size 64).
# Compare with --wav False (Block AttnRes), --residual rezero or --residual layerscale.
_WAV = dict(VARIANTS["wav"], data="data/tinystories", n_embd=256, n_head=4, sequence_len=256,
            batch_size=64, lr=1e-3, warmup_iters=500, max_iters=20000, eval_interval=1000,
            eval_tokens=1 << 20)
# RD-AttnRes (FineWeb-Edu, GPT-2 tokens, 2.0B tokens, milestones as in the paper); batch 0.5M tokens
# on any number of GPUs. micro_batch 16: on one GPU each forward runs 16 x 1024 tokens, ~18 (rd_s)
# and ~30 GiB (rd_m) in bf16 (estimate_memory), which fits an 80 GB GPU (and a 40 GB one); on 8 GPUs
# each runs its 8 sequences at once. Compare with --rd off (the parent), tied, average, frozen_v;
# pair with --seed.
_RD = dict(VARIANTS["rd"], data="data/fineweb_edu", sequence_len=1024, batch_size=64,
           grad_accum=8, micro_batch=16, lr=6e-4, warmup_iters=200, max_tokens=2_000_000_000,
           eval_interval=250, eval_tokens=1 << 20, milestones="0.25B,0.5B,1B,2B", log_interval=10)
PRESETS = {
    "wav12": dict(_WAV, n_layer=12),
    "wav24": dict(_WAV, n_layer=24),
    "wav48": dict(_WAV, n_layer=48),
    # the paper's S and M have 120M and 343M parameters; this GPT (tied embeddings, 4x MLP) has 93M and 241M
    "rd_s": dict(_RD, n_layer=16, n_embd=576, n_head=9),
    "rd_m": dict(_RD, n_layer=24, n_embd=832, n_head=13, lr=3e-4),
}

# --eval_tokens at most: the evaluation crops' offsets are held in memory (8 bytes per crop)
MAX_EVAL_TOKENS = 10 ** 9
# --eval_tokens when not given: 32K per split; 8K on CPU with a large vocabulary (GPT-2's 50,257 tokens),
# where the output layer makes an evaluated token ~8x dearer than at char level with train.py's model
# (128 x 50257 multiply-adds a token against ~0.9M for the 4 layers): 32K took ~30% of a CPU run there.
EVAL_TOKENS, EVAL_TOKENS_CPU_LARGE_VOCAB, LARGE_VOCAB = 32768, 8192, 1024


def option(default, help, parse=None, metavar=None, choices=None, runtime=False):
    """A TrainSettings field and its --help text (nanoroute.setting makes GPTConfig's). parse and
    metavar: for a flag whose text is not its type (--max_tokens 2B). runtime=True: the field says
    how this invocation runs, not what the run is, so --resume never takes it from a checkpoint."""
    return dataclasses.field(default=default, metadata=dict(help=help, parse=parse, metavar=metavar,
                                                            choices=choices, runtime=runtime))


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


@dataclasses.dataclass
class TrainSettings:
    """Every training flag, with its help; the model's flags are GPTConfig's fields. The defaults
    make a run that learns on two CPU cores in a few minutes (the demo data, ~1.6M tokens)."""
    data: str = option(
        "data/demo", "prepared dataset folder (python prepare_data.py NAME); data/demo is prepared "
        "automatically")
    out_dir: str = option(
        "out", "output folder: metrics.jsonl, last.pt, best.pt, summary.json", runtime=True)
    preset: str | None = option(
        None, "named paper set-up: " + ", ".join(PRESETS) + "; explicit flags override it",
        metavar="NAME", choices=PRESETS, runtime=True)
    batch_size: int = option(
        16, "sequences per micro-step, for all processes together (each takes batch_size/world)")
    grad_accum: int = option(
        1, "micro-steps per optimizer step; a step sees batch_size*grad_accum sequences")
    micro_batch: int = option(
        0, "the most sequences one process runs in one forward: its share of each micro-step is "
        "cut into chunks of this many, with the same batches and gradient (0: all of its share)")
    lr: float = option(2e-3, "peak learning rate")
    min_lr: float | None = option(
        None, "floor of the cosine decay, reached at the last step (default: lr/10)")
    warmup_iters: int = option(20, "steps of linear warmup")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: off)")
    max_iters: int = option(400, "optimizer steps (the schedule length)")
    max_tokens: int | None = option(
        None, "token budget instead of --max_iters: 2B, 500M, 64K or an integer", parse=count)
    eval_interval: int = option(
        100, "evaluate and write last.pt (best.pt if better) every this many steps")
    eval_tokens: int | None = option(
        None, f"tokens per split (train, val) in each evaluation (default: {EVAL_TOKENS}; "
        f"{EVAL_TOKENS_CPU_LARGE_VOCAB} on CPU with a vocabulary over {LARGE_VOCAB} tokens)",
        parse=count)
    milestones: str | None = option(
        None, "also evaluate when the token count crosses these, e.g. 0.25B,0.5B,1B,2B",
        parse=_milestones, metavar="LIST")
    log_interval: int = option(20, "print and log the train loss every this many steps")
    seed: int = option(1337, "data order and init")
    device: str = option(
        "auto", "auto (cuda if available, else mps, else cpu), cpu, cuda, cuda:N, mps "
        "(Apple silicon)", runtime=True)
    dtype: str = option(
        "auto", "auto (bfloat16 autocast on a GPU with native bf16, CUDA compute capability 8.0 "
        "or more; float32 elsewhere), float32, bfloat16", runtime=True)
    compile: bool = option(False, "torch.compile the model", runtime=True)
    resume: bool = option(False, "continue from OUT_DIR/last.pt", runtime=True)
    stop_after: int | None = option(
        None, "stop after this step, saving last.pt (then --resume); the schedule still ends at "
        "--max_iters", runtime=True)
    wandb_project: str | None = option(
        None, "also log metrics.jsonl's numbers to this Weights & Biases project (pip install "
        "wandb)", runtime=True)
    wandb_run: str | None = option(None, "name of the wandb run (default: wandb's)", runtime=True)


def build_parser(config_class=GPTConfig):
    """train.py's flags: one per TrainSettings field, then one per GPTConfig field (config_class: a
    subclass's too)."""
    p = prepare_data.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                    epilog="Bool flags take True/False/1/0; alone they mean True.")
    add_flags(p, TrainSettings, "training")
    shown = {f.name: f"{MODEL_DEFAULTS[f.name]} here; GPTConfig's is {f.default}"
             for f in dataclasses.fields(config_class) if f.name in MODEL_DEFAULTS}
    add_flags(p, config_class, "model (GPTConfig fields)", dict(shown, vocab_size="the dataset's"))
    return p


def add_flags(parser, cls, title, shown=None):
    """One --flag per field of the dataclass cls, in the --help group `title`: of the type in the
    field's annotation (or the parse in its metadata), with the help in its metadata and its default
    (shown: {name: text} where this script's default is not the field's). Every flag's argparse
    default is None, so that what was given is known (for presets and --resume)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, meta = _flag_type(hints[f.name]), f.metadata
        if kind is bool:
            extra = dict(type=_bool, nargs="?", const=True, metavar="BOOL")
        else:
            metavar = meta.get("metavar") or {int: "N", float: "X"}.get(kind, "S")
            extra = dict(type=meta.get("parse") or kind, metavar=metavar)
        if meta.get("choices"):
            extra["choices"] = list(meta["choices"])
        default = (shown or {}).get(f.name, f.default)
        shown_default = "" if default is None else f" (default: {default})"
        group.add_argument(f"--{f.name}", help=meta["help"] + shown_default, **extra)


def _flag_type(hint):
    """int for `int` and for `int | None`."""
    types = [t for t in typing.get_args(hint) if t is not type(None)]
    return types[0] if types else hint


def _bool(text):
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True/False/1/0, got {text!r}")


def default_settings(config_class=GPTConfig):
    """Every setting of a run given no flag: TrainSettings', then GPTConfig's with MODEL_DEFAULTS
    over them; vocab_size None (the dataset's)."""
    config = {f.name: f.default for f in dataclasses.fields(config_class)}
    return {**dataclasses.asdict(TrainSettings()), **config, **MODEL_DEFAULTS, "vocab_size": None}


def resolve_settings(explicit, ckpt=None, ckpt_path=None, config_class=GPTConfig):
    """defaults < checkpoint (--resume) < preset < explicit flags. With --resume the checkpoint's
    config wins: a config flag (or preset value) that differs from it is an error. Returns the
    TrainSettings, the model's settings (a dict; vocab_size is the dataset's, known later) and the
    preset's values."""
    preset = PRESETS.get(explicit.get("preset"), {})
    given = {**preset, **explicit}
    settings = default_settings(config_class)
    if ckpt is not None:
        for name, value in ckpt["config"].items():
            if name in given and given[name] != value:
                raise UsageError(f"--{name} {given[name]} conflicts with {ckpt_path}'s {name}={value}: drop the "
                                 "flag to resume that run, or start a new one in another --out_dir")
        runtime = {f.name for f in dataclasses.fields(TrainSettings) if f.metadata["runtime"]}
        settings.update({k: v for k, v in ckpt["train_args"].items() if k not in runtime})
        settings.update(ckpt["config"])
    if "max_iters" in explicit and "max_tokens" in explicit:
        raise UsageError("give --max_iters or --max_tokens, not both")
    settings.update(given)
    if "max_iters" in explicit:
        settings["max_tokens"] = None  # an explicit step count beats a preset's or checkpoint's budget
    train = TrainSettings(**{f.name: settings[f.name] for f in dataclasses.fields(TrainSettings)})
    return train, {f.name: settings[f.name] for f in dataclasses.fields(config_class)}, preset


def check_settings(a, world):
    """Every training setting in its range, wherever it came from (a flag, a preset, a checkpoint):
    one line naming the flag. nan and inf fail every range."""
    optional = ("eval_tokens", "stop_after", "max_tokens")
    positive = ("batch_size", "grad_accum", "max_iters", "eval_interval", "log_interval")
    for name in positive + tuple(n for n in optional if getattr(a, n) is not None):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name} {getattr(a, name)}: must be a positive integer")
    if a.warmup_iters < 0:
        raise UsageError(f"--warmup_iters {a.warmup_iters}: must be >= 0")
    for name in ("lr", "weight_decay", "grad_clip") + ("min_lr",) * (a.min_lr is not None):
        if not 0 <= getattr(a, name) < math.inf:
            raise UsageError(f"--{name} {getattr(a, name)}: must be a finite number >= 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(a, name) < 1:
            raise UsageError(f"--{name} {getattr(a, name)}: must be in [0, 1), e.g. 0.9 / 0.95")
    check_seed(a.seed)
    if a.eval_tokens is not None and a.eval_tokens > MAX_EVAL_TOKENS:
        raise UsageError(f"--eval_tokens {a.eval_tokens}: at most {MAX_EVAL_TOKENS:,} tokens per split")
    if not a.data:
        raise UsageError("--data '': give the folder of a prepared dataset")
    if a.dtype not in ("auto", "float32", "bfloat16"):
        raise UsageError(f"--dtype {a.dtype}: choose auto, float32 or bfloat16")
    if a.wandb_run is not None and a.wandb_project is None:
        raise UsageError("--wandb_run needs --wandb_project NAME")
    if a.batch_size % world:
        raise UsageError(f"--batch_size {a.batch_size} is not divisible by the {world} processes: "
                         "each process takes an equal share of the batch")


def check_seed(seed):
    """A seed torch takes (train.py and sample.py): prepare_data's range, 0 to 2**63 - 1."""
    low, high = prepare_data.LIMITS["seed"][1:3]
    if not low <= seed <= high:
        raise UsageError(f"--seed {seed}: must be an integer from {low} to 2**63 - 1")


def check_out_dir(out_dir):
    """An empty --out_dir would be the current folder (the repository, as often as not)."""
    if not out_dir.strip():
        raise UsageError(f"--out_dir {out_dir!r}: give a folder name, e.g. --out_dir out")


def model_config(model, vocab_size, data_dir, config_class=GPTConfig):
    """The run's GPTConfig: the model settings, with the dataset's vocab_size."""
    if model["vocab_size"] is not None and model["vocab_size"] != vocab_size:
        raise UsageError(f"--vocab_size {model['vocab_size']} differs from dataset {data_dir}'s "
                         f"vocab_size {vocab_size}: drop the flag (it defaults to the dataset's)")
    try:
        return config_class(**dict(model, vocab_size=vocab_size))
    except ValueError as e:
        raise UsageError(str(e)) from None


def complete_settings(a, config, device):
    """What waits for the dataset and the device: --eval_tokens when not given, and --max_iters
    from --max_tokens. Returns the tokens per step."""
    if a.eval_tokens is None:
        a.eval_tokens = default_eval_tokens(config.vocab_size, device)
    tokens_per_step = a.batch_size * a.grad_accum * config.sequence_len
    a.max_iters = math.ceil(a.max_tokens / tokens_per_step) if a.max_tokens else a.max_iters
    return tokens_per_step


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


def pick_device(name, local_rank=0, world=1):
    """auto: CUDA, else Apple's MPS, else the CPU. Under torchrun (world > 1) "cuda" is process
    LOCAL_RANK's GPU; a cuda:N where several GPUs are visible would put every process on GPU N."""
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
    elif name.startswith("cuda:") and world > 1 and torch.cuda.device_count() > 1:
        raise UsageError(f"--device {name} under torchrun: every process would run on that one GPU; "
                         "give --device cuda (each process takes the GPU of its LOCAL_RANK) or "
                         "choose the GPUs with CUDA_VISIBLE_DEVICES")
    return torch.device(name)


def pick_dtype(name, device):
    """--dtype auto: bfloat16 autocast on a CUDA GPU with native bf16, float32 elsewhere."""
    if name == "auto":
        bf16 = device.type == "cuda" and bf16_native(torch.cuda.get_device_capability(device))
        return torch.bfloat16 if bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def bf16_native(capability):
    """Whether a CUDA GPU of this compute capability (major, minor) has bf16 tensor cores: Ampere
    (8.0) and later. Not torch.cuda.is_bf16_supported(), which is true where bf16 is emulated too
    (slower than float32 there)."""
    return tuple(capability) >= (8, 0)


def read_settings(explicit, world, master):
    """The settings, from the checkpoint too with --resume: (TrainSettings, the model's settings,
    the checkpoint or None)."""
    check_out_dir(explicit.get("out_dir", TrainSettings.out_dir))
    ckpt_path, ckpt = Path(explicit.get("out_dir", TrainSettings.out_dir)) / "last.pt", None
    if explicit.get("resume"):
        ckpt = load_checkpoint(ckpt_path, f"--resume: no checkpoint at {ckpt_path}; train without "
                               "--resume first")
        check_checkpoint_settings(ckpt, ckpt_path)
    elif ckpt_path.exists():
        raise UsageError(f"{ckpt_path.parent} already holds a run ({ckpt_path}): add --resume to "
                         "continue it, or choose another --out_dir (or delete that folder)")
    a, model_settings, preset = resolve_settings(explicit, ckpt, ckpt_path)
    check_settings(a, world)
    check_micro_batch(a, world)
    if a.wandb_project and master:
        import_wandb()  # now: a missing package costs no training
    if preset and master:
        values = [f"{k}={v}" + (f" (overridden: {explicit[k]})" if k in explicit else "")
                  for k, v in preset.items()]
        print(f"preset {a.preset}: " + " ".join(values))
    return a, model_settings, ckpt


def start_processes(device_name):
    """(rank, world, device). torchrun sets RANK, WORLD_SIZE and LOCAL_RANK: one process per GPU."""
    ddp = "RANK" in os.environ
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) if ddp else (0, 1, 0)
    device = pick_device(device_name, local_rank, world)
    if device.type == "cuda":  # also for one process on cuda:1: pinned memory and NCCL follow it
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


# -----------------------------------------------------------------------------
# Data: random crops at offsets that depend only on (seed, step, micro-step)


def open_dataset(data_dir, master=True, new_run=True):
    """meta.json of data_dir. For a new run the demo dataset is prepared on the spot if missing
    (only the demo: every other dataset is a download, and load_meta names the command that
    fetches it). --resume never prepares: it continues on the data the run was trained on."""
    if new_run and Path(data_dir).name == "demo" and not (Path(data_dir) / "meta.json").exists() and master:
        print(f"preparing the demo dataset in {data_dir}")
        try:  # prepare() refuses a folder that holds files it did not make
            prepare_data.prepare("demo", data_dir)
        except UsageError as e:
            raise UsageError(f"--data {data_dir}: {e}") from None
    if dist.is_initialized():
        dist.barrier()  # the other processes wait for rank 0 to prepare it
    meta = prepare_data.load_meta(data_dir)
    prepare_data.check_tokens(data_dir, meta, meta["splits"])  # ids < vocab_size; cached after the first run
    return meta


def find_data(recorded, run_dir, fix, dataset=None, root=None):
    """The data folder a run was trained on, found from any working folder. recorded: the run's
    --data as given, relative to the folder train.py ran in. Tried as it is, then (when relative)
    under the run folder and each folder above it, one of which train.py usually ran in; with
    root, only root/NAME. The folder must hold a prepared dataset named `dataset` (when known).
    Returns it (relative when recorded was); UsageError naming `fix` when there is none."""
    path, run_dir = Path(recorded), Path(run_dir)
    if root is not None:
        tried = [Path(root) / path.name]
    elif path.is_absolute():
        tried = [path]
    else:
        here = run_dir.resolve()
        tried = [path] + [folder / path for folder in (here, *here.parents)]
    for folder in tried:
        if _holds_dataset(folder, dataset):
            return str(recorded) if folder == path else os.path.relpath(folder)
    what = f"no prepared {dataset} dataset" if dataset else "no prepared dataset"
    where = f"at {tried[0]}"
    if len(tried) > 1:
        where = f"at {recorded}, from here or from {run_dir} or a folder above it"
    raise UsageError(f"the data folder of the run in {run_dir}: {what} {where}; {fix}")


def _holds_dataset(folder, dataset):
    """Whether folder has a meta.json of that dataset (of any, for None). A damaged one counts:
    load_meta then says what is wrong with it."""
    if not (folder / "meta.json").is_file():
        return False
    try:
        return dataset in (None, json.loads((folder / "meta.json").read_text())["dataset"])
    except (OSError, ValueError, KeyError, TypeError):
        return True


def dataset_identity(meta):
    """What tells datasets apart, recorded in each checkpoint: the name, the level and the
    vocabulary (its characters at char level; every gpt2 dataset has GPT-2's tokens)."""
    identity = {k: meta[k] for k in ("dataset", "level", "vocab_size")}
    if meta["level"] == "char":
        identity["chars"] = meta["chars"]
    return identity


def check_same_dataset(ckpt, path, meta, data_dir, fix, master=True):
    """UsageError unless meta.json (of data_dir) is the dataset the checkpoint was trained on
    (--resume, sample.py); `fix` ends the message. A checkpoint of an older train.py, which did
    not record the characters, is compared on what it has, with a note."""
    recorded, here = ckpt["meta"], dataset_identity(meta)
    vocab_size = recorded.get("vocab_size", ckpt["config"]["vocab_size"])
    if vocab_size != here["vocab_size"]:
        raise UsageError(f"dataset {data_dir} has vocab_size {here['vocab_size']} but {path} was "
                         f"trained with {vocab_size}: {fix}")
    for key in ("dataset", "level", "chars"):
        if key in recorded and key in here and recorded[key] != here[key]:
            raise UsageError(f"dataset {data_dir} is not the one {path} was trained on: "
                             f"{_difference(key, here[key], recorded[key])}; {fix}")
    missing = [key for key in here if key not in recorded]
    if missing and master:
        print(f"note: {path} does not record the dataset's {', '.join(missing)} (an older train.py "
              "wrote it): compared on the rest")


def _difference(key, here, recorded):
    if key != "chars":
        return f"its {key} is {here}, the checkpoint's {recorded}"
    i = next(i for i, (x, y) in enumerate(zip(here, recorded)) if x != y)  # as many of each
    return f"other characters, as many (id {i} is {here[i]!r} here, {recorded[i]!r} there)"
def check_micro_batch(a, world):
    """--micro_batch must cut each process's share of a micro-step into equal chunks: one shape for
    every forward (torch.compile builds one graph), and the same weight for every chunk."""
    share = a.batch_size // world
    if a.micro_batch < 0:
        raise UsageError(f"--micro_batch {a.micro_batch}: must be 0 (all of a process's share) "
                         "or positive")
    if 0 < a.micro_batch < share and share % a.micro_batch:
        divisors = ", ".join(str(n) for n in range(1, share) if share % n == 0)
        raise UsageError(f"--micro_batch {a.micro_batch} does not divide the {share} sequences "
                         f"each process runs per micro-step (--batch_size {a.batch_size} over "
                         f"{world} process(es)): choose one of {divisors} or 0")


def chunks(rows, micro_batch):
    """rows cut into consecutive chunks of micro_batch (0: one chunk)."""
    size = micro_batch or len(rows)
    return [rows[i:i + size] for i in range(0, len(rows), size)]


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


def check_fits(a, T, train_data, val_data):
    """A crop (and a batch of them) must fit in the splits."""
    for split, data in (("train", train_data), ("val", val_data)):
        if len(data) < T + 2:
            raise UsageError(f"--sequence_len {T} is longer than the {split} split of {a.data} "
                             f"({len(data)} tokens): lower --sequence_len")
    if a.batch_size * T > len(train_data):
        raise UsageError(f"a batch of --batch_size {a.batch_size} x sequence_len {T} = "
                         f"{a.batch_size * T} tokens is larger than the training data "
                         f"({len(train_data)} tokens): lower --batch_size")


def open_data(a, ckpt, given, master):
    """The dataset's meta.json and its train and val splits. With --resume and no --data, the data
    folder the checkpoint names is found from any working folder (find_data)."""
    ckpt_path = Path(a.out_dir) / "last.pt"
    if ckpt is not None and not given:
        fix = "give --data DIR, the dataset it was trained on"
        found = find_data(a.data, ckpt_path.parent, fix, ckpt["meta"].get("dataset"))
        if found != a.data and master:
            print(f"note: the data folder {a.data} of {ckpt_path} is not here; found it at {found}")
        a.data = found
    meta = open_dataset(a.data, master, new_run=ckpt is None)
    if ckpt is not None:
        check_same_dataset(ckpt, ckpt_path, meta, a.data, "resume with the --data it was trained on",
                           master)
    splits = (prepare_data.open_split(a.data, split, meta) for split in ("train", "val"))
    return meta, *splits


# -----------------------------------------------------------------------------
# Model and schedule


def build_model(a, config, device):
    """The GPT and its AdamW. torch.manual_seed right before GPT() gives paired runs (the same seed,
    another routing) identical shared weights."""
    torch.manual_seed(a.seed)
    model = GPT(config).to(device)
    return model, model.configure_optimizers(a.weight_decay, a.lr, (a.beta1, a.beta2), device.type)


def get_lr(step, a, max_iters):
    """Linear warmup over warmup_iters steps, then cosine decay to min_lr at the last step."""
    min_lr = a.lr / 10 if a.min_lr is None else a.min_lr
    if step < a.warmup_iters:
        return a.lr * (step + 1) / a.warmup_iters
    progress = min(1.0, (step - a.warmup_iters) / max(1, max_iters - 1 - a.warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (a.lr - min_lr)


# -----------------------------------------------------------------------------
# The run: setup, the loop, evaluation, the end


def main(argv=None):
    with run_safely() as cleanup:  # below the banner: one line for bad input, a full disk, Ctrl-C
        with out_of_memory_is_usage_error():  # and for a GPU out of memory: the flags to lower
            train(setup(argv, cleanup))


@dataclasses.dataclass
class Run:
    """What the loop shares with its parts: set up once, but for the progress at the end, which is
    what a checkpoint records. __post_init__ adds the precision context (ctx), ddp, the fixed
    evaluation crops of each split and the milestones as (label, tokens)."""
    settings: TrainSettings
    config: GPTConfig
    meta: dict  # the dataset's meta.json
    train_data: np.ndarray
    val_data: np.ndarray
    tokens_per_step: int
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    device: torch.device
    dtype: torch.dtype
    rank: int
    world: int
    out_dir: Path
    model: torch.nn.Module = None  # what the loop calls: raw_model, compiled or in DDP as asked
    stop_signals: list = None  # the signals received (catch_stop_signals)
    wandb: object = None  # the wandb run, with --wandb_project
    resumed: bool = False
    # the progress
    step: int = 0
    tokens: int = 0
    best_val: float = math.inf
    last_eval: dict = None  # the last eval line of metrics.jsonl
    reached: dict = dataclasses.field(default_factory=dict)  # {milestone: step, tokens, val_loss}
    wall_before: float = 0.0  # seconds spent before --resume
    t_start: float = 0.0  # time.time() when the loop started

    def __post_init__(self):
        a, T = self.settings, self.config.sequence_len
        bf16 = self.dtype == torch.bfloat16
        self.ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        self.ddp = dist.is_initialized()
        self.train_batches = eval_offsets(len(self.train_data), T, a.batch_size, a.eval_tokens, 0)
        self.val_batches = eval_offsets(len(self.val_data), T, a.batch_size, a.eval_tokens, 1)
        labels = a.milestones.split(",") if a.milestones else []
        self.milestones = [(label.strip(), count(label)) for label in labels]

    @property
    def master(self):
        return self.rank == 0

    def log(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs)

    def elapsed(self):
        return self.wall_before + time.time() - self.t_start


def setup(argv, cleanup):
    """Everything before the first step: settings, processes, data, model and optimizer, the
    out_dir lock, --resume; the Run. cleanup (an ExitStack) releases the lock and the signals."""
    # a lone "--" is dropped: `torchrun train.py -- --rd off` keeps torchrun from reading --rd as
    # one of its --rdzv_* flags
    argv = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg != "--"]
    explicit = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    rank, world, device = start_processes(explicit.get("device", "auto"))
    a, model_settings, ckpt = read_settings(explicit, world, master=rank == 0)
    meta, train_data, val_data = open_data(a, ckpt, "data" in explicit, master=rank == 0)
    config = model_config(model_settings, meta["vocab_size"], a.data)
    check_fits(a, config.sequence_len, train_data, val_data)
    tokens_per_step = complete_settings(a, config, device)

    # the model, its optimizer and precision; then --out_dir becomes this run's, --resume restores
    dtype = pick_dtype(a.dtype, device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    raw_model, optimizer = build_model(a, config, device)
    if rank == 0:  # before anything is written there
        prepare_data.writable_folder(Path(a.out_dir), "--out_dir")
        lock_out_dir(Path(a.out_dir), cleanup)
    run = Run(a, config, meta, train_data, val_data, tokens_per_step, raw_model, optimizer, device,
              dtype, rank, world, Path(a.out_dir))
    if ckpt is None:
        start_fresh(run)
    else:
        resume(run, ckpt)
    run.model = torch.compile(raw_model) if a.compile else raw_model
    if run.ddp:
        run.model = DDP(run.model, device_ids=[device.index] if device.type == "cuda" else None)
    print_header(run)
    for line in gpu_notes(run):  # CUDA: the estimated peak memory, MFU's peak, a slow dtype
        run.log(line)
    run.t_start, run.wandb = time.time(), start_wandb(run)
    run.stop_signals = catch_stop_signals(cleanup)
    return run


def train(run):
    """The loop: optimizer steps, a log line every --log_interval steps, an evaluation with its
    checkpoints every --eval_interval steps and at each milestone, then the end (finish). It stops
    early, with last.pt saved, after --stop_after or on Ctrl-C / SIGTERM."""
    a = run.settings
    if not run.resumed:  # a checkpoint, even of step 0, comes after its evaluation
        evaluate_and_save(run, get_lr(0, a, a.max_iters))
    first = run.step + 1  # this invocation's first step compiles (--compile) and warms up: no rate
    train_time, steps_since_log = 0.0, 0  # time in training steps since the last log line (no evals)
    while run.step < a.max_iters:
        t0 = time.time()
        lr = get_lr(run.step, a, a.max_iters)
        loss = train_step(run, lr)
        run.step, run.tokens = run.step + 1, run.tokens + run.tokens_per_step
        step_time = time.time() - t0  # train_step's loss.item() waited for the GPU
        if run.step > first:
            train_time, steps_since_log = train_time + step_time, steps_since_log + 1

        if run.step % a.log_interval == 0 or run.step == 1:
            dt = train_time / steps_since_log if steps_since_log else None  # None: first alone
            log_step(run, loss, lr, dt, step_time)
            train_time, steps_since_log = 0.0, 0
        before, now = run.tokens - run.tokens_per_step, run.tokens
        crossed = [label for label, n in run.milestones if before < n <= now]
        if run.step % a.eval_interval == 0 or run.step == a.max_iters or crossed:
            evaluate_and_save(run, lr, crossed)
        if a.stop_after is not None and a.stop_after <= run.step < a.max_iters:
            save_unless_saved(run)
            run.log(f"stopped after step {run.step} (--stop_after); continue with: "
                    f"{resume_command(run)}")
            if run.wandb:
                run.wandb.finish()
            return
        if stop_requested(run.stop_signals, run.ddp, run.device):
            save_unless_saved(run)
            raise interrupted(run)
    finish(run)


def train_step(run, lr):
    """One optimizer step on the crops of (seed, step): --grad_accum micro-steps, the gradient of
    their mean loss (all-reduced over the processes), clipped, AdamW. Returns that mean loss."""
    a, model = run.settings, run.model
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss = torch.zeros((), device=run.device)
    for x, y, weight, last in micro_batches(run):
        # DDP: all-reduce the gradients only on the last backward of the step
        sync = model.no_sync() if run.ddp and not last else nullcontext()
        with sync:
            with run.ctx:
                chunk_loss = model(x, y)[1]  # [1]: the logits are freed before the backward
            (chunk_loss * weight).backward()
        loss += chunk_loss.detach().float() * weight
    if run.ddp:
        dist.all_reduce(loss)
        loss /= run.world
    loss = loss.item()
    if not math.isfinite(loss):  # before the update, and no checkpoint is written after this
        raise diverged(run, "loss", run.step + 1)
    if a.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), a.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss


def micro_batches(run):
    """This process's batches of the step, as (x, y, weight, last): --grad_accum micro-steps, rows
    r::W of each (process r of W), cut into chunks of --micro_batch sequences (chunks). weight: the
    chunk's share of the step's mean loss; last: the step's last chunk."""
    a, T = run.settings, run.config.sequence_len
    for micro in range(a.grad_accum):
        rows = batch_offsets(a.seed, run.step, micro, len(run.train_data), T, a.batch_size)
        mine = rows[run.rank::run.world]
        parts = chunks(mine, a.micro_batch)
        for i, part in enumerate(parts):
            x, y = get_batch(run.train_data, part, T, run.device)
            last = micro == a.grad_accum - 1 and i == len(parts) - 1
            yield x, y, len(part) / len(mine) / a.grad_accum, last


def log_step(run, loss, lr, dt, step_time):
    """A train line (stdout, metrics.jsonl, wandb). dt: seconds per step since the last line, but
    this invocation's first step; None when that first step is all there is (its time, step_time,
    counts compiling and warming up, so it gets no tokens/s and no MFU)."""
    n = run.tokens_per_step
    peak = peak_flops(torch.cuda.get_device_name(run.device), run.dtype) \
        if run.device.type == "cuda" else None
    mfu = run.raw_model.estimate_mfu(n / run.world, dt, peak) if peak and dt else None
    tok_per_s = round(n / dt, 1) if dt else None
    if run.master:
        ms = round(1000 * (dt or step_time), 2)
        record(run, dict(type="train", step=run.step, tokens=run.tokens, loss=loss, lr=lr,
                         tok_per_s=tok_per_s, ms_per_step=ms, mfu=mfu))
    why = "compiling and warm-up" if run.settings.compile else "warm-up"
    rate = f"{n / dt / 1e3:.1f}k tok/s | {1000 * dt:.1f} ms/step" if dt else \
        f"first step {1000 * step_time:.1f} ms ({why}: not in tok/s)"
    run.log(f"step {run.step} | loss {loss:.4f} | lr {lr:.1e} | {rate}"
            + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""))


def evaluate_and_save(run, lr, crossed=()):
    """Train and val loss on the fixed evaluation crops, the routing diagnostics, an eval line, and
    the checkpoints: last.pt, and best.pt first when the val loss improved."""
    T, device, ctx, rank, world = run.config.sequence_len, run.device, run.ctx, run.rank, run.world
    where = (T, device, ctx, rank, world, run.settings.micro_batch)
    train_loss = evaluate(run.model, run.train_data, run.train_batches, *where)
    val_loss = evaluate(run.model, run.val_data, run.val_batches, *where)
    if not (math.isfinite(val_loss) and math.isfinite(train_loss)):
        raise diverged(run, "validation loss", run.step)
    routes = None
    if run.master:
        routes = routes_block(run.raw_model, run.val_data, run.val_batches[0], T, device, ctx)
    for label in crossed:
        run.reached[label] = dict(step=run.step, tokens=run.tokens, val_loss=val_loss)
    char_level = run.meta["level"] == "char"
    run.last_eval = dict(type="eval", step=run.step, tokens=run.tokens, train_loss=train_loss,
                         val_loss=val_loss, val_bpc=val_loss / math.log(2) if char_level else None,
                         lr=lr, elapsed_s=round(run.elapsed(), 3),
                         milestone=",".join(crossed) or None, routes=routes)
    if run.master:
        record(run, run.last_eval)
    run.log(f"eval step {run.step} | train {train_loss:.4f} | val {val_loss:.4f}"
            + (f" | bpc {run.last_eval['val_bpc']:.4f}" if char_level else "")
            + (f" | js_mean {routes['js_mean']:.4f}" if routes and routes["js_mean"] is not None else "")
            + (f" | milestone {run.last_eval['milestone']}" if crossed else ""))
    improved, run.best_val = val_loss < run.best_val, min(run.best_val, val_loss)
    save_checkpoint(run, improved)


@torch.no_grad()
def evaluate(model, data, batches, T, device, ctx, rank, world, micro_batch=0):
    """Mean loss over fixed crops; each process takes its rows of every batch, in forwards of
    --micro_batch sequences as in training."""
    model.eval()
    losses = []
    for offsets in batches:
        for part in chunks(offsets[rank::world], micro_batch):
            x, y = get_batch(data, part, T, device)
            with ctx:
                losses.append(model(x, y)[1].float())
    model.train()
    loss = torch.stack(losses).mean()  # equal chunks (check_micro_batch): the batches' mean
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


def finish(run):
    """The end: an evaluation unless the last step had one, the test loss (when the dataset has a
    test split), summary.json, then how the model routes and what to try next."""
    a, config, meta, T = run.settings, run.config, run.meta, run.config.sequence_len
    if run.last_eval is None or run.last_eval["step"] != run.step:
        evaluate_and_save(run, get_lr(run.step - 1, a, a.max_iters))
    test_loss = None
    if meta["splits"].get("test", 0) >= T + 2:
        test_data = prepare_data.open_split(a.data, "test", meta)
        test_batches = eval_offsets(len(test_data), T, a.batch_size, a.eval_tokens, 2)
        test_loss = evaluate(run.model, test_data, test_batches, T, run.device, run.ctx, run.rank,
                             run.world, a.micro_batch)
    bpc = (lambda v: v / math.log(2) if meta["level"] == "char" and v is not None else None)
    val_loss = run.last_eval["val_loss"]
    final = dict(val_loss=val_loss, val_bpc=bpc(val_loss), test_loss=test_loss,
                 test_bpc=bpc(test_loss))
    summary = dict(config=dataclasses.asdict(config), train=dataclasses.asdict(a), final=final,
                   best_val_loss=run.best_val, step=run.step, tokens_seen=run.tokens,
                   wall_time_s=round(run.elapsed(), 3), milestones=run.reached,
                   routes=run.last_eval["routes"], dataset=meta["dataset"], level=meta["level"])
    if run.master:
        save_atomic(summary, run.out_dir / "summary.json")
    run.log(f"done: {run.step} steps, {run.tokens:,} tokens, val {val_loss:.4f}"
            + (f", test {test_loss:.4f}" if test_loss is not None else "")
            + f", {summary['wall_time_s']:.0f} s; wrote {run.out_dir}/summary.json")
    if run.wandb:
        run.wandb.finish()
    if run.master:
        stats = batch_routing_stats(run.raw_model, run.val_data, run.val_batches[0], T, run.device,
                                    run.ctx)
        run.log("\n" + (routing_summary(stats) + "\n\n" if stats else "")
                + next_commands(a, config, stats is not None, run.device, run.world))


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


def next_commands(a, config, routed, device, world=1):
    """What to try after a run, as commands to paste: text from it, how it routes, and the baseline
    without routing that is paired with it."""
    at = [] if Path(a.out_dir) == Path(TrainSettings.out_dir) else ["--out_dir", a.out_dir]
    commands = [(command("sample.py", at), "text from best.pt")]
    if routed:
        commands += [(command("sample.py", [*at, "--routes"]),
                      "how each read routes over a val crop"),
                     (command("train.py", baseline_flags(a, config, device), world),
                      "the baseline without routing: same seed, same batches")]
    width = min(60, max(len(line) for line, _ in commands))
    return "\n".join(["next:"] + [f"  {line:<{width}}  # {why}" for line, why in commands])


def baseline_flags(a, config, device):
    """train.py's flags for the run without routing paired with this one: --residual prenorm and
    every setting of this run that train.py would not give it unasked (a preset's too), but the
    routing fields (routing_fields: a GPTConfig subclass's too), and its own --out_dir."""
    defaults = default_settings(type(config))
    defaults["eval_tokens"] = default_eval_tokens(config.vocab_size, device)  # what it gets unasked
    skip = {*routing_fields(type(config)), "vocab_size", "out_dir", "preset", "resume",
            "stop_after", "wandb_run"}
    if a.max_tokens:
        skip.add("max_iters")  # computed from --max_tokens
    flags = ["--residual", "prenorm"]
    for name, value in {**dataclasses.asdict(a), **dataclasses.asdict(config)}.items():
        if name not in skip and value != defaults[name]:
            flags += [f"--{name}", value]
    if a.wandb_run:
        flags += ["--wandb_run", f"{a.wandb_run}_prenorm"]
    return flags + ["--out_dir", f"{Path(a.out_dir)}_prenorm"]


def resume_command(run):
    """The command that continues this run: --resume takes the settings from last.pt, but not those
    that say how an invocation runs (runtime), so the ones given are repeated."""
    a, default = run.settings, TrainSettings()
    flags = ["--out_dir", a.out_dir, "--resume"]
    for f in dataclasses.fields(TrainSettings):
        value = getattr(a, f.name)
        if f.metadata["runtime"] and f.name not in ("out_dir", "preset", "resume", "stop_after") \
                and value != getattr(default, f.name):
            flags += [f"--{f.name}", value]
    return command("train.py", flags, run.world)


def command(script, flags, world=1):
    """A command line that works when pasted into a shell: each argument quoted where needed."""
    launcher = ["python", script]
    if world > 1:
        launcher = ["torchrun", f"--nproc_per_node={world}", script, "--"]
    return shlex.join([*launcher, *map(str, flags)])



def start_fresh(run):
    """A new run: each process draws its own dropout stream; no metrics.jsonl of an earlier try."""
    torch.manual_seed(run.settings.seed + run.rank)
    if run.master:
        (run.out_dir / "metrics.jsonl").unlink(missing_ok=True)


def print_header(run):
    """What this run is: the data, the model, the schedule, the processes and the precision."""
    a, config, meta, T = run.settings, run.config, run.meta, run.config.sequence_len
    run.log(f"data: {a.data} ({meta['dataset']}, {meta['level']} level, vocab {config.vocab_size}; "
            f"train {len(run.train_data):,} / val {len(run.val_data):,} tokens)")
    routing = f" (block {config.routing_block}, wav {config.wav}, rd {config.rd})"
    run.log(f"model: {config.n_layer} layers x {config.n_embd}, {config.n_head} heads, "
            f"sequence_len {T}, residual {config.residual}"
            + (routing if config.residual == "attnres" else "")
            + f"; {run.raw_model.get_num_params() / 1e6:.2f}M parameters")
    if block_note(config):
        run.log(block_note(config))
    min_lr = a.lr / 10 if a.min_lr is None else a.min_lr
    run.log(f"training: {a.max_iters} steps x {run.tokens_per_step:,} tokens (batch "
            f"{a.batch_size} x accum {a.grad_accum} x {T}) = "
            f"{a.max_iters * run.tokens_per_step / 1e6:.1f}M tokens; "
            f"lr {a.lr:g} warmup {a.warmup_iters} cosine to {min_lr:g}; {run.world} process(es) on "
            f"{run.device} ({threads_each()}), {str(run.dtype).removeprefix('torch.')}; evaluation: "
            f"{a.eval_tokens:,} tokens per split every {a.eval_interval} steps")
    if threads_note(run.device, run.world):
        run.log(threads_note(run.device, run.world))


def threads_each():
    threads = torch.get_num_threads()  # intra-op threads: OMP_NUM_THREADS, else one per core
    return f"{threads} thread{'s' * (threads != 1)} each"


def threads_note(device, world):
    """A note when this run's processes ask for more CPU threads than there are cores: each step then
    waits on threads that wait for a core (5-10x slower steps measured on a busy 2-core machine).
    experiments.py gives each run of --jobs N its share (OMP_NUM_THREADS); torchrun gives 1."""
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device.type != "cpu" or world * threads <= cores:
        return None
    return (f"note: {world} process(es) x {threads} threads share {cores} cores: set OMP_NUM_THREADS="
            f"{max(1, cores // world)} (threads that wait for a core slow every step)")


# =============================================================================
# Below this banner: keeping runs safe; nothing of training. How a run ends (one line and exit
# code 2 for bad input, a full disk, a failed compile or too little memory; 130 / 143 / 129 for
# Ctrl-C / SIGTERM / SIGHUP), checkpoints (atomic, weights_only, checked before loading), resume
# (RNG states, metrics.jsonl repair), files never written through a link, the out_dir lock, stop
# signals, wandb.
# =============================================================================


@contextmanager
def run_safely():
    """The frame of a run: yields an ExitStack that releases the out_dir lock and the signal
    handlers however the run ends, and turns each way it can fail into one line and an exit code."""
    try:
        with ExitStack() as cleanup:
            yield cleanup
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
        sys.exit(128 + e.signum)  # 130 SIGINT, 143 SIGTERM, 129 SIGHUP: what a shell reports for them
    except Exception as e:  # a compiler that fails, memory that runs out; anything else is a bug
        line = failure_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before training starts, or a second one while last.pt is saved
        print("error: interrupted; checkpoints saved before are whole (continue with --resume if last.pt exists)",
              file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            leave_worker(sys.exc_info()[1])


def leave_worker(exc):
    """A torchrun worker ends here, its process group destroyed: the atexit handlers run (wandb's
    among them), then the process exits with os._exit, skipping the interpreter's teardown. In that
    teardown a gloo thread can still release a tensor and abort the process ("terminate called
    without an active exception", SIGABRT), which torchrun reports as a failed run. exc: the
    exception on its way out; a SystemExit gives the exit code, a bug keeps its traceback."""
    if exc is not None and not isinstance(exc, SystemExit):
        return
    code = 0 if exc is None or exc.code is None else exc.code if isinstance(exc.code, int) else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or terminal: nothing left to show
            pass
    os._exit(code)


def failure_line(e):
    """The one line for an exception that is not a bug of train.py, else None: torch.compile failing
    (its compile workers are stopped, so none keeps the process alive) or memory running out."""
    dynamo = sys.modules.get("torch._dynamo.exc")  # imported by torch.compile: only it raises these
    if dynamo is not None and isinstance(e, dynamo.TorchDynamoException):
        stop_compile_workers()
        cause = getattr(e, "inner_exception", None) or e
        return (f"torch.compile failed ({first_line(f'{type(cause).__name__}: {cause}')}); run with "
                "--compile False (the same model, only slower)")
    if out_of_memory(e):
        return (f"out of memory ({first_line(str(e))}); lower --batch_size (raise --grad_accum to keep "
                "the tokens per step) or the model's size; checkpoints saved before are whole "
                "(--resume continues from last.pt)")
    return None


def out_of_memory(e):
    """torch's out-of-memory errors: CUDA's and MPS's OutOfMemoryError, the CPU allocator's
    RuntimeError, numpy's MemoryError."""
    text = str(e)
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or isinstance(e, RuntimeError) and (
        "not enough memory" in text or "can't allocate memory" in text or "out of memory" in text)


def first_line(text, width=160):
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


def stop_compile_workers():
    """Shut down inductor's pool of compile workers, if torch.compile started one."""
    compiler = sys.modules.get("torch._inductor.async_compile")
    if compiler is not None:
        with suppress(Exception):  # a best effort: the error line matters more
            compiler.shutdown_compile_workers()


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: training stopped at the end of a step, with last.pt saved."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.signum = signum


def interrupted(run):
    """The Interrupted to raise, after last.pt was saved; rank 0 says how to continue."""
    signum = run.stop_signals[0] if run.stop_signals else signal.SIGTERM  # DDP: another one got it
    message = (f"stopped by {signal.Signals(signum).name} after step {run.step}, "
               f"{run.out_dir / 'last.pt'} saved; continue with: {resume_command(run)}")
    return Interrupted(signum, message if run.master else "")


def diverged(run, what, at_step):
    path = run.out_dir / "last.pt"
    kept = f"last good checkpoint kept at {path}" if path.exists() else "no checkpoint was written"
    return UsageError(f"non-finite {what} at step {at_step}; {kept} (lower --lr or raise "
                      "--warmup_iters)")


CKPT_KEYS = ("model", "optimizer", "step", "tokens", "best_val_loss", "config", "train_args", "meta", "rng")


def save_checkpoint(run, improved):
    """last.pt, and best.pt first when improved: everything --resume needs. The step is the data
    position: batches are a function of (seed, step)."""
    if not all(p.isfinite().all() for p in run.raw_model.parameters()):
        raise diverged(run, "weights", run.step)
    meta = dataset_identity(run.meta)  # what --resume and sample.py compare with their --data
    state = dict(model=strip_prefixes(run.raw_model.state_dict()),
                 optimizer=run.optimizer.state_dict(), step=run.step, tokens=run.tokens,
                 best_val_loss=run.best_val, milestones=run.reached,
                 last_eval=run.last_eval, rng=rng_states(run.device, run.world),
                 wall_time_s=run.elapsed(), config=dataclasses.asdict(run.config),
                 train_args=dataclasses.asdict(run.settings), meta=meta)
    # best.pt first: last.pt then never counts a best that best.pt does not hold. A crash between
    # the two renames leaves best.pt a step ahead, and --resume takes the lower best_val_loss of
    # the two files, so summary.json's best_val_loss is always best.pt's.
    if run.master:
        last = run.out_dir / "last.pt"
        try:
            if improved:
                save_atomic(state, run.out_dir / "best.pt")
            save_atomic(state, last)
        except OSError as e:
            kept = f"the previous {last} is kept" if last.exists() else "no checkpoint was written"
            why = prepare_data.os_error_line(e, "--out_dir")
            raise UsageError(f"saving a checkpoint in {run.out_dir} failed: {why} "
                             f"({kept}; continue with --resume)") from None


def save_unless_saved(run):
    """last.pt of this step, before stopping early (an evaluation at this step has written it)."""
    if run.last_eval is None or run.last_eval["step"] != run.step:
        save_checkpoint(run, improved=False)


def save_atomic(obj, path):
    """A checkpoint (torch.save) or a JSON file, written with prepare_data.write_atomic: a crash, a full
    disk or Ctrl-C never leaves a half-written file under the real name, nor a .tmp."""
    if isinstance(obj, dict) and "model" in obj:
        prepare_data.write_atomic(path, lambda f: torch.save(obj, f))
    else:
        prepare_data.write_json(path, obj)


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


def _dataset_record(v):
    chars = v.get("chars", []) if isinstance(v, dict) else None
    return (isinstance(v, dict) and isinstance(v.get("dataset"), str) and isinstance(v.get("level"), str)
            and type(v.get("vocab_size")) is int and isinstance(chars, list)
            and all(isinstance(c, str) for c in chars) and len(chars) in (0, v["vocab_size"]))


def _rng_record(v):
    return isinstance(v, list) and v != [] and all(
        isinstance(s, dict) and isinstance(s.get("torch"), torch.Tensor) for s in v)


# what a checkpoint's records must be, beyond config and train_args (optional ones: when present)
_RECORDS = {
    "step": (lambda v: type(v) is int and v >= 0, "a step number"),
    "tokens": (lambda v: type(v) is int and v >= 0, "a token count"),
    "best_val_loss": (lambda v: type(v) in (int, float), "a number"),
    "meta": (_dataset_record, "the dataset's name, level, vocab_size (and characters)"),
    "rng": (_rng_record, "each process's RNG states"),
    "milestones": (lambda v: isinstance(v, dict), "a dict"),
    "last_eval": (lambda v: v is None or isinstance(v, dict) and type(v.get("step")) is int, "an eval line"),
    "wall_time_s": (lambda v: type(v) in (int, float), "seconds"),
}
CHECKPOINT_FIX = "use the version of nanoroute that wrote it, or retrain"


def check_checkpoint_settings(ckpt, path, config_class=GPTConfig):
    """UsageError naming what differs unless a checkpoint's records are what this train.py writes:
    a config of config_class's fields (vocab_size among them), training args and the other records
    of their types. Checked before anything is taken from it (--resume, sample.py)."""
    problem = _fields_problem(ckpt["config"], config_class, "config", unknown_ok=False)
    if problem is None and "vocab_size" not in ckpt["config"]:
        problem = "its config has no vocab_size"
    problem = problem or _fields_problem(ckpt["train_args"], TrainSettings, "train_args", unknown_ok=True)
    for key, (ok, what) in _RECORDS.items():
        if problem is None and (key in CKPT_KEYS or key in ckpt) and not ok(ckpt[key]):
            problem = f"its {key} is not {what} ({str(ckpt[key])[:40]})"
    if problem is None and ckpt["meta"]["vocab_size"] != ckpt["config"]["vocab_size"]:
        problem = "its meta and config disagree on vocab_size"
    if problem:
        raise UsageError(f"checkpoint {path} is not one this train.py writes: {problem}; {CHECKPOINT_FIX}")


def _fields_problem(values, cls, name, unknown_ok):
    """What is wrong with a checkpoint's dict of dataclass fields (None: nothing): not a dict, a
    field cls does not have (unless unknown_ok: a training arg an older version had), a value
    not of the field's type."""
    if not isinstance(values, dict):
        return f"its {name} is not a dict"
    hints = typing.get_type_hints(cls)
    unknown = [k for k in values if k not in hints]
    if unknown and not unknown_ok:
        return f"its {name} has fields this {cls.__name__} does not know: {', '.join(map(str, unknown))}"
    for key, value in values.items():
        kinds = (typing.get_args(hints[key]) or (hints[key],)) if key in hints else (type(value),)
        if not (type(value) in kinds or float in kinds and type(value) is int):
            kind = hints[key].__name__ if isinstance(hints[key], type) else hints[key]
            return f"its {name} {key}={value!r} is not of the type {kind}"
    return None


def check_checkpoint_layout(ckpt, path, model, optimizer=None):
    """UsageError naming what differs unless the checkpoint's tensors fit model (and optimizer): the
    same tensor names and shapes, as many parameter groups of as many parameters, optimizer states
    of the parameters' shapes. Before loading: never torch's long error or a half-loaded model."""
    want, have = model.state_dict(), ckpt["model"]
    if not (isinstance(have, dict) and all(isinstance(v, torch.Tensor) for v in have.values())):
        problem = "its model is not a dict of tensors"
    else:
        problem = _names_problem("its model lacks", [k for k in want if k not in have])
        problem = problem or _names_problem("its model has tensors this one has not:",
                                            [k for k in have if k not in want])
        problem = problem or _names_problem("its model has other shapes for", [
            k for k in want if have[k].shape != want[k].shape])
    if problem is None and optimizer is not None:
        problem = _optimizer_problem(ckpt["optimizer"], optimizer)
    if problem:
        raise UsageError(f"checkpoint {path} does not fit its own config's model: {problem}; {CHECKPOINT_FIX}")


def _names_problem(words, names):
    if not names:
        return None
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{words} {', '.join(names[:3])}{more}"


def _optimizer_problem(saved, optimizer):
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                             for g in groups) and isinstance(saved.get("state"), dict)):
        return "its optimizer is not an optimizer's state_dict"
    if len(groups) != len(optimizer.param_groups):
        return f"its optimizer has {len(groups)} parameter groups, this model's {len(optimizer.param_groups)}"
    params = []
    for i, (group, mine) in enumerate(zip(groups, optimizer.param_groups)):
        if len(group["params"]) != len(mine["params"]):
            return (f"its optimizer's group {i} has {len(group['params'])} parameters, this model's "
                    f"{len(mine['params'])}")
        params += [(saved_id, p) for saved_id, p in zip(group["params"], mine["params"])]
    shapes = dict(params)
    for key, state in saved["state"].items():
        tensors = state.values() if isinstance(state, dict) else [None]
        if key not in shapes or any(isinstance(t, torch.Tensor) and t.dim() and t.shape != shapes[key].shape
                                    for t in tensors):
            return f"its optimizer's state {key} fits none of this model's parameters"
    return None


def resume(run, ckpt):
    """--resume: the weights, the optimizer, the progress and each process's RNG state from last.pt,
    and metrics.jsonl cut back to its step."""
    check_checkpoint_layout(ckpt, run.out_dir / "last.pt", run.raw_model, run.optimizer)
    run.raw_model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.resumed, run.step, run.tokens = True, ckpt["step"], ckpt["tokens"]
    run.best_val = ckpt["best_val_loss"]
    if (run.out_dir / "best.pt").exists():  # a step ahead of last.pt after a crash between renames
        best = load_checkpoint(run.out_dir / "best.pt", "", ("best_val_loss",), mmap=True)
        run.best_val = min(run.best_val, best["best_val_loss"])
    run.wall_before, run.reached = ckpt.get("wall_time_s", 0.0), ckpt.get("milestones", {})
    run.last_eval = ckpt.get("last_eval")
    restore_rng(run, ckpt["rng"])
    metrics = run.out_dir / "metrics.jsonl"
    if run.master and (unreadable := keep_metrics_until(metrics, run.step)):
        run.log(f"note: dropped {unreadable} line(s) of {metrics} that do not parse (cut by an "
                "interruption, or damaged)")
    run.log(f"resuming {run.out_dir / 'last.pt'} at step {run.step} ({run.tokens:,} tokens)")


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


def restore_rng(run, states):
    """Each process's RNG state from rng_states; reseeded when the number of processes changed."""
    if len(states) == run.world:
        torch.set_rng_state(states[run.rank]["torch"])
        if "cuda" in states[run.rank] and run.device.type == "cuda":
            torch.cuda.set_rng_state(states[run.rank]["cuda"], run.device)
    else:
        run.log(f"note: {run.out_dir / 'last.pt'} was written by {len(states)} processes, not "
                f"{run.world}: dropout is reseeded (the data order is unaffected)")
        torch.manual_seed(run.settings.seed + 1000 * run.step + run.rank)


def strip_prefixes(state_dict):  # torch.compile adds _orig_mod., DDP adds module.
    return {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in state_dict.items()}


def keep_metrics_until(path, step):
    """On resume: drop the lines an interrupted run wrote after its checkpoint, and lines that do not
    parse (cut by a kill, or bytes damaged on disk: no reader can use them, so resuming recovers
    rather than stops); returns how many did not parse. The file is rewritten atomically: a kill
    during the rewrite leaves the old file whole."""
    kept, unreadable = [], 0
    if path.is_symlink():  # never read or written through
        raise UsageError(link_refused(path))
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            if json.loads(line.decode("utf-8"))["step"] <= step:
                kept.append(line + b"\n")
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            unreadable += bool(line.strip())
    if path.exists():
        prepare_data.write_atomic(path, lambda f: f.write(b"".join(kept)))
    return unreadable


def record(run, line):
    """One line of metrics.jsonl; the same numbers to wandb with --wandb_project."""
    with open_new_or_append(run.out_dir / "metrics.jsonl", append=True) as f:
        f.write(json.dumps(line) + "\n")
    if run.wandb:
        run.wandb.log(wandb_numbers(line), step=line["step"])


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 where the system has no symbolic links to refuse


def open_new_or_append(path, append=False):
    """path opened for writing text: a new file (O_EXCL), or with append=True created or appended
    to. O_NOFOLLOW: a symbolic link planted at path is refused, never written through (whole files
    go through prepare_data.write_atomic, which replaces such a link instead)."""
    flags = os.O_WRONLY | os.O_CREAT | NOFOLLOW | (os.O_APPEND if append else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError:
        if Path(path).is_symlink():
            raise UsageError(link_refused(path)) from None
        raise
    return os.fdopen(fd, "a" if append else "w", encoding="utf-8")


def link_refused(path):
    return (f"{path} is a symbolic link: train.py never writes through one (it could point anywhere); "
            "remove it and re-run")


def remove_leftover_temp_files(out_dir):
    """The temporary files that a save cut short by kill -9 leaves (write_atomic's tmpXXXXXXXX.NAME.tmp,
    checkpoint-sized ones pile up over repeated kills): removed while this run holds the lock, so
    no save is under way. Only plain files of exactly that name for the files train.py writes."""
    names = "|".join(re.escape(name) for name in ("last.pt", "best.pt", "summary.json", "metrics.jsonl"))
    pattern = re.compile(rf"tmp[0-9a-f]{{8}}\.({names})\.tmp")
    leftovers = [p for p in out_dir.iterdir() if pattern.fullmatch(p.name) and not p.is_symlink() and p.is_file()]
    for leftover in leftovers:
        leftover.unlink()
    if leftovers:
        print(f"note: removed {len(leftovers)} temporary file(s) of saves cut short in {out_dir} "
              f"({', '.join(sorted(p.name for p in leftovers)[:3])})")


def import_wandb():
    """wandb, for --wandb_project; checked before any training, so a missing package costs nothing."""
    try:
        import wandb
    except ImportError:
        raise UsageError("--wandb_project needs the wandb package: pip install wandb (or drop the flag)") from None
    return wandb


def start_wandb(run):
    """The wandb run of --wandb_project (on rank 0), its config every setting; else None."""
    a = run.settings
    if not (a.wandb_project and run.master):
        return None
    if (run.out_dir / "wandb").is_symlink():  # wandb would write its files wherever it points
        raise UsageError(link_refused(run.out_dir / "wandb"))
    return import_wandb().init(project=a.wandb_project, name=a.wandb_run, dir=run.out_dir,
                               config=dict(dataclasses.asdict(a), **dataclasses.asdict(run.config)))


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


def lock_out_dir(out_dir, cleanup):
    """One run per --out_dir: OUT_DIR/train.lock holds the pid of the train.py writing there, and goes
    when it ends (cleanup). A lock left by a process that no longer runs (kill -9) is taken over.
    Every lock file is created new (O_EXCL | O_NOFOLLOW) and read without following a link. Then,
    under the lock, the temporary files of saves cut short are removed."""
    path, mine = out_dir / "train.lock", out_dir / f"train.lock.{os.getpid()}"
    try:
        with open_new_or_append(mine) as f:
            f.write(f"{os.getpid()}\n")
    except FileExistsError:
        raise UsageError(f"{mine} is in the way of this run's lock (left by a killed train.py of the same "
                         f"pid?): delete it if no train.py writes to {out_dir}, and re-run") from None
    try:
        for attempt in range(2):
            try:
                os.link(mine, path)  # atomic: the lock appears with the pid already in it
                break
            except FileExistsError:
                pid = lock_pid(path)
                if pid is None:
                    raise UsageError(f"{path} is not a lock train.py wrote (a link, or no pid in it): "
                                     f"delete it if no train.py writes to {out_dir}, and re-run") from None
                if attempt or process_alive(pid):
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
    remove_leftover_temp_files(out_dir)


def lock_pid(path):
    """The pid in a lock file; None when there is none (a link is not followed: None too)."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | NOFOLLOW)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def remove_dead_lock(path, pid):
    """Remove the lock of dead process pid. Two runs may find it at once, and the first may already have
    made its own lock there: only the run that creates PATH.takeover (O_EXCL) may remove the lock, and
    only while it still names pid. The other run's next link then fails as "in use"."""
    claim = path.with_name(path.name + ".takeover")
    try:
        open_new_or_append(claim).close()
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


def stop_requested(received, ddp, device):
    """Whether to stop now; under DDP all processes stop at the same step if any got a signal."""
    if not ddp:
        return bool(received)
    flag = torch.tensor(float(bool(received)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


# SIGHUP: the terminal closed (a run started without nohup); not on Windows
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def catch_stop_signals(cleanup):
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP only set a flag (the returned list), which the training loop
    reads at the end of each step; a second signal a second or more later interrupts at once (sooner,
    it is the same Ctrl-C, which torchrun forwards to processes that got it from the terminal already).
    A signal ignored when train.py started stays ignored, as Python does for SIGINT: nohup ignores
    SIGHUP so that a run outlives its terminal, and `cmd &` in a script ignores SIGINT so that Ctrl-C
    reaches only the foreground job. SIGTERM (kill PID) stops such a run. The old handlers return at
    cleanup."""
    received, first = [], []

    def handler(signum, frame):
        if received and time.monotonic() - first[0] >= 1:
            raise KeyboardInterrupt
        received.append(signum)
        first[:] = first or [time.monotonic()]
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                cleanup.callback(signal.signal, sig, signal.signal(sig, handler))
    for name in ("stdout", "stderr"):  # a closed terminal (SIGHUP) must not stop the run before it saves
        stream = getattr(sys, name)
        if stream.isatty():
            setattr(sys, name, Terminal(stream))
            cleanup.callback(setattr, sys, name, stream)
    return received


class Terminal:
    """sys.stdout or sys.stderr when it is a terminal. Once the terminal is closed every write to it
    fails (EIO), also in the moment before SIGHUP arrives: the stream's file descriptor then points
    to /dev/null, so the lines meant for the terminal are dropped and the run stops at the end of
    its step, saving last.pt, as on SIGTERM."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            self.drop_from_now_on()
            return self.stream.write(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.drop_from_now_on()
            self.stream.flush()

    def drop_from_now_on(self):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self.stream.fileno())  # what the stream still holds is flushed there
        os.close(null)

    def __getattr__(self, name):
        return getattr(self.stream, name)



# -----------------------------------------------------------------------------
# Memory and speed on a GPU: the estimated peak memory printed at start, out of memory as one
# line, the peak FLOP/s that MFU divides by

GIB = 2 ** 30
FIT_SHARE = 0.9  # of a GPU's memory; the rest: the CUDA context, the allocator's fragmentation


def estimate_memory(config, tokens_per_forward, dtype, world=1):
    """Bytes of one process's training step at its peak, the start of the backward, in eager
    mode: {"parameters", "gradients", "optimizer" (AdamW's two moments), "ddp" (DDP's gradient
    buckets, with several processes), "activations" (what the forward saves for backward, and
    autocast's bf16 copies of the weights), "logits" (the gradients of the float32 log-probabilities
    and logits, alive at the start of the backward), "total"}. Checked against bench.py's exact
    count of the saved tensors on CPU (test_memory_estimate_matches_the_saved_tensor_count);
    torch.compile usually needs less (inductor recomputes cheap pointwise results)."""
    matrices, other = _param_counts(config)
    n = matrices + other
    casts = 2 * matrices if dtype == torch.bfloat16 else 0  # autocast's copies, once per forward
    activations = casts + activation_bytes_per_token(config, dtype) * tokens_per_forward
    parts = dict(parameters=4 * n, gradients=4 * n, optimizer=8 * n, ddp=4 * n if world > 1 else 0,
                 activations=activations, logits=8 * config.vocab_size * tokens_per_forward)
    return dict(parts, total=sum(parts.values()))


def _param_counts(config):
    """(matrix parameters, the rest): GPT's Linear and Embedding weights (tied: the embedding
    once); biases, gains and the routing's parameters (a query, detail biases per read, at most)."""
    d, L = config.n_embd, config.n_layer
    matrices = L * 12 * d * d + config.vocab_size * d
    other = L * 13 * d if config.bias else 0
    if config.residual == "rezero":
        other += 2 * L
    elif config.residual == "layerscale":
        other += 2 * L * d
    elif config.residual == "attnres":
        other += (3 * L + 1) * (d + 2)
    return matrices, other


def activation_bytes_per_token(config, dtype):
    """Bytes per token that one eager forward saves for backward, tensor by tensor (d = n_embd;
    e = 2 under bf16 autocast, else 4; the residual stream and the routing are float32)."""
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    e = 2 if dtype == torch.bfloat16 else 4
    # attention: its input's norm (bf16 copy), q|k|v (v's view keeps all three), q and k after
    # rotary, the output, made contiguous for c_proj; MLP: the input's norm, c_fc's output, GELU's
    attention, mlp = 8 * e * d + 4 * config.n_head, 9 * e * d
    if config.residual == "rezero" and e == 4:  # no norm: the linears save the stream itself
        attention, mlp = attention - e * d, mlp - e * d
    if config.residual in ("rezero", "layerscale"):  # gain * u saves u
        attention, mlp = attention + e * d, mlp + e * d
    head = e * d + 4 * V + 16  # the final norm's copy, the log-probabilities, inputs and targets
    if config.residual == "attnres":
        return L * (attention + mlp) + _routing_bytes_per_token(config, e) + head
    # each sublayer's float32 input and the last (their norms save them; ReZero under autocast
    # saves only the bf16 copies, counted above, and the last)
    inputs = 1 if config.residual == "rezero" and e == 2 else 2 * L + 1
    return L * (attention + mlp) + 4 * d * inputs + head


def _routing_bytes_per_token(config, e):
    """What Block AttnRes, WAV and RD save per token, in float32 but for the copies under autocast:
    every read's output, the block's pieces, each completed block's sources, the embedding, and per
    read and source a few numbers (logits, norms, weights)."""
    d, m, n_sub = config.n_embd, config.routing_block, 2 * config.n_layer
    sources = 1 + len(config.detail_bases)  # of a block: the state and its details
    two_routes = config.rd in ("decoupled", "average", "frozen_v")

    def reads(sublayer):  # the reads before a sublayer: two for RD's attention
        return 2 if two_routes and sublayer % 2 == 0 else 1
    n_reads = sum(reads(s) for s in range(n_sub)) + 1  # and the readout
    total = 4 * d * (n_reads + 1)  # each read's output (its norm and PartialMerge share it); e
    if two_routes:  # the value input's norm (a bf16 copy); then v alone, not q|k|v (two less)
        total -= config.n_layer * e * d
    if config.rd == "average":  # ½(h + h_v), kept where both reads are PartialMerge's
        total += 4 * d * sum(1 for s in range(0, n_sub, 2) if s % m)
    # a block's piece is made anew by each update, and kept when a later read of the block sees it
    # (all but the last update of a completed block; with learned bases the last too: its
    # coefficient's gradient needs it); each completed block's sources
    completed = n_sub // m
    kept = n_sub if config.wav_learned_bases else n_sub - completed
    total += 4 * d * (kept + sources * completed)
    starts = range(0, n_sub, m)
    for b, start in enumerate(starts):  # per read and source: logits, norms, weights
        S = 1 + sources * b
        R = sum(reads(s) for s in range(start, min(start + m, n_sub))) + (b == len(starts) - 1)
        total += 4 * (S * (R + 3) + R * (4 * sources + 3))
    if not config.fast_routing:  # the reference read: each read stacks its sources and their norms
        for s in range(n_sub):
            seen = 1 + sources * (s // m) + (sources if s % m else 0)
            total += 2 * 4 * d * seen * reads(s)
        total += 2 * 4 * d * (1 + completed + (n_sub % m > 0))  # the readout's: states only
    return total


def gpu_notes(run):
    """The lines after the header on CUDA: the estimated peak memory (memory_line), and notes when
    MFU is left out (no known peak for this GPU and precision) or bf16 is emulated here."""
    if run.device.type != "cuda":
        return []
    name, dtype = torch.cuda.get_device_name(run.device), str(run.dtype).removeprefix("torch.")
    notes = [memory_line(run.config, run.settings, run.world, run.device, run.dtype)]
    if peak_flops(name, run.dtype) is None:
        notes.append(f"note: MFU left out: no peak FLOP/s known for {name} in {dtype} "
                     "(train.PEAK_FLOPS)")
    native = bf16_native(torch.cuda.get_device_capability(run.device))
    if run.dtype == torch.bfloat16 and not native:
        notes.append(f"note: {name} has no native bf16 (compute capability below 8.0): it is "
                     "emulated, slower than --dtype float32")
    return notes


def memory_line(config, a, world, device, dtype):
    """The estimated peak memory per GPU next to the GPU's own, and a warning (with a
    --micro_batch that fits) when the estimate exceeds FIT_SHARE of it."""
    share, rows = a.batch_size // world, rows_per_forward(a.batch_size, a.micro_batch, world)
    usable = FIT_SHARE * torch.cuda.get_device_properties(device).total_memory

    def peak(rows):
        return estimate_memory(config, rows * config.sequence_len, dtype, world)
    est = peak(rows)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in est.items() if k != "total" and v)
    line = (f"memory: estimated peak {est['total'] / GIB:.1f} GiB per GPU ({parts}; forwards of "
            f"{rows} x {config.sequence_len} tokens) of {usable / FIT_SHARE / GIB:.1f} GiB on "
            f"{torch.cuda.get_device_name(device)}")
    if est["total"] <= usable:
        return line
    fits = [r for r in range(1, share + 1) if share % r == 0 and peak(r)["total"] <= usable]
    fix = f"--micro_batch {fits[-1]}" if fits else "a smaller model, --sequence_len or more GPUs"
    return (line + f"\nwarning: that is more than {FIT_SHARE:.0%} of this GPU's memory: the run "
            f"may stop out of memory; try {fix} (the same batches, in smaller forwards)")


def rows_per_forward(batch_size, micro_batch, world):
    """The sequences one process runs per forward: its share of a micro-step (--batch_size over
    the processes), or --micro_batch of them when that is smaller (0: the whole share)."""
    share = batch_size // world
    return min(micro_batch or share, share)


@contextmanager
def out_of_memory_is_usage_error():
    """A GPU out of memory is one line naming the flags to lower (run_safely: exit code 2); the
    checkpoints written before are kept."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        asked = re.search(r"Tried (to allocate [\d.]+ \w+)", str(e))
        raise UsageError(f"out of GPU memory{f' (tried {asked[1]})' if asked else ''}: lower "
                         "--micro_batch (sequences per forward; the batches stay the same), or "
                         "--batch_size or --sequence_len; checkpoints written before are kept "
                         "(continue with --resume if last.pt exists)") from None


# Dense peak FLOP/s per GPU and precision, from NVIDIA's data sheets (the figures "with sparsity"
# halved). A100 (A100 Tensor Core GPU data sheet): bf16 312T, TF32 156T. H100 SXM / PCIe / NVL
# (H100 Tensor Core GPU data sheet): bf16 989T / 756T / 835T, TF32 494T / 378T / 418T. H200 SXM /
# NVL (H200 Tensor Core GPU data sheet): as H100 SXM / NVL. L4 (L4 Tensor Core GPU data sheet):
# bf16 121T, TF32 60T. GeForce RTX 4090 (NVIDIA Ada GPU architecture white paper, appendix A, bf16
# with float32 accumulation): 165T, TF32 83T. float32 means TF32: train.py turns TF32 on. The
# patterns are tried in order on torch.cuda.get_device_name(); whole names only, so that an RTX
# A1000, an L40S, an RTX 4090 D or a laptop's RTX 4090 (other, lower peaks) count as unknown.
PEAK_FLOPS = [
    (r"\bH100\b.*PCIe", 756e12, 378e12),
    (r"\bH[12]00\b.*NVL", 835e12, 418e12),
    (r"\bH[12]00\b", 989e12, 494e12),
    (r"\bA100\b", 312e12, 156e12),
    (r"\bL4\b", 121e12, 60e12),
    (r"RTX 4090$", 165e12, 83e12),
]


def peak_flops(device_name, dtype):
    """The dense peak FLOP/s of this GPU in this precision (PEAK_FLOPS), or None when unknown."""
    for pattern, bf16, tf32 in PEAK_FLOPS:
        if re.search(pattern, device_name):
            return {torch.bfloat16: bf16, torch.float32: tf32}.get(dtype)
    return None

if __name__ == "__main__":
    main()
