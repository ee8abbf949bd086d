"""
Paired sweeps over nanoroute's variants, the report that compares them, and routing interventions on
a trained run (SPEC: Paired experiments, What the controls can show). docs/experiments.md has more.

    python experiments.py sweep controls --jobs 2     # its variants x 3 seeds; tail -f runs/*/*.log
    python experiments.py sweep custom --data data/text8 --variants prenorm,block,wav,rd \
        --depths 8,12 --seeds 0-2 --lrs 1e-3,2e-3 --jobs 4 -- --max_iters 2000
    python experiments.py report runs/controls --plots --heatmap block_L4_s0
    python experiments.py ablate runs/controls/block_L4_s0 --older_than 0
"""

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import common
import prepare_data
import train
from common import UsageError, write_atomic, write_json
from diagnostics import ROUTE_NUMBERS, source_block
from nanoroute import CONFIG_FIELDS, VARIANTS, GPTConfig, missing_need, variant

# an absolute path: a sweep runs from any working folder
TRAIN = str(Path(__file__).resolve().parent / "train.py")

# The tiny and controls sweeps: 4 layers x 64, 300 steps of 1,024 characters, milestones at evals
SMALL = ("--n_embd 64 --n_head 4 --sequence_len 64 --batch_size 16 --max_iters 300 "
         "--warmup_iters 20 --eval_interval 25 --eval_tokens 8K --milestones 76.8K,153.6K,307.2K "
         "--log_interval 25")
# One thread per run: a model this small gains little from two, and on a busy 2-core machine two
# threads wait on each other (steps up to 10x slower). An OMP_NUM_THREADS you set is kept.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

# Named sweeps; the papers' name each depth's train.py preset (it sets the width and the schedule).
DEMO = dict(datasets=["demo"], depths=[4], seeds=[0, 1, 2], flags=SMALL, env=ONE_THREAD)
SWEEPS = {
    "tiny": dict(DEMO, variants="prenorm rezero layerscale block wav rd rd_tied rd_average "
                 "rd_frozen_v"),
    "controls": dict(DEMO, variants="prenorm denseformer block block_static block_h4 wav rd"),
    "wav_paper": dict(datasets=["tinystories", "text8"], depths=[12, 24, 48], seeds=[0], flags="",
                      variants="prenorm rezero layerscale block wav",
                      presets={12: "wav12", 24: "wav24", 48: "wav48"}),
    "rd_paper": dict(datasets=["fineweb_edu"], depths=[16, 24], presets={16: "rd_s", 24: "rd_m"},
                     seeds=[0, 1, 2, 3, 4], variants="block rd rd_tied rd_average rd_frozen_v",
                     flags="--max_tokens 2B --milestones 0.25B,0.5B,1B,2B"),
}
# sweep custom: three seeds, the fewest that give a spread of the paired differences
CUSTOM = dict(depths=[train.MODEL_DEFAULTS["n_layer"]], seeds=[0, 1, 2], flags="")
# train.py's flags: the fields of its settings and of the model, each with its needs= ("attnres",
# "wav" or None: where it has an effect) and its default in train.py
FIELDS = [f for cls in (train.TrainSettings, GPTConfig) for f in dataclasses.fields(cls)]
NEEDS = {f.name: f.metadata.get("needs") for f in FIELDS}
DEFAULTS = {f.name: train.MODEL_DEFAULTS.get(f.name, f.default) for f in FIELDS}
MAX_RUNS = 1000  # more is a typo (--seeds 0-100000000)
NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib): no figures; tables are whole"

# --- Planning a sweep: the runs, their flags, and every check that can fail before the first. ---

def plan(a, extra=()):
    """The runs of sweep a.name (dicts), seed-major: a sweep stopped early leaves whole pairs."""
    variants = listed(a.variants, "--variants", lambda v: [v] * (v in VARIANTS), ",".join(VARIANTS))
    seeds = listed(a.seeds, "--seeds", lambda part: span(part, 0))
    depths = listed(a.depths, "--depths", lambda part: span(part, 1))
    rates = listed(a.lrs, "--lrs", lambda x: [float(x)] * (float(x) > 0), "rates like 1e-3,2e-3")
    grid = sweep_grid(a, variants)
    presets, variants = grid.get("presets", {}), variants or grid["variants"].split()
    # every check before any run starts: a bad flag never fails the 40th run of a sweep
    taken = check_train_flags(extra, presets, rates)
    settings = set_values(a.set, taken)
    # the flags after -- and each --set's values: {--NAME: [value, ...]}, each where it applies
    options = {**{k: [x] for k, x in flag_dict(extra).items()}, **settings}
    notes = left_out(options, variants)
    depths = depths or preset_depths(options) or grid["depths"]
    seeds, rates = seeds or grid["seeds"], rates or [None]
    size = [grid["datasets"], depths, seeds, variants, rates, *settings.values()]
    # counted before the grid is built: a typo must not allocate a million runs
    if (count := math.prod(map(len, size))) > MAX_RUNS:
        raise UsageError(f"sweep {a.name}: {count} runs, more than {MAX_RUNS}: give fewer "
                         "--seeds, --depths, --variants, --lrs or --set values")
    runs = []
    for dataset, depth in itertools.product(grid["datasets"], depths):
        if presets and depth not in presets:
            raise UsageError(f"--depths {depth}: sweep {a.name} has presets for depths "
                             f"{', '.join(map(str, presets))} only (the preset sets the width)")
        # one block for every AttnRes variant at this depth: no Δ is also one of block size
        m = sweep_block(variants, depth, a.attnres_block)
        folder = grid.get("folder") or f"{a.data_root}/{dataset}"
        # seed-major: a sweep stopped early leaves each seed's runs side by side, ready to pair
        for seed, v, lr in itertools.product(seeds, variants, rates):
            block = m if VARIANTS[v]["residual"] == "attnres" else None
            # a flag with no effect in this variant is left out: it runs once, not once per value
            mine = {k: values for k, values in options.items() if not inert(k[2:], variant(v))}
            for chosen in [dict(zip(mine, values)) for values in itertools.product(*mine.values())]:
                swept = {k[2:]: x for k, x in chosen.items() if k in settings}
                run = run_name(v, depth, seed, lr, swept)
                run = f"{dataset}/{run}" if len(grid["datasets"]) > 1 else run
                preset = presets[depth] if presets else None
                args = run_args(preset, folder, depth, seed, v, block, grid["flags"], chosen, lr)
                runs.append(dict(name=run, dir=Path(a.out or f"runs/{a.name}") / run, variant=v,
                                 dataset=dataset, depth=depth, seed=seed, lr=lr, sweep=a.name,
                                 attnres_block=block, args=args, env=grid.get("env", {}),
                                 data=folder, set=swept, set_base={
                                     k[2:]: settings[k][0] for k in mine if k in settings}))
    for run in runs:  # what train.py checks of each run's settings, before the first one starts
        check_run(run, a.torchrun or 1)
    for note in notes:  # once every check passed
        print(note)
    return runs

def preset_depths(options):
    """[the depth] of the presets given after -- or in --set: a sweep gives each run --n_layer,
    which would run a preset at the sweep's default depth, not its own, without a word."""
    names = options.get("--preset", [])
    depths = {train.PRESETS[name]["n_layer"] for name in names}
    if len(depths) > 1:
        raise UsageError(f"presets of {len(depths)} depths ({', '.join(names)}): a sweep gives "
                         "each run its depth; give --depths (each preset runs at each depth)")
    return sorted(depths) or None

def run_name(v, depth, seed, lr, swept):  # block_L4_s0, then its lr and --set values
    name = f"{v}_L{depth}_s{seed}" + (f"_lr{lr:g}" if lr else "")
    # block_L4_s0_wav_rho2; a value with a / (a path) stays one folder's name
    return name + "".join(f"_{k}{file_safe(x)}" for k, x in swept.items())

def file_safe(text):  # text as one file or folder name: runs/a/b -> runs_a_b
    return re.sub(r"[^\w.-]+", "_", str(text))

def check_run(run, world):
    """train.py's checks of a run's settings and model (check_settings): a combination that
    train.py refuses is one line now, not a failed run in the middle of a sweep."""
    try:
        a, model = resolved(run)
        train.check_settings(a, world, model)
    except UsageError as e:
        raise UsageError(f"run {run['name']}: train.py refuses it: {e}") from None

def resolved(run):
    """(TrainSettings, the model's settings) that train.py makes of a run's flags."""
    explicit = {k: x for k, x in train_args(run["args"], run["name"]).items() if x is not None}
    return train.resolve_settings(explicit)

def sweep_grid(a, variants):
    """The grid of sweep a.name: SWEEPS' entry, or custom's on the dataset of --data."""
    if a.name == "custom" and (a.data is None or not variants):
        raise UsageError("sweep custom needs --data FOLDER (a prepared dataset) and --variants, "
                         "e.g. --data data/demo --variants prenorm,block,wav,rd")
    if a.name == "custom":  # the dataset its meta.json names (a missing demo is made first)
        if a.data_root != "data":  # the named sweeps' folder of datasets: custom's is --data
            raise UsageError(f"--data_root {a.data_root}: only the named sweeps read it; sweep "
                             f"custom reads --data: give the whole path, --data {a.data_root}/...")
        folder = prepare_data.dataset_folder(a.data)
        demo = folder.name == "demo" and not (folder / "meta.json").exists()
        dataset = "demo" if demo else prepare_data.load_meta(folder)["dataset"]
        return dict(CUSTOM, datasets=[dataset], folder=str(folder))
    if a.data is not None:
        raise UsageError(f"--data {a.data}: only sweep custom takes a data folder; sweep {a.name} "
                         f"reads {', '.join(SWEEPS[a.name]['datasets'])} from --data_root")
    return SWEEPS[a.name]

def run_args(preset, folder, depth, seed, name, block, grid_flags, chosen, lr):
    """train.py's flags for one run of a sweep: chosen holds the --set and after -- values."""
    # the preset sets width and schedule; train.py lets every other flag override it
    args = ["--preset", preset] if preset else []
    args += ["--data", folder, "--n_layer", str(depth), "--seed", str(seed)]
    # every field a variant may set: a preset's wav=True never leaks into block
    args += [s for k, value in variant(name).items() for s in (f"--{k}", str(value))]
    args += [] if block is None else ["--attnres_block", str(block)]
    # argparse keeps a flag's last value: yours (after --, --set) beat the grid's
    args += [*shlex.split(grid_flags), *itertools.chain(*chosen.items())]
    return args + (["--lr", f"{lr:g}"] if lr else [])

def listed(text, flag, parse, example=f"integers like 0,1,2 or 0-4, at most {MAX_RUNS}"):
    """A comma-separated flag as distinct values, parse(part) giving each part's ([]: refused)."""
    if text is None:
        return None
    # a part that fails to parse, gives [] or repeats a value: one error line naming the flag
    with contextlib.suppress(ValueError):
        parts = [parse(part.strip()) for part in text.split(",")]
        values = [v for part in parts for v in part]
        if all(parts) and len(set(values)) == len(values):
            return values
    raise UsageError(f"{flag} {text}: expected distinct {example}")

def span(part, low):  # a part of --seeds or --depths: '3' or a rising range '0-4', integers >= low
    first, _, last = part.partition("-")
    values = range(int(first), int(last or first) + 1)  # refused before a list of it is built:
    return values if values and values[0] >= low and len(values) <= MAX_RUNS else []

def check_train_flags(extra, presets, lrs):
    """The flags after -- before any run: the grid's own refused, all parsed. {flag: the fix} of
    those --set may not take either."""
    use = {"--data": "--data (sweep custom) or --data_root", "--n_layer": "--depths",
           "--seed": "--seeds", "--out_dir": "--out", "--attnres_block": "it before --",
           **{f"--{k}": "--variants" for k in variant("block")},
           **({"--preset": "sweep custom for another preset"} if presets else {}),
           **({"--lr": "--lrs"} if lrs else {}), "--resume": "the same sweep command to resume"}
    refused = {k: f"the sweep sets it for each run; use {v}" for k, v in use.items()}
    refused |= dict.fromkeys(["-h", "--help"], "the flags after -- are train.py's: train.py -h")
    for flag in [f for f in refused if f in {*flag_dict(extra), *extra}]:
        raise UsageError(f"{flag} after --: {refused[flag]}")
    # train.py's own parser, now: a typo fails before the first run, not in each run
    train_args(list(extra), "after --")
    return refused | dict.fromkeys(flag_dict(extra), "give it after -- or in --set, not both")

def value_text(x):  # %g text: 1e-3 and 0.001 are one value, one run folder name, one report row
    return f"{x:g}" if isinstance(x, float) else str(x)

def set_values(given, taken):
    """{--NAME: its values} of each --set NAME=V1,V2, parsed by train.py's parser (a float as %g
    text), the baseline first: the value equal to train.py's default, else the first given."""
    settings = {}
    for item in given:  # an unknown NAME or a bad value: train.py's parser says so
        name, _, texts = item.partition("=")
        taken |= dict.fromkeys(settings, "give one --set per flag")
        if f"--{name}" in taken:
            raise UsageError(f"--set {item}: {taken[f'--{name}']}")
        # how a run runs or what it writes: its values would be one run twice, in one report row
        # (--preset, though runtime, gives a set-up of its own: --set may sweep presets)
        if name in (RUNTIME | train.OUTPUT) - {"preset"}:
            raise UsageError(f"--set {item}: --{name} says how a run runs or what it writes, not "
                             "what it trains: give it after -- (every run takes it)")
        values = listed(texts, f"--set {name}", lambda text: [
            train_args([f"--{name}={text}"], f"--set {item}")[name]], f"values of --{name}")
        values.sort(key=lambda value: value != DEFAULTS[name])  # stable: else the first given
        settings[f"--{name}"] = [value_text(x) for x in values]
        folders = [file_safe(x) for x in settings[f"--{name}"]]  # in its runs' folder names
        if len(set(folders)) < len(folders):
            raise UsageError(f"--set {item}: two values make one run folder name "
                             f"({', '.join(folders)}): give values that differ in a letter or "
                             "digit")
    return settings

def train_args(argv, where):
    """{name: value} of argv as train.py parses it; its parser's one `error:` line becomes ours."""
    err = io.StringIO()
    try:
        # argparse prints its error (and --help) and exits: caught here to become one line of ours
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return vars(train.build_parser().parse_args(argv))
    except SystemExit:
        why = re.sub(r"^error: |; see --help$", "", err.getvalue().strip().splitlines()[-1])
        raise UsageError(f"{where}: {why}") from None

def inert(name, config):
    """Why train.py's --name has no effect in a model of config (nanoroute.missing_need)."""
    return missing_need(NEEDS.get(name), config)

def left_out(options, variants):
    """A line per flag (--NAME) that some variants leave out, as it has no effect in them; a flag
    that every one would leave out is an error."""
    notes = []
    for flag in options:
        off = [v for v in variants if inert(flag[2:], variant(v))]
        if off == variants:
            raise UsageError(f"{flag}: it has no effect in {', '.join(variants)}: add to "
                             "--variants one it applies to (nanoroute.missing_need)")
        notes += [f"# {flag} is left out of the {', '.join(off)} runs: it has no effect there"] * (
            off != [])
    return notes

def flag_dict(args):
    """{--flag: value} of a train.py argument list ("True" for a bare flag; the last one wins)."""
    found = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            bare = i + 1 == len(args) or args[i + 1].startswith("--")
            found[flag] = value if eq else "True" if bare else args[i + 1]
    return found

def sweep_block(variants, depth, given=None):
    """The routing block of every AttnRes variant at a depth, so that no difference between them is
    also one of block size: the largest automatic one (WAV needs 4 where Block AttnRes takes 2)."""
    try:  # a depth or block a variant cannot take is one line now, not a failed run later
        blocks = [GPTConfig(n_layer=depth, **variant(v), attnres_block=given or 0).routing_block
                  for v in variants if VARIANTS[v]["residual"] == "attnres"]
    except ValueError as e:
        raise UsageError(f"--depths {depth}: {e}") from None
    return max(blocks, default=None)

def job_slots(jobs, per_run=1, extra=()):
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: must be at least 1")
    if jobs == 1:
        return [{}]
    # GPUs: each run its own (per_run for --torchrun), so runs never share one GPU's memory
    if flag_dict(extra).get("--device", "cuda") != "cpu" and torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if jobs * per_run > len(gpus):
            raise UsageError(f"--jobs {jobs}: {len(gpus)} visible GPU(s); lower --jobs")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per_run:(i + 1) * per_run])}
                for i in range(jobs)]
    # CPUs: the cores this process may use, shared out; threads beyond them wait on each other
    cores = str(max(1, len(os.sched_getaffinity(0)) // (jobs * per_run)))
    return [{} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": cores}] * jobs

# --- Running a sweep: skip, resume or start each run; a line as each starts and ends. ---

def pending(runs, launcher):
    """(run, command) of each run to do: a finished one is skipped, an interrupted one resumed."""
    todo = []
    for run in runs:
        d = run["dir"]
        foreign = foreign_files(d)
        if foreign:  # never taken as this sweep's run, nor written into
            raise UsageError(f"{d} holds files this sweep did not make ({', '.join(foreign)}; "
                             "no run.json): move them, or give the sweep another --out")
        changed = flags_changed(run)
        if (d / "summary.json").exists():
            if changed:
                print(f"WARNING: {d} ran with other flags: {', '.join(changed)}; it is kept "
                      "(use another --out to run these)")
            # the same flags, yet another model: a default changed in the code since
            elif (d / "run.json").exists():
                with contextlib.suppress(OSError, ValueError, KeyError):
                    changed = drifted(run, json.loads((d / "summary.json").read_text())["config"])
                if changed:
                    print(f"WARNING: {d} ran at other defaults: its flags now make "
                          f"{', '.join(changed)}; it is kept (use another --out to run these)")
            print(f"skip {d}: finished")
            continue
        # an interrupted run continues from its last.pt: the same command resumes the sweep
        resume = ["--resume"] if (d / "last.pt").exists() else []
        if resume and changed:  # a training flag changes it from its last step (train.py says so)
            print(f"WARNING: {d} resumes with other flags: {', '.join(changed)}; from its last "
                  "step on (use another --out to run these from the start)")
        todo.append((run, [*launcher, *run["args"], "--out_dir", str(d), *resume]))
    return todo

def foreign_files(d):
    """What a run's folder holds if the sweep did not start it there (no run.json): a train.py run
    by hand, a user's files; none where it did, or where the folder is new or empty."""
    if (d / "run.json").exists() or not d.is_dir():
        return []
    # what a kill inside start()'s write of run.json leaves is the sweep's
    return sorted(p.name for p in d.iterdir() if not p.match(common.leftover("run.json")))

def flags_changed(run):
    """The flags in which a run's command differs from the one it was started with (its
    run.json), "--max_iters 80 (was 40)"; none without a readable run.json. A flag one command
    lacks is train.py's default there: a field a new variant row gives every run changes none."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        was = flag_dict(json.loads((run["dir"] / "run.json").read_text())["args"])
        now = flag_dict(run["args"])

        def same(k):  # one value, or one command lacks it and the other gives the default
            if k in now and k in was:
                return now[k] == was[k]
            return at_default(k, now.get(k, was.get(k)))
        return [f"{k} {now.get(k, 'unset')} (was {was.get(k, 'unset')})"
                for k in dict.fromkeys([*now, *was]) if not same(k)]
    return []

def at_default(flag, text):  # whether train.py reads `--flag text` as its default
    name = flag[2:]
    try:
        return name in DEFAULTS and train_args([f"{flag}={text}"], flag)[name] == DEFAULTS[name]
    except UsageError:  # a flag train.py no longer has
        return False

def drifted(run, config):
    """The model fields in which a finished run's config differs from what its flags make now,
    "wav_rho 2.0 (was 4.0)"; a field newer than the run is left out (its default is the old way)."""
    now = resolved(run)[1]  # vocab_size None: the data's, not a flag's
    return [f"{k} {now[k]} (was {config[k]})" for k in now
            if k in config and now[k] is not None and now[k] != config[k]]

def launch(todo, slots):
    """Each (run, command), len(slots) at once: {failed run: its last error line}."""
    running, failed, free, queued = {}, {}, list(slots), list(enumerate(todo, 1))
    try:
        while queued or running:
            while queued and free:
                i, (run, cmd) = queued.pop(0)
                label, slot = f"[{i}/{len(todo)}] {run['dir']}", free.pop()
                running[start(run, cmd, label, slot)] = run, label, slot, time.time()
            time.sleep(0.2)  # polling a few processes costs nothing next to a training run
            for process in [p for p in running if p.poll() is not None]:
                run, label, slot, t0 = running.pop(process)
                free.append(slot)
                error = ended(run, process.returncode, label, time.time() - t0)
                failed.update({run["name"]: error} if error else {})
    except KeyboardInterrupt:  # it reached the runs too (one process group): each saves last.pt
        for process in running:
            process.wait()
        raise
    return failed

def interrupt(signum, frame):  # a stop signal as Ctrl-C: a KeyboardInterrupt, with its number
    raise KeyboardInterrupt(signum)

def start(run, cmd, label, slot):  # run.json, then train.py writing to train.log: its process
    d, env = run["dir"], run_env(run, slot)
    d.mkdir(parents=True, exist_ok=True)
    keys = ("variant", "dataset", "depth", "seed", "lr", "attnres_block", "set", "set_base",
            "sweep", "args")
    # run.json first: report knows the run's variant and --set values even if it fails at once
    write_json(d / "run.json", {k: run[k] for k in keys} | dict(command=shell(cmd, env)))
    print(f"{label}: started" + " (resuming from last.pt)" * ("--resume" in cmd)
          + "".join(f" {k}={v}" for k, v in env.items()), flush=True)
    with open(d / "train.log", "ab") as log:  # unbuffered: `tail -f` shows each line as printed
        # no stdin: a run never waits on the terminal the sweep runs in
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={"PYTHONUNBUFFERED": "1", **os.environ, **env})

def ended(run, code, label, seconds):  # how a run ended; its last error line if it failed
    summary = run["dir"] / "summary.json"
    if code == 0 and summary.exists():
        val = json.loads(summary.read_text())["final"]["val_loss"]
        return print(f"{label}: done in {seconds:.0f} s, val loss {val:.4f}", flush=True)
    if code == 0:  # -- --stop_after: saved in last.pt, not failed
        return print(f"{label}: stopped before its last step; the same command resumes it",
                     flush=True)
    log = (run["dir"] / "train.log").read_text(errors="replace")
    lines = [s for s in log.splitlines() if s.strip()] or ["(no output)"]
    # train.py's `error:` line, or a traceback's last line: what the sweep's summary shows
    error = next((s for s in reversed(lines) if "error" in s.lower()), lines[-1])
    print(f"{label}: FAILED (exit {code}): {error}", flush=True)
    return error

def run_env(run, slot):  # the slot's, the sweep's; yours win but for the slot's GPUs (of yours)
    env = {k: v for k, v in {**slot, **run["env"]}.items() if k not in os.environ}
    return env | {k: v for k, v in slot.items() if k == "CUDA_VISIBLE_DEVICES"}

def shell(cmd, env):
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])

def sweep(args, extra):
    runs = plan(args, extra)
    slots = job_slots(args.jobs, args.torchrun or 1, extra)
    launcher = [sys.executable, TRAIN] if not args.torchrun else [  # "--": train.py drops it
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={args.torchrun}", TRAIN, "--"]
    if args.dry_run:
        return print("\n".join(shell(cmd, run_env(run, {})) for run, cmd in
                               pending(runs, launcher))) or 0
    for folder in dict.fromkeys(run["data"] for run in runs):  # before the first run:
        if Path(folder).name == "demo" and not (Path(folder) / "meta.json").exists():
            prepare_data.prepare("demo", folder)  # now, not by several runs at once
        prepare_data.load_meta(folder)  # another missing dataset: the command that prepares it
    todo, t0 = pending(runs, launcher), time.time()
    # SIGTERM (`kill -TERM -- -PGID`, a sweep under nohup) stops it as Ctrl-C does: the signal
    # reached the runs too, and the sweep waits until each has saved (a rerun must not race them)
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        failed = launch(todo, slots)
    except KeyboardInterrupt as stop:
        print("interrupted: the same command resumes the sweep", file=sys.stderr)
        return 128 + (stop.args[0] if stop.args else signal.SIGINT)  # as a shell reports it
    finally:
        signal.signal(signal.SIGTERM, old)
    done = [r for r, _ in todo if r["name"] not in failed and (r["dir"] / "summary.json").exists()]
    stopped = len(todo) - len(done) - len(failed)  # by -- --stop_after: not failed
    print(f"sweep: {len(runs)} runs: {len(runs) - len(todo)} skipped, {len(done)} done, "
          + f"{stopped} stopped, " * bool(stopped)
          + f"{len(failed)} failed; {time.time() - t0:.0f} s, {len(slots)} at a time"
          + "".join(f"\nfailed: {name}: {error}" for name, error in failed.items()))
    return 1 if failed else 0

# --- Report: run folders, groups of like runs, paired statistics, Markdown. ---

# What never splits a group: how a run was run (train.py's runtime settings, and its output=True
# ones: what it wrote, how often it printed its loss; --dtype: its precision is warned of, as auto
# and float32 are one on a CPU), what the grid varies (seed, lr, depth), what the dataset fixes,
# and what makes the rows (the variant's fields, block).
RUNTIME = {f.name for f in dataclasses.fields(train.TrainSettings) if f.metadata["runtime"]}
NOT_SETUP = RUNTIME | train.OUTPUT | {"dtype", "seed", "lr", "n_layer", "vocab_size",
                                      "attnres_block", *variant("block")}

def find_runs(folders):
    """(runs, notes): each folder is a run itself or holds runs; unreadable ones become notes."""
    runs, notes = [], []
    for folder in map(Path, folders):
        if not folder.is_dir():  # a typo: never a report of the other folders without a word
            raise UsageError(f"{folder}: no such folder")
        # run.json alone: a sweep's run not finished yet; summary.json alone: a train.py run by hand
        found = sorted({p.parent for f in ("run.json", "summary.json") for p in folder.rglob(f)})
        if not found:
            notes.append(f"{folder}: no runs in it (no run.json or summary.json)")
        for d in found:
            given = d == folder or len(folders) > 1  # a run folder, or several folders: as given
            try:
                runs.append(read_run(d, (d if given else d.relative_to(folder)).as_posix()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                notes.append(f"{d}: its files cannot be read ({type(e).__name__}: {e})")
    return runs, notes

def read_run(d, name):
    """A run folder; its summary.json says what it is, its run.json (a sweep's) its variant."""
    info, summary = [json.loads((d / f).read_text(encoding="utf-8")) if (d / f).exists() else None
                     for f in ("run.json", "summary.json")]
    lines = (d / "metrics.jsonl").read_text().splitlines() if (d / "metrics.jsonl").exists() else []
    run = dict(name=name, dir=d, summary=summary, variant=(info or {}).get("variant"),
               curve={e["tokens"]: e["val_loss"] for e in map(json.loads, lines)  # after step 0
                      if e["type"] == "eval" and e["tokens"] > 0})
    if summary is not None:
        # a setting added since the run was made: at its default, as the code ran then (a new
        # setting's default keeps the old behaviour), so an older run pairs with a newer one
        config = {**{k: DEFAULTS[k] for k in CONFIG_FIELDS}, **summary["config"]}
        settings = {**DEFAULTS, **summary["train"]}
        swept, base = (info or {}).get("set", {}), (info or {}).get("set_base", {})
        # the data by its folder's name (from any folder) and level (a text as bytes or characters)
        both = {**settings, **config, "data": Path(settings["data"]).name,
                "level": summary["level"]}
        # the --set values name its row too; `home`: at the baselines
        knobs = routing_knobs(both, config, summary.get("changes", []))
        row, home = [repr(sorted({**knobs, **swept, **at}.items())) for at in ({}, base)]
        # what makes a group: every other setting (data, width, schedule...), as sorted text:
        # hashable, and equal exactly when two runs were set up alike; under --max_tokens the
        # budget, not the steps it made of each run's batch
        derived = {"max_iters"} if settings["max_tokens"] else set()
        setup = [(k, repr(x)) for k, x in both.items()
                 if k not in {*NOT_SETUP, *swept, *derived} and not NEEDS.get(k)]
        # settings a --resume gave anew (train.py records them): a run pairs with runs changed
        # alike; but the routing's (needs=), which name its row (above)
        changes = [f"{c['setting']} {c['was']} → {c['now']} at step {c['step']}"
                   for c in summary.get("changes", []) if not NEEDS.get(c["setting"])]
        setup = tuple(sorted(setup + [("changed at --resume", ", ".join(changes))] * bool(changes)))
        block = GPTConfig(**config).routing_block if config["residual"] == "attnres" else None
        # off: a --set value off its baseline; such a row pairs with `home`, its own variant at the
        # baselines (summarize). No run.json (train.py by hand): named by its config
        run.update(variant=run["variant"] or config_variant(config), dataset=summary["dataset"],
                   depth=config["n_layer"], seed=settings["seed"], lr=settings["lr"], block=block,
                   final=float(summary["final"]["val_loss"]), level=summary["level"], setup=setup,
                   milestones=summary.get("milestones") or {}, routes=summary.get("routes") or {},
                   # what the data was, where the run recorded it: a folder prepared anew differs
                   data_sha256=json.dumps(summary.get("data_sha256"), sort_keys=True),
                   # float32 or bfloat16 (older runs: --dtype where not auto, else unknown)
                   precision=summary.get("precision", settings["dtype"].replace("auto", "")),
                   ran=f"--device {settings['device']} --compile {settings['compile']}",
                   tokens=summary.get("tokens_seen"),  # how long it trained (older runs: None)
                   set=knobs | swept, set_base=base, row=row, home=home, off=row != home)
    return run


def routing_knobs(both, config, changes):
    """{name: value} of a run's routing knobs (needs=): the variant's, named in its row where not
    the default (so prenorm and a wav of wav_rho 2 pair). One a --resume changed is named by its
    values and their steps: the run is not in the row of runs that had its last value throughout."""
    # as --set names them: a run by hand of wav_rho 2.0 is in the row of a sweep's wav_rho=2
    knobs = {k: value_text(x) for k, x in both.items() if k not in NOT_SETUP and NEEDS.get(k)
             and not inert(k, config) and x != DEFAULTS[k]}
    changed = {}
    for c in changes:
        if NEEDS.get(c["setting"]):
            now = f"{value_text(c['now'])} at step {c['step']}"
            was = changed.get(c["setting"], value_text(c["was"]))
            changed[c["setting"]] = was + " → " + now
    return knobs | changed

def config_variant(config):
    """The name of the VARIANTS row a config is, the first that matches; else of the nearest row
    (fewest fields apart) and how the config differs from it, "wav, rd=decoupled": never a name
    that another variant's runs may have."""
    apart = {v: {k: config[k] for k, x in variant(v).items() if config[k] != x} for v in VARIANTS}
    nearest = min(apart, key=lambda v: len(apart[v]))  # the first of the nearest rows
    return ", ".join([nearest, *(f"{k}={x}" for k, x in apart[nearest].items())])


def mean_std(values):  # (mean, sample std, ddof=1): std None for one value, both for none
    values = [v for v in values if v is not None]
    stdev = statistics.stdev(values) if len(values) > 1 else None
    return (statistics.fmean(values), stdev) if values else (None, None)

def paired(runs, base_runs, value):
    """value(run) - value(baseline run of the same seed value): {mean, std, wins, ties, n}."""
    # by seed: a run pairs only with the baseline's run of its own seed (the same batches, the
    # same seed before the init); a seed without a partner drops out, and n counts the pairs
    base = {r["seed"]: value(r) for r in base_runs}
    # None: a milestone that run never reached; left out of the pairs, never counted as 0
    diffs = [value(r) - base[r["seed"]] for r in runs
             if value(r) is not None and base.get(r["seed"]) is not None]
    mean, std = mean_std(diffs)
    # wins: the seeds where the run's loss is lower; a tie is no win (ties counts them)
    return dict(mean=mean, std=std, wins=sum(d < 0 for d in diffs),
                ties=sum(d == 0 for d in diffs), n=len(diffs))

def summarize(runs, baseline):
    """Groups of like finished runs; a row per (variant, routing block, knobs and --set values),
    at its chosen lr. A row with --set values off their baselines pairs with the row of its
    variant at the baselines, any other with the baseline variant's row."""
    groups, rank = {}, {v: i for i, v in enumerate(VARIANTS)}
    for r in runs:
        # a group: one dataset, depth and setup; inside it, only the rows (variant, knobs) differ
        rows = groups.setdefault((str(r["dataset"]), r["depth"], r["setup"]), {})
        key = (r["variant"], r["block"], r["off"], r["row"])
        # by lr: make_row keeps the rate of the row's lowest mean and lists the others
        rows.setdefault(key, {}).setdefault(r["lr"], []).append(r)
    out = []
    for (dataset, depth, setup), by_row in sorted(groups.items()):
        # in VARIANTS' order; a variant this version does not know comes last
        keys = sorted(by_row, key=lambda k: (rank.get(k[0], len(rank)), k[0], k[1] or 0, *k[2:]))
        rows = [make_row(k[0], k[1], by_row[k]) for k in keys]
        by_key = dict(zip(keys, rows))
        # every milestone a run of the group crossed, in token order below
        reached = {k: m["tokens"] for row in rows for r in row["runs"]
                   for k, m in r["milestones"].items()}
        # the baseline variant's row with the fewest knobs named: block, not "block, wav_rho=2"
        plain = [row for row in rows if (row["variant"], row["off"]) == (baseline, False)]
        base = min(plain, key=lambda row: row["label"].count("="), default=None)
        for row in rows:
            # a row off its --set baselines pairs with its own variant at the baselines (home), any
            # other with the baseline variant's row; each at its own best lr (make_row): at the
            # row's lr, a value that moves the best rate would beat a home run off its best
            home = by_key.get((row["variant"], row["block"], False, row["runs"][0]["home"]))
            row["vs"] = (home and home["runs"]) if row["off"] else base and base["runs"]
            # the baseline is not paired with itself: a Δ of 0 by construction is no result
            vs = row["vs"] if row is not base else None
            row["delta"] = vs and paired(row["runs"], vs, lambda r: r["final"])
            # k=k: each lambda keeps its own milestone (a plain closure would see the loop's last k)
            at = {k: lambda r, k=k: r["milestones"].get(k, {}).get("val_loss") for k in reached}
            row["at"] = {k: (mean_std(map(val, row["runs"])), vs and paired(row["runs"], vs, val))
                         for k, val in at.items()}
        out.append(dict(dataset=dataset, depth=depth, level=rows[0]["runs"][0]["level"], rows=rows,
                        setup=setup, base=base, milestones=sorted(reached, key=reached.get)))
    return out

def make_row(name, block, by_lr):
    """A row: the variant's runs at the lr of the lowest mean final val loss over seeds."""
    means = {lr: statistics.fmean(r["final"] for r in rs) for lr, rs in by_lr.items()}
    # each row at its own best rate: a variant is not judged at a rate tuned for another
    lr = min(means, key=means.get)
    runs = sorted(by_lr[lr], key=lambda r: r["seed"])
    # the variant, its knobs and --set values; off their baselines, the values its Δ is against
    base = ", ".join(f"{k}={x}" for k, x in runs[0]["set_base"].items() if runs[0]["set"][k] != x)
    label = ", ".join([name, *(f"{k}={x}" for k, x in runs[0]["set"].items())])
    label += f" (Δ vs {base})" if base else ""
    # the lowest or highest of several rates: the best may lie outside the grid
    side = {min(means): ("lowest", "below"), max(means): ("highest", "above")}.get(lr)
    edge = f"lr {lr:g} is the {side[0]} of the grid for {label}: the best rate may be " \
        f"{side[1]} it; extend --lrs" if side and len(means) > 1 else None
    # rates whose runs have other seeds (a sweep still running): their means are not alike
    seeds = {lr: sorted(r["seed"] for r in rs) for lr, rs in by_lr.items()}
    uneven = f"lr {lr:g} for {label} is chosen over rates run on other seeds (" + "; ".join(
        f"lr {k:g}: {v}" for k, v in sorted(seeds.items())) + "): the choice may change as " \
        "they finish" if len({tuple(v) for v in seeds.values()}) > 1 else None
    # two runs of one seed in one row: a paired Δ could take either, so refuse to guess
    for a, b in [(a, b) for a, b in zip(runs, runs[1:]) if a["seed"] == b["seed"]]:
        raise UsageError(f"runs {a['name']} and {b['name']} are both {name}, seed {a['seed']}, lr "
                         f"{lr:g} in one setup: neither pairs clearly; report one at a time")
    # the level's unit (prepare_data.LEVELS): bits per character, perplexity for GPT-2 tokens
    to_metric = prepare_data.LEVELS[runs[0]["level"]][1]
    routes = {k: mean_std(r["routes"].get(k) for r in runs) for k in route_numbers(runs)}
    return dict(variant=name, block=block, lr=lr, runs=runs, val=mean_std(r["final"] for r in runs),
                label=label, off=runs[0]["off"], warnings=[w for w in (edge, uneven) if w],
                metric=mean_std(to_metric(r["final"]) for r in runs),  # bits per char, perplexity
                routes=routes,  # the routes' numbers: {name: (mean, std)}
                js_pair=runs[0]["routes"].get("js_pair"),  # what the two routes feed: "QK‖V"
                wall=mean_std(r["summary"].get("wall_time_s") for r in runs),
                others={k: (m, len(by_lr[k])) for k, m in means.items() if k != lr})

def route_numbers(runs):
    """The run-level numbers of the runs' routes (routing_stats: entropy_norm_mean, js_mean and any
    a user adds), each a column of the report, in their order: a new statistic is reported without
    a word here. A name that no run gives a number (js_pair's label, a mean of nothing) has none."""
    names = {}
    for r in runs:
        for k, v in r["routes"].items():
            names[k] = names.get(k, False) or common.is_number(v)
    return [k for k, number in names.items() if number]

def data_name(g):  # a group's data: its folder, and the dataset where they differ (textfile)
    folder = Path(g["rows"][0]["runs"][0]["summary"]["train"]["data"]).name
    return g["dataset"] if folder == g["dataset"] else f"{folder} ({g['dataset']})"

def titles(groups):
    """Each group's heading; groups of one data and depth also name what sets them apart."""
    heads = []
    for g in groups:
        twins = [dict(h["setup"]) for h in groups
                 if (data_name(h), h["depth"]) == (data_name(g), g["depth"])]
        diff = [f"{k} {dict(g['setup']).get(k, 'unset')}" for k in sorted(set().union(*twins))
                if len({t.get(k) for t in twins}) > 1]
        heads.append(f"{data_name(g)}, {g['depth']} layers" + f" ({', '.join(diff)})" * bool(diff))
    return heads

def _ms(ms, digits=4, sign=""):  # "mean ± std"; "mean ± –" for one seed; "–" for none
    std = "–" if ms[1] is None else f"{ms[1]:.{digits}f}"
    return "–" if ms[0] is None else f"{ms[0]:{sign}.{digits}f} ± {std}"

def _delta(d):  # two cells: "Δ mean ± std", "wins/n"
    if not d or not d["n"]:
        return ["–", "–"]
    ties = f" ({d['ties']} tied)" if d["ties"] else ""
    return [_ms((d["mean"], d["std"]), sign="+"), f"{d['wins']}/{d['n']}{ties}"]

def table(header, rows):
    """A markdown table's lines. A row with more or fewer cells than the header is an error: a
    column added to one and not the other would otherwise stop the table rendering, silently."""
    for cells in rows:
        if len(cells) != len(header):
            raise ValueError(f"a report row has {len(cells)} cells for {len(header)} columns "
                             f"({' | '.join(header)}): {cells}")
    lines = ["| " + " | ".join(str(c) for c in cells) + " |" for cells in [header, *rows]]
    return lines[:1] + ["|---" * len(header) + "|"] + lines[1:]

def group_notes(g, baseline):
    """The lines under a group's heading: what its runs share, what to read its table with."""
    # the settings every run here shares off its default: a report says what the runs were
    # (one since removed from train.py has no default: named)
    shared = [f"{k} {v}" for k, v in g["setup"]
              if k not in ("data", "level") and v != repr(DEFAULTS.get(k))]
    lines = [f"Every run here: {', '.join(shared)}.", ""] * bool(shared)

    def known(key, unknown):  # the values of key among the group's runs, but the unknown one
        return sorted({r[key] for row in g["rows"] for r in row["runs"]} - {unknown})

    # grouped by the data folder's name: say so where the splits' SHA-256 show other data in it
    if len(known("data_sha256", "null")) > 1:
        lines += ["**WARNING: these runs trained on different data** in folders of one name (their "
                  "splits' SHA-256 differ): prepare each text in its own folder.", ""]
    # precision is how a run ran (--dtype auto is bf16 on one device, float32 on another), yet
    # it moves the loss: pairs across it measure it too
    precisions = known("precision", "")
    if len(precisions) > 1:
        lines += [f"**WARNING: these runs ran at different precisions** ({', '.join(precisions)}): "
                  "their differences measure the precision too: give every run one --dtype.", ""]
    # how a run ran never splits a group, but its wall time (train s) measures that too
    ran = known("ran", None)
    if len(ran) > 1:
        lines += [f"**train s compares runs that ran differently** ({'; '.join(ran)}): a time "
                  "there is also one of device and compiling.", ""]
    # a finished run trained to the end its settings set, so one group's runs saw the same tokens;
    # a change that ends a run sooner (early stopping) would be compared as if it had not been
    seen = known("tokens", None)
    if len(seen) > 1:
        lines += [f"**WARNING: these runs ended after different numbers of tokens** "
                  f"({', '.join(f'{t:,}' for t in seen)}): their differences measure that too.", ""]
    lines += routing_notes(g)
    if not g["base"]:
        lines += [f"(no finished {baseline} run here: no paired differences)", ""]
    # a row off its --set baselines pairs only with its variant at them, set up alike
    lone = [row["label"] for row in g["rows"] if row["off"] and not row["vs"]]
    if lone:
        lines += [f"**No Δ for {'; '.join(lone)}**: no run of its --set baseline here "
                  "(a setting that differs, a --resume change say, puts a run in another group)",
                  ""]
    return lines

def table_warnings(rows):
    """The WARNING lines under a group's table: each row's own (its lr), and the Δs of one pair."""
    lines = [f"WARNING: {w}" for row in rows for w in row["warnings"]]
    # one pair: a Δ without a spread cannot be told from the seeds' noise
    lone = [row["label"] for row in rows if row["delta"] and row["delta"]["n"] == 1]
    return lines + [f"WARNING: one seed for the Δ of {', '.join(lone)}: it cannot be told from "
                    "noise; run more --seeds"] * bool(lone)

def routing_notes(g):
    """The lines that say where a group's rows route differently: blocks, the reads of a mean."""
    lines = []
    # a sweep gives its AttnRes rows one block (sweep_block); runs by hand may differ: say so
    if len({row["block"] for row in g["rows"]} - {None}) > 1:
        base = g["base"] and f" (Δ against {g['base']['label']} at block {g['base']['block']})"
        lines += [f"**Routing blocks differ**: a difference is also one of block size{base or ''}."
                  "\n"]
    # some route numbers are means over reads (routing_stats: entropy_reads): a row whose model
    # has other reads (a variant without the MLP's, say) would compare a mean of other things
    reads = {}
    for row in g["rows"]:
        names = row["runs"][0]["routes"].get("entropy_reads")
        if names:  # none: no routes, or a run from before they were recorded
            reads.setdefault(tuple(names), []).append(row["label"])
    if len(reads) > 1:
        kinds = "; ".join(f"{', '.join(labels)}: {len(names)} reads"
                          for names, labels in reads.items())
        means = ", ".join(k for k, number in ROUTE_NUMBERS.items() if number["over_reads"])
        lines += [f"**WARNING: {means}: means over other reads in some rows** ({kinds}): compare "
                  "them only between rows of the same reads.", ""]
    return lines

def milestone_table(rows, marks):  # per variant: val loss at each milestone, its Δ and wins
    header = ["variant"]
    for m in marks:
        header += [f"val @{m}", f"Δ @{m}", "wins"]
    cells = []
    for row in rows:
        cells.append([row["label"]])
        for m in marks:
            cells[-1] += [_ms(row["at"][m][0]), *_delta(row["at"][m][1])]
    return table(header, cells)

def markdown(folders, runs, groups, baseline, notes):
    finished = [r for r in runs if r["summary"]]
    lines = [f"# Report: {' '.join(folders)}", "", f"{len(runs)} runs: {len(finished)} finished, "
             f"{len(runs) - len(finished)} unfinished. A group: runs alike but for seed, lr, "
             "variant and --set values. Val loss: the last eval's, nats/token, mean ± sample std "
             f"over seeds. Δ: paired difference to **{baseline}** (same seed), or (Δ vs) to the "
             "same variant at the baseline of its --set values (the default, else the first "
             "given), over the seeds both have; wins: of those n seeds, where lower. lr: of the "
             "lowest mean. Then the routes' numbers (routing_stats): "
             + "; ".join(f"{k}, {number['about']}" for k, number in ROUTE_NUMBERS.items()) + ".",
             ""]
    lines += [f"Left out: {note}" for note in notes] + [""] * bool(notes)
    for g, title in zip(groups, titles(groups)):
        unit, marks = prepare_data.LEVELS[g["level"]][0], g["milestones"]
        lines += [f"## {title}", "", *group_notes(g, baseline)]
        numbers = route_numbers([run for row in g["rows"] for run in row["runs"]])
        header = ["variant", "lr", "block", "seeds", "val loss", f"val {unit}", "Δ val loss",
                  "wins", *numbers, "train s"]
        rows = []
        for row in g["rows"]:
            name = f"**{row['label']}** (baseline)" if row is g["base"] else row["label"]
            routes = []
            for k in numbers:
                cell = _ms(row["routes"].get(k, (None, None)), 3)
                have = sum(common.is_number(run["routes"].get(k)) for run in row["runs"])
                if 0 < have < len(row["runs"]):  # a statistic newer than some of its runs
                    cell += f" ({have} of {len(row['runs'])} seeds)"
                # newer than all of them: not "–", which says the routes have no such number
                elif all(run["routes"] and k not in run["routes"] for run in row["runs"]):
                    cell = "not recorded"
                if k == "js_mean" and row["js_pair"]:
                    cell += f" ({row['js_pair']})"  # what the two routes feed
                routes.append(cell)
            rows.append([name, f"{row['lr']:g}", row["block"] or "–", len(row["runs"]),
                         _ms(row["val"]), _ms(row["metric"], 4 if unit == "bpc" else 2),
                         *_delta(row["delta"]), *routes, _ms(row["wall"], 0)])
        lines += table(header, rows)
        warned = table_warnings(g["rows"])
        lines += [""] * bool(warned) + warned
        if marks:
            lines += ["", "Milestones (val loss where the token count crossed each one):", ""]
            lines += milestone_table(g["rows"], marks)
        others = [f"- {row['label']}: " + "; ".join(
            f"lr {lr:g}: {m:.4f} ({n} seeds)" for lr, (m, n) in sorted(row["others"].items()))
            for row in g["rows"] if row["others"]]
        head = ["", "Other learning rates (mean final val loss over their seeds):", ""]
        lines += head * bool(others) + others + [""]
    unfinished = ", ".join(r["name"] for r in runs if not r["summary"])
    lines += [f"Unfinished (no summary.json yet): {unfinished}"] * bool(unfinished)
    return "\n".join(lines) + "\n"

def report(args, extra):
    runs, notes = find_runs(args.folders)
    if not runs:  # why, from the notes: no run.json or summary.json, or files it cannot read
        more = f" (and {len(notes) - 3} more)" * (len(notes) > 3)
        raise UsageError(f"{'; '.join(notes[:3])}{more}: give a sweep's --out folder or a "
                         "train.py --out_dir")
    variants = {r["variant"] for r in runs if r["summary"]}
    # block first: WAV and RD modify Block AttnRes, so a Δ against it is their own effect
    baseline = args.baseline or next((v for v in ("block", "prenorm") if v in variants),
                                     min(variants, default=None))
    if variants and baseline not in variants:
        raise UsageError(f"--baseline {baseline}: no finished run of that variant; finished "
                         f"variants: {', '.join(sorted(variants))}")
    # the output and the checkpoints first: a wrong --out or --heatmap is one line
    out = common.own_file(args.out or Path(args.folders[0]) / "report.md",
                          lambda text: text.startswith("# Report: "))
    heatmaps = {name: route_matrix(next((r["dir"] for r in runs if r["name"] == name), Path(name)),
                                   args.data) for name in args.heatmap}
    names = ["val_loss.png"] * args.plots + [heatmap_file(name) for name in heatmaps]
    figure_paths(out.parent, names)  # refused now, before report.md is written
    # finished runs alone: an unfinished run's loss is of an earlier step, not comparable
    groups = summarize([r for r in runs if r["summary"]], baseline)
    text = markdown(args.folders, runs, groups, baseline, notes)
    Figure = figure_class() if args.plots or heatmaps else None
    if (args.plots or heatmaps) and Figure is None:  # in report.md too: its figures are missing
        text += f"\n{NO_MATPLOTLIB}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text.encode())
    print(text + f"\nwrote {out}")
    if Figure is not None:
        figures = {"val_loss.png": (val_loss_figure, groups, baseline)} if args.plots else {}
        for name, matrix in heatmaps.items():
            figures[heatmap_file(name)] = (routes_figure, name, *matrix)
        save_figures(out.parent, figures, Figure)
    return 0

# --- Figures (matplotlib is optional). ---

def figure_class():  # matplotlib's Figure, or None where it is not installed
    try:
        # Figure, not pyplot: no display or global state needed; matplotlib stays optional
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure

# each PNG's Software text: a figure there that lacks it is a user's, never written over
PNG_MARK = {"Software": "nanoroute experiments.py"}
OWN_NAME = "move or rename it: this command writes a file of its own under that name"

def heatmap_file(run):
    return f"routes_{file_safe(run).strip('_.')}.png"

def figure_paths(folder, names):
    """{FILE: folder/FILE} for figures that may be written: new, or PNGs this script wrote."""
    mark = "Software\0" + PNG_MARK["Software"]
    # a figure of an earlier version has no mark: refused too, as a file of yours would be
    return {name: common.own_file(folder / name, lambda text: mark in text, OWN_NAME)
            for name in names}

def save_figures(folder, figures, Figure):
    """Each {FILE: (draw, *args)}: draw(Figure, *args) as the PNG folder/FILE."""
    for name, path in figure_paths(folder, figures).items():
        draw, *args = figures[name]
        fig = draw(Figure, *args)
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, metadata=PNG_MARK))
        print(f"wrote {path}")

def val_loss_figure(Figure, groups, baseline):
    from matplotlib import colormaps
    fig = Figure(figsize=(6.5 * len(groups), 7.5), layout="constrained")
    axes = fig.subplots(2, len(groups), squeeze=False, sharex="col",
                        gridspec_kw=dict(height_ratios=[3, 2]))
    for g, title, ax, dax in zip(groups, titles(groups), axes[0], axes[1]):
        for row in g["rows"]:
            # lower panel: each run minus its same-seed partner (minus: at its own token counts)
            base = {r["seed"]: r["curve"] for r in row["vs"] or []}
            # a variant's colour from its place in VARIANTS: the same in every figure
            shade = colormaps["tab20"](([*VARIANTS, row["variant"]].index(row["variant"])) % 20)
            curves = [r["curve"] for r in row["runs"]]
            # the routing block where the group's rows differ in it: else two alike labels
            blocks = {r["block"] for r in g["rows"]} - {None}
            m = f"block {row['block']}, " if len(blocks) > 1 and row["block"] else ""
            band(ax, curves, shade, f"{row['label']} ({m}lr {row['lr']:g}, {len(curves)})")
            band(dax, [minus(r["curve"], base[r["seed"]]) for r in row["runs"]
                       if r["seed"] in base and row is not g["base"]], shade)
        late = [y for row in g["rows"] for r in row["runs"] for t, y in r["curve"].items()
                if t >= 0.2 * max(r["curve"], default=0)]  # the first fifth would dwarf the rest
        dax.axhline(0, color="black", linewidth=0.8)
        ax.set(title=title, ylabel="val loss (nats/token)", ylim=(None, max(late, default=None)))
        dax.set(xlabel="tokens", ylabel=f"Δ val loss vs {baseline} or Δ vs (same seed; "
                "between its evals, linear)")
        ax.legend(fontsize=8, title="variant (lr, seeds); band: min–max", title_fontsize=8)
    return fig

def minus(curve, partner):
    """curve − partner ({tokens: val loss}) at curve's token counts within partner's span, partner
    linear between its evals: runs of other batches (--set batch_size) evaluate at other counts."""
    tokens = sorted(partner)
    losses = [partner[t] for t in tokens]
    return {t: y - np.interp(t, tokens, losses) for t, y in curve.items()
            if tokens and tokens[0] <= t <= tokens[-1]}

def band(ax, curves, shade, label=None):
    """Mean line and min–max band over curves ({tokens: value}), at the tokens all reached."""
    # the tokens every curve reached: a run cut short does not bend the mean or the band
    if curves and (tokens := sorted(set.intersection(*map(set, curves)))):
        y = np.array([[c[t] for t in tokens] for c in curves])
        ax.plot(tokens, y.mean(0), color=shade, label=label, marker="o" * (len(tokens) < 3))
        ax.fill_between(tokens, y.min(0), y.max(0), color=shade, alpha=0.2, linewidth=0)

def routes_figure(Figure, name, reads, sources, matrix):
    # NaN, masked below: a source not in a read's pool is blank, not a weight of 0
    w = np.array([[np.nan if x is None else x for x in row] for row in matrix], dtype=float)
    fig = Figure(figsize=(2.6 + 0.8 * len(sources), 1.6 + 0.34 * len(reads)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(w), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (i, j), x in np.ndenumerate(w):
        if not np.isnan(x):
            ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if x < 0.6 else "black")
    ax.set_xticks(range(len(sources)), sources, rotation=30, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(reads)), reads)
    ax.set(xlabel="source (blank: not in this read's pool)", ylabel="read",
           title=f"{name}: mean routing weight (best.pt, 8 val crops)")
    fig.colorbar(image, ax=ax, label="weight", shrink=0.9)
    return fig

# --- A trained run's routes, and interventions on them (SPEC: Controls, interventions). ---

def load_model(run_dir, ckpt="best.pt", data=None, device="cpu"):
    """A run's model (eval mode), checkpoint, val split (of --data if given) and eval crops."""
    path, last = Path(run_dir) / ckpt, Path(run_dir) / "last.pt"
    hint = " (it has a last.pt: --ckpt last)" if ckpt == "best.pt" and last.exists() else ""
    saved = checkpoint.load(path, f"no {ckpt} in {run_dir}: give a run folder of train.py{hint}")
    model = checkpoint.model_from(saved, path).to(device).eval()
    if model.config.residual != "attnres":
        raise UsageError(f"{path}: a {model.config.residual} model has no depth routes")
    folder, meta = checkpoint.open_data(saved, run_dir, data)  # one line if moved or another
    val, s = prepare_data.open_split(folder, "val", meta), saved["settings"]
    T = model.config.sequence_len
    # split 1: the val crops train.py scored this run on: the base loss compares with its evals
    return model, saved, val, train.eval_offsets(len(val), T, s["batch_size"], s["eval_tokens"], 1)

def route_matrix(run_dir, data=None):
    """(reads, sources, each read's mean weight per source or None): best.pt, train.py's crops."""
    model, _, val, offsets = load_model(run_dir, data=data)
    # the same 8 val crops as train.py's routing diagnostics, on best.pt's weights
    stats = train.routes(model, val, offsets[0][:8], torch.device("cpu"))
    reads = stats["reads"]
    return list(reads), stats["sources"], [[dict(zip(r["sources"], r["mean_weight"])).get(s)
                                             for s in stats["sources"]] for r in reads.values()]

def chosen_mask(pools, m, names=(), older_than=None, only=None):
    """(mask, kept): {Read: sources} hidden by name (C0, P take their details) or by age, in every
    read or only `only`; a read it would leave nothing to read keeps its sources and is listed."""
    known = {n for pool in pools.values() for src in pool for n in (src, src.partition(".")[0])}
    if set(names) - known or only not in (None, *map(str, pools)):
        raise UsageError(f"--mask {','.join(names)} --read {only}: the sources are "
                         f"{sorted(known)}; the reads {', '.join(map(str, pools))}")
    mask, kept = {}, []
    for read, pool in pools.items():
        # age in blocks: the reader's block minus the completed block's index
        age = {src: read.sublayer // m - source_block(src) for src in pool if src[0] == "C"}
        hidden = {src for src in pool if src in names or src.partition(".")[0] in names
                  or (older_than is not None and age.get(src, -1) > older_than)}
        if hidden and only in (None, str(read)):
            # a read may not hide every source (its softmax would have nothing to read): it keeps
            # them all and is listed
            mask.update({read: hidden} if len(hidden) < len(pool) else {})
            kept += [str(read)] * (len(hidden) == len(pool))
    if not mask:
        raise UsageError("ablate: give --mask NAMES and/or --older_than K that hide a source of "
                         f"some read (a read keeps a mask of all its sources: {kept or 'none'})")
    return mask, kept

def random_mask(mask, pools, seed):  # the control: as many sources per read, never all, at random
    rng = random.Random(seed)
    return {read: set(rng.sample(pools[read], len(hidden))) for read, hidden in mask.items()}

def ablate(args, extra):
    """Δ val loss of the mask in each read alone and in all, beside count-matched random masks."""
    if args.draws < 1:
        raise UsageError(f"--draws {args.draws}: give 1 or more random masks to compare with")
    if (args.older_than or 0) < 0:
        raise UsageError(f"--older_than {args.older_than}: give 0 or more (0: every completed "
                         "block)")
    folder, device = Path(args.run_dir), train.pick_device(args.device)
    tag, out = ablate_files(args)
    model, saved, val, offsets = load_model(args.run_dir, f"{args.ckpt}.pt", args.data, device)
    s, T = saved["settings"], model.config.sequence_len
    with torch.no_grad():  # each read's sources by name, from one forward (RD tied: one read)
        routes = model(train.get_batch(val, offsets[0][:1], T, device)[0][0], return_routes=True)[2]
    pools = {r["read"]: r["sources"] for r in routes if r["read"] in model.reads}
    names = args.mask.split(",") if args.mask else []
    mask, kept = chosen_mask(pools, model.config.routing_block, names, args.older_than, args.read)

    # in the run's precision (--dtype, on this device): unmasked, its loss is the run's evals'
    ctx = train.autocast(train.pick_dtype(s["dtype"], device), device)

    def score(masked):  # train.evaluate's number on the run's eval crops, masked
        model.masked = masked
        return train.evaluate(model, val, offsets, T, device, ctx, s["micro_batch"])
    base, rows = score({}), []
    path = "fast (the kernel takes the −inf logits)" if model.config.fast_routing else "reference"
    print(f"{args.run_dir} ({args.ckpt}.pt, step {saved['progress']['step']}): val loss "
          f"{base:.4f} on its eval crops; routing path {path}; random: {args.draws} draws")
    masks = [(str(r), {r: h}) for r, h in mask.items()] + [("all", mask)] * (len(mask) > 1)
    for label, masked in masks:
        # the control: as many sources hidden at random (seeds 0..draws-1): a Δ beyond theirs is
        # about which sources, not how many
        control = [score(random_mask(masked, pools, seed)) - base for seed in range(args.draws)]
        rows.append(dict(read=label, delta=score(masked) - base, random=control,
                         random_mean_std=mean_std(control),
                         masked={str(r): sorted(h, key=source_block) for r, h in masked.items()}))
        print(f"  {label:<14} {rows[-1]['delta']:+.4f}  random {_ms(mean_std(control), sign='+')}  "
              + ",".join(rows[-1]["masked"].get(label, [f"{len(mask)} reads"])))
    if kept:
        print(f"  not masked (it would hide every source of the read): {', '.join(kept)}")
    write_json(out, dict(vars(args), step=saved["progress"]["step"],
               fast_routing=model.config.fast_routing, base_val_loss=base, rows=rows, kept=kept))
    print(f"wrote {out}")
    Figure = figure_class()
    if Figure is None:
        return print(NO_MATPLOTLIB) or 0
    save_figures(folder, {f"ablate_{tag}.png": (ablate_figure, rows, folder.name, tag)}, Figure)
    return 0

def ablate_files(args):
    """The ablation's tag and JSON path, its files checked first: a user's file of that name is
    refused before the ablation runs, not written over after it."""
    # the checkpoint in the name: an ablation of last.pt never writes over best.pt's
    tag = "_".join([args.ckpt] + [f"mask-{args.mask}"] * bool(args.mask)
                   + [f"read-{args.read}"] * bool(args.read)
                   + [f"older{args.older_than}"] * (args.older_than is not None))
    folder = Path(args.run_dir)
    figure_paths(folder, [f"ablate_{tag}.png"])
    return tag, common.own_file(folder / f"ablate_{tag}.json",
                                lambda text: '"base_val_loss"' in text, OWN_NAME)

def ablate_figure(Figure, rows, run, tag):
    fig = Figure(figsize=(7, 1.4 + 0.4 * len(rows)), layout="constrained")
    ax, y = fig.subplots(), range(len(rows))
    ax.barh(y, [r["delta"] for r in rows], label="the mask")
    ax.errorbar([r["random_mean_std"][0] for r in rows], y, fmt="o", color="C1",
                xerr=[r["random_mean_std"][1] or 0 for r in rows], label="random, mean ± std")
    ax.set_yticks(y, [r["read"] for r in rows])
    ax.set(xlabel="Δ val loss (masked − unmasked)", title=f"{run}: ablate {tag}")
    ax.legend(fontsize=8)
    return fig

# --- Command line. ---

def build_parser():
    p = common.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="a named sweep or a custom grid, train.py per run",
                       epilog="; ".join(f"{k}: {v['variants']} x seeds {v['seeds']}, depths "
                                        f"{v['depths']}" for k, v in SWEEPS.items()) + ". Flags "
                       "after -- go to each run they have an effect in; `tail -f OUT/*/train.log` "
                       "follows the runs.")
    s.add_argument("name", choices=[*SWEEPS, "custom"])
    s.add_argument("--out", type=common.folder_name,
                   help="folder of the run folders (default: runs/NAME)")
    s.add_argument("--data", type=common.folder_name,
                   help="custom: a prepared dataset folder (its meta.json names it)")
    s.add_argument("--data_root", type=common.folder_name, default="data",
                   help="named sweeps: folder of the datasets")
    s.add_argument("--variants", help="custom (required), or override: " + ",".join(VARIANTS))
    s.add_argument("--seeds", help="0,1,2 or 0-4 (custom: 0-2)")
    s.add_argument("--depths", help=f"n_layer values (custom: {CUSTOM['depths'][0]})")
    s.add_argument("--lrs", help="run each variant and seed at each rate: 1e-3,2e-3,4e-3")
    s.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                   help="run each variant and seed at each value of train.py's --NAME (again for "
                   "another); a variant it has no effect in runs once")
    s.add_argument("--attnres_block", type=int, help="of all AttnRes runs (default: largest auto)")
    s.add_argument("--jobs", type=int, default=1, help="runs at once (CPU: cores/N threads each)")
    s.add_argument("--torchrun", type=int, metavar="N", help="each run on N processes (DDP)")
    s.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    r = sub.add_parser("report", help="tables (and figures) of finished runs")
    r.add_argument("folders", type=common.folder_name, nargs="+",
                   help="sweep --out folders or train.py run folders")
    r.add_argument("--baseline", help="variant the others pair with (default: block, else prenorm)")
    r.add_argument("--out", type=common.file_name,
                   help="report.md's path (default: in the first folder)")
    r.add_argument("--plots", action="store_true", help="also val_loss.png (matplotlib)")
    r.add_argument("--heatmap", action="append", default=[], metavar="RUN", help="routes_RUN.png")
    a = sub.add_parser("ablate", help="Δ val loss when a run's reads may not read some sources")
    a.add_argument("run_dir", type=common.folder_name)
    a.add_argument("--mask", help="source names: emb,C0 (C0 and P take their details too)")
    a.add_argument("--older_than", type=int, metavar="K", help="mask blocks older than K blocks")
    a.add_argument("--read", help="only this read, e.g. layer3.attn (default: every read)")
    a.add_argument("--draws", type=int, default=5, help="random count-matched masks (seeds 0..N-1)")
    a.add_argument("--ckpt", choices=("best", "last"), default="best")
    a.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps")
    for parser in (r, a):
        parser.add_argument("--data", type=common.folder_name,
                            help="the runs' dataset folder, if it moved")
    return p

@common.cli
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = build_parser().parse_args(argv[:cut]), argv[cut + 1:]
    if extra and args.command != "sweep":
        raise UsageError(f"{args.command} takes no flags after -- (got {shlex.join(extra)})")
    return dict(sweep=sweep, report=report, ablate=ablate)[args.command](args, extra)

if __name__ == "__main__":
    sys.exit(main())
