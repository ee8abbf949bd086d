"""
Paired sweeps over nanoroute's variants, and the report that compares them (SPEC: Paired experiments).

    python experiments.py sweep tiny                             # 9 variants x 3 seeds: 8 min on 2 CPU cores
    python experiments.py sweep custom --data data/text8 --variants prenorm,block,wav,rd --depths 8,12 \
        --seeds 0-2 --jobs 4 -- --max_iters 2000        # any grid on any prepared folder, 4 runs at once
    python experiments.py sweep rd_paper --dry_run               # print the RD paper's 50 commands
    python experiments.py sweep wav_paper --depths 12 -- --device cuda:0   # flags after -- go to every run
    python experiments.py sweep rd_paper --seeds 0-1 --torchrun 8          # each run on 8 GPUs
    python experiments.py report runs/tiny --baseline block --plots --heatmap rd_L4_s0

A sweep runs train.py once per grid point, --jobs N of them at once (each with its share of the CPU
cores, or on CUDA its own GPU), in OUT/[DATASET/]VARIANT_L{depth}_s{seed}/ (run.json: what the run is and
its command; train.log: its output), and shows each running run's latest step. Finished runs
(summary.json) are skipped and interrupted ones continue from last.pt: the same command resumes a sweep.
Ctrl-C or SIGTERM, to the sweep or to one of its runs, stops the sweep and the runs under way (each
saves last.pt). Before the first run, the flags after -- are checked by train.py's parser and every data
folder must be prepared (--dry_run says what is missing). The variants of a seed are paired: train.py
makes the data order and the shared initial weights depend only on --seed. Like for like: every AttnRes
variant of a sweep gets the same routing block at a depth (the largest automatic one among them; WAV
needs 4).

The report groups finished runs by (dataset, depth, variant) over seeds and writes RUNS/report.md:
mean ± std of the final val loss and bits per char (or perplexity), the paired difference to a baseline
variant (same dataset, depth and seed) with its std and wins, the same at each milestone, the normalised
route entropy (AttnRes) and QK/V JS divergence (RD). --plots adds PNGs (matplotlib, optional).
"""

import concurrent.futures
import contextlib
import errno
import importlib
import io
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import prepare_data
import train
from prepare_data import UsageError
from nanoroute import VARIANTS, GPTConfig  # VARIANTS: the variant names and their GPTConfig values
from train import MODEL_DEFAULTS

TRAIN = str(Path(__file__).resolve().parent / "train.py")
CUSTOM_SEEDS = [0, 1, 2]  # sweep custom without --seeds: three seeds, the fewest that give a std of the pairs

# Named sweeps: the grid (datasets x depths x seeds x variants) and the flags every run shares.
# presets: the train.py preset of each depth (the preset sets the width and the schedule).
SWEEPS = {
    "tiny": dict(
        about="all 9 variants x seeds 0,1,2 at 4 layers x 64 wide, 300 steps on the demo data: "
              "8 min on 2 busy CPU cores",
        datasets=["demo"], depths=[4], seeds=[0, 1, 2], variants=list(VARIANTS),
        # 1024 tokens a step: the milestones are steps 75, 150 and 300, where evaluations fall anyway
        flags="--n_embd 64 --n_head 4 --sequence_len 64 --batch_size 16 --max_iters 300 --warmup_iters 20 "
              "--eval_interval 25 --eval_tokens 8K --milestones 76.8K,153.6K,307.2K --log_interval 25",
        # one thread: a model this small gains little from two, and on a busy machine two threads wait on
        # each other (10x slower steps measured here); an OMP_NUM_THREADS already set is kept
        env={"OMP_NUM_THREADS": "1"}),
    "wav_paper": dict(
        about="WAV v1's design: char-level tinystories and text8, 12/24/48 layers, one seed as in the paper",
        datasets=["tinystories", "text8"], depths=[12, 24, 48], seeds=[0],
        variants=["prenorm", "rezero", "layerscale", "block", "wav"],
        presets={12: "wav12", 24: "wav24", 48: "wav48"}, flags=""),
    "rd_paper": dict(
        about="RD-AttnRes's design: fineweb_edu, S (16 layers, rd_s) and M (24 layers, rd_m), 5 paired seeds, "
              "2B tokens",
        datasets=["fineweb_edu"], depths=[16, 24], seeds=[0, 1, 2, 3, 4],
        variants=["block", "rd", "rd_tied", "rd_average", "rd_frozen_v"],
        presets={16: "rd_s", 24: "rd_m"}, flags="--max_tokens 2B --milestones 0.25B,0.5B,1B,2B"),
}

NO_MATPLOTLIB = ("matplotlib is not installed: pip install matplotlib to get plots "
                 "(the report table is complete without them)")


# -----------------------------------------------------------------------------
# Sweep


def plan(name, out, seeds=None, depths=None, variants=None, extra=(), data_root="data", data=None):
    """The runs of sweep `name` ("custom": variants x depths x seeds on the prepared folder `data`):
    [{name, dir, variant, dataset, depth, seed, sweep, attnres_block, args, env, data}], seed-major (all
    variants of a seed before the next seed: an interrupted sweep leaves whole pairs). seeds and depths
    are text as on the command line ("0-2", "8,12")."""
    seeds, depths = _ints(seeds, "--seeds", 0), _ints(depths, "--depths", 1)
    variants = _variants(variants)
    if name == "custom":
        sweep = custom_sweep(data, variants)
    elif data is not None:
        raise UsageError(f"--data {data}: only sweep custom takes a data folder; sweep {name} reads its datasets "
                         f"({', '.join(SWEEPS[name]['datasets'])}) from --data_root")
    else:
        sweep = SWEEPS[name]
    check_train_flags(extra, name, sweep.get("presets"))
    runs = []
    for dataset in sweep["datasets"]:
        for depth in depths or sweep["depths"]:
            presets = sweep.get("presets")
            if presets and depth not in presets:
                raise UsageError(f"--depths {depth}: sweep {name} has a preset for depths "
                                 f"{', '.join(map(str, presets))} only (the preset sets the width)")
            block = sweep_block(variants or sweep["variants"], depth, extra)
            for seed in seeds or sweep["seeds"]:
                for variant in variants or sweep["variants"]:
                    run = f"{variant}_L{depth}_s{seed}"
                    if len(sweep["datasets"]) > 1:
                        run = f"{dataset}/{run}"
                    flags = [s for k, v in VARIANTS[variant].items() for s in (f"--{k}", str(v))]
                    routed = VARIANTS[variant]["residual"] == "attnres"
                    if routed and _flag_value(extra, "--attnres_block") is None:
                        flags += ["--attnres_block", str(block)]
                    args = (["--preset", presets[depth]] if presets else []) + [
                        "--data", sweep.get("folder", f"{data_root}/{dataset}"), "--n_layer", str(depth),
                        "--seed", str(seed), *flags, *shlex.split(sweep["flags"]), *extra]
                    runs.append(dict(name=run, dir=Path(out) / run, variant=variant, dataset=dataset, depth=depth,
                                     seed=seed, sweep=name, attnres_block=block if routed else None, args=args,
                                     env=sweep.get("env", {}), data=args[args.index("--data") + 1]))
    return runs


GRID_FLAGS = {"--data": "--data (sweep custom) or --data_root", "--n_layer": "--depths", "--seed": "--seeds",
              "--out_dir": "--out", **{f"--{k}": "--variants" for k in VARIANTS["block"]}}


def check_train_flags(extra, name, presets):
    """The flags after -- (for every train.py run), checked before any run starts: the grid's own flags
    by their full names, and everything else by train.py's parser (an unknown, abbreviated or misspelt
    flag, a bad value), each one UsageError line now rather than a failed or mislabelled run later."""
    for flag, grid in GRID_FLAGS.items():  # after --, they would silently override the grid
        if _flag_value(extra, flag) is not None:
            raise UsageError(f"{flag} after --: the sweep sets it for each run; use {grid} (before --)")
    if _flag_value(extra, "--resume") is not None:
        raise UsageError("--resume after --: the sweep resumes each interrupted run itself (run the "
                         "same command again)")
    if presets and _flag_value(extra, "--preset") is not None:
        raise UsageError(f"--preset after --: sweep {name} sets the preset of each depth "
                         f"({', '.join(presets.values())}); use sweep custom for another preset")
    if "-h" in extra or "--help" in extra:
        raise UsageError("--help after --: the flags after -- are train.py's: python train.py --help")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            train.build_parser().parse_args(list(extra))
    except SystemExit:  # the parser's one `error: ...` line, taken into ours
        why = (said.getvalue().strip().splitlines() or ["not accepted"])[-1]
        why = why.removeprefix("error: ").removesuffix("; see --help")
        meant = re.search(r"did you mean (--\w+)\?", why)
        if meant and meant[1] in GRID_FLAGS:
            why += f"; the sweep sets {meant[1]} itself: use {GRID_FLAGS[meant[1]]}"
        why += " (the flags after -- go to every run: python train.py --help)"
        raise UsageError(f"after --: {why}") from None


def custom_sweep(data, variants):
    """sweep custom's grid, like an entry of SWEEPS: the dataset named by the folder's meta.json, and
    train.py's defaults for everything the flags after -- do not set."""
    if data is None or not variants:
        raise UsageError("sweep custom needs --data FOLDER (a prepared dataset) and --variants, e.g. "
                         "--data data/demo --variants prenorm,block,wav,rd")
    try:
        dataset = prepare_data.load_meta(data)["dataset"]
    except prepare_data.UsageError as e:
        raise UsageError(f"--data {data}: {e}") from None
    return dict(datasets=[dataset], folder=str(data), depths=[MODEL_DEFAULTS["n_layer"]], seeds=CUSTOM_SEEDS,
                variants=variants, flags="")


def sweep_block(variants, depth, extra):
    """The routing block (sublayers) every AttnRes variant of a sweep gets at this depth, so that no
    difference between them is also a difference in block size: the largest automatic block among them
    (WAV needs 4 where Block AttnRes alone takes 2), or --attnres_block given after --. None without
    AttnRes variants."""
    routed = [v for v in variants if VARIANTS[v]["residual"] == "attnres"]
    given = _flag_value(extra, "--attnres_block")
    if not routed:
        return None
    if given is not None:
        if not given.isdigit():
            raise UsageError(f"--attnres_block {given} (after --): expected a number of sublayers, e.g. 4")
        return int(given)
    try:
        return max(GPTConfig(n_layer=depth, **VARIANTS[v]).routing_block for v in routed)
    except ValueError as e:
        raise UsageError(f"--depths {depth}: {e}") from None


def _flag_value(args, flag):
    """The last value of `flag` in a train.py argument list (--flag V or --flag=V), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def job_slots(jobs, per_run=1, extra=()):
    """The environment of each of `jobs` runs at once. On CUDA, each its own GPUs (per_run of them, e.g.
    --torchrun's processes) through CUDA_VISIBLE_DEVICES; on CPU, each its share of the cores through
    OMP_NUM_THREADS (torch reads it at start), unless it is set already. One job: the environment as is."""
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: must be at least 1")
    if jobs == 1:
        return [{}]
    device = _flag_value(extra, "--device") or "auto"
    import torch
    if device != "cpu" and torch.cuda.is_available():
        if device.startswith("cuda:"):
            raise UsageError(f"--jobs {jobs} with --device {device}: drop --device (or give --device cuda); each "
                             "run gets its own GPU through CUDA_VISIBLE_DEVICES")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if jobs * per_run > len(gpus):
            raise UsageError(f"--jobs {jobs}: {len(gpus)} visible GPU(s) hold at most {len(gpus) // per_run} runs "
                             f"of {per_run} GPU(s) at once; lower --jobs")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per_run:(i + 1) * per_run])} for i in range(jobs)]
    if "OMP_NUM_THREADS" in os.environ:
        return [{}] * jobs
    return [{"OMP_NUM_THREADS": str(max(1, _cores() // (jobs * per_run)))}] * jobs


def run_sweep(runs, launcher, dry_run=False, slots=({},)):
    """Run each run's command (launcher + args + --out_dir), len(slots) at a time, each run in the
    environment of the slot it takes (job_slots), with each running run's progress on the way;
    returns the names of failed runs. A run that a signal stopped stops the sweep (Stopped)."""
    todo, skipped, t0 = [], 0, time.time()
    for i, run in enumerate(runs, 1):
        d = run["dir"]
        if (d / "summary.json").exists():
            before = read_run_json(d / "run.json").get("args", run["args"])
            print(f"skip {d} (summary.json exists)" + ("" if before == run["args"] else
                  "; WARNING: it ran with other flags than this sweep's, use another --out to rerun it"))
            skipped += 1
            continue
        resume = (d / "last.pt").exists()  # interrupted: continue it rather than start over
        cmd = [*launcher, *run["args"], "--out_dir", str(d), *(["--resume"] if resume else [])]
        if dry_run:
            print(_shell(cmd, _run_env(run, {})))
            continue
        todo.append((f"[{i}/{len(runs)}] {d}", run, cmd, resume))
    if dry_run:
        return []
    sweep = Sweep(slots, Progress(sys.stdout))
    try:
        sweep.run(todo)
    finally:
        failed = sorted(sweep.failed, key=[r["name"] for r in runs].index)
        stopped = f", {len(sweep.stopped)} stopped" if sweep.signum else ""
        print(f"sweep: {len(runs)} runs: {skipped} skipped (finished before), {sweep.done} done, "
              f"{len(failed)} failed{stopped}; {time.time() - t0:.0f} s"
              + f"; {len(slots)} at a time" * (len(slots) > 1))
    return failed


def check_out(out, make):
    """The folder of the run folders: made (make), or checked that it can be; else UsageError."""
    try:
        if make:
            Path(out).mkdir(parents=True, exist_ok=True)
            return
        where = next(p for p in [Path(out).absolute(), *Path(out).absolute().parents] if p.exists())
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(where))
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", str(where))
    except OSError as e:
        where = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        message = f"--out {out}: cannot make that folder ({where}); choose another --out"
        raise UsageError(message) from None


def check_data(runs):
    """The data folders the runs need: (problems, demo folders to prepare). A problem is a folder that
    is not a prepared dataset, in load_meta's words (which name the command that prepares it). A demo
    folder that does not exist yet is no problem: the sweep prepares it before the first run (once,
    also under --jobs)."""
    problems, demo = [], []
    for folder in dict.fromkeys(run["data"] for run in runs):
        if Path(folder).name == "demo" and not os.path.lexists(folder):
            demo.append(folder)
            continue
        try:
            prepare_data.load_meta(folder)
        except UsageError as e:
            problems.append(str(e))
    return problems, demo


def get_ready(runs, out):
    """Before the first run: the folder of the run folders and every data folder, or one UsageError."""
    check_out(out, make=False)
    problems, demo = check_data(runs)
    if problems:
        more = len(problems) - 1
        raise UsageError(problems[0] + (f" (and {more} more: see --dry_run)" if more else ""))
    check_out(out, make=True)
    for folder in demo:
        print(f"preparing the demo dataset in {folder}")
        prepare_data.prepare("demo", folder)


def _run_env(run, slot):
    """A run's extra environment: its slot's, then its sweep's (tiny: one thread); a variable the user
    set wins, except the slot's CUDA_VISIBLE_DEVICES (job_slots picked it among the user's)."""
    env = {k: v for k, v in {**slot, **run.get("env", {})}.items() if k not in os.environ}
    return {**env, **{k: v for k, v in slot.items() if k == "CUDA_VISIBLE_DEVICES"}}


def _shell(cmd, env):
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])


# -----------------------------------------------------------------------------
# Report: reading run folders, statistics, Markdown

# run.json's fields as the sweep writes them (None allowed: a hand-made run.json may leave any out)
RUN_FIELDS = dict(variant=str, dataset=str, depth=int, seed=int, sweep=str, attnres_block=int,
                  args=list, command=str)


def read_run_json(path, notes=None):
    """A run folder's run.json as a dict; {} if there is none, or if it is damaged (not JSON, not an
    object, a field of the wrong type), with a note in notes: the run is then read from its
    summary.json alone, as a plain train.py run would be."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        why = _wrong_fields(info, RUN_FIELDS)
    except (OSError, ValueError) as e:
        why = _unreadable(e)
    if why and notes is not None:
        notes.append(f"{path} is damaged ({why}): left out; the run is read from its summary.json")
    return {} if why else info


def read_summary(path):
    """A run's summary.json, or None while the run is unfinished (no file). A file that is there but is
    not a summary train.py wrote is an error: shown as unfinished, the run would silently drop out."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        why = summary_problem(summary)
    except OSError as e:
        raise UsageError(f"cannot read {path} ({e.strerror or e}): make it readable, or move that run "
                         "folder out of the report's folder") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        why = _unreadable(e)
    if why:
        raise UsageError(f"{path} is damaged ({why}): delete it and run the sweep command again, which "
                         "finishes that run from its last.pt")
    return summary


def read_evals(path, notes):
    """The eval lines of a run's metrics.jsonl. A damaged line is left out with a note; a cut last
    line (no newline: an interrupted run's, repaired when it resumes) is left out without one."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    except OSError as e:
        notes.append(f"{path} cannot be read ({e.strerror or e}): the run's curve is left out")
        return []
    lines = text.split("\n")  # the last piece is "" or a cut line
    evals, damaged = [], 0
    for i, line in enumerate(lines):
        record = _json_object(line) if line.strip() else {}
        usable = record is not None and (record.get("type") != "eval" or (
            _is_int(record.get("step")) and _is_number(record.get("tokens"))
            and _is_number(record.get("val_loss"))))
        if not usable:
            damaged += i < len(lines) - 1
        elif record.get("type") == "eval":
            evals.append(record)
    if damaged:
        notes.append(f"{path}: {damaged} damaged line(s) left out")
    return evals


def variant_of(config):
    """The VARIANTS name of a GPTConfig dict (for run folders without run.json), else 'custom'."""
    return next((k for k, v in VARIANTS.items() if all(config.get(f) == x for f, x in v.items())), "custom")


def load_runs(runs_dir, notes=None):
    """Every folder under runs_dir with a run.json or summary.json: {name, dir, variant, dataset, depth,
    seed, block, summary (None while unfinished), evals (metrics.jsonl's eval lines)}. What is left
    out of a damaged run.json or metrics.jsonl is said in notes (a list)."""
    notes = [] if notes is None else notes
    root = Path(runs_dir)
    dirs = sorted({p.parent for f in ("run.json", "summary.json") for p in root.rglob(f)})
    runs = []
    for d in dirs:
        info, summary = read_run_json(d / "run.json", notes), read_summary(d / "summary.json")
        s = summary or {}
        config, trained = s.get("config") or {}, s.get("train") or {}
        runs.append(dict(name=d.relative_to(root).as_posix(), dir=d, summary=summary,
                         evals=read_evals(d / "metrics.jsonl", notes),
                         block=info["attnres_block"] if "attnres_block" in info else routing_block(config),
                         variant=info.get("variant") or variant_of(config),
                         dataset=info.get("dataset") or s.get("dataset"),
                         depth=info.get("depth") or config.get("n_layer"),
                         seed=info["seed"] if info.get("seed") is not None else trained.get("seed")))
    return runs


def routing_block(config):
    """The routing block (sublayers) of a run's GPTConfig dict, automatic resolved; None without AttnRes."""
    if not config or config.get("residual") != "attnres":
        return None
    try:
        return GPTConfig(**config).routing_block
    except (TypeError, ValueError):
        return None


def mean_std(values):
    """(mean, sample std with ddof=1); std is None for one value, both None for none."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def paired(runs, baseline_runs, value):
    """Paired difference value(run) - value(baseline run of the same seed), over the seeds both have
    (by seed value, whatever the order or gaps; a run without a seed pairs with none): {mean, std,
    wins (seeds where the variant is lower, i.e. better), ties, n}."""
    base = {r["seed"]: value(r) for r in baseline_runs if r["seed"] is not None}
    diffs = [value(r) - base[r["seed"]] for r in runs if value(r) is not None and base.get(r["seed"]) is not None]
    mean, std = mean_std(diffs)
    return dict(mean=mean, std=std, wins=sum(d < 0 for d in diffs), ties=sum(d == 0 for d in diffs), n=len(diffs))


def final_val(run):
    return run["summary"]["final"]["val_loss"]


def milestone_val(label):  # val loss of the evaluation where the token count crossed this milestone
    return lambda run: (run["summary"].get("milestones") or {}).get(label, {}).get("val_loss")


def route_entropy(run):
    """Mean over reads of the last evaluation's normalised route entropy, entropy / ln(number of
    sources the read sees): 0 when one source takes all, 1 when the weights are uniform, so WAV (about
    3x the sources) compares with Block AttnRes. Reads of one source (no value) and RD's extra value
    reads (*.attn.v: every variant averages the same reads; JS compares those) are left out. None for
    runs without it (no AttnRes, or from before summary.json had entropy_norm)."""
    entropy = [h for name, h in ((run["summary"].get("routes") or {}).get("entropy_norm") or {}).items()
               if h is not None and not name.endswith(".v")]
    return statistics.fmean(entropy) if entropy else None


def js_mean(run):  # RD runs: JS divergence between the QK and V routes, mean over attention layers
    return (run["summary"].get("routes") or {}).get("js_mean")


def summarize(runs, baseline):
    """Finished runs grouped by (dataset, depth): [{dataset, depth, level, baseline, milestones, blocks
    ({AttnRes variant: its routing blocks}), rows: [{variant, seeds, val, metric, entropy, js, wall, delta,
    at: {milestone: {val, delta}}}]}]."""
    groups, seen = {}, {}
    for r in runs:
        if not r["summary"]:
            continue
        groups.setdefault((r["dataset"], r["depth"]), {}).setdefault(r["variant"], []).append(r)
        key = (r["dataset"], r["depth"], r["variant"], r["seed"])
        if r["seed"] is not None and seen.setdefault(key, r["name"]) != r["name"]:
            raise UsageError(f"runs {seen[key]} and {r['name']} are both {r['variant']} with seed "
                             f"{r['seed']} ({r['dataset']}, {r['depth']} layers), so neither pairs "
                             "clearly: report one sweep's folder at a time, or move one of them away")
    order = {v: i for i, v in enumerate(VARIANTS)}
    out = []
    for (dataset, depth), by_variant in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1] or 0)):
        level = next(iter(by_variant.values()))[0]["summary"].get("level")
        to_metric = (lambda v: v / math.log(2)) if level == "char" else math.exp  # bits per char, perplexity
        reached = {label: m["tokens"] for rs in by_variant.values() for r in rs
                   for label, m in (r["summary"].get("milestones") or {}).items()}
        labels = sorted(reached, key=reached.get)
        base = by_variant.get(baseline)
        rows = []
        for variant in sorted(by_variant, key=lambda v: (order.get(v, len(order)), v)):
            rs = sorted(by_variant[variant], key=lambda r: (r["seed"] is None, r["seed"] or 0))
            compare = base is not None and variant != baseline
            rows.append(dict(
                variant=variant, seeds=[r["seed"] for r in rs], val=mean_std([final_val(r) for r in rs]),
                metric=mean_std([to_metric(final_val(r)) for r in rs]),
                entropy=mean_std([route_entropy(r) for r in rs]), js=mean_std([js_mean(r) for r in rs]),
                wall=mean_std([r["summary"].get("wall_time_s") for r in rs]),
                delta=paired(rs, base, final_val) if compare else None,
                at={label: dict(val=mean_std([milestone_val(label)(r) for r in rs]),
                                delta=paired(rs, base, milestone_val(label)) if compare else None)
                    for label in labels}))
        blocks = {v: sorted({r["block"] for r in rs}) for v, rs in by_variant.items()
                  if VARIANTS.get(v, {}).get("residual", "attnres") == "attnres" and rs[0]["block"] is not None}
        out.append(dict(dataset=dataset, depth=depth, level=level, baseline=baseline if base else None,
                        milestones=labels, blocks=blocks, rows=rows))
    return out


def _ms(ms, digits=4, sign=""):  # "mean ± std", "mean ± –" for one seed, "–" for none
    if ms[0] is None:
        return "–"
    return f"{ms[0]:{sign}.{digits}f} ± " + ("–" if ms[1] is None else f"{ms[1]:.{digits}f}")


def _delta(d):  # (Δ mean ± std, wins/n)
    if not d or not d["n"]:
        return "–", "–"
    return _ms((d["mean"], d["std"]), sign="+"), f"{d['wins']}/{d['n']}" + (f" ({d['ties']} tied)" if d["ties"] else "")


def markdown(runs_dir, runs, groups, baseline, notes=()):
    finished = [r for r in runs if r["summary"]]
    lines = [f"# Report: {runs_dir}", "",
             f"{len(runs)} runs: {len(finished)} finished, {len(runs) - len(finished)} unfinished. "
             "Val loss: the last evaluation's, in nats per token; mean ± sample std over seeds (– for one seed). "
             f"Δ: paired difference to **{baseline}** (variant − baseline on the same dataset, depth and seed), "
             "mean ± std over seeds; wins: seeds where the variant's val loss is lower. Route entropy: "
             "normalised, entropy / ln(number of sources the read sees) (0: one source takes all, "
             "1: uniform), mean over the reads of more than one source, AttnRes runs (– for runs from "
             "before it was recorded); JS (nats, ≤ ln 2 = 0.693): QK route vs V route, mean over "
             "attention layers, RD runs. Both from each run's last evaluation.", ""]
    command = read_run_json(finished[0]["dir"] / "run.json").get("command") if finished else None
    if command:
        lines += [f"Command of run `{finished[0]['name']}`: `{command}`", ""]
    if notes:
        lines += ["Left out: " + "; ".join(notes) + ".", ""]
    for g in groups:
        unit = "val bpc" if g["level"] == "char" else "val ppl"
        lines += [f"## {g['dataset']}, {g['depth']} layers", ""]
        every = {m for ms in g["blocks"].values() for m in ms}
        if len(every) == 1:
            lines += [f"Routing block: {every.pop()} sublayers for every AttnRes variant (like for like).", ""]
        elif every:
            lines += ["**Routing blocks differ** (" + ", ".join(f"{v}: {'/'.join(map(str, ms))}" for v, ms in
                      g["blocks"].items()) + " sublayers): a difference between these variants is also one of "
                      "block size; rerun them with the same --attnres_block.", ""]
        if g["baseline"] is None:
            lines += [f"(baseline {baseline} has no finished run here: no paired differences)", ""]
        lines += [f"| variant | seeds | val loss | {unit} | Δ val loss | wins | route entropy (norm.) "
                  "| JS QK‖V | train s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in g["rows"]:
            delta, wins = _delta(row["delta"])
            name = f"**{row['variant']}** (baseline)" if row["variant"] == g["baseline"] else row["variant"]
            lines.append(f"| {name} | {len(row['seeds'])} | {_ms(row['val'])} | "
                         f"{_ms(row['metric'], 4 if g['level'] == 'char' else 2)} | {delta} | {wins} | "
                         f"{_ms(row['entropy'], 3)} | {_ms(row['js'], 3)} | {_ms(row['wall'], 0)} |")
        if g["milestones"]:
            lines += ["", "Milestones (val loss when the token count crossed each one):", "",
                      "| variant | " + " | ".join(f"val @{m} | Δ @{m} | wins" for m in g["milestones"]) + " |",
                      "|---|" + "---|---|---|" * len(g["milestones"])]
            for row in g["rows"]:
                cells = [f"{_ms(row['at'][m]['val'])} | {' | '.join(_delta(row['at'][m]['delta']))}"
                         for m in g["milestones"]]
                lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
        lines.append("")
    unfinished = [r for r in runs if not r["summary"]]
    if unfinished:
        lines += ["## Unfinished runs (no summary.json)", ""]
        for r in unfinished:
            last = r["evals"][-1] if r["evals"] else None
            lines.append(f"- {r['name']}: " + (f"last eval at step {last['step']}, val loss {last['val_loss']:.4f}"
                                               if last else "no evaluation yet"))
        lines.append("")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Plots (optional: matplotlib)


def route_matrix(run_dir, rows=16, data_root=None):
    """Mean routing weights of a run's best.pt on `rows` val crops: (reads, sources, matrix) with
    sources in pool order and None where a read cannot see a source. The val split is read from
    the data folder the run was trained on (found from here, or as DATA_ROOT/NAME: --data_root)."""
    import numpy as np
    import torch

    import train
    from nanoroute import GPT, GPTConfig, routing_stats
    # train.py's loader: weights_only, and one clear line for a missing or damaged file
    ckpt = train.load_checkpoint(Path(run_dir) / "best.pt", f"no best.pt in {run_dir}",
                                 keys=("model", "config", "train_args"))
    if ckpt["config"].get("residual") != "attnres":  # the checkpoint decides, whatever run.json calls it
        raise UsageError(f"--heatmap: {Path(run_dir) / 'best.pt'} is a residual={ckpt['config'].get('residual')} "
                         "model, which has no depth routes; choose an AttnRes run")
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    dataset = ckpt.get("meta", {}).get("dataset")
    data_dir = train.find_data(ckpt["train_args"]["data"], run_dir,
                               "give --data_root DIR, the folder that holds it", dataset, data_root)
    data, T = prepare_data.open_split(data_dir, "val"), model.config.sequence_len
    x = torch.from_numpy(np.stack([data[o:o + T] for o in np.linspace(0, len(data) - T - 1, rows, dtype=int)])
                         .astype(np.int64))
    with torch.no_grad():
        stats = routing_stats(model(x, return_routes=True)[2])
    reads, sources = stats["reads"], stats["sources"]
    matrix = [[dict(zip(r["sources"], r["mean_weight"])).get(s) for s in sources] for r in reads.values()]
    return list(reads), sources, matrix


def plots(runs_dir, runs, heatmaps, baseline=None):
    """val_loss.png (val_loss_figure) and routes_<run>.png (routes_figure) next to report.md, for
    heatmaps {run: route_matrix(run)}; returns the paths written. Without matplotlib: a line, no
    files."""
    try:
        importlib.import_module("matplotlib")  # optional; the figures import its parts
    except ImportError:
        print(NO_MATPLOTLIB)
        return []
    figures = {"val_loss.png": val_loss_figure(runs, baseline)}
    figures.update({f"routes_{name.replace('/', '_')}.png": routes_figure(name, *matrix)
                    for name, matrix in heatmaps.items()})
    written = []
    for filename, fig in figures.items():
        if fig is None:
            print(f"no evaluation past step 0 in any run yet: no {filename}")
            continue
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=PLOT_DPI)
        written.append(Path(runs_dir) / filename)
        prepare_data.write_atomic(written[-1], lambda f: f.write(png.getvalue()))
    return written


PLOT_DPI = 110


def val_loss_figure(runs, baseline):
    """One panel pair per (dataset, depth), at most PANELS_PER_ROW side by side: on top each
    variant's val loss over tokens (mean over seeds, min–max band), below its paired difference to
    the baseline (same seed; diff_axis). A variant's curve is that of its finished runs, as in the
    table (of its unfinished ones while none has finished), in the same colour in every panel and
    figure. Returns a matplotlib Figure, None while no run has an evaluation past step 0 (a curve
    starts after it)."""
    from matplotlib.figure import Figure
    groups = {}
    for r in runs:
        if any(e["tokens"] > 0 for e in r["evals"]):
            groups.setdefault((str(r["dataset"]), r["depth"] or 0), {}).setdefault(r["variant"], []).append(r)
    if not groups:
        return None
    cols = min(PANELS_PER_ROW, len(groups))
    rows = -(-len(groups) // cols)
    fig = Figure(figsize=(8.0 * cols, 6.0 * rows), layout="constrained")
    for cell, ((dataset, depth), by_variant) in zip(fig.subfigures(rows, cols, squeeze=False).ravel(),
                                                    sorted(groups.items())):
        ax, dax = cell.subplots(2, 1, sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
        finished = {v: [r for r in rs if r["summary"]] or rs for v, rs in by_variant.items()}
        _draw_group(ax, dax, finished, baseline)
        ax.set_title(f"{dataset}, {depth} layers")
    return fig


PANELS_PER_ROW = 3  # (dataset, depth) groups side by side in val_loss.png; more go to the next row


def _draw_group(ax, dax, by_variant, baseline):
    """val_loss_figure's two panels of one (dataset, depth) group, {variant: its runs}. As in the
    table, runs pair by seed value, and a run without a seed is drawn but pairs with none."""
    curves = {v: [(r["seed"], {e["tokens"]: e["val_loss"] for e in r["evals"] if e["tokens"] > 0})
                  for r in rs] for v, rs in by_variant.items()}
    base = {s: c for s, c in curves.get(baseline, []) if s is not None}
    late, spans = [], {}
    for variant in sorted(curves, key=_variant_rank):
        color, seeds = _variant_color(variant), len(curves[variant])
        finished = by_variant[variant][0]["summary"] is not None
        label = f"{variant} ({seeds} seed{'s' * (seeds > 1)}{'' if finished else ', unfinished'})"
        late += _band(ax, [c for _, c in curves[variant]], color, label)
        diffs = [{t: y - base[s][t] for t, y in c.items() if t in base[s]}
                 for s, c in curves[variant] if s in base]
        if variant != baseline and diffs:
            _band(dax, diffs, color)
            spans[variant] = [d for c in diffs for d in c.values()]
    lo = min(y for v in curves.values() for _, c in v for y in c.values())
    if late and max(late) > lo:  # zoom on the last 80% of training, where the variants differ
        ax.set_ylim(lo - 0.05 * (max(late) - lo), max(late) + 0.05 * (max(late) - lo))
    ax.set(ylabel="val loss (nats/token)")
    ax.legend(title="mean over seeds, band: min–max", fontsize=8, title_fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1))
    scale = diff_axis(dax, spans, _variant_color(baseline) if baseline in curves else "black")
    dax.set(xlabel="tokens", ylabel=f"Δ val loss vs {baseline}\n(same seed{scale})")
    dax.xaxis.set_major_formatter(_formatter(_tokens))
    for a in (ax, dax):
        a.grid(alpha=0.3)


def _band(ax, curves, color, label=None):
    """Mean line and min–max band over seeds, at the tokens every seed reached; returns the mean's
    values in the last 80% of training."""
    import numpy as np
    tokens = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not tokens:
        return []
    y = np.array([[c[t] for t in tokens] for c in curves])
    marker = "o" if len(tokens) < 3 else None  # a curve of one or two points shows as points
    ax.plot(tokens, y.mean(0), color=color, label=label, marker=marker, markersize=4)
    ax.fill_between(tokens, y.min(0), y.max(0), color=color, alpha=0.2, linewidth=0)
    return [m for t, m in zip(tokens, y.mean(0)) if t >= 0.2 * tokens[-1]]


def diff_axis(ax, spans, zero_color):
    """The paired-difference axis, with a zero line and ticks that read as plain numbers (+0.05,
    −0.1, never 4.4×10⁻²). Linear around 0; but when the variant furthest off lies more than 10x
    further than the typical one (ReZero after 300 steps), small gaps would vanish on a linear axis:
    then linear within ±L, a round number that holds the typical variant, and logarithmic beyond,
    with ticks on both sides of 0. spans: {variant: its differences}. Returns what the axis label
    adds ("; log beyond ±0.1", or nothing when linear)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator
    values = [d for ds in spans.values() for d in ds] or [0.0]
    lo, hi = min(0.0, *values), max(0.0, *values)
    peaks = sorted(max(map(abs, ds), default=0.0) for ds in spans.values()) or [0.0]
    typical = peaks[len(peaks) // 2]
    ax.axhline(0, color=zero_color, linewidth=1.2)
    if peaks[-1] <= 10 * typical or peaks[-1] == 0:
        pad = 0.08 * ((hi - lo) or 0.01)
        ax.set_ylim(lo - pad, hi + pad)
        ax.yaxis.set_major_locator(MaxNLocator(6, steps=[1, 2, 2.5, 5, 10]))
        note = ""
    else:
        linear = _round_up(typical)
        ax.set_yscale("symlog", linthresh=linear, linscale=1.0)
        ax.set_ylim(1.3 * min(lo, -linear), 1.3 * max(hi, linear))
        ax.yaxis.set_major_locator(FixedLocator(_symlog_ticks(lo, hi, linear)))
        ax.yaxis.set_minor_locator(NullLocator())
        note = f"; log beyond ±{_plain(linear)[1:]}"
    ax.yaxis.set_major_formatter(_formatter(_plain))
    return note


def _round_up(x):
    """The smallest of 1, 2, 5 x 10^k that is >= x (x > 0)."""
    k = math.floor(math.log10(x))
    return next(m * 10.0 ** e for e in (k, k + 1) for m in (1, 2, 5) if m * 10.0 ** e >= x * (1 - 1e-9))


def _symlog_ticks(lo, hi, linear):
    """Ticks of a symlog axis, linear within ±linear: 0, ±linear/2, ±linear, then 1, 2, 5 x 10^k out
    to the data, fewer where the data reaches further (1, 5 x 10^k past 4x linear, powers of 10 past
    40x), so that labels never crowd."""
    ticks = [-linear, -linear / 2, 0.0, linear / 2, linear]
    for sign, end in ((1, hi), (-1, -lo)):
        steps = (1, 2, 5) if end <= 4 * linear else (1, 5) if end <= 40 * linear else (1,)
        k = math.floor(math.log10(linear))
        while 10.0 ** k <= end:
            ticks += [sign * m * 10.0 ** k for m in steps
                      if linear * 1.0001 < m * 10.0 ** k <= end * 1.0001]
            k += 1
    return sorted(ticks)


def _plain(x):  # a tick as a plain signed number: +0.05, −0.1, 0
    if abs(x) < 1e-12:
        return "0"
    import numpy as np
    digits = np.format_float_positional(abs(x), precision=3, fractional=False, trim="-")
    return ("+" if x > 0 else "−") + digits


def _tokens(x):  # a token count as the milestones write it: 0, 50K, 1.5M, 2B
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _formatter(fn):
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda x, pos: fn(x))


def _variant_rank(variant):
    return (list(VARIANTS) + [variant]).index(variant)


def _variant_color(variant):  # the same colour for a variant in every panel and figure
    return f"C{_variant_rank(variant) % 10}"


def routes_figure(name, reads, sources, matrix):
    """A heatmap of route_matrix's mean routing weights: rows are reads, columns sources in pool order,
    each cell its weight, blank where the read cannot see the source. Returns a matplotlib Figure."""
    import numpy as np
    from matplotlib.figure import Figure
    w = np.array([[np.nan if x is None else x for x in row] for row in matrix], dtype=float)
    fig = Figure(figsize=(max(6.4, 2.6 + 0.8 * len(sources)), max(3.6, 1.6 + 0.34 * len(reads))),
                 layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(w), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (i, j), x in np.ndenumerate(w):
        if not np.isnan(x):
            ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if x < 0.6 else "black")
    slanted = max(map(len, sources)) > 3
    ax.set_xticks(range(len(sources)), sources, rotation=30 if slanted else 0,
                  ha="right" if slanted else "center", rotation_mode="anchor")
    ax.set_yticks(range(len(reads)), reads)
    ax.set(xlabel="source (blank: not in this read's pool)", ylabel="read",
           title=f"{name}: mean routing weight (best.pt, val crops)")
    fig.colorbar(image, ax=ax, label="weight", shrink=0.9)
    return fig


# -----------------------------------------------------------------------------
# Command line


def report(runs_dir, baseline=None, make_plots=False, heatmaps=(), data_root=None):
    notes = []
    runs = load_runs(runs_dir, notes)
    if not runs:
        raise UsageError(f"no runs under {runs_dir} (no run.json or summary.json): run `python experiments.py "
                         "sweep NAME` first, or give the sweep's --out folder")
    variants = {r["variant"] for r in runs if r["summary"]}
    baseline = baseline or next((v for v in ("block", "prenorm") if v in variants), min(variants, default=None))
    if variants and baseline not in variants:
        raise UsageError(f"--baseline {baseline}: no finished run of that variant; finished variants: "
                         f"{', '.join(sorted(variants)) or 'none'}")
    for name in heatmaps:
        run = next((r for r in runs if r["name"] == name), None)
        if run is None or not (run["dir"] / "best.pt").exists():
            raise UsageError(f"--heatmap {name}: no run folder with a best.pt of that name under {runs_dir}; "
                             f"e.g. {next((r['name'] for r in runs if r['variant'] == 'rd'), runs[0]['name'])}")
        config = (run["summary"] or {}).get("config") or VARIANTS.get(run["variant"], {})
        if config.get("residual", "attnres") != "attnres":
            raise UsageError(f"--heatmap {name}: a {run['variant']} run has no depth routes; choose an AttnRes run")
    # read the checkpoints now, with or without matplotlib: a damaged one is an error either way
    heatmaps = {name: route_matrix(Path(runs_dir) / name, data_root=data_root) for name in heatmaps}
    text = markdown(runs_dir, runs, summarize(runs, baseline), baseline, notes)
    print(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    try:  # report.md and the plots go next to the runs
        prepare_data.write_atomic(Path(runs_dir) / "report.md", lambda f: f.write(text.encode() + b"\n"))
        print(f"wrote {Path(runs_dir) / 'report.md'}")
        for path in plots(runs_dir, runs, heatmaps, baseline) if make_plots else []:
            print(f"wrote {path}")
    except OSError as e:
        raise UsageError(f"cannot write the report into {runs_dir} ({e.strerror or e}): make that "
                         "folder writable, or report a writable copy of it") from None


def _ints(text, flag, low):
    """'0,1,2', '0-4' or '0-2,5' as a list of distinct integers >= low; None for None."""
    if text is None:
        return None
    parts = [re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part) for part in str(text).split(",")]
    values = [n for m in parts if m for n in range(int(m[1]), int(m[2] or m[1]) + 1)]
    if not all(parts) or not values or len(set(values)) != len(values) or min(values) < low \
            or any(m[2] and int(m[2]) < int(m[1]) for m in parts):
        raise UsageError(f"{flag} {text}: expected distinct integers >= {low} like 0,1,2 or a rising range "
                         f"like {low}-{low + 2}")
    return values


def _variants(text):
    if text is None:
        return None
    names = text.split(",")
    bad = [v for v in names if v not in VARIANTS]
    if bad or len(set(names)) != len(names):
        raise UsageError(f"--variants {text}: " + (f"unknown {', '.join(map(repr, bad))}" if bad else "a variant twice")
                         + f"; choose from {','.join(VARIANTS)}")
    return names


def build_parser():
    p = prepare_data.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="run a named sweep, or sweep custom: your grid on a prepared folder "
                       "(train.py per grid point); flags after -- go to every run",
                       epilog="named sweeps: " + "; ".join(f"{k}: {v['about']}" for k, v in SWEEPS.items())
                       + "; custom: --variants x --depths x --seeds on --data, train.py's defaults otherwise")
    s.add_argument("name", choices=[*SWEEPS, "custom"], help="a named sweep, or custom")
    s.add_argument("--out", help="folder of the run folders (default: runs/NAME)")
    s.add_argument("--data", help="custom: the prepared dataset folder (its meta.json names the dataset)")
    s.add_argument("--seeds", help="override the sweep's seeds: 0,1,2 or 0-4 (custom: default 0-2)")
    s.add_argument("--depths", help=f"override the sweep's depths (n_layer; custom: default "
                                    f"{MODEL_DEFAULTS['n_layer']})")
    s.add_argument("--variants", help="override the variants (custom: required): " + ",".join(VARIANTS))
    s.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs at once (default 1): on CPU each gets cores/N threads, on CUDA its own GPU")
    s.add_argument("--data_root", default="data", help="folder of the prepared datasets (default: data)")
    s.add_argument("--torchrun", type=int, metavar="N", help="run each run on N processes (torchrun --standalone)")
    s.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    r = sub.add_parser("report", help="table (and plots) from a sweep's run folders")
    r.add_argument("runs_dir", help="a sweep's --out folder")
    r.add_argument("--baseline", help="variant the others are paired against (default: block, else prenorm)")
    r.add_argument("--plots", action="store_true", help="also write val_loss.png (needs matplotlib)")
    r.add_argument("--heatmap", action="append", default=[], metavar="RUN",
                   help="also write routes_RUN.png for this run folder (implies --plots; repeatable)")
    r.add_argument("--data_root", metavar="DIR",
                   help="--heatmap: the folder of the prepared datasets, when a run's own --data "
                   "is not found (default: from here or from the run folder)")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "report":
            if extra:
                raise UsageError(f"report takes no flags after -- (got {shlex.join(extra)})")
            report(args.runs_dir, args.baseline, args.plots or bool(args.heatmap), args.heatmap,
                   args.data_root)
            return 0
        return sweep(args, extra)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only folder: what was written so far is whole
        print(f"error: {prepare_data.os_error_line(e, '--out')}", file=sys.stderr)
        return 2


def sweep(args, extra):
    out = args.out or f"runs/{args.name}"
    runs = plan(args.name, out, args.seeds, args.depths, args.variants, extra, args.data_root, args.data)
    slots = job_slots(args.jobs, args.torchrun or 1, extra)
    launcher = [sys.executable, TRAIN] if not args.torchrun else [  # "--": train.py drops it
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.torchrun}",
        TRAIN, "--"]
    if args.dry_run:
        check_out(out, make=False)
        run_sweep(runs, launcher, dry_run=True)
        problems, demo = check_data(runs)
        for problem in problems:
            print(f"missing: {problem} (the sweep stops before its first run until then)")
        for folder in demo:
            print(f"note: {folder} is not prepared yet; the sweep prepares it first (python "
                  f"prepare_data.py demo --out {shlex.quote(str(folder))})")
        return 0
    try:
        with stop_on_signals():
            get_ready(runs, out)
            failed = run_sweep(runs, launcher, slots=slots)
    except (KeyboardInterrupt, Stopped) as e:
        print("interrupted: run the same command again to resume (finished runs are skipped, the "
              "others continue from their last.pt)", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    if failed:
        print(f"{len(failed)} run(s) failed (see their train.log): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# -----------------------------------------------------------------------------
# Below this banner: running the runs safely (processes, signals, files), showing their progress, and
# checking the files they leave; nothing of the experiment's design.

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 1.0  # how often the running runs' metrics.jsonl are read for the progress lines
# the numbers of a progress line per evaluation, named as in train.py's eval line
EVAL_NUMBERS = (("train", "train_loss"), ("val", "val_loss"), ("bpc", "val_bpc"))


class Stopped(Exception):
    """The sweep stops on a signal: its own (Ctrl-C, SIGTERM, SIGHUP), or one that stopped a run."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_signal(returncode):
    """The signal that ended a run, else None: train.py exits 128 + signum after it saved (130 for
    SIGINT, 143 for SIGTERM); a process that a signal killed before it could save has -signum."""
    return next((s for s in STOP_SIGNALS if returncode in (128 + s, -s)), None)


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGHUP stop the sweep as Ctrl-C does (Stopped in the main thread); a signal that is
    ignored (SIGHUP under nohup) stays ignored."""
    def handler(signum, frame):
        raise Stopped(signum)

    before = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                before[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


class Sweep:
    """The runs under way, one per free slot. A run that a signal stopped, or the sweep's own signal,
    stops the sweep: no run starts after it, and each run under way gets the signal once, as from a
    Ctrl-C (train.py stops after its step and saves last.pt). Each run has a session of its own, so a
    terminal's Ctrl-C reaches only the sweep, which passes it on; a second Ctrl-C passes on too
    (train.py then stops at once)."""

    def __init__(self, slots, progress):
        self.free, self.jobs, self.progress = queue.SimpleQueue(), len(slots), progress
        for slot in slots:
            self.free.put(slot)
        self.lock = threading.Lock()
        self.running, self.signalled = {}, set()  # label: its process; labels that got the stop signal
        self.failed, self.stopped, self.done, self.signum = [], [], 0, None

    def run(self, todo):
        """Every (label, run, cmd, resume) of todo; raises Stopped if a signal stopped the sweep."""
        pool = concurrent.futures.ThreadPoolExecutor(self.jobs)
        futures = [pool.submit(self.launch, *job) for job in todo]
        with self.progress.polling():
            while True:
                try:
                    for future in futures:
                        future.result()
                    break
                except KeyboardInterrupt:
                    self.stop(signal.SIGINT, again=True)
                except Stopped as e:
                    self.stop(e.signum, again=True)
                except BaseException:  # a bug: the runs under way stop and save, then the traceback
                    self.stop(signal.SIGTERM)
                    raise
        pool.shutdown()
        if self.signum is not None:
            raise Stopped(self.signum)

    def launch(self, label, run, cmd, resume):  # in a worker thread: one run, from start to end
        slot = self.free.get()  # a free slot exists: the pool runs at most len(slots) of these at once
        try:
            t = time.time()
            process = self.start(label, run, cmd, slot, resume)
            if process is not None:
                self.finish(label, run, process.wait(), time.time() - t)
        finally:
            self.free.put(slot)

    def start(self, label, run, cmd, slot, resume):
        """The run's process, after run.json and train.log are in its folder; None once the sweep stops
        or when the folder cannot be written (a failed run)."""
        d, env = run["dir"], _run_env(run, slot)
        info = {k: run[k] for k in ("variant", "dataset", "depth", "seed", "sweep", "attnres_block", "args")}
        with self.lock:  # under the lock: stop() sees every process that starts
            if self.signum is not None:
                return None
            try:
                log, log_start = open_run_folder(d, dict(info, command=_shell(cmd, env)))
                tail = RunTail(run, log_start)  # before the run writes: what is there now is not news
            except OSError as e:
                self.failed.append(run["name"])
                self.progress.say(f"{label}: FAILED: {prepare_data.os_error_line(e, '--out')}")
                return None
            with log:  # PYTHONUNBUFFERED: train.log shows each line as it is printed
                process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           env={"PYTHONUNBUFFERED": "1", **os.environ, **env})
            self.running[label] = process
        self.progress.say(f"{label}{' (resuming from last.pt)' if resume else ''}: started"
                          + "".join(f" {k}={v}" for k, v in env.items()))
        self.progress.watch(label, tail)  # after the line that names the run
        return process

    def finish(self, label, run, returncode, seconds):
        with self.lock:
            del self.running[label]
        self.progress.unwatch(label)  # its last evaluations come before its end line
        d, signum = run["dir"], stop_signal(returncode)
        if signum is not None:
            self.stop(signum)
            with self.lock:
                self.stopped.append(run["name"])
            again = "resumes it from its last.pt" if (d / "last.pt").exists() else "starts it again"
            name = signal.Signals(signum).name
            result = f"stopped by {name} (exit {returncode}); the same command {again}"
        else:
            result = self.outcome(run, returncode, seconds)
        self.progress.say(f"{label}: {result}")

    def outcome(self, run, returncode, seconds):
        d, why = run["dir"], None
        if returncode == 0 and (d / "summary.json").exists():
            try:
                final = read_summary(d / "summary.json")["final"]
                with self.lock:
                    self.done += 1
                return f"done in {seconds:.0f} s, val loss {final['val_loss']:.4f}"
            except UsageError as e:
                why = str(e)
        with self.lock:
            self.failed.append(run["name"])
        return f"FAILED (exit {returncode}): {why or last_error_line(d / 'train.log')}"

    def stop(self, signum, again=False):
        """Start no more runs; each run under way gets signum (SIGTERM for SIGHUP: train.py saves on
        it), once, unless again (a second Ctrl-C)."""
        with self.lock:
            self.signum = signum if self.signum is None else self.signum
            for label, process in self.running.items():
                if (again or label not in self.signalled) and process.returncode is None:
                    self.signalled.add(label)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)


def open_run_folder(d, info):
    """Make run folder d, write its run.json (info) and open its train.log to append to: (file, its
    size before). A planted link named train.log is refused (O_NOFOLLOW), never followed."""
    d.mkdir(parents=True, exist_ok=True)
    prepare_data.write_json(d / "run.json", info)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(d / "train.log", flags, 0o644)
    return os.fdopen(fd, "ab"), os.fstat(fd).st_size


def last_error_line(log):
    """The last line of a train.log that names an error, else its last line."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
    except OSError as e:
        return f"(its train.log cannot be read: {e.strerror or e})"
    return next((s for s in reversed(lines) if "error" in s.lower()), lines[-1])


class Progress:
    """The sweep's lines, and each running run's latest step (read from its metrics.jsonl): on a
    terminal, one status line below the others, refreshed in place; elsewhere (a file, a pipe), a
    line per evaluation. A run's evaluations all appear before its end line."""

    def __init__(self, stream):
        self.stream, self.tty = stream, stream.isatty()
        self.lock, self.runs = threading.Lock(), {}  # label: RunTail

    def say(self, line):
        with self.lock:
            self._write(line + "\n")

    def watch(self, label, tail):
        with self.lock:
            self.runs[label] = tail

    def unwatch(self, label):
        with self.lock:
            self._news(label, self.runs.pop(label))

    def poll(self):
        with self.lock:
            for label, tail in self.runs.items():
                self._news(label, tail)
            self._write("")  # the status line, refreshed

    @contextlib.contextmanager
    def polling(self):
        """poll() every POLL_S seconds in a thread while the block runs; then the status line goes."""
        done = threading.Event()

        def loop():
            while not done.wait(POLL_S):
                self.poll()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            with self.lock:
                self.runs.clear()
                self._write("")

    def status(self):
        """The status line: each running run's latest step, cut to the terminal's width."""
        width = shutil.get_terminal_size().columns - 1
        line = "  ".join(f"[{tail.name}: {tail.latest}]" for tail in self.runs.values())
        return line if len(line) <= width else line[:max(0, width - 3)] + "..."

    def _news(self, label, tail):  # under the lock
        for line in tail.read():
            if not self.tty:
                self._write(f"{label}: {line}\n")

    def _write(self, text):  # under the lock; on a terminal the status line is redrawn below the text
        if self.tty:
            text = "\r\x1b[K" + text + self.status()
        if text:
            self.stream.write(text)
            self.stream.flush()


class RunTail:
    """What a running run logs from the moment the sweep starts it: the evaluation lines that its
    metrics.jsonl gains (read on from where the last look stopped; from the start again if train.py
    rewrote the file, printing no evaluation twice), its latest step as text, and its number of steps
    (from the header line train.py writes to train.log)."""

    def __init__(self, run, log_start=0):
        self.name, self.log = run["name"], run["dir"] / "train.log"
        self.metrics = run["dir"] / "metrics.jsonl"
        self.offset, self.inode, self.log_offset, self.total = 0, None, log_start, None
        self.last_eval, self.latest = -1, "starting"
        self.read()  # what is there already (a resumed run's earlier lines) is not news

    def read(self):
        """The evaluations since the last read, as lines; updates latest."""
        self._find_total()
        try:
            with open(self.metrics, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode or os.fstat(f.fileno()).st_size < self.offset:
                    self.inode, self.offset = inode, 0  # rewritten (train.py's repair on resume)
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []  # not written yet
        data = data[:data.rfind(b"\n") + 1]  # whole lines: one being written waits for the next look
        self.offset += len(data)
        news = []
        for line in data.splitlines():
            record = _json_object(line)
            if record is None or not _is_int(record.get("step")):
                continue
            of = f"/{self.total}" if self.total else ""
            if record.get("type") == "eval" and _is_number(record.get("val_loss")):
                numbers = [(name, record.get(key)) for name, key in EVAL_NUMBERS]
                self.latest = f"eval step {record['step']}{of}" + "".join(
                    f" | {name} {v:.4f}" for name, v in numbers if _is_number(v))
                if record["step"] > self.last_eval:
                    self.last_eval = record["step"]
                    news.append(self.latest)
            elif record.get("type") == "train" and _is_number(record.get("loss")):
                self.latest = f"step {record['step']}{of} | loss {record['loss']:.4f}"
        return news

    def _find_total(self):  # "training: 300 steps x ..." near the top of this start's part of train.log
        if self.total is not None:
            return
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                text = f.read(1 << 16).decode(errors="replace")
        except OSError:
            return
        found = re.search(r"^training: ([\d,]+) steps", text, re.MULTILINE)
        if found:
            self.total = int(found[1].replace(",", ""))
        elif re.search(r"^(eval )?step \d", text, re.MULTILINE):  # training began without it
            self.total = 0


# checking the files runs leave: a damaged one is a note or one error line, never a traceback


def summary_problem(s):
    """Why s (a summary.json's content) is not what train.py writes, in the parts the report reads;
    None if it is."""
    if not isinstance(s, dict):
        return "not a JSON object"
    if not _is_number((s.get("final") if isinstance(s.get("final"), dict) else {}).get("val_loss")):
        return "no final val_loss"
    shape = dict(config=dict, train=dict, milestones=dict, routes=dict, wall_time_s=float, dataset=str,
                 level=str)
    why = (_wrong_fields(s, shape) or _wrong_fields(s.get("train") or {}, dict(seed=int), "train.")
           or _wrong_fields(s.get("config") or {}, dict(n_layer=int, residual=str), "config."))
    if why:
        return why
    for label, m in (s.get("milestones") or {}).items():
        if not (isinstance(m, dict) and _is_number(m.get("tokens")) and _is_number(m.get("val_loss"))):
            return f"milestone {label} has no tokens and val_loss"
    routes = s.get("routes") or {}
    for key in ("entropy", "entropy_norm"):
        values = routes.get(key) or {}
        if not (isinstance(values, dict) and all(v is None or _is_number(v) for v in values.values())):
            return f"routes.{key} is not an object of numbers"
    return _wrong_fields(routes, dict(js_mean=float), "routes.")


def _json_object(line):
    """A JSON line as a dict, else None (not JSON, or JSON that is not an object)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _wrong_fields(obj, types, prefix=""):
    """Why obj is not a dict whose fields in `types` are None or of their type (float: any number);
    None if it is."""
    if not isinstance(obj, dict):
        return f"{prefix.rstrip('.') or 'it'} is not a JSON object"
    for key, kind in types.items():
        value = obj.get(key)
        if value is None:
            continue
        ok = {int: _is_int, float: _is_number}.get(kind, lambda v: isinstance(v, kind))(value)
        if not ok or (kind is list and not all(isinstance(v, str) for v in value)):
            return f"{prefix}{key} is not {_KINDS[kind]}"
    return None


_KINDS = {int: "an integer", float: "a number", str: "a string", list: "a list of strings",
          dict: "an object"}


def _unreadable(e):
    if isinstance(e, OSError):
        return f"cannot be read: {e.strerror or e}"
    return "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"not valid JSON: {e}"


if __name__ == "__main__":
    sys.exit(main())
