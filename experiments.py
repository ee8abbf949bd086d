"""
Paired sweeps over nanoroute's variants, and the report that compares them (SPEC: Paired experiments).

    python experiments.py sweep tiny                             # 9 variants x 3 seeds: 8 min on 2 CPU cores
    python experiments.py sweep rd_paper --dry_run               # print the RD paper's 50 commands
    python experiments.py sweep wav_paper --depths 12 -- --device cuda:0   # flags after -- go to every run
    python experiments.py sweep rd_paper --seeds 0-1 --torchrun 8          # each run on 8 GPUs
    python experiments.py report runs/tiny --baseline block --plots --heatmap rd_L4_s0

A sweep runs train.py once per grid point, one run after another, in OUT/[DATASET/]VARIANT_L{depth}_s{seed}/
(run.json: what the run is and its command; train.log: its output). Finished runs (summary.json) are
skipped and interrupted ones continue from last.pt: the same command resumes a sweep. The variants of a
seed are paired: train.py makes the data order and the shared initial weights depend only on --seed.

The report groups finished runs by (dataset, depth, variant) over seeds and writes RUNS/report.md:
mean ± std of the final val loss and bits per char (or perplexity), the paired difference to a baseline
variant (same dataset, depth and seed) with its std and wins, the same at each milestone, route entropy
(AttnRes) and QK/V JS divergence (RD). --plots adds PNGs (matplotlib, optional).
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parent / "train.py")

# A variant is a set of GPTConfig values, passed as flags. All three are always given, so a preset's own
# values (rd_s sets rd=decoupled, wav12 sets wav=True) never leak into another variant.
VARIANTS = {
    "prenorm": dict(residual="prenorm", wav=False, rd="off"),
    "rezero": dict(residual="rezero", wav=False, rd="off"),
    "layerscale": dict(residual="layerscale", wav=False, rd="off"),
    "block": dict(residual="attnres", wav=False, rd="off"),  # Block AttnRes
    "wav": dict(residual="attnres", wav=True, rd="off"),
    "rd": dict(residual="attnres", wav=False, rd="decoupled"),
    "rd_tied": dict(residual="attnres", wav=False, rd="tied"),
    "rd_average": dict(residual="attnres", wav=False, rd="average"),
    "rd_frozen_v": dict(residual="attnres", wav=False, rd="frozen_v"),
}

# Named sweeps: the grid (datasets x depths x seeds x variants) and the flags every run shares.
# presets: the train.py preset of each depth (the preset sets the width and the schedule).
# attnres_flags: added to the AttnRes variants only (train.py rejects AttnRes flags on the others).
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
        env={"OMP_NUM_THREADS": "1"},
        # auto would give Block AttnRes 2 sublayers per block at 4 layers, but WAV needs 4: the same for all
        attnres_flags="--attnres_block 4"),
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


class UsageError(Exception):
    """A problem the user can fix: main() prints `error: ...` and exits with code 2."""


# -----------------------------------------------------------------------------
# Sweep


def plan(name, out, seeds=None, depths=None, variants=None, extra=(), data_root="data"):
    """The runs of sweep `name`: [{name, dir, variant, dataset, depth, seed, sweep, args}], seed-major
    (all variants of a seed before the next seed: an interrupted sweep leaves whole pairs)."""
    sweep = SWEEPS[name]
    bad = [v for v in variants or () if v not in VARIANTS]
    if bad:
        raise UsageError(f"--variants {','.join(bad)}: unknown; choose from {','.join(VARIANTS)}")
    runs = []
    for dataset in sweep["datasets"]:
        for depth in depths or sweep["depths"]:
            presets = sweep.get("presets")
            if presets and depth not in presets:
                raise UsageError(f"--depths {depth}: sweep {name} has a preset for depths "
                                 f"{', '.join(map(str, presets))} only (the preset sets the width)")
            for seed in sweep["seeds"] if seeds is None else seeds:
                for variant in variants or sweep["variants"]:
                    run = f"{variant}_L{depth}_s{seed}"
                    if len(sweep["datasets"]) > 1:
                        run = f"{dataset}/{run}"
                    flags = [s for k, v in VARIANTS[variant].items() for s in (f"--{k}", str(v))]
                    if VARIANTS[variant]["residual"] == "attnres":
                        flags += shlex.split(sweep.get("attnres_flags", ""))
                    args = (["--preset", presets[depth]] if presets else []) + [
                        "--data", f"{data_root}/{dataset}", "--n_layer", str(depth), "--seed", str(seed),
                        *flags, *shlex.split(sweep["flags"]), *extra]
                    runs.append(dict(name=run, dir=Path(out) / run, variant=variant, dataset=dataset, depth=depth,
                                     seed=seed, sweep=name, args=args, env=sweep.get("env", {})))
    return runs


def run_sweep(runs, launcher, dry_run=False):
    """Run each run's command (launcher + args + --out_dir) in turn; returns the names of failed runs."""
    failed, skipped, t0 = [], 0, time.time()
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
        env = {k: v for k, v in run.get("env", {}).items() if k not in os.environ}
        command = " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)])
        if dry_run:
            print(command)
            continue
        d.mkdir(parents=True, exist_ok=True)
        info = {k: run[k] for k in ("variant", "dataset", "depth", "seed", "sweep", "args")}
        (d / "run.json").write_text(json.dumps(dict(info, command=command), indent=1) + "\n")
        print(f"[{i}/{len(runs)}] {d}{' (resuming from last.pt)' if resume else ''} ...", end=" ", flush=True)
        t = time.time()
        with open(d / "train.log", "a") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
        if rc == 0 and (d / "summary.json").exists():
            final = json.loads((d / "summary.json").read_text())["final"]
            print(f"done in {time.time() - t:.0f} s, val loss {final['val_loss']:.4f}")
        else:
            lines = (d / "train.log").read_text(errors="replace").strip().splitlines() or ["(no output)"]
            print(f"FAILED (exit {rc}): {next((s for s in reversed(lines) if 'error' in s.lower()), lines[-1])}")
            failed.append(run["name"])
    if not dry_run:
        print(f"sweep: {len(runs)} runs: {skipped} skipped (finished before), {len(runs) - skipped - len(failed)} "
              f"done, {len(failed)} failed; {time.time() - t0:.0f} s")
    return failed


# -----------------------------------------------------------------------------
# Report: reading run folders, statistics, Markdown


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


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
        info, summary = _read_json(d / "run.json") or {}, _read_json(d / "summary.json")
        evals = []
        for line in (d / "metrics.jsonl").read_text().splitlines() if (d / "metrics.jsonl").exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption
            if record.get("type") == "eval":
                evals.append(record)
        s = summary or {}
        runs.append(dict(name=d.relative_to(root).as_posix(), dir=d, summary=summary, evals=evals,
                         variant=info.get("variant") or variant_of(s.get("config", {})),
                         dataset=info.get("dataset") or s.get("dataset"),
                         depth=info.get("depth") or s.get("config", {}).get("n_layer"),
                         seed=info.get("seed", s.get("train", {}).get("seed"))))
    return runs


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
    """Finished runs grouped by (dataset, depth): [{dataset, depth, level, baseline, milestones,
    rows: [{variant, seeds, val, metric, entropy, js, wall, delta, at: {milestone: {val, delta}}}]}]."""
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
        out.append(dict(dataset=dataset, depth=depth, level=level, baseline=baseline if base else None,
                        milestones=labels, rows=rows))
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


def route_matrix(run_dir, rows=16):
    """Mean routing weights of a run's best.pt on `rows` val crops: (reads, sources, matrix) with
    sources in pool order and None where a read cannot see a source."""
    import numpy as np
    import torch

    import prepare_data
    import train
    from nanoroute import GPT, GPTConfig, routing_stats
    try:  # train.py's loader: weights_only, and one clear line for a missing or damaged file
        ckpt = train.load_checkpoint(Path(run_dir) / "best.pt", f"no best.pt in {run_dir}",
                                     keys=("model", "config", "train_args"))
    except train.UsageError as e:
        raise UsageError(str(e)) from None
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    data, T = prepare_data.open_split(ckpt["train_args"]["data"], "val"), model.config.sequence_len
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


def report(runs_dir, baseline=None, make_plots=False, heatmaps=()):
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
        if VARIANTS.get(run["variant"], {}).get("residual", "attnres") != "attnres":
            raise UsageError(f"--heatmap {name}: a {run['variant']} run has no depth routes; choose an AttnRes run")
    # read the checkpoints now, with or without matplotlib: a damaged one is an error either way
    heatmaps = {name: route_matrix(Path(runs_dir) / name) for name in heatmaps}
    text = markdown(runs_dir, runs, summarize(runs, baseline), baseline)
    print(text)
    (Path(runs_dir) / "report.md").write_text(text + "\n")
    print(f"wrote {Path(runs_dir) / 'report.md'}")
    for path in plots(runs_dir, runs, heatmaps, baseline) if make_plots else []:
        print(f"wrote {path}")


def _ints(text):  # "0,1,2" or "0-4"
    try:
        return [n for part in text.split(",") for n in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 0,1,2 or 0-4") from None


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="run a named sweep (train.py per grid point); flags after -- go to every run",
                       epilog="named sweeps: " + "; ".join(f"{k}: {v['about']}" for k, v in SWEEPS.items()))
    s.add_argument("name", choices=list(SWEEPS), help="the named sweep")
    s.add_argument("--out", help="folder of the run folders (default: runs/NAME)")
    s.add_argument("--seeds", type=_ints, help="override the sweep's seeds: 0,1,2 or 0-4")
    s.add_argument("--depths", type=_ints, help="override the sweep's depths (n_layer)")
    s.add_argument("--variants", type=lambda t: t.split(","), help="override the variants: " + ",".join(VARIANTS))
    s.add_argument("--data_root", default="data", help="folder of the prepared datasets (default: data)")
    s.add_argument("--torchrun", type=int, metavar="N", help="run each run on N processes (torchrun --standalone)")
    s.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    r = sub.add_parser("report", help="table (and plots) from a sweep's run folders")
    r.add_argument("runs_dir", help="a sweep's --out folder")
    r.add_argument("--baseline", help="variant the others are paired against (default: block, else prenorm)")
    r.add_argument("--plots", action="store_true", help="also write val_loss.png (needs matplotlib)")
    r.add_argument("--heatmap", action="append", default=[], metavar="RUN",
                   help="also write routes_RUN.png for this run folder (implies --plots; repeatable)")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "report":
            report(args.runs_dir, args.baseline, args.plots or bool(args.heatmap), args.heatmap)
            return 0
        runs = plan(args.name, args.out or f"runs/{args.name}", args.seeds, args.depths, args.variants, extra,
                    args.data_root)
        launcher = [sys.executable, TRAIN] if not args.torchrun else [  # "--": train.py drops it
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.torchrun}",
            TRAIN, "--"]
        try:
            failed = run_sweep(runs, launcher, args.dry_run)
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
