"""experiments.py: the report's statistics on hand-made run folders, one real sweep through train.py
(resume, skip, a failure), the plans of the named sweeps, and ablate on a real tiny run."""

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import diagnostics
import experiments
import nanoroute
import prepare_data
import train
from conftest import TINY, error_line, run, summary, trained

assert TINY[:2] == ["--n_layer", "2"]
SWEPT = TINY[2:]  # a sweep sets --n_layer itself (--depths)
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def hand_run(root, name, variant, seed, val, *, lr=2e-3, depth=4, dataset="demo", level="char",
             milestones=(), evals=((0, 4.0), (500, 3.0)), run_json=True, reads=None, **flags):
    """A finished run folder as train.py (and a sweep: run.json) leaves it, with the final val loss
    `val`; flags: GPTConfig or TrainSettings fields. Route entropy, RD's JS and a statistic a user
    added to routing_stats (user_mean) from the seed, and a flag (user_flag); reads: those of the
    entropy's mean."""
    d = Path(root) / name
    d.mkdir(parents=True)
    config = dataclasses.asdict(nanoroute.GPTConfig(n_layer=depth, **nanoroute.variant(variant)))
    config.update({k: flags.pop(k) for k in list(flags) if k in config})
    routed = config["residual"] == "attnres"
    rd = variant == "rd"
    routes = dict(entropy_norm_mean=0.5 + seed % 10 / 10, js_mean=seed / 10 if rd else None,
                  js_pair="QK‖V" if rd else None, user_mean=float(seed),  # as routing_stats
                  user_flag=True,  # a true/false of yours: no number, no column
                  entropy_reads=reads or [f"layer{j}.{r}" for j in range(depth)
                                          for r in ("attn", "mlp")][1:] + ["readout"])
    settings = dataclasses.asdict(train.TrainSettings(seed=seed, lr=lr, **flags))
    summary = dict(config=config, train=settings, dataset=dataset, level=level,
                   final=dict(val_loss=val), wall_time_s=10.0, routes=routes if routed else None,
                   milestones={k: dict(step=1, tokens=t, val_loss=v) for k, t, v in milestones})
    (d / "summary.json").write_text(json.dumps(summary))
    lines = [dict(type="eval", step=i, tokens=t, val_loss=v) for i, (t, v) in enumerate(evals)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if run_json:
        (d / "run.json").write_text(json.dumps(dict(variant=variant, seed=seed, args=[])))
    return d


def plan(*argv):
    """The runs `experiments.py ARGV` plans (train.py's flags after --)."""
    argv = [str(a) for a in argv]
    cut = argv.index("--") if "--" in argv else len(argv)
    return experiments.plan(experiments.build_parser().parse_args(argv[:cut]), argv[cut + 1:])


def report(*argv):
    """The report's groups as summarize returns them for these folders (default baseline)."""
    runs, notes = experiments.find_runs(argv)
    assert not notes
    return experiments.summarize([r for r in runs if r["summary"]], "block")


# --- The report's statistics, on hand-made runs ---

def test_report_pairs_by_seed_value_with_gaps_and_counts_wins_and_ties(tmp_path, capsys):
    block, rd = {2: 2.0, 3: 2.5, 10: 3.0}, {10: 2.7, 2: 2.1}  # rd - block: +0.1 (2), -0.3 (10)
    at = {("block", 2): 2.8, ("block", 3): 2.9, ("block", 10): 3.1, ("rd", 10): 3.0, ("rd", 2): 2.8}
    for variant, finals in (("block", block), ("rd", rd)):
        for seed, val in finals.items():
            hand_run(tmp_path, f"{variant}_L4_s{seed}", variant, seed, val,
                     milestones=[("10K", 10_000, val), ("2K", 2_000, at[variant, seed])])
    hand_run(tmp_path, "fw/block_L16_s0", "block", 0, 3.0, depth=16, level="gpt2",
             dataset="fineweb_edu", data="data/fineweb_edu")
    demo, fw = report(tmp_path)
    assert (demo["dataset"], demo["depth"], fw["dataset"]) == ("demo", 4, "fineweb_edu")
    rows = {row["variant"]: row for row in demo["rows"]}
    assert rows["block"]["val"] == pytest.approx((2.5, 0.5))
    assert [r["seed"] for r in rows["block"]["runs"]] == [2, 3, 10]
    assert rows["rd"]["val"] == pytest.approx((2.4, statistics.stdev([2.1, 2.7])))
    assert rows["rd"]["metric"][0] == pytest.approx(2.4 / math.log(2))  # bits per char
    assert rows["rd"]["delta"] == pytest.approx(dict(mean=-0.1, std=statistics.stdev([0.1, -0.3]),
                                                     wins=1, ties=0, n=2))
    assert demo["milestones"] == ["2K", "10K"]  # in token order, not text order
    assert rows["rd"]["at"]["2K"][1] == pytest.approx(dict(mean=-0.05, std=statistics.stdev(
        [0.0, -0.1]), wins=1, ties=1, n=2))  # seed 2 ties
    numbers = rows["rd"]["routes"]  # every number of the routes, one a user added too
    assert numbers["entropy_norm_mean"] == pytest.approx((0.6, statistics.stdev([0.5, 0.7])))
    assert numbers["js_mean"] == pytest.approx((0.6, statistics.stdev([1.0, 0.2])))
    assert numbers["user_mean"] == pytest.approx((6.0, statistics.stdev([10.0, 2.0])))
    assert fw["rows"][0]["metric"][0] == pytest.approx(math.exp(3.0))  # perplexity for tokens
    code, out, _ = run(experiments.main, ["report", tmp_path], capsys)
    text = (tmp_path / "report.md").read_text()
    assert code == 0 and text in out
    assert ("| rd | 0.002 | 2 | 2 | 2.4000 ± 0.4243 | 3.4625 ± 0.6121 | -0.1000 ± 0.2828 | 1/2 | "
            "0.600 ± 0.141 | 0.600 ± 0.566 (QK‖V) | 6.000 ± 5.657 | 10 ± 0 |" in text)
    assert "| wins | entropy_norm_mean | js_mean | user_mean | train s |" in text
    assert "| **block** (baseline) | 0.002 | 2 | 3 | 2.5000 ± 0.5000 |" in text
    assert "| rd | 2.9000 ± 0.1414 | -0.0500 ± 0.0707 | 1/2 (1 tied) |" in text
    assert "## fineweb_edu, 16 layers" in text and "val ppl" in text
    # every row of every table has its header's cells (a separator short of one: no table at all)
    tables = [part.splitlines() for part in text.split("\n\n") if part.startswith("|")]
    assert len(tables) == 3 and all(len({line.count("|") for line in t}) == 1 for t in tables)
    with pytest.raises(ValueError, match="1 cells for 2 columns"):  # a column added to the header
        experiments.table(["variant", "late loss"], [["rd"]])
    # a statistic some runs lack (added since they ran) says over how many seeds it is; a folder
    # without runs is named, one that is not there is an error
    older = json.loads((tmp_path / "rd_L4_s2" / "summary.json").read_text())
    del older["routes"]["user_mean"]
    (tmp_path / "rd_L4_s2" / "summary.json").write_text(json.dumps(older))
    (tmp_path / "empty").mkdir()
    code, out, _ = run(experiments.main, ["report", tmp_path, tmp_path / "empty"], capsys)
    assert code == 0 and "| 10.000 ± – (1 of 2 seeds) | 10 ± 0 |" in out
    assert f"Left out: {tmp_path / 'empty'}: no runs in it (no run.json or summary.json)" in out
    err = error_line(experiments.main, ["report", tmp_path, tmp_path / "typo"], capsys)
    assert f"error: {tmp_path / 'typo'}: no such folder" in err
    # newer than every run of a routed row: not recorded, not the – of a row without routes
    for seed in (2, 10):
        path = tmp_path / f"rd_L4_s{seed}" / "summary.json"
        older = json.loads(path.read_text())
        older["routes"].pop("user_mean", None)
        path.write_text(json.dumps(older))
    out = run(experiments.main, ["report", tmp_path], capsys)[1]
    assert "| 0.600 ± 0.566 (QK‖V) | not recorded | 10 ± 0 |" in out
    assert "| **block** (baseline) | 0.002 | 2 | 3 | 2.5000 ± 0.5000 |" in out  # its number kept
    # a seed the baseline lacks drops out of the pairs, and of n (wins/n counts pairs)
    lone = [dict(seed=2, val=2.1), dict(seed=5, val=2.4)]
    assert experiments.paired(lone, [dict(seed=2, val=2.0)], lambda r: r["val"]) == \
        pytest.approx(dict(mean=0.1, std=None, wins=0, ties=0, n=1))


def test_the_baseline_is_its_row_naming_the_fewest_settings(tmp_path):
    # block with a routing setting off its default is a row of its own, however its label sorts
    for seed in (0, 1):
        hand_run(tmp_path, f"block_L4_s{seed}", "block", seed, 2.0)
        hand_run(tmp_path, f"coef_L4_s{seed}", "block", seed, 1.0, route_entropy_coef=0.5)
        hand_run(tmp_path, f"rd_L4_s{seed}", "rd", seed, 2.5)
    group, = report(tmp_path)
    rows = {row["label"]: row for row in group["rows"]}
    assert group["base"] is rows["block"] and len(rows) == 3
    assert rows["rd"]["delta"]["mean"] == pytest.approx(0.5)


def test_a_mean_over_other_reads_is_said_to_be_one_and_each_number_defined(tmp_path, capsys,
                                                                           monkeypatch):
    # a variant whose MLPs read no route of their own (parallel layers, say) averages other reads;
    # a number a user adds to ROUTE_NUMBERS is defined in the heading and named in the warning
    monkeypatch.setitem(diagnostics.ROUTE_NUMBERS, "user_mean",
                        dict(over_reads=True, about="a user's mean over reads"))
    for seed in (0, 1):
        hand_run(tmp_path, f"block_s{seed}", "block", seed, 2.0)
        hand_run(tmp_path, f"wav_s{seed}", "wav", seed, 1.9)
        hand_run(tmp_path, f"rd_s{seed}", "rd", seed, 1.8, reads=["layer1.attn", "readout"])
    text = run(experiments.main, ["report", tmp_path], capsys)[1]
    assert "**WARNING: entropy_norm_mean, user_mean: means over other reads in some rows** " \
        "(block, wav: 8 reads; rd: 2 reads): compare them only between rows of the same " \
        "reads." in text
    assert "entropy_norm_mean, the route entropy normalised; js_mean, RD's route" in text
    assert "; user_mean, a user's mean over reads." in text
    shutil.rmtree(tmp_path / "rd_s0")
    shutil.rmtree(tmp_path / "rd_s1")
    assert "other reads" not in run(experiments.main, ["report", tmp_path], capsys)[1]


def test_rows_of_two_routing_blocks_are_said_to_differ_and_which_is_the_baseline(tmp_path, capsys):
    for seed in (0, 1):  # runs by hand: the auto block of 4 layers (2), and 4
        hand_run(tmp_path, f"block_s{seed}", "block", seed, 2.0)
        hand_run(tmp_path, f"block4_s{seed}", "block", seed, 1.9, attnres_block=4)
    group, = report(tmp_path)
    assert [(row["block"], row["delta"] and row["delta"]["mean"]) for row in group["rows"]] == [
        (2, None), (4, pytest.approx(-0.1))]
    text = run(experiments.main, ["report", tmp_path], capsys)[1]
    assert "**Routing blocks differ**: a difference is also one of block size (Δ against block " \
        "at block 2)." in text


def test_a_run_by_hand_is_named_by_its_config_as_a_variant_or_the_nearest_and_its_changes(
        tmp_path):
    # train.py by hand leaves no run.json: each variant's run is named by its VARIANTS row, and a
    # config that no row is (two variants at once) by the nearest row and how it differs, never by
    # its residual alone ("attnres"), which would pass it off as another run
    for v in nanoroute.VARIANTS:
        hand_run(tmp_path, v, v, 0, 2.0, run_json=False)
    hand_run(tmp_path, "wav_rd", "wav", 0, 2.0, run_json=False, rd="decoupled")
    # two rows as near (block and block_h4, one field apart): the first, in the table's order
    hand_run(tmp_path, "heads2", "block", 0, 2.0, run_json=False, route_heads=2)
    names = {d.name: experiments.read_run(d, d.name)["variant"] for d in tmp_path.iterdir()}
    assert names == {**{v: v for v in nanoroute.VARIANTS}, "wav_rd": "wav, rd=decoupled",
                     "heads2": "block, route_heads=2"}


def test_one_data_folder_at_two_levels_makes_two_groups_each_in_its_unit(tmp_path, capsys):
    for seed in (0, 1):  # one text as characters and as tokens: never paired across the two
        hand_run(tmp_path, f"chars/block_s{seed}", "block", seed, 2.0)
        hand_run(tmp_path, f"tokens/prenorm_s{seed}", "prenorm", seed, 3.0 + 2 * seed,
                 level="gpt2")
    groups = {g["level"]: g for g in report(tmp_path)}
    assert groups["char"]["rows"][0]["metric"][0] == pytest.approx(2.0 / math.log(2))
    ppl = [math.exp(3.0), math.exp(5.0)]  # each seed's, then their mean (not exp of the mean)
    assert groups["gpt2"]["rows"][0]["metric"] == pytest.approx((statistics.fmean(ppl),
                                                                  statistics.stdev(ppl)))
    assert groups["gpt2"]["base"] is None  # no block run at that level: no Δ
    assert run(experiments.main, ["report", tmp_path], capsys)[0] == 0
    text = (tmp_path / "report.md").read_text()
    assert "| val bpc |" in text and "| val ppl |" in text and "(level 'gpt2')" in text
    assert "different data" not in text
    # the folder prepared anew between two runs (other options): their data's digests differ;
    # a run from before the digests were kept (seed 1 at first) is unknown, not other data
    for seed, digest in ((0, "a1"), (1, "b2")):
        path = tmp_path / "chars" / f"block_s{seed}" / "summary.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), data_sha256={"val": digest})))
        run(experiments.main, ["report", tmp_path], capsys)
        assert ("different data" in (tmp_path / "report.md").read_text()) == (seed == 1)
    text = (tmp_path / "report.md").read_text()
    assert text.count("WARNING: these runs trained on different") == 1
    assert "different precisions" not in text  # hand_run's --dtype auto: unknown, like older runs
    # one seed in bf16 (--dtype auto on a GPU), the other in float32: said, the two named
    for seed, precision in ((0, "bfloat16"), (1, "float32")):
        path = tmp_path / "chars" / f"block_s{seed}" / "summary.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), precision=precision)))
    run(experiments.main, ["report", tmp_path], capsys)
    text = (tmp_path / "report.md").read_text()
    assert text.count("WARNING: these runs ran at different precisions** (bfloat16, float32)") == 1
    assert "ran differently" not in text
    # one seed compiled: the same group (how it ran), but its wall time is not the other's
    path = tmp_path / "chars" / "block_s1" / "summary.json"
    done = json.loads(path.read_text())
    path.write_text(json.dumps(dict(done, train=dict(done["train"], compile=True))))
    run(experiments.main, ["report", tmp_path], capsys)
    text = (tmp_path / "report.md").read_text()
    assert text.count("**train s compares runs that ran differently** (--device auto --compile "
                      "False; --device auto --compile True)") == 1
    assert "different numbers of tokens" not in text  # hand_run's: unknown, like older runs
    # one seed ended sooner (a run stopped early, say): its loss is not at the others' length
    for seed, tokens in ((0, 1000), (1, 500)):
        path = tmp_path / "chars" / f"block_s{seed}" / "summary.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), tokens_seen=tokens)))
    run(experiments.main, ["report", tmp_path], capsys)
    text = (tmp_path / "report.md").read_text()
    assert text.count("WARNING: these runs ended after different numbers of tokens** (500, "
                      "1,000)") == 1


def test_text_files_are_headed_by_their_folders(tmp_path):
    for name, data in (("a", "data/notes"), ("b", "/elsewhere/tales")):  # one dataset: textfile
        hand_run(tmp_path, name, "block", 0, 2.0, dataset="textfile", data=data)
    assert experiments.titles(report(tmp_path)) == ["notes (textfile), 4 layers",
                                                    "tales (textfile), 4 layers"]


def test_report_keeps_unlike_runs_apart_and_reports_several_folders(tmp_path, capsys):
    """A 40-step 128-wide run is not a seed of a 300-step 64-wide one; where and how a run ran
    (out_dir, device, compile, the data folder as written) does not split a group. train.py's
    `python experiments.py report out out_prenorm`: two run folders without run.json, their
    variants from their configs; report.md goes to the first folder, or --out."""
    runs = tmp_path / "runs"
    for seed in (0, 1):
        hand_run(runs, f"block_s{seed}", "block", seed, 2.0 + seed / 10, n_embd=96,
                 max_iters=300, device="cpu", out_dir=f"runs/b{seed}", data="demo",
                 weight_decay=0.05)
        hand_run(runs, f"prenorm_s{seed}", "prenorm", seed, 2.2 + seed / 10, n_embd=96,
                 max_iters=300, compile=True, data="data/demo", weight_decay=0.05)
    hand_run(runs, "block_wide", "block", 0, 1.5, n_embd=192, max_iters=40, weight_decay=0.05)
    # a run made before some settings existed (its summary.json lacks them) ran as their defaults
    # do: it still pairs with the runs made since
    older = runs / "block_s1" / "summary.json"
    summary = json.loads(older.read_text())
    del summary["train"]["grad_clip"], summary["config"]["bias"], summary["config"]["route_heads"]
    del summary["train"]["max_tokens"]  # a default of None (no value) counts too
    summary["train"]["log_interval"] = 7  # it printed more often: the same run
    older.write_text(json.dumps(summary))
    narrow, wide = report(runs)
    assert [len(row["runs"]) for row in narrow["rows"]] == [2, 2]  # prenorm, block: 2 seeds each
    assert [len(row["runs"]) for row in wide["rows"]] == [1] and wide["base"] is not None
    assert narrow["rows"][0]["delta"] == pytest.approx(dict(mean=0.2, std=0.0, wins=0, ties=0, n=2))
    assert experiments.titles([narrow, wide]) == ["demo, 4 layers (max_iters 300, n_embd 96)",
                                                  "demo, 4 layers (max_iters 40, n_embd 192)"]
    assert experiments.main(["report", str(runs)]) == 0
    text = (runs / "report.md").read_text()
    assert text.count("## demo, 4 layers (") == 2 and "| prenorm | 0.002 | – | 2 |" in text
    # what every run of a group shares off train.py's defaults, the differences too (n_head: 6)
    for width in ("max_iters 300, n_embd 96", "max_iters 40, n_embd 192"):
        assert f"\nEvery run here: {width}, n_head 6, weight_decay 0.05.\n" in text
    out = hand_run(tmp_path, "out", "block", 1337, 2.0, run_json=False)
    made = json.loads((out / "summary.json").read_text())  # before route_static existed: a block
    del made["config"]["route_static"]
    (out / "summary.json").write_text(json.dumps(made))
    base = hand_run(tmp_path, "out_prenorm", "prenorm", 1337, 2.25, run_json=False)
    code, printed, _ = run(experiments.main, ["report", out, base], capsys)
    text = (out / "report.md").read_text()
    assert code == 0 and f"# Report: {out} {base}" in text
    assert "| prenorm | 0.002 | – | 1 | 2.2500 ± – | 3.2461 ± – | +0.2500 ± – | 0/1 |" in text
    sweep = tmp_path / "sweep"
    hand_run(sweep, "wav_L4_s1337", "wav", 1337, 1.75)
    argv = ["report", sweep, out, "--out", tmp_path / "both.md"]
    code, _, _ = run(experiments.main, argv, capsys)
    text = (tmp_path / "both.md").read_text()
    assert code == 0 and "| wav | 0.002 | 4 | 1 | 1.7500 ± – |" in text
    assert "-0.2500 ± – | 1/1" in text
    assert run(experiments.main, argv, capsys)[0] == 0  # its own report there: written again
    (tmp_path / "notes.md").write_text("my notes\n")  # a file of yours: refused, kept
    err = error_line(experiments.main, ["report", sweep, "--out", tmp_path / "notes.md"], capsys)
    assert "notes.md exists and is not a file this script wrote: give another path" in err
    assert (tmp_path / "notes.md").read_text() == "my notes\n"
    err = error_line(experiments.main, ["report", out, "--baseline", "rd"], capsys)
    assert "--baseline rd: no finished run of that variant; finished variants: block" in err
    # an unreadable run is left out; the same run in two folders stops the report
    hand_run(tmp_path / "a", "block_L4_s0", "block", 0, 2.0)
    (hand_run(tmp_path / "a", "rd_L4_s0", "rd", 0, 1.9) / "summary.json").write_text("{not json")
    code, printed, _ = run(experiments.main, ["report", tmp_path / "a"], capsys)
    assert code == 0 and "Left out: " in printed and "rd_L4_s0: its files cannot be read" in printed
    assert "| **block** (baseline) | 0.002 | 2 | 1 |" in printed
    hand_run(tmp_path / "b", "block_L4_s0", "block", 0, 2.2)  # several folders: runs by path
    err = error_line(experiments.main, ["report", tmp_path / "a", tmp_path / "b"], capsys)
    assert f"runs {tmp_path / 'a'}/block_L4_s0 and {tmp_path / 'b'}/block_L4_s0 " \
        "are both block, seed 0" in err
    older = hand_run(tmp_path / "c", "block_L4_s0", "block", 0, 2.0) / "summary.json"
    summary = json.loads(older.read_text())
    summary["train"]["since_removed"] = 3  # a setting train.py no longer has: named, no default
    older.write_text(json.dumps(summary))
    code, printed, _ = run(experiments.main, ["report", tmp_path / "c"], capsys)
    assert code == 0 and "\nEvery run here: n_embd 384, n_head 6, since_removed 3.\n" in printed


def test_lrs_each_variant_at_the_rate_of_its_lowest_mean(demo, tmp_path, capsys):
    finals = {("block", 1e-3): [2.0, 2.2], ("block", 2e-3): [1.9, 2.1], ("block", 4e-3): [2.3, 2.4],
              ("rd", 1e-3): [1.8, 2.0], ("rd", 2e-3): [2.0, 2.0],
              # the mean picks 2e-3 (inside the grid), the median would pick 1e-3
              ("wav", 1e-3): [1.0, 1.0, 4.0], ("wav", 2e-3): [1.5, 1.5, 1.5],
              ("wav", 4e-3): [3.0] * 3}
    for (variant, lr), vals in finals.items():
        for seed, val in enumerate(vals):
            hand_run(tmp_path, f"{variant}_L4_s{seed}_lr{lr:g}", variant, seed, val, lr=lr)
    group, = report(tmp_path)
    rows = {row["variant"]: row for row in group["rows"]}
    assert (rows["block"]["lr"], rows["rd"]["lr"], rows["wav"]["lr"]) == (2e-3, 1e-3, 2e-3)
    assert rows["rd"]["delta"] == pytest.approx(dict(mean=-0.1, std=0.0, wins=2, ties=0, n=2))
    assert list(rows["rd"]["others"]) == [2e-3] and rows["rd"]["others"][2e-3] == (2.0, 2)
    code, out, _ = run(experiments.main, ["report", tmp_path], capsys)
    text = (tmp_path / "report.md").read_text()
    assert code == 0 and "| rd | 0.001 | 2 | 2 | 1.9000 ± 0.1414 |" in text
    assert "- block: lr 0.001: 2.1000 (2 seeds)" in text
    assert "- rd: lr 0.002: 2.0000 (2 seeds)" in text
    warning = "WARNING: lr 0.001 is the lowest of the grid for rd: the best rate may be below " \
        "it; extend --lrs\n"  # block's 0.002 lies inside its grid: no warning
    assert warning in text and warning in out and text.count("WARNING") == 1
    # rates run on other seeds, as many (a sweep still running); a Δ of one pair, of two runs
    uneven = tmp_path / "uneven"
    for seed, lr, val in ((0, 1e-3, 2.0), (1, 1e-3, 2.2), (0, 2e-3, 1.9), (2, 2e-3, 1.9)):
        hand_run(uneven, f"block_L4_s{seed}_lr{lr:g}", "block", seed, val, lr=lr)
    for seed in (0, 5):  # seed 5 has no partner
        hand_run(uneven, f"rd_L4_s{seed}", "rd", seed, 1.8, lr=2e-3)
    code, out, _ = run(experiments.main, ["report", uneven], capsys)
    assert code == 0 and "WARNING: lr 0.002 for block is chosen over rates run on other seeds " \
        "(lr 0.001: [0, 1]; lr 0.002: [0, 2]): the choice may change as they finish" in out
    assert "WARNING: one seed for the Δ of rd: it cannot be told from noise" in out
    runs = plan("sweep", "tiny", "--lrs", "1e-3,2e-3", "--variants", "block", "--seeds", 0)
    assert [r["name"] for r in runs] == ["block_L4_s0_lr0.001", "block_L4_s0_lr0.002"]
    assert [experiments.flag_dict(r["args"])["--lr"] for r in runs] == ["0.001", "0.002"]
    code, printed, _ = run(experiments.main, ["sweep", "custom", "--data", demo, "--variants",
                                              "block", "--dry_run", "--", "--lr", "1e-3"], capsys)
    assert code == 0 and printed.count("--lr 1e-3") == 3  # --lr without --lrs: every run's
    # a --set value pairs with its baseline value, each at its own best lr: at 1e-3, the value's
    # best, the baseline's runs are 0.5 worse than at their own best (2e-3)
    for lr, at_base, at_five in [(1e-3, [2.0, 2.2], [1.4, 1.5]), (2e-3, [1.5, 1.7], [1.6, 1.9])]:
        for seed in (0, 1):
            for value, finals in (("20", at_base), ("5", at_five)):
                d = hand_run(tmp_path / "set", f"block_s{seed}_lr{lr:g}_w{value}", "block", seed,
                             finals[seed], lr=lr, warmup_iters=int(value))
                (d / "run.json").write_text(json.dumps(dict(
                    variant="block", seed=seed, args=[], set={"warmup_iters": value},
                    set_base={"warmup_iters": "20"})))
    group, = report(tmp_path / "set")
    five, = [row for row in group["rows"] if row["off"]]
    assert five["lr"] == 1e-3  # paired with warmup_iters=20 at its best, 2e-3, not at 1e-3
    assert five["delta"] == pytest.approx(dict(mean=-0.15, std=0.0707107, wins=2, ties=0, n=2))
    # --set batch_size=16,8 under one token budget: twice the steps at 8, still one group
    for seed in (0, 1):
        for batch, steps, final in ((16, 10, 2.0), (8, 20, 2.1)):
            d = hand_run(tmp_path / "budget", f"block_s{seed}_b{batch}", "block", seed, final,
                         batch_size=batch, max_tokens=40960, max_iters=steps)
            (d / "run.json").write_text(json.dumps(dict(
                variant="block", seed=seed, args=[], set={"batch_size": str(batch)},
                set_base={"batch_size": "16"})))
    group, = report(tmp_path / "budget")
    # a --set value that names a folder (a setting of yours) is one folder in a run's name
    assert experiments.file_safe("../data/ood v2") == ".._data_ood_v2"
    eight, = [row for row in group["rows"] if row["off"]]
    assert eight["delta"] == pytest.approx(dict(mean=0.1, std=0.0, wins=0, ties=0, n=2))
    # one of them resumed at another batch_size than it began with: unlike its --set row's others
    path = tmp_path / "budget" / "block_s1_b8" / "summary.json"
    changed = [dict(step=5, setting="batch_size", was=16, now=8)]
    path.write_text(json.dumps(dict(json.loads(path.read_text()), changes=changed)))
    assert len(report(tmp_path / "budget")) == 2
    run(experiments.main, ["report", tmp_path / "budget"], capsys)  # its Δ: none, and why
    text = (tmp_path / "budget" / "report.md").read_text()
    assert text.count("**No Δ for block, batch_size=8 (Δ vs batch_size=16)**: no run of") == 1
    # its curve against its partner's in the figure: evaluated at other token counts, the
    # partner's linear between its evals (not left out: an empty band), within its span
    partner = {0: 4.0, 200: 2.0, 400: 1.0}
    assert experiments.minus({100: 2.0, 300: 1.5, 500: 1.0}, partner) == {100: -1.0, 300: 0.0}


# --- Sweeps ---

def test_bad_input_is_one_error_line(demo, block_run, tmp_path, capsys):
    custom = ["sweep", "custom", "--out", tmp_path / "runs", "--dry_run", "--data", demo]
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()  # a run whose summary cannot be read: the error says so
    (tmp_path / "broken" / "summary.json").write_text("{")
    cases = [
        ([*custom, "--variants", "prenorm,blok"], "--variants prenorm,blok: expected distinct"),
        ([*custom, "--variants", "wav,wav"], "--variants wav,wav: expected distinct"),
        ([*custom, "--variants", "block", "--seeds", "2-0"], "--seeds 2-0: expected distinct"),
        ([*custom, "--variants", "block", "--seeds", "0,1,1"], "--seeds 0,1,1: expected"),
        ([*custom, "--variants", "block", "--depths", "0"], "--depths 0: expected distinct"),
        ([*custom, "--variants", "wav", "--depths", "1"], "--depths 1: n_layer=1: WAV needs"),
        ([*custom, "--variants", "wav", "--attnres_block", "2"], "WAV needs an even routing block"),
        ([*custom, "--variants", "block", "--lrs", "0,1e-3"], "--lrs 0,1e-3: expected distinct"),
        ([*custom[:-1], tmp_path / "text8", "--variants", "block"],
         f"data folder {tmp_path / 'text8'} does not exist"),
        ([*custom[:-2], "--variants", "block"], "sweep custom needs --data FOLDER"),
        ([*custom, "--variants", "block", "--data_root", "big"], "--data_root big: only the named"),
        (["sweep", "tiny", "--data", demo, "--dry_run"], "only sweep custom takes a data folder"),
        ([*custom, "--variants", "block", "--", "--n_layer", "8"],
         "--n_layer after --: the sweep sets it for each run; use --depths"),
        ([*custom, "--variants", "block", "--", "--seed=3"], "--seed after --: the sweep sets"),
        ([*custom, "--variants", "block", "--", "--wav", "True"], "--wav after --: the sweep sets"),
        ([*custom, "--variants", "block", "--", "--out_dir", "x"], "use --out"),
        ([*custom, "--variants", "block", "--", "--resume"], "--resume after --"),
        ([*custom, "--variants", "block", "--", "-h"], "the flags after -- are train.py's"),
        ([*custom, "--variants", "block", "--lrs", "1e-3", "--", "--lr", "1"], "use --lrs"),
        ([*custom, "--variants", "block", "--", "--n_lay", "3"],
         "after --: unrecognized arguments: --n_lay 3 (did you mean --n_layer?)"),
        ([*custom, "--variants", "block", "--", "--max_iters", "abc"],
         "after --: argument --max_iters: invalid int value: 'abc'"),
        ([*custom, "--variants", "block", "--jobs", "0"], "--jobs 0: must be at least 1"),
        ([*custom, "--variants", "block", "--seeds", "0-100000000"], "0-4, at most 1000"),
        ([*custom, "--variants", "block,wav", "--seeds", "0-999"], "2000 runs, more than 1000"),
        ([*custom, "--variants", "block", "--seeds", "0-499", "--set", "warmup_iters=1,2,3"],
         "1500 runs, more than 1000"),  # --set values multiply the runs too
        ([*custom, "--variants", "wav", "--set", "wav_rh=2"], "(did you mean --wav_rho?)"),
        ([*custom, "--variants", "wav", "--set", "wav_rho=x"], "invalid float value: 'x'"),
        ([*custom, "--variants", "wav", "--set", "seed=1,2"], "--set seed=1,2: the sweep sets"),
        *[([*custom, "--variants", "block", "--set", f"{f.name}=1,2"], "what it writes, not what")
          for f in dataclasses.fields(train.TrainSettings) if f.metadata["output"]],
        ([*custom, "--variants", "block", "--set", "compile=0,1"], "--compile says how a run runs"),
        ([*custom, "--variants", "block", "--set", "wav_rho=2"], "no effect in block: add to"),
        # a combination that train.py refuses: one line before the first run, naming the run
        ([*custom, "--variants", "block", "--set", "micro_batch=0,3", "--", "--batch_size", "8"],
         "run block_L4_s0_micro_batch3: train.py refuses it: --batch_size 8 over 1 process(es)"),
        ([*custom, "--variants", "block", "--set", "n_head=4,3"], "n_head=3: must divide n_embd"),
        ([*custom, "--variants", "block", "--torchrun", "3"], "--batch_size 16 over 3 process"),
        ([*custom, "--variants", "prenorm", "--", "--wav_rho", "2"], "it has no effect in prenorm"),
        (["sweep", "wav_paper", "--dry_run", "--", "--preset", "wav12"], "use sweep custom"),
        (["sweep", "wav_paper", "--dry_run", "--depths", "8"], "has presets for depths 12, 24"),
        (["report", tmp_path, "--", "--baseline", "rd"], "report takes no flags after --"),
        (["report", tmp_path / "nothing"], "nothing: no such folder"),
        (["report", tmp_path, "--plot"], "--plot (did you mean --plots?)"),  # a subcommand's flags
        ([*custom, "--variants", "block", "--seed", "0"], "--seed 0 (did you mean --seeds?)"),
        (["report", tmp_path / "empty"], "no runs in"),
        (["report", tmp_path / "broken"], "broken: its files cannot be read (JSONDecodeError"),
        (["ablate", block_run, "--draws", 0], "--draws 0: give 1 or more"),
        (["ablate", block_run, "--draws", -1], "--draws -1: give 1 or more"),
        (["ablate", block_run, "--older_than", -1], "--older_than -1: give 0 or more"),
        (["ablate", block_run, "--mask", "C7"], "--mask C7 --read None: the sources are"),
        (["ablate", block_run, "--mask", "emb", "--read", "layer9.mlp"], "the reads layer0.attn"),
        (["ablate", block_run, "--read", "layer0.attn", "--mask", "emb"], "hide a source of some"),
        (["ablate", block_run], "give --mask NAMES and/or --older_than K"),
    ]
    empty_path = [(["sweep", "tiny", "--out"], "--out", "folder"),  # a path of spaces: this line
                  (["sweep", "custom", "--data"], "--data", "folder"),
                  (["sweep", "tiny", "--data_root"], "--data_root", "folder"),
                  (["report"], "folders", "folder"),
                  (["report", "runs", "--out"], "--out", "file"),
                  (["report", "runs", "--data"], "--data", "folder"),
                  (["ablate"], "run_dir", "folder"),
                  (["ablate", "runs/a", "--data"], "--data", "folder")]
    cases += [([*argv, " "], f"error: argument {flag}: ' ': give a {kind} name; see --help\n")
              for argv, flag, kind in empty_path]
    for argv, message in cases:
        assert message in error_line(experiments.main, argv, capsys, quiet=True), argv


def test_a_preset_given_to_a_sweep_runs_at_its_own_depth_unless_depths_says(demo, capsys):
    """A sweep gives every run --n_layer: a preset after -- (or in --set) runs at its depth, not at
    the sweep's default; --depths given wins; presets of two depths need --depths."""
    sweep = ["sweep", "custom", "--data", demo, "--variants", "block", "--seeds", 0]
    for argv, depth in [([*sweep, "--", "--preset", "rd_s", "--max_iters", 1], 16),
                        ([*sweep, "--depths", 2, "--", "--preset", "rd_s", "--max_iters", 1], 2),
                        ([*sweep, "--set", "preset=wav12", "--", "--max_iters", 1], 12)]:
        runs = plan(*argv)
        assert {(r["depth"], experiments.flag_dict(r["args"])["--n_layer"]) for r in runs} == {
            (depth, str(depth))}, argv
    err = error_line(experiments.main, [*sweep, "--dry_run", "--set", "preset=wav12,wav24"], capsys)
    assert "presets of 2 depths (wav12, wav24): a sweep gives each run its depth; give --depths" \
        in err


def test_the_named_sweeps_plans_one_block_per_depth_and_every_variant_flag(tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, out, _ = run(experiments.main, ["sweep", "controls", "--dry_run", "--out", tmp_path,
                                          "--data_root", tmp_path / "data"], capsys)
    commands = out.splitlines()
    variants = experiments.SWEEPS["controls"]["variants"].split()
    folders = [c.split("--out_dir ")[1] for c in commands]
    assert code == 0 and folders == [str(tmp_path / f"{v}_L4_s{seed}") for seed in (0, 1, 2)
                                     for v in variants]  # every variant, seed-major: pairs first
    for command in commands:
        name = Path(command.split("--out_dir ")[1]).name.split("_L4")[0]
        flags = experiments.flag_dict(command.split()[1:])
        assert command.startswith("OMP_NUM_THREADS=1 ")
        assert flags["--data"] == f"{tmp_path}/data/demo"
        assert all(flags[f"--{k}"] == str(v) for k, v in nanoroute.variant(name).items()), command
        routed = nanoroute.VARIANTS[name]["residual"] == "attnres"
        assert flags.get("--attnres_block") == ("4" if routed else None)  # WAV's 4 for all
    rd = plan("sweep", "rd_paper", "--seeds", 0)
    assert {r["attnres_block"] for r in rd} == {4, 6} and all(r["args"][:2] == ["--preset", "rd_s"]
                                                              for r in rd[:5])
    assert all(experiments.flag_dict(r["args"])["--rd"] == nanoroute.variant(r["variant"])["rd"]
               for r in rd)  # rd_s's rd=decoupled never leaks into block
    code, out, _ = run(experiments.main, ["sweep", "tiny", "--dry_run", "--torchrun", 2, "--seeds",
                                          0, "--variants", "rd", "--out", tmp_path], capsys)
    assert code == 0 and " -m torch.distributed.run --standalone --nproc_per_node=2 " \
        f"{experiments.TRAIN} -- --data data/demo " in out  # "--": torchrun keeps off --rd
    assert [r["name"] for r in plan("sweep", "wav_paper", "--depths", 12)][:2] == [
        "tinystories/prenorm_L12_s0", "tinystories/rezero_L12_s0"]
    # job slots share the cores, the sweep's env wins, and a failure says its error
    cores = len(os.sched_getaffinity(0))
    # the cores this process may use (taskset, a container), not the machine's
    monkeypatch.setattr(os, "cpu_count", lambda: 64 * cores)
    assert experiments.job_slots(1) == [{}]
    assert experiments.job_slots(2, extra=["--device", "cpu"]) == [
        {"OMP_NUM_THREADS": str(max(1, cores // 2))}] * 2
    assert experiments.job_slots(2 * cores + 1, extra=["--device", "cpu"])[0] == {
        "OMP_NUM_THREADS": "1"}  # more runs than cores: never 0 threads
    assert experiments.run_env(dict(env={"OMP_NUM_THREADS": "1"}), {"OMP_NUM_THREADS": "2"}) == \
        {"OMP_NUM_THREADS": "1"}  # tiny's one thread beats --jobs' share
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert experiments.job_slots(2, extra=["--device", "cpu"]) == [{}, {}]
    # the threads you set beat tiny's one: the runs inherit yours
    assert experiments.run_env(dict(env={"OMP_NUM_THREADS": "1"}), {}) == {}
    d = tmp_path / "run"  # a failed run: its last error line
    d.mkdir()
    (d / "train.log").write_text("note: an error of no consequence\nerror: the real one\n")
    assert experiments.ended(dict(dir=d), 2, "[1/1]", 1.0) == "error: the real one"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # 4 GPUs: each run its own 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert [slot["CUDA_VISIBLE_DEVICES"] for slot in experiments.job_slots(2, 2)] == ["0,1", "2,3"]


def test_a_sweep_skips_finished_runs_resumes_interrupted_ones_and_survives_a_failure(
        demo, tmp_path, capsys):
    """One real sweep through train.py, two runs at once: prenorm finished earlier with another
    --max_iters (skipped, with a warning naming it), block interrupted after step 1 (resumed,
    with a warning naming the flag its first sweep gave otherwise), rd's folder, which the sweep
    started, holds a stray best.pt (train.py refuses it: the sweep goes on and exits 1)."""
    out = tmp_path / "runs"
    argv = ["sweep", "custom", "--data", demo, "--variants", "prenorm,block,rd", "--depths", "2",
            "--seeds", "0", "--jobs", "2", "--out", out, "--", *SWEPT, "--max_iters", "3"]
    runs = {r["variant"]: r for r in plan(*argv)}
    prenorm, block, rd = (runs[v] for v in ("prenorm", "block", "rd"))
    assert run(train.main, [*prenorm["args"], "--out_dir", prenorm["dir"]])[0] == 0
    before = [a.replace("3", "5") if a == "3" and prev == "--max_iters" else a
              for prev, a in zip(["", *prenorm["args"]], prenorm["args"])] + ["--dropout", "0.1"]
    # a field a new variant row gives every run, at its default: the run ran so, no change
    cut = before.index("--rd")
    before = before[:cut] + before[cut + 2:]
    (prenorm["dir"] / "run.json").write_text(json.dumps(dict(variant="prenorm", args=before)))
    assert run(train.main, [*block["args"], "--out_dir", block["dir"], "--stop_after", 1])[0] == 0
    assert not (block["dir"] / "summary.json").exists()
    started = [a.replace("3", "2") if a == "3" and prev == "--max_iters" else a  # its first sweep
               for prev, a in zip(["", *block["args"]], block["args"])]
    (block["dir"] / "run.json").write_text(json.dumps(dict(variant="block", args=started)))
    rd["dir"].mkdir(parents=True)
    (rd["dir"] / "run.json").write_text(json.dumps(dict(variant="rd", args=rd["args"])))
    (rd["dir"] / "best.pt").write_bytes(b"not a run of this sweep")
    capsys.readouterr()

    code, printed, _ = run(experiments.main, argv, capsys)
    assert code == 1, printed
    assert f"WARNING: {prenorm['dir']} ran with other flags: --max_iters 3 (was 5), --dropout " \
        "unset (was 0.1)" in printed
    assert f"skip {prenorm['dir']}: finished" in printed
    assert f"WARNING: {block['dir']} resumes with other flags: --max_iters 3 (was 2); from its " \
        "last step on" in printed
    assert f"[1/2] {block['dir']}: started (resuming from last.pt)" in printed
    assert f"[1/2] {block['dir']}: done in " in printed and "val loss " in printed
    assert printed.index(f"[2/2] {rd['dir']}: started") < printed.index(": done in ")  # 2 at once
    assert f"[2/2] {rd['dir']}: FAILED (exit 2): error: {rd['dir']} already holds a run" in printed
    assert "sweep: 3 runs: 1 skipped, 1 done, 1 failed" in printed
    assert f"\nfailed: {rd['name']}: error: {rd['dir']} already holds a run" in printed
    assert summary(block["dir"])["step"] == 3
    assert "resuming" in (block["dir"] / "train.log").read_text()
    info = json.loads((block["dir"] / "run.json").read_text())
    assert info["attnres_block"] == 2 and info["command"].endswith(" --resume")
    assert info["args"] == block["args"] and info["variant"] == "block"

    code, printed, _ = run(experiments.main, ["report", out], capsys)
    assert code == 0 and "Unfinished (no summary.json yet): rd_L2_s0" in printed
    assert "| **block** (baseline) | 0.002 | 2 | 1 |" in printed
    assert "| prenorm | 0.002 | – | 1 |" in printed


def test_a_sweep_refuses_a_run_folder_it_did_not_start(demo, tmp_path, capsys):
    """A folder of a run's name without run.json (a train.py run by hand, a user's files) is one
    error line before any run starts, and is left as it was; a kill's leftover of run.json's write
    (the sweep's own) is not."""
    argv = ["sweep", "custom", "--data", demo, "--variants", "prenorm,block", "--depths", "2",
            "--seeds", "0", "--out", tmp_path, "--", *SWEPT, "--max_iters", "2"]
    dry_run = [*argv[:argv.index("--")], "--dry_run", *argv[argv.index("--"):]]
    prenorm, block = plan(*argv)
    assert run(train.main, [*block["args"], "--out_dir", block["dir"]])[0] == 0  # by hand
    files = sorted(p.name for p in block["dir"].iterdir())
    for args in (argv, dry_run):
        err = error_line(experiments.main, args, capsys)
        assert f"{block['dir']} holds files this sweep did not make ({', '.join(files)}; no " \
            "run.json): move them, or give the sweep another --out" in err
        assert sorted(p.name for p in block["dir"].iterdir()) == files
        assert not prenorm["dir"].exists()
    shutil.rmtree(block["dir"])
    block["dir"].mkdir()
    (block["dir"] / ".run.json.a1b2c3d4.tmp").write_text("{")
    code, printed, _ = run(experiments.main, dry_run, capsys)
    assert code == 0 and printed.count("train.py") == 2, printed
    (block["dir"] / ".mine").write_text("a hidden file of yours")
    assert f"{block['dir']} holds files this sweep did not make (.mine; no run.json)" in \
        error_line(experiments.main, dry_run, capsys)


def test_a_finished_run_at_another_default_is_kept_with_a_warning(demo, tmp_path, capsys):
    # the same flags, but the code's default changed since it ran (wav_rho 4 -> 2, say): the sweep
    # keeps it, as any finished run, and says in what it is another model than its flags now make
    run, = plan("sweep", "custom", "--data", demo, "--variants", "wav", "--depths", "2",
                "--seeds", "0", "--out", tmp_path, "--", *SWEPT)
    run["dir"].mkdir(parents=True)
    (run["dir"] / "run.json").write_text(json.dumps(dict(variant="wav", args=run["args"])))
    model = experiments.resolved(run)[1]  # what train.py makes of its flags
    config = {**model, "vocab_size": 27, "wav_rho": 2.0}  # as its summary.json recorded it
    (run["dir"] / "summary.json").write_text(json.dumps(dict(config=config)))
    assert experiments.pending([run], ["train.py"]) == []
    printed = capsys.readouterr().out
    assert f"WARNING: {run['dir']} ran at other defaults: its flags now make wav_rho 4.0 (was " \
        "2.0); it is kept" in printed and f"skip {run['dir']}: finished" in printed
    # a default that changed to a false value (dropout 0.1 -> 0.0) counts the same
    config |= {"wav_rho": 4.0, "dropout": 0.1}
    (run["dir"] / "summary.json").write_text(json.dumps(dict(config=config)))
    assert experiments.pending([run], ["train.py"]) == []
    assert "its flags now make dropout 0.0 (was 0.1); it is kept" in capsys.readouterr().out
    config["dropout"] = 0.0  # as they make it now: no word
    (run["dir"] / "summary.json").write_text(json.dumps(dict(config=config)))
    assert experiments.pending([run], ["train.py"]) == []
    assert "WARNING" not in capsys.readouterr().out


def test_a_sweep_stopped_by_sigterm_waits_for_its_runs_to_save_and_resumes(demo, tmp_path, capsys):
    """`kill -TERM -- -PGID` (a sweep under nohup): the running run saves last.pt, the sweep waits
    for it, starts no other, says how to resume and exits 143; the same command finishes both runs,
    also after a `-- --stop_after` (runs stopped, not failed)."""
    argv = ["sweep", "custom", "--data", demo, "--variants", "block,prenorm", "--depths", "2",
            "--seeds", "0", "--out", tmp_path, "--", *SWEPT, "--max_iters", 10 ** 6,
            "--eval_interval", 10 ** 6, "--log_interval", 1]
    first, second = (r["dir"] for r in plan(*argv))  # one at a time (--jobs 1)
    cmd = [sys.executable, Path(experiments.__file__), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # its own process group
    log = first / "train.log"
    try:
        while not (log.exists() and "step 3 " in log.read_text()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        printed, err = proc.communicate(timeout=600)  # a busy machine: minutes, a hang: never
    finally:  # its runs too, had one outlived it (they train for 10**6 steps)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, printed + err
    assert "interrupted: the same command resumes the sweep" in err and not second.exists()
    step = torch.load(first / "last.pt", weights_only=False)["progress"]["step"]
    assert f"stopped by SIGTERM after step {step}" in log.read_text()
    resumed = [a if a != 10 ** 6 or prev != "--max_iters" else step + 2
               for prev, a in zip(["", *argv], argv)]
    resumed[1:1] = ["--jobs", 2]  # now both at once
    code, printed, _ = run(experiments.main, [*resumed, "--stop_after", step + 1], capsys)
    assert code == 0 and "stopped before its last step; the same command resumes it" in printed
    assert "sweep: 2 runs: 0 skipped, 0 done, 2 stopped, 0 failed" in printed, printed
    assert run(experiments.main, resumed)[0] == 0
    assert summary(first)["step"] == summary(second)["step"] == step + 2
    code, printed, _ = run(experiments.main, resumed, capsys)  # all done: nothing stopped
    assert code == 0 and "sweep: 2 runs: 2 skipped, 0 done, 0 failed" in printed


# --- A trained run's routes: ablate, heatmap ---

@pytest.fixture(scope="module")
def block_run(demo, tmp_path_factory):
    """A finished Block AttnRes run of 3 steps (2 layers: routing blocks of 2 sublayers)."""
    out = tmp_path_factory.mktemp("runs") / "block_L2_s0"  # --eval_tokens 700: 3 batches
    return trained(demo, out, "--max_iters", 3, "--residual", "attnres", "--eval_tokens", 700)


def evaluate(model, val, offsets, masked):
    """The mean loss over the crops at offsets, directly, with model.masked = masked."""
    model.masked, T = masked, model.config.sequence_len
    batches = [b for rows in offsets for b in train.get_batch(val, rows, T, torch.device("cpu"))]
    with torch.no_grad():
        return torch.stack([model(x, y)[1] for x, y in batches]).mean().item()


def test_ablate_matches_direct_evaluations_its_control_and_one_read(demo, block_run, tmp_path,
                                                                   capsys):
    code, printed, _ = run(experiments.main, ["ablate", block_run, "--mask", "emb", "--draws", 4],
                           capsys)
    result = json.loads((block_run / "ablate_best_mask-emb.json").read_text())
    assert code == 0 and "routing path fast" in printed and result["fast_routing"]
    assert "not masked (it would hide every source of the read): layer0.attn" in printed
    saved = checkpoint.load(block_run / "best.pt", "")
    model = checkpoint.model_from(saved, block_run).eval()
    folder, meta = checkpoint.open_data(saved, block_run)
    val = prepare_data.open_split(folder, "val", meta)
    s = saved["settings"]
    offsets = train.eval_offsets(len(val), model.config.sequence_len, s["batch_size"],
                                 s["eval_tokens"], 1)
    base = evaluate(model, val, offsets, {})
    assert result["base_val_loss"] == pytest.approx(base, abs=1e-6)
    assert base == pytest.approx(saved["progress"]["best_val_loss"], abs=1e-5)  # train.py's score
    # in the run's precision and forwards: a bf16 run's unmasked loss, scored in its micro-batches,
    # is its own evals' too, and so are its masks
    bf16 = trained(demo, tmp_path / "bf16", "--max_iters", 1, "--residual", "attnres",
                   "--dtype", "bfloat16", "--micro_batch", 2)
    assert run(experiments.main, ["ablate", bf16, "--mask", "emb", "--draws", 1], capsys)[0] == 0
    in_bf16 = json.loads((bf16 / "ablate_best_mask-emb.json").read_text())
    loss = in_bf16["base_val_loss"]
    assert loss == checkpoint.load(bf16 / "best.pt", "")["progress"]["best_val_loss"]
    model16, _, val16, offsets16 = experiments.load_model(bf16)
    row = in_bf16["rows"][-1]
    model16.masked = {r: set(row["masked"][str(r)]) for r in model16.reads
                      if str(r) in row["masked"]}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        masked = train.evaluate(model16, val16, offsets16, model16.config.sequence_len,
                                torch.device("cpu"))
    assert row["delta"] == masked - loss
    reads = {str(r): r for r in model.reads}
    every = {reads[name]: set(hidden) for row in result["rows"] if row["read"] == "all"
             for name, hidden in row["masked"].items()}
    assert set(map(str, every)) == {"layer0.mlp", "layer1.attn", "layer1.mlp", "readout"}
    all_row = next(row for row in result["rows"] if row["read"] == "all")
    assert all_row["delta"] == pytest.approx(evaluate(model, val, offsets, every) - base, abs=1e-6)
    assert len(all_row["random"]) == 4 and all_row["random_mean_std"][0] == pytest.approx(
        statistics.fmean(all_row["random"]))
    # the controls are random_mask's of seeds 0..draws-1 (docs/experiments.md), scored directly
    model.masked = {}
    x = train.get_batch(val, offsets[0][:1], model.config.sequence_len, torch.device("cpu"))[0][0]
    with torch.no_grad():
        pools = {r["read"]: r["sources"] for r in model(x, return_routes=True)[2]}
    for seed, delta in enumerate(all_row["random"]):
        control = evaluate(model, val, offsets, experiments.random_mask(every, pools, seed))
        assert delta == pytest.approx(control - base, abs=1e-6), seed
    assert (block_run / "ablate_best_mask-emb.png").exists() == HAS_MPL
    moved = tmp_path / "moved"  # a run whose data folder moved: found with --data
    moved.mkdir()
    best = torch.load(block_run / "best.pt", weights_only=True)
    torch.save(dict(best, data_dir=str(tmp_path / "gone")), moved / "best.pt")
    argv = ["ablate", moved, "--mask", "emb", "--draws", 1]
    assert "--data" in error_line(experiments.main, argv, capsys)
    assert run(experiments.main, [*argv, "--data", demo], capsys)[0] == 0
    moved_result = json.loads((moved / "ablate_best_mask-emb.json").read_text())
    assert moved_result["base_val_loss"] == result["base_val_loss"]
    x = torch.zeros(1, 8, dtype=torch.long)
    pools = {r["read"]: r["sources"] for r in model(x, return_routes=True)[2]}
    row = next(row for row in result["rows"] if row["read"] == "layer1.mlp")  # masked alone
    alone = {reads[name]: set(hidden) for name, hidden in row["masked"].items()}
    assert row["random"][1] == pytest.approx(
        evaluate(model, val, offsets, experiments.random_mask(alone, pools, 1)) - base, abs=1e-6)
    # the random control: count-matched per read, and it never empties one
    mask, kept = experiments.chosen_mask(pools, 2, [], older_than=0)
    assert {str(r): h for r, h in mask.items()} == {"layer1.attn": {"C0"}, "layer1.mlp": {"C0"},
                                                     "readout": {"C0", "C1"}} and kept == []
    mask, _ = experiments.chosen_mask(pools, 2, [], older_than=1)  # only C0 in the readout: 2
    assert {str(r): h for r, h in mask.items()} == {"readout": {"C0"}}
    wav = {nanoroute.Read(2, "attn"): ["emb", "C0", "C0.phase", "C0.split", "C1"]}
    assert experiments.chosen_mask(wav, 4, ["C0"])[0] == {  # C0 with its details; C0.split alone
        nanoroute.Read(2, "attn"): {"C0", "C0.phase", "C0.split"}}
    assert experiments.chosen_mask(wav, 4, ["C0.split"])[0] == {
        nanoroute.Read(2, "attn"): {"C0.split"}}
    mask, kept = experiments.chosen_mask(pools, 2, ["emb", "C0"])
    assert kept == ["layer0.attn", "layer1.attn"]  # they read emb (and C0) alone
    draws = [experiments.random_mask(mask, pools, seed) for seed in range(30)]
    for drawn in draws:
        assert drawn.keys() == mask.keys()
        for read, hidden in drawn.items():
            assert len(hidden) == len(mask[read]) < len(pools[read]) and hidden <= set(pools[read])
    assert len({frozenset(d[max(mask, key=lambda r: len(pools[r]))]) for d in draws}) > 1
    assert experiments.random_mask(mask, pools, 7) == experiments.random_mask(mask, pools, 7)
    # one read, from last.pt too; without best.pt, the error says --ckpt last
    code, printed, _ = run(experiments.main, ["ablate", block_run, "--older_than", 0, "--read",
                                              "readout", "--draws", 2], capsys)
    result = json.loads((block_run / "ablate_best_read-readout_older0.json").read_text())
    assert code == 0 and [row["read"] for row in result["rows"]] == ["readout"]
    assert result["rows"][0]["masked"] == {"readout": ["C0", "C1"]}
    assert run(experiments.main, ["ablate", block_run, "--older_than", 0, "--read", "readout",
                                  "--draws", 1, "--ckpt", "last"], capsys)[0] == 0
    saved = {c: json.loads((block_run / f"ablate_{c}_read-readout_older0.json").read_text())
             for c in ("best", "last")}
    assert (saved["best"]["draws"], saved["last"]["draws"]) == (2, 1)  # last's never over best's
    # every option in the name: a mask in one read never writes over that mask in every read
    args = experiments.build_parser().parse_args(["ablate", str(block_run), "--mask", "C0",
                                                  "--read", "readout"])
    assert experiments.ablate_files(args)[0] == "best_mask-C0_read-readout"
    shutil.copytree(block_run, tmp_path / "no_best")
    (tmp_path / "no_best" / "best.pt").unlink()
    err = error_line(experiments.main, ["ablate", tmp_path / "no_best", "--mask", "emb"], capsys)
    assert "(it has a last.pt: --ckpt last)" in err


@pytest.mark.optional
@pytest.mark.skipif(not HAS_MPL, reason="needs matplotlib (optional: pip install matplotlib)")
def test_plots_and_heatmap_are_written_and_without_matplotlib_the_table_is(block_run, demo,
                                                                           tmp_path, monkeypatch,
                                                                           capsys):
    for variant, seed, val in [("block", 0, 2.0), ("block", 1, 2.1), ("rd", 0, 1.9),
                               ("rd", 1, 2.0)]:
        hand_run(tmp_path, f"{variant}_L4_s{seed}", variant, seed, val,
                 evals=((0, 4.0), (500, 3.0 + val / 10), (1000, val)))
    code, printed, _ = run(experiments.main, ["report", tmp_path, block_run, "--plots",
                                              "--heatmap", block_run], capsys)
    heatmap = tmp_path / f"routes_{str(block_run).strip('/').replace('/', '_')}.png"
    assert code == 0 and (tmp_path / "val_loss.png").stat().st_size > 0 and heatmap.exists()
    assert f"wrote {heatmap}" in printed
    code, printed, _ = run(experiments.main, ["report", tmp_path, block_run, "--plots",
                                              "--heatmap", block_run], capsys)
    assert code == 0 and f"wrote {heatmap}" in printed  # its own figures: written again
    # a run whose data folder moved: found with --data
    moved = tmp_path / "moved" / "block_L2_s0"
    moved.mkdir(parents=True)
    best = torch.load(block_run / "best.pt", weights_only=True)
    torch.save(dict(best, data_dir=str(tmp_path / "gone")), moved / "best.pt")
    code, _, err = run(experiments.main, ["report", tmp_path, "--heatmap", moved], capsys)
    assert code == 2 and "--data" in err
    code, printed, _ = run(experiments.main, ["report", tmp_path, "--heatmap", moved, "--data",
                                              demo], capsys)
    assert code == 0 and "wrote " in printed and "routes_" in printed
    reads, sources, matrix = experiments.route_matrix(block_run)
    assert reads[0] == "layer0.attn" and sources == ["emb", "C0", "C1", "P"]
    assert matrix[0] == [pytest.approx(1.0), None, None, None]  # the first read sees emb alone
    assert all(sum(w for w in row if w is not None) == pytest.approx(1.0) for row in matrix)
    (tmp_path / "val_loss.png").unlink()
    # below, each run minus its baseline partner: rd, lower than block at both seeds, below 0
    fig = experiments.val_loss_figure(experiments.figure_class(), report(tmp_path), "block")
    deltas = [line.get_ydata() for line in fig.axes[1].get_lines()]  # (the group's Δ panel)
    assert any(np.allclose(y, [-0.01, -0.1]) for y in deltas), deltas
    # block at another routing block too: a row of its own, its legend says which block it is
    hand_run(tmp_path, "block_m1_s0", "block", 0, 2.05, attnres_block=1)
    groups = report(tmp_path)
    fig = experiments.val_loss_figure(experiments.figure_class(), groups, "block")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"block (block 1, lr 0.002, 1)", "block (block 2, lr 0.002, 2)"} <= set(labels), labels
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    out = tmp_path / "new" / "er" / "report.md"  # in folders not made yet: made
    code, printed, _ = run(experiments.main, ["report", tmp_path, "--plots", "--out", out], capsys)
    assert code == 0 and experiments.NO_MATPLOTLIB in printed and "| rd | 0.002 |" in printed
    assert experiments.NO_MATPLOTLIB in out.read_text()  # the report says its figures are missing
    assert not (tmp_path / "new" / "er" / "val_loss.png").exists()


def test_set_runs_each_value_where_it_applies_and_pairs_it_by_seed(demo, tmp_path, capsys):
    """--set wav_detail_bias=-1,-2: wav runs at each value, prenorm once without it (as without
    the routing-only --wav_rho after --); -2, the default, is the baseline -1 pairs with by seed."""
    argv = ["sweep", "custom", "--data", demo, "--variants", "prenorm,wav", "--depths", 2,
            "--seeds", "0,1", "--set", "wav_detail_bias=-1,-2", "--out", tmp_path, "--", *SWEPT,
            "--max_iters", 2, "--wav_rho", 2]
    cut = argv.index("--")
    code, out, _ = run(experiments.main, [*argv[:cut], "--dry_run", *argv[cut:]], capsys)
    assert code == 0 and "# --wav_rho is left out of the prenorm runs: it has no effect there\n" \
        "# --wav_detail_bias is left out of the prenorm runs: it has no effect there\n" in out
    runs = plan(*argv)
    assert {r["name"]: experiments.flag_dict(r["args"]).get("--wav_detail_bias") for r in runs
            if r["seed"] == 0} == {"prenorm_L2_s0": None, "wav_L2_s0_wav_detail_bias-2": "-2",
                                   "wav_L2_s0_wav_detail_bias-1": "-1"}  # seed 1 likewise
    assert all(("--wav_rho" in r["args"]) == (r["variant"] == "wav") for r in runs)
    # no default (wav_rho's is 4) among the values: the first given is the baseline
    wav_rho = plan("sweep", "custom", "--data", demo, "--variants", "wav", "--set", "wav_rho=3,2")
    assert {r["set_base"]["wav_rho"] for r in wav_rho if r["set"]} == {"3"}
    # train.py's default, not GPTConfig's (n_embd 384): the value a plain train.py run has
    widths = plan("sweep", "custom", "--data", demo, "--variants", "wav", "--set", "n_embd=64,128")
    assert {r["set_base"]["n_embd"] for r in widths if r["set"]} == {"128"}
    for r in runs:  # run.json as the sweep writes it (a no-op command), then train.py's run
        experiments.start(r, [sys.executable, "-c", ""], r["name"], {}).wait()
        assert run(train.main, [*r["args"], "--out_dir", r["dir"]])[0] == 0
    # a run by hand of the same values, as train.py records them (2.0, -1.0): named as --set
    # names them, in a row of its own (no --set baseline: it pairs with the baseline variant)
    by_hand = next(r for r in runs if r["name"] == "wav_L2_s0_wav_detail_bias-1")["args"]
    by_hand = [*by_hand, "--seed", 2, "--wav_detail_bias", -1.0, "--out_dir", tmp_path / "hand"]
    assert run(train.main, by_hand)[0] == 0
    group, = experiments.summarize(experiments.find_runs([tmp_path])[0], "prenorm")
    rows = {row["label"]: [r["name"] for r in row["runs"]] for row in group["rows"]}
    assert rows["wav, wav_rho=2, wav_detail_bias=-1"] == ["hand"]
    shutil.rmtree(tmp_path / "hand")
    label = "wav, wav_rho=2, wav_detail_bias=-1 (Δ vs wav_detail_bias=-2)"
    group, = experiments.summarize(experiments.find_runs([tmp_path])[0], "prenorm")
    rows = {row["label"]: row for row in group["rows"]}
    final = {r["name"]: summary(r["dir"])["final"]["val_loss"] for r in runs}
    diffs = [final[f"wav_L2_s{s}_wav_detail_bias-1"] - final[f"wav_L2_s{s}_wav_detail_bias-2"]
             for s in (0, 1)]
    assert rows[label]["delta"] == pytest.approx(dict(
        mean=statistics.fmean(diffs), std=statistics.stdev(diffs), wins=sum(d < 0 for d in diffs),
        ties=sum(d == 0 for d in diffs), n=2))
    assert rows["wav, wav_rho=2, wav_detail_bias=-2"]["delta"]["n"] == 2  # with prenorm
    code, out, _ = run(experiments.main, ["report", tmp_path], capsys)
    assert code == 0 and f"| {label} | 0.002 | 4 | 2 |" in out


def test_report_and_ablate_refuse_a_users_file_where_they_write(block_run, tmp_path, capsys):
    """A user's file under a name report --plots or ablate writes (a figure, the ablation's JSON):
    one error line before anything is computed or written, the file unchanged; the scripts' own
    files there are written over when run again."""
    folder, elsewhere = tmp_path / "block_L2_s0", tmp_path / "notes"
    shutil.copytree(block_run, folder, ignore=shutil.ignore_patterns("ablate_*", "*.png", "*.md"))
    elsewhere.mkdir()
    run_files = set(folder.iterdir())
    ablate = ["ablate", folder, "--mask", "emb", "--draws", 1]
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x1ftEXtSoftware\x00Matplotlib version3.9.0"  # not ours
    for mine, text, argv in [
            (folder / "val_loss.png", b"my notes", ["report", folder, "--plots"]),
            (elsewhere / "val_loss.png", png,  # the figures go beside report.md
             ["report", folder, "--plots", "--out", elsewhere / "report.md"]),
            (folder / "ablate_best_mask-emb.png", png, ablate),
            (folder / "ablate_best_mask-emb.json", b'{"rows": []}', ablate)]:
        mine.write_bytes(text)
        err = error_line(experiments.main, argv, capsys)
        assert f"{mine} exists and is not a file this script wrote: move or rename it: this " \
            "command writes a file of its own under that name (it is not written over)" in err
        assert mine.read_bytes() == text  # and nothing else written
        assert {*folder.iterdir(), *elsewhere.iterdir()} == {*run_files, mine}, mine
        mine.unlink()
    assert run(experiments.main, ["report", folder, "--heatmap", folder], capsys)[0] == 0
    assert not (folder / "val_loss.png").exists()  # --plots alone writes it
    for _ in range(2):  # their own files, written again
        assert run(experiments.main, ablate, capsys)[0] == 0
        assert run(experiments.main, ["report", folder, "--plots"], capsys)[0] == 0
    figures = {"val_loss.png", "ablate_best_mask-emb.png"} if HAS_MPL else set()
    written = {"report.md", "ablate_best_mask-emb.json"} | figures
    assert written <= {p.name for p in folder.iterdir()}
