"""
What keeps a train.py run safe, and nothing of training (as nanochat's checkpoint_manager.py is to
its training script): a new run never writes over a run (check_out_dir), but for what a kill in its
first save left, and deletes only a kill's temporary files; files are written whole
(common.write_atomic); a checkpoint is read with weights_only=True after its zip CRCs are
checked (flipped bytes would otherwise load silently); SIGINT and SIGTERM stop the loop at the end
of a step, which saves; a resumed run is bitwise the same as an uninterrupted one (batches depend
on the step alone; each process's RNG states are kept).
"""

import dataclasses
import io
import json
import math
import os
import signal
import sys
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

import prepare_data
from common import UsageError, leftover, write_atomic
from nanoroute import GPT, GPTConfig

try:
    import fcntl
except ImportError:  # not on Windows: no lock there
    fcntl = None

# what a run writes into its folder: any of them there means a run is there
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "summary.json")
# every checkpoint of this train.py holds these: one missing means another version wrote it
KEYS = ("model", "optimizer", "config", "settings", "data_dir", "dataset", "progress", "rng")

@dataclasses.dataclass
class Progress:
    """A run's course so far: what a checkpoint records besides the model and the optimizer."""
    step: int = 0
    tokens: int = 0
    best_val_loss: float = math.inf
    milestones: dict = dataclasses.field(default_factory=dict)  # {label: step, tokens, val_loss}
    lines: list = dataclasses.field(default_factory=list)  # metrics.jsonl
    seconds: float = 0.0  # spent before this invocation
    changes: list = dataclasses.field(default_factory=list)  # settings --resume gave anew

_LOCKS = {}  # {folder: the open descriptor its lock is held on}, until release()

def lock(out_dir):
    """Holds out_dir for this process (rank 0, the one that writes) until release() or its end,
    however it ends: another train.py on the folder, such as a --resume while the run still trains
    (torchrun's workers outlive a kill of torchrun), is refused rather than writing beside it."""
    if fcntl is None or os.environ.get("RANK", "0") != "0" or out_dir in _LOCKS:
        return
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"{out_dir} is in use by another train.py, still running: wait for it "
                         "or stop it (under torchrun, its workers too)") from None
    except OSError:  # a file system without locks (some network ones): unlocked, and said
        os.close(fd)
        print(f"note: {out_dir} cannot be locked here: nothing stops a second train.py writing "
              "there", flush=True)
        return
    _LOCKS[out_dir] = fd

def release():  # the folders lock() holds: train.main may be called again from Python
    for fd in _LOCKS.values():
        os.close(fd)
    _LOCKS.clear()

def check_out_dir(out_dir, resume):
    """The checkpoint to resume (--resume), with a kill's temporary files gone; or None after
    checking that out_dir holds no run (or only what a run stopped in its first save left)."""
    if out_dir.is_dir():  # first: a live run's files are its own, temporary ones too
        lock(out_dir)
    if resume:
        ckpt = load(out_dir / "last.pt", f"nothing to resume in {out_dir} (no last.pt): train "
                    "without --resume first")
        remove_temporary_files(out_dir)
        return ckpt
    found = [name for name in RUN_FILES if (out_dir / name).exists()]
    if found and not stopped_in_first_save(out_dir):
        raise UsageError(f"{out_dir} already holds a run ({', '.join(found)}): add --resume to "
                         "continue it, or choose another --out_dir")
    # rank 0 alone speaks: under torchrun every process runs this check
    if found and os.environ.get("RANK", "0") == "0":
        print(f"note: the run in {out_dir} stopped in its first save (step 0, no last.pt): "
              "starting it over", flush=True)
    return None

def make_out_dir(out_dir):
    """A new run's folder, without a kill's temporary files. Made only after every check of the
    run, its settings' and its model's: a refused run leaves no empty folder behind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock(out_dir)
    remove_temporary_files(out_dir)

def stopped_in_first_save(out_dir):
    """True if out_dir holds what a run killed in its first save leaves: no last.pt, and a
    metrics.jsonl of step 0 alone (save writes it first, so a best.pt beside it is of step 0).
    A plain run redoes all of it, so it starts over and writes over them."""
    # a last.pt means a save finished: that run is for --resume, never written over
    if any((out_dir / name).exists() for name in ("last.pt", "summary.json")):
        return False
    try:
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
        return bool(lines) and all(json.loads(line)["step"] == 0 for line in lines)
    except (OSError, ValueError, TypeError, KeyError):  # absent, unreadable, not of train.py
        return False

def remove_temporary_files(out_dir):
    """What a kill inside write_atomic leaves (.last.pt.<8 random characters>.tmp, as big as a
    checkpoint), of the run files' names alone: their writer was killed, nothing else makes them."""
    for name in RUN_FILES:
        # write_atomic's leftovers and, in practice, nothing else
        for tmp in out_dir.glob(leftover(name)):
            if tmp.is_file():  # never a folder of that name
                tmp.unlink(missing_ok=True)

def load(path, missing):
    """A checkpoint as tensors and plain values, its CRCs checked; `missing`: if there is none."""
    path = Path(path)
    if not path.exists():
        raise UsageError(missing)
    if not path.is_file():  # a folder, a FIFO, a link to /dev/zero: reading hangs or fills memory
        raise UsageError(f"checkpoint {path} is not a file (a folder, a device or a pipe): "
                         "put the checkpoint file itself there")
    try:
        with zipfile.ZipFile(path) as z:
            # testzip reads every member and checks its CRC: torch.load alone would load
            # flipped bytes in a tensor without a word
            bad = z.testzip()
        bad = bad and f"CRC mismatch in {bad}"
        # weights_only: loading runs no code; on the CPU: a checkpoint of any GPU loads
        # anywhere, and load_state_dict copies it onto the model's device
        ckpt = None if bad else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a pickle that weights_only refuses, ...
        bad, ckpt = f"{type(e).__name__}: {' '.join(str(e).split())}"[:120], None
    if bad:
        raise UsageError(f"checkpoint {path} is damaged ({bad}): use a copy of it, or retrain")
    absent = [k for k in KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if absent:
        raise UsageError(f"checkpoint {path} is not one of this train.py (it has no "
                         f"{', '.join(absent)}): use the version of nanoroute that wrote it")
    return ckpt

def model_from(ckpt, path, model=None):
    """The weights in `model` (default: a GPT of the config), or one line saying what differs."""
    try:
        model = model or GPT(GPTConfig(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise UsageError(f"checkpoint {path} does not fit this version of nanoroute: "
                         f"{' '.join(str(e).split())[:300]}") from None
    # a tensor the model ties under two names (the embedding, the head) took one of two the
    # checkpoint holds apart: load_state_dict keeps the last without a word
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied = first.setdefault(p, name)
        if not torch.equal(ckpt["model"][tied], ckpt["model"][name]):
            raise UsageError(f"checkpoint {path} holds {tied} and {name} apart, and this model "
                             "ties them (one tensor): build the model the checkpoint's way")
    return model

def dataset_identity(meta):
    """What tells datasets apart, recorded in each checkpoint: the name, the vocabulary and the
    splits' SHA-256 (the same characters in other text differ only there)."""
    identity = dict(dataset=meta["dataset"], vocab_size=meta["vocab_size"], chars=meta.get("chars"))
    if "sha256" in meta:  # a folder prepared before they were recorded: unknown, left out
        identity["sha256"] = meta["sha256"]
    return identity

def open_data(ckpt, run_dir, data=None):
    """(folder, meta.json) of a run's data: `data` (--data), or its own, from any working folder
    (recorded relative to the run folder, or absolute). One line if missing, or another dataset."""
    folder = prepare_data.dataset_folder(data) if data else Path(run_dir) / ckpt["data_dir"]
    if not data and not (folder / "meta.json").exists():
        raise UsageError(f"the data of the run in {run_dir} is not at {folder} any more: give "
                         f"--data with the {ckpt['dataset']['dataset']} dataset it was trained on")
    meta = prepare_data.load_meta(folder)
    if dataset_identity(meta) != ckpt["dataset"]:
        raise UsageError(f"{folder} is not the dataset the run in {run_dir} was trained on "
                         f"({ckpt['dataset']['dataset']}, vocab {ckpt['dataset']['vocab_size']}): "
                         "give --data with that dataset")
    # as it was given: absolute, or relative to the working folder, as a --data given here would
    # be (save() records it relative to the run folder)
    if data or Path(ckpt["data_dir"]).is_absolute():
        return folder, meta
    return Path(os.path.relpath(folder)), meta

GPU_RNG = ("cuda", "mps")  # devices whose dropout draws from a generator of their own

def rng_state(device):
    """This process's RNG states: the CPU's, and a GPU's own (CUDA's, Apple's MPS'), from which
    dropout on it draws."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type in GPU_RNG:
        rng[device.type] = getattr(torch, device.type).get_rng_state(device)
    return rng

def set_rng_state(rng, device):
    """Puts back what rng_state saved; a GPU run resumed on a CPU keeps the CPU state alone (a
    CPU's dropout draws from it), a GPU its own where it was saved there."""
    torch.set_rng_state(rng["cpu"])
    if device.type in GPU_RNG and device.type in rng:
        getattr(torch, device.type).set_rng_state(rng[device.type], device)

def save(out_dir, state, progress, improved, device, rank=0, world=1):
    """state (the model's and the optimizer's state dicts, config, settings, data_dir, dataset),
    progress (a Progress, its seconds the run's so far) and each process's RNG states, written by
    rank 0: metrics.jsonl, then best.pt (when improved), then last.pt. best.pt before last.pt: a
    crash between the two leaves best.pt a step ahead, never behind (restore takes the lower best).
    Under DDP every process calls it: the RNG states are gathered."""
    rng = rng_state(device)  # dropout's: each process's, gathered on rank 0
    states = [rng]
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, rng)
    # only after the gather: every process must join that collective before rank 0 writes alone
    if rank != 0:
        return
    data_dir = Path(state["data_dir"])  # relative to the run folder: both may move together
    data_dir = data_dir.resolve() if data_dir.is_absolute() else \
        os.path.relpath(data_dir.resolve(), Path(out_dir).resolve())
    states = [{k: v.cpu() for k, v in s.items()} for s in states]
    state = dict(state, data_dir=str(data_dir), rng=states, progress=dataclasses.asdict(progress))
    buffer = io.BytesIO()  # in memory first: a full disk is then a plain OSError (one line)
    torch.save(state, buffer)
    lines = "".join(json.dumps(line) + "\n" for line in progress.lines)
    # metrics.jsonl first: a kill after it leaves it ahead of last.pt, never behind, and the next
    # save rewrites it whole from last.pt's own lines (stopped_in_first_save relies on the order)
    write_atomic(out_dir / "metrics.jsonl", lines.encode())
    # the same bytes: best.pt is a whole checkpoint of the best step, not its weights alone
    for name in ("best.pt", "last.pt") if improved else ("last.pt",):
        write_atomic(out_dir / name, buffer.getbuffer())

def param_names(model, optimizer):
    """The names of the optimizer's parameters, group by group: its saved state is matched to the
    parameters by this order alone (a refactor that reorders them would load it into others)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

def restore(ckpt, out_dir, model, optimizer, seed, device, rank=0, world=1):
    """--resume: last.pt's weights and optimizer state into model and optimizer, each process's
    RNG states (reseeded from seed if another process count wrote it); returns its Progress."""
    path, rng = out_dir / "last.pt", ckpt["rng"]
    model_from(ckpt, path, model)
    # load_state_dict puts the saved groups' settings back: keep this invocation's, so that a flag
    # given with --resume (--beta2 0.99, --weight_decay 0.05) is used, not only printed and saved
    settings = [{k: v for k, v in group.items() if k != "params"}
                for group in optimizer.param_groups]
    names = param_names(model, optimizer)
    if ckpt.get("params", names) != names:  # a checkpoint from before the names were kept: as is
        now, was = sum(names, []), sum(ckpt["params"], [])
        i = next((i for i, pair in enumerate(zip(now, was)) if pair[0] != pair[1]), len(was))
        raise UsageError(f"checkpoint {path}: its optimizer state is of other parameters, in their "
                         f"order (#{i}: {was[i:i + 1] or 'none'}, here {now[i:i + 1] or 'none'}):"
                         " resume with the nanoroute that wrote it, or start a run")
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError) as e:
        raise UsageError(f"checkpoint {path}: its optimizer does not fit ({e})") from None
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)
    p = Progress(**ckpt["progress"])
    if (out_dir / "best.pt").exists():  # a step ahead of last.pt after a crash between them
        best = load(out_dir / "best.pt", "")  # checked as last.pt: a damaged one is one line
        p.best_val_loss = min(p.best_val_loss, best["progress"]["best_val_loss"])
    # the same process count: each rank takes its own states back; the run goes on bitwise
    if len(rng) == world:
        set_rng_state(rng[rank], device)
    else:
        if rank == 0:
            print(f"note: {path} was written by {len(rng)} process(es), not {world}: dropout is "
                  "reseeded (the batches are unaffected)", flush=True)
        # no saved state fits: seeded by the step, so dropout never replays the first steps' masks,
        # and by the rank, so the processes differ
        torch.manual_seed(seed + 1000 * p.step + rank)
    return p

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

def catch_stop_signals():
    """SIGINT and SIGTERM note the signal in a list (returned, with the old handlers); one ignored
    at start stays so (`cmd &` in a script ignores SIGINT). tmux or nohup outlive a terminal."""
    received, old = [], {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in old.items():
        if handler is not signal.SIG_IGN:
            # the handler only notes it: the loop stops at a step's end, where a save is consistent;
            # a KeyboardInterrupt mid-step could leave the optimizer half updated
            signal.signal(sig, lambda signum, frame: received.append(signum))
    return received, old

def stop_signal(received, device, world=1):
    """The signal to stop on (0: none) of those received (catch_stop_signals' list); under DDP
    any process's, so all stop at the same step."""
    signum = received[0] if received else 0
    if world > 1:
        # on the device: NCCL reduces GPU tensors only
        signum = torch.tensor(signum, device=device)
        # MAX: a signal to any one process stops every process at this same step
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
    return int(signum)

def leave(code):
    """Exit with code. A torchrun worker leaves at once: a gloo thread can abort the interpreter's
    teardown after a finished run ("terminate called without an active exception"; seen here)."""
    if "RANK" not in os.environ:
        sys.exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()
    # os._exit skips Python's flushing: the last lines must not be lost
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
