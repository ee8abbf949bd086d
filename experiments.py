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
its command; train.log: its output). Finished runs (summary.json) are skipped and interrupted ones
continue from last.pt: the same command resumes a sweep. The variants of a seed are paired: train.py makes
the data order and the shared initial weights depend only on --seed. Like for like: every AttnRes variant
of a sweep gets the same routing block at a depth (the largest automatic one among them; WAV needs 4).

The report groups finished runs by (dataset, depth, variant) over seeds and writes RUNS/report.md:
mean ± std of the final val loss and bits per char (or perplexity), the paired difference to a baseline
variant (same dataset, depth and seed) with its std and wins, the same at each milestone, route entropy
(AttnRes) and QK/V JS divergence (RD). --plots adds PNGs (matplotlib, optional).
"""

import concurrent.futures
import json
import math
import os
import queue
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import prepare_data
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
    [{name, dir, variant, dataset, depth, seed, sweep, attnres_block, args, env}], seed-major (all
    variants of a seed before the next seed: an interrupted sweep leaves whole pairs). seeds and depths
    are text as on the command line ("0-2", "8,12")."""
    seeds, depths = _ints(seeds, "--seeds", 0), _ints(depths, "--depths", 1)
    variants = _variants(variants)
    for flag, grid in GRID_FLAGS.items():  # after --, they would silently override the grid
        if _flag_value(extra, flag) is not None:
            raise UsageError(f"{flag} after --: the sweep sets it for each run; use {grid} (before --)")
    if name == "custom":
        sweep = custom_sweep(data, variants)
    elif data is not None:
        raise UsageError(f"--data {data}: only sweep custom takes a data folder; sweep {name} reads its datasets "
                         f"({', '.join(SWEEPS[name]['datasets'])}) from --data_root")
    else:
        sweep = SWEEPS[name]
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
                                     env=sweep.get("env", {})))
    return runs


GRID_FLAGS = {"--data": "--data (sweep custom) or --data_root", "--n_layer": "--depths", "--seed": "--seeds",
              "--out_dir": "--out", **{f"--{k}": "--variants" for k in VARIANTS["block"]}}


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
    environment of the slot it takes (job_slots); returns the names of failed runs."""
    todo, skipped, t0 = [], 0, time.time()
    for i, run in enumerate(runs, 1):
        d = run["dir"]
        if (d / "summary.json").exists():
            before = (_read_json(d / "run.json") or {}).get("args", run["args"])
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

    free, lock, stop, failed = queue.SimpleQueue(), threading.Lock(), threading.Event(), []
    for slot in slots:
        free.put(slot)

    def launch(label, run, cmd, resume):
        slot = free.get()  # a free slot exists: the pool runs at most len(slots) of these at once
        try:
            if stop.is_set():
                return
            d, env = run["dir"], _run_env(run, slot)
            d.mkdir(parents=True, exist_ok=True)
            info = {k: run[k] for k in ("variant", "dataset", "depth", "seed", "sweep", "attnres_block", "args")}
            prepare_data.write_json(d / "run.json", dict(info, command=_shell(cmd, env)))
            with lock:
                print(f"{label}{' (resuming from last.pt)' if resume else ''}: started"
                      + "".join(f" {k}={v}" for k, v in slot.items()), flush=True)
            t = time.time()
            with open(d / "train.log", "a") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
            ok = rc == 0 and (d / "summary.json").exists()
            if ok:
                final = read_summary(d / "summary.json")["final"]
                result = f"done in {time.time() - t:.0f} s, val loss {final['val_loss']:.4f}"
            else:
                lines = (d / "train.log").read_text(errors="replace").strip().splitlines() or ["(no output)"]
                result = f"FAILED (exit {rc}): {next((s for s in reversed(lines) if 'error' in s.lower()), lines[-1])}"
            with lock:
                print(f"{label}: {result}", flush=True)
                if not ok:
                    failed.append(run["name"])
        finally:
            free.put(slot)

    pool = concurrent.futures.ThreadPoolExecutor(len(slots))
    try:
        for future in [pool.submit(launch, *job) for job in todo]:
            future.result()
    except BaseException:  # Ctrl-C: the runs under way get it too; start no more
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    failed.sort(key=[r["name"] for r in runs].index)
    print(f"sweep: {len(runs)} runs: {skipped} skipped (finished before), {len(runs) - skipped - len(failed)} "
          f"done, {len(failed)} failed; {time.time() - t0:.0f} s" + f"; {len(slots)} at a time" * (len(slots) > 1))
    return failed


def _run_env(run, slot):
    """A run's extra environment: its slot's, then its sweep's (tiny: one thread); a variable the user
    set wins, except the slot's CUDA_VISIBLE_DEVICES (job_slots picked it among the user's)."""
    env = {k: v for k, v in {**slot, **run.get("env", {})}.items() if k not in os.environ}
    return {**env, **{k: v for k, v in slot.items() if k == "CUDA_VISIBLE_DEVICES"}}


def _shell(cmd, env):
    return " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)])


# -----------------------------------------------------------------------------
# Report: reading run folders, statistics, Markdown


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_summary(path):
    """A run's summary.json, or None while the run is unfinished (no file). A file that is there but is
    not a summary train.py wrote is an error: shown as unfinished, the run would silently drop out."""
    if not Path(path).exists():
        return None
    try:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))
        why = None if isinstance(summary, dict) and isinstance((summary.get("final") or {}).get("val_loss"),
                                                                 (int, float)) else "no final val_loss"
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        why = f"not valid JSON: {type(e).__name__}"
    if why:
        raise UsageError(f"{path} is damaged ({why}): delete it and run the sweep command again, which "
                         "finishes that run from its last.pt")
    return summary


def variant_of(config):
    """The VARIANTS name of a GPTConfig dict (for run folders without run.json), else 'custom'."""
    return next((k for k, v in VARIANTS.items() if all(config.get(f) == x for f, x in v.items())), "custom")


def load_runs(runs_dir):
    """Every folder under runs_dir with a run.json or summary.json: {name, dir, variant, dataset, depth,
    seed, summary (None while unfinished), evals (metrics.jsonl's eval lines)}."""
    root = Path(runs_dir)
    dirs = sorted({p.parent for f in ("run.json", "summary.json") for p in root.rglob(f)})
    runs = []
    for d in dirs:
        info, summary = _read_json(d / "run.json") or {}, read_summary(d / "summary.json")
        evals = []
        metrics = d / "metrics.jsonl"
        for line in metrics.read_text(errors="replace").splitlines() if metrics.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption, or damaged bytes
            if record.get("type") == "eval":
                evals.append(record)
        s = summary or {}
        runs.append(dict(name=d.relative_to(root).as_posix(), dir=d, summary=summary, evals=evals,
                         block=info["attnres_block"] if "attnres_block" in info else routing_block(s.get("config")),
                         variant=info.get("variant") or variant_of(s.get("config", {})),
                         dataset=info.get("dataset") or s.get("dataset"),
                         depth=info.get("depth") or s.get("config", {}).get("n_layer"),
                         seed=info.get("seed", s.get("train", {}).get("seed"))))
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
    """Paired difference value(run) - value(baseline run of the same seed), over the seeds both have:
    {mean, std, wins (seeds where the variant is lower, i.e. better), ties, n}."""
    base = {r["seed"]: value(r) for r in baseline_runs}
    diffs = [value(r) - base[r["seed"]] for r in runs if value(r) is not None and base.get(r["seed"]) is not None]
    mean, std = mean_std(diffs)
    return dict(mean=mean, std=std, wins=sum(d < 0 for d in diffs), ties=sum(d == 0 for d in diffs), n=len(diffs))


def final_val(run):
    return run["summary"]["final"]["val_loss"]


def milestone_val(label):  # val loss of the evaluation where the token count crossed this milestone
    return lambda run: run["summary"].get("milestones", {}).get(label, {}).get("val_loss")


def route_entropy(run):
    """Mean over reads of the last evaluation's route entropy (AttnRes runs). RD's extra value reads
    (*.attn.v) are left out, so every variant averages the same reads (JS compares those)."""
    entropy = [h for name, h in ((run["summary"].get("routes") or {}).get("entropy") or {}).items()
               if not name.endswith(".v")]
    return statistics.fmean(entropy) if entropy else None


def js_mean(run):  # RD runs: JS divergence between the QK and V routes, mean over attention layers
    return (run["summary"].get("routes") or {}).get("js_mean")


def summarize(runs, baseline):
    """Finished runs grouped by (dataset, depth): [{dataset, depth, level, baseline, milestones, blocks
    ({AttnRes variant: its routing blocks}), rows: [{variant, seeds, val, metric, entropy, js, wall, delta,
    at: {milestone: {val, delta}}}]}]."""
    groups = {}
    for r in runs:
        if r["summary"]:
            groups.setdefault((r["dataset"], r["depth"]), {}).setdefault(r["variant"], []).append(r)
    order = {v: i for i, v in enumerate(VARIANTS)}
    out = []
    for (dataset, depth), by_variant in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1] or 0)):
        level = next(iter(by_variant.values()))[0]["summary"].get("level")
        to_metric = (lambda v: v / math.log(2)) if level == "char" else math.exp  # bits per char, perplexity
        reached = {label: m["tokens"] for rs in by_variant.values() for r in rs
                   for label, m in r["summary"].get("milestones", {}).items()}
        labels = sorted(reached, key=reached.get)
        base = by_variant.get(baseline)
        rows = []
        for variant in sorted(by_variant, key=lambda v: (order.get(v, len(order)), v)):
            rs = sorted(by_variant[variant], key=lambda r: r["seed"])
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


def markdown(runs_dir, runs, groups, baseline):
    finished = [r for r in runs if r["summary"]]
    lines = [f"# Report: {runs_dir}", "",
             f"{len(runs)} runs: {len(finished)} finished, {len(runs) - len(finished)} unfinished. "
             "Val loss: the last evaluation's, in nats per token; mean ± sample std over seeds (– for one seed). "
             f"Δ: paired difference to **{baseline}** (variant − baseline on the same dataset, depth and seed), "
             "mean ± std over seeds; wins: seeds where the variant's val loss is lower. Route entropy (nats): "
             "mean over reads, AttnRes runs; JS (nats, ≤ ln 2 = 0.693): QK route vs V route, mean over "
             "attention layers, RD runs. Both from each run's last evaluation.", ""]
    if finished and (finished[0]["dir"] / "run.json").exists():
        cmd = _read_json(finished[0]["dir"] / "run.json").get("command", "")
        lines += [f"Command of run `{finished[0]['name']}`: `{cmd}`", ""]
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
        lines += [f"| variant | seeds | val loss | {unit} | Δ val loss | wins | route entropy | JS QK‖V | train s |",
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
    """val_loss.png (val loss per variant, and its paired difference to the baseline) and
    routes_<run>.png next to report.md for heatmaps {run: route_matrix(run)}; returns the paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # headless
        import matplotlib.pyplot as plt
    except ImportError:
        print(NO_MATPLOTLIB)
        return []
    import numpy as np

    def band(ax, curves, color, label=None):  # mean line and min-max band over seeds; returns the mean
        tokens = sorted(set.intersection(*(set(c) for c in curves))) if curves else []  # reached by every seed
        y = np.array([[c[t] for t in tokens] for c in curves])
        if tokens:
            ax.plot(tokens, y.mean(0), color=color, label=label)
            ax.fill_between(tokens, y.min(0), y.max(0), color=color, alpha=0.2, linewidth=0)
        return [m for t, m in zip(tokens, y.mean(0) if tokens else []) if t >= 0.2 * tokens[-1]]

    groups, written = {}, []
    for r in runs:
        if r["evals"]:
            groups.setdefault((str(r["dataset"]), r["depth"] or 0), {}).setdefault(r["variant"], []).append(r)
    fig, axes = plt.subplots(2, max(1, len(groups)), figsize=(7 * max(1, len(groups)), 8), squeeze=False, sharex="col")
    for (ax, dax), ((dataset, depth), by_variant) in zip(axes.T, sorted(groups.items())):
        curves = {v: {r["seed"]: {e["tokens"]: e["val_loss"] for e in r["evals"] if e["tokens"] > 0} for r in rs}
                  for v, rs in by_variant.items()}
        base, late = curves.get(baseline, {}), []
        for i, variant in enumerate(sorted(curves, key=lambda v: (list(VARIANTS) + [v]).index(v))):
            late += band(ax, list(curves[variant].values()), f"C{i}", f"{variant} (n={len(curves[variant])})")
            diffs = [{t: y - base[s][t] for t, y in c.items() if t in base[s]} for s, c in curves[variant].items()
                     if s in base]
            if variant == baseline:
                dax.axhline(0, color=f"C{i}", label=f"{variant} (baseline)")
            elif diffs:
                band(dax, diffs, f"C{i}", variant)
        lo = min((min(y for c in v.values() for y in c.values()) for v in curves.values()), default=None)
        if late and max(late) > lo:  # zoom on the last 80% of training, where the variants differ
            ax.set_ylim(lo - 0.05 * (max(late) - lo), max(late) + 0.05 * (max(late) - lo))
        ax.set(title=f"{dataset}, {depth} layers: mean over seeds, band = min–max", ylabel="val loss (nats/token)")
        dax.set(title=f"paired difference to {baseline} (same seed)", xlabel="tokens",
                ylabel="Δ val loss (nats/token)")
        dax.set_yscale("symlog", linthresh=0.05)  # linear within ±0.05, log beyond: small and large gaps both show
        for a in (ax, dax):
            a.grid(alpha=0.3)
            a.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    written.append(Path(runs_dir) / "val_loss.png")
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)
    for name, (reads, sources, matrix) in heatmaps.items():
        w = np.array([[np.nan if x is None else x for x in row] for row in matrix])
        fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(sources), 1.0 + 0.3 * len(reads)))
        image = ax.imshow(np.ma.masked_invalid(w), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        for (i, j), x in np.ndenumerate(w):
            if not np.isnan(x):
                ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=6, color="white" if x < 0.6 else "black")
        ax.set_xticks(range(len(sources)), sources, rotation=60, fontsize=7)
        ax.set_yticks(range(len(reads)), reads, fontsize=7)
        ax.set_xlabel("source (blank: not in this read's pool)")
        ax.set_title(f"{name}: mean routing weight (best.pt, val crops)", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.04)
        fig.tight_layout()
        written.append(Path(runs_dir) / f"routes_{name.replace('/', '_')}.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written


# -----------------------------------------------------------------------------
# Command line


def report(runs_dir, baseline=None, make_plots=False, heatmaps=(), data_root=None):
    runs = load_runs(runs_dir)
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
    text = markdown(runs_dir, runs, summarize(runs, baseline), baseline)
    print(text)
    prepare_data.write_atomic(Path(runs_dir) / "report.md", lambda f: f.write(text.encode() + b"\n"))
    print(f"wrote {Path(runs_dir) / 'report.md'}")
    for path in plots(runs_dir, runs, heatmaps, baseline) if make_plots else []:
        print(f"wrote {path}")


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
            report(args.runs_dir, args.baseline, args.plots or bool(args.heatmap), args.heatmap,
                   args.data_root)
            return 0
        runs = plan(args.name, args.out or f"runs/{args.name}", args.seeds, args.depths, args.variants, extra,
                    args.data_root, args.data)
        slots = job_slots(args.jobs, args.torchrun or 1, extra)
        launcher = [sys.executable, TRAIN] if not args.torchrun else [  # "--": train.py drops it
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.torchrun}",
            TRAIN, "--"]
        try:
            failed = run_sweep(runs, launcher, args.dry_run, slots)
        except KeyboardInterrupt:
            print("\ninterrupted: run the same command again to resume (finished runs are skipped, "
                  "interrupted ones continue from their last.pt)", file=sys.stderr)
            return 130
        if failed:
            print(f"{len(failed)} run(s) failed (see their train.log): {', '.join(failed)}", file=sys.stderr)
            return 1
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
