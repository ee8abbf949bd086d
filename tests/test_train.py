"""train.py and checkpoint.py end to end on tiny models (conftest.TINY: a step takes ms)."""

import dataclasses
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import diagnostics
import nanoroute
import prepare_data
import train
from conftest import (ROOT, ROUTED, TINY, error_line, flip_a_stored_byte, metrics, run,
                      same_weights, summary, tiny, trained, weights, without_times)

# what a routing setting where it has no effect names: the variants it applies to, VARIANTS' routed
ROUTED_VARIANTS = [v for v in nanoroute.VARIANTS if nanoroute.variant(v)["residual"] == "attnres"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # train.py's as a command


def test_a_run_writes_its_files_and_ends_with_how_it_routes_and_what_next(routed):
    out, printed = routed, (routed.parent / "routed.out").read_text()  # conftest's routed run
    assert sorted(p.name for p in out.iterdir()) == sorted(checkpoint.RUN_FILES)
    lines = metrics(out)
    assert [(x["type"], x["step"]) for x in lines] == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2),
        ("train", 3), ("train", 4), ("eval", 4)]
    assert [x["tokens"] for x in lines if x["type"] == "train"] == [256, 512, 768, 1024]
    assert lines[1]["tok_per_s"] is None and lines[2]["tok_per_s"] > 0  # step 1 warms up
    assert [x["milestone"] for x in lines if x["type"] == "eval"] == [None, "512", "1K"]
    done, last = summary(out), lines[-1]
    assert done["final"]["val_loss"] == last["val_loss"] and done["step"] == 4
    assert done["final"]["val_bpc"] == pytest.approx(last["val_loss"] / math.log(2))
    data = prepare_data.load_meta(out / weights(out)["data_dir"])  # the report tells data apart
    assert done["data_sha256"] == data["sha256"] and len(data["sha256"]) == 3
    assert done["precision"] == "float32"  # --dtype auto on a CPU: what it resolved to
    assert done["milestones"]["1K"]["val_loss"] == last["val_loss"]
    assert done["best_val_loss"] == min(x["val_loss"] for x in lines if x["type"] == "eval")
    assert done["final"]["test_loss"] > 0 and done["routes"]["js_mean"] is not None
    assert "routing (mean weight per source" in printed and "readout" in printed
    assert "python sample.py --out_dir runs/routed --routes" in printed  # as it was given
    assert "python experiments.py report runs/routed runs/routed_prenorm" in printed
    best, last_pt = weights(out, "best.pt")["progress"], weights(out)["progress"]
    assert best["best_val_loss"] == done["best_val_loss"] == last_pt["best_val_loss"]


def test_each_micro_step_trains_on_crops_of_its_own(demo, tmp_path, monkeypatch):
    # --grad_accum 2: a step's two micro-steps see batch_offsets of (step, 0) and (step, 1), not
    # the same crops twice (which would count twice the tokens for one batch's gradient)
    seen, real = [], train.get_batch
    monkeypatch.setattr(train, "get_batch", lambda data, offsets, *rest: seen.append(
        (len(data), offsets.tolist())) or real(data, offsets, *rest))
    trained(demo, tmp_path / "r", "--grad_accum", 2, "--max_iters", 2, "--eval_interval", 2)
    a = train.TrainSettings()
    B, T = int(TINY[TINY.index("--batch_size") + 1]), int(TINY[TINY.index("--sequence_len") + 1])
    n = len(prepare_data.open_split(demo, "train"))
    want = [train.batch_offsets(a.seed, step, micro, n, T, B).tolist()
            for step in (0, 1) for micro in (0, 1)]
    assert [offsets for size, offsets in seen if size == n and offsets in want] == want
    # and every token count counts both micro-steps' tokens
    assert summary(tmp_path / "r")["tokens_seen"] == 2 * 2 * B * T


def test_resume_is_bitwise_exact(demo, tmp_path, capsys, monkeypatch):
    # dropout (each process's RNG state), grad_accum and micro_batch: all must carry over
    flags = [*ROUTED, "--dropout", "0.1", "--grad_accum", "2", "--micro_batch", "4",
             "--max_iters", "6", "--eval_interval", "3"]
    trained(demo, tmp_path / "whole", *flags)
    with monkeypatch.context() as patch:  # a slow machine: each reading of the clock 1000 s on
        clock = itertools.count(0, 1000)
        patch.setattr(time, "time", lambda: float(next(clock)))
        trained(demo, tmp_path / "part", *flags, "--stop_after", "2")
    said = capsys.readouterr().out
    assert "stopped (--stop_after) after step 2; continue with: python train.py --out_dir" in said
    assert "--resume --device cpu\n" in said  # how this invocation ran: not in last.pt
    before = weights(tmp_path / "part")["progress"]["seconds"]
    code, printed, _ = run(train.main, ["--out_dir", tmp_path / "part", "--resume", "--device",
                                        "cpu"], capsys)
    assert code == 0 and "resuming" in printed
    elapsed = [x["elapsed_s"] for x in metrics(tmp_path / "part") if x["type"] == "eval"]
    assert before >= 1000 and elapsed == sorted(elapsed)  # the wall time counts on over resumes
    untimed = [x["step"] for x in metrics(tmp_path / "part") if x.get("ms_per_step", 0) is None]
    assert untimed == [1, 3]  # each invocation's first step warms up: not in its speed
    assert summary(tmp_path / "part")["wall_time_s"] > before
    assert same_weights(tmp_path / "whole", tmp_path / "part")
    assert without_times(metrics(tmp_path / "whole")) == without_times(metrics(tmp_path / "part"))
    whole, part = summary(tmp_path / "whole"), summary(tmp_path / "part")
    assert whole["final"] == part["final"] and whole["best_val_loss"] == part["best_val_loss"]


def test_resume_from_elsewhere_and_of_a_finished_run(demo, routed, tmp_path, monkeypatch,
                                                     capsys):
    # routed ran in its project folder with --data demo: data/demo, recorded from runs/routed
    assert weights(routed)["data_dir"] == os.path.join("..", "..", "data", "demo")
    shutil.copytree(routed.parent.parent, tmp_path / "moved")  # the whole project moves
    monkeypatch.chdir(tmp_path)  # and is resumed from elsewhere
    out = tmp_path / "moved" / "runs" / "routed"
    # the optimizer's flags too: used, not only saved (loading its state would put 0.95 back)
    code, printed, _ = run(train.main, ["--out_dir", out, "--resume", "--max_iters", "5",
                                        "--beta2", "0.99", "--weight_decay", "0.05"], capsys)
    assert code == 0 and f"--data {os.path.join('moved', 'data', 'demo')} " in printed  # from here
    assert metrics(out)[-1]["step"] == 5 and weights(out)["settings"]["max_iters"] == 5
    groups = weights(out)["optimizer"]["param_groups"]
    assert [g["betas"] for g in groups] == [(0.9, 0.99)] * 2
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.05]
    out = tmp_path / "moved" / "runs" / "done"  # a finished run resumed with nothing to add
    shutil.copytree(routed, out)  # rewrites nothing, with the files' times
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    capsys.readouterr()
    code, printed, _ = run(train.main, ["--out_dir", out, "--resume"], capsys)
    assert code == 0 and printed.count("\n") == 1 and "finished run (step 4" in printed
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    # a larger budget in tokens continues it (8 x 32 tokens a step: 6 steps)
    assert run(train.main, ["--out_dir", out, "--resume", "--max_tokens", 6 * 256], capsys)[0] == 0
    assert summary(out)["step"] == 6
    # recorded as the budget it gave, not as the steps train.py made of it
    assert [c["setting"] for c in summary(out)["changes"]] == ["max_tokens"]
    shutil.copytree(routed, tmp_path / "moved" / "runs" / "again")
    monkeypatch.chdir(tmp_path / "moved")  # in the folder it ran in: data as it was given, demo
    code = run(train.main, ["--out_dir", "runs/again", "--resume", "--max_iters", 5], capsys)[0]
    assert code == 0
    assert summary(tmp_path / "moved" / "runs" / "again")["train"]["data"] == "demo"
    # an absolute --data stays absolute in the commands it prints, not ../../.. from here
    trained(demo, tmp_path / "abs", "--stop_after", 2)
    printed = run(train.main, ["--out_dir", tmp_path / "abs", "--resume"], capsys)[1]
    assert f"--data {demo} " in printed


def test_same_seed_runs_start_paired_across_variants_and_batches_ignore_processes(demo, tmp_path):
    starts = {}
    for name, flags in (("block", []), ("prenorm", ["--residual", "prenorm"]),
                        ("dense", ["--residual", "denseformer"]), ("wav", ROUTED)):
        trained(demo, tmp_path / name, *flags, "--max_iters", "1", "--lr", "0")
        starts[name] = weights(tmp_path / name)["model"]  # lr 0: the initial weights
    shared = [k for k in starts["prenorm"] if all(k in s for s in starts.values())]
    assert "lm_head.weight" in shared and "layers.1.mlp.c_fc.weight" in shared
    for s in starts.values():
        assert all(torch.equal(s[k], starts["prenorm"][k]) for k in shared)
    rows = train.batch_offsets(7, 3, 1, 10_000, 32, 8)
    assert np.array_equal(rows, train.batch_offsets(7, 3, 1, 10_000, 32, 8))
    assert np.array_equal(np.concatenate([rows[0::2], rows[1::2]]),
                          np.concatenate([rows[r::2] for r in (0, 1)]))
    assert not np.array_equal(rows, train.batch_offsets(7, 4, 1, 10_000, 32, 8))
    assert not np.array_equal(rows, train.batch_offsets(7, 3, 0, 10_000, 32, 8))  # a micro-step
    assert train.eval_offsets(10_000, 32, 8, 300, 1).shape == (2, 8)  # up to whole batches


def test_the_clip_scales_every_parameters_gradient_by_one_norm():
    model = nanoroute.GPT(nanoroute.GPTConfig(n_layer=2, n_embd=32, n_head=2, sequence_len=8,
                                              vocab_size=16, residual="attnres"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # the routing's too, in the optimizer's second group
    grads = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    norm = torch.cat([g.flatten() for g in grads]).norm()
    # plain SGD at lr 1 moves each parameter by its (clipped) gradient
    groups = [dict(params=list(g.values())) for g in (
        {n: p for n, p in model.named_parameters() if n not in model.no_decay_parameters()},
        model.no_decay_parameters())]
    a = train.TrainSettings(grad_clip=1.0)
    train.update(model, torch.optim.SGD(groups, lr=1.0), a)
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(b - p.detach(), g / norm, atol=1e-6, rtol=1e-4)
        assert p.grad is None  # freed until the next backward (a GPU's peak counts them there)


def test_the_route_entropy_term_trains_the_routing():
    model = nanoroute.GPT(nanoroute.GPTConfig(n_layer=2, n_embd=32, n_head=2, sequence_len=8,
                                              vocab_size=16, residual="attnres"))
    queries = [p for n, p in model.no_decay_parameters().items() if n.startswith("query")]
    with torch.no_grad():
        for q in queries:  # off uniform weights, where the entropy's gradient is zero
            q.normal_()
    x = torch.randint(0, 16, (2, 8))
    total, cross_entropy = train.step_loss(model, x, x, train.TrainSettings(route_entropy_coef=1))
    grads = torch.autograd.grad(total - cross_entropy, queries, allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_schedule_token_budget_and_micro_batches(demo, tmp_path):
    a, _ = train.resolve_settings({"max_iters": 10, "warmup_iters": 2, "lr": 1.0})
    lrs = [train.get_lr(step, a) for step in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[-1] == pytest.approx(0.1) \
        and sorted(lrs[1:], reverse=True) == lrs[1:]
    given = vars(train.build_parser().parse_args(["--min_lr", "0", "--max_iters", "10",
                                                  "--warmup_iters", "2"]))
    a, _ = train.resolve_settings({k: v for k, v in given.items() if v is not None})
    assert train.get_lr(9, a) == 0.0  # an explicit --min_lr 0, not lr/10
    budget, _ = train.resolve_settings({"preset": "rd_s", "max_iters": 5})
    assert budget.max_tokens is None and budget.max_iters == 5  # explicit steps beat preset tokens
    trained(demo, tmp_path / "t", "--max_tokens", "1K", "--batch_size", "4", "--eval_tokens", "128")
    assert metrics(tmp_path / "t")[-1]["step"] == 8  # ceil(1000 / (4 x 32))
    # resumed with a larger batch: the budget still counts the tokens seen, not steps x batch
    trained(demo, tmp_path / "b", "--max_tokens", "2K", "--batch_size", "4", "--stop_after", "3")
    for flags in (["--batch_size", 8, "--stop_after", 5], []):  # the second: at its new batch
        assert run(train.main, ["--out_dir", tmp_path / "b", "--resume", *flags])[0] == 0
    assert summary(tmp_path / "b")["tokens_seen"] == 3 * 128 + 7 * 256  # ceil(1616 / 256) = 7
    # micro-batches: the same batches and gradient, in smaller forwards
    for name, extra in (("whole", []), ("micro", ["--micro_batch", "2"])):
        trained(demo, tmp_path / name, "--max_iters", "2", *extra)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "micro")
    assert all(torch.allclose(a["model"][k], b["model"][k], atol=1e-6) for k in a["model"])
    losses = [[x["loss"] for x in metrics(tmp_path / d) if x["type"] == "train"]
              for d in ("whole", "micro")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_logged_losses_are_the_losses_of_their_crops(routed):
    """The eval line's val loss is the model's mean loss over the fixed crops of EVAL_SEED."""
    ckpt = weights(routed)
    model = checkpoint.model_from(ckpt, routed).eval()
    folder, cpu = checkpoint.open_data(ckpt, routed)[0], torch.device("cpu")
    data, test = (prepare_data.open_split(folder, split) for split in ("val", "test"))
    a, T = train.resolve_settings({}, ckpt)[0], model.config.sequence_len
    batches = train.eval_offsets(len(data), T, a.batch_size, a.eval_tokens, 1)
    with torch.no_grad():
        losses = [model(x, y)[1] for o in batches for x, y in train.get_batch(data, o, T, cpu)]
        offsets = train.eval_offsets(len(test), T, a.batch_size, a.eval_tokens, 2)
        tests = [model(x, y)[1] for o in offsets for x, y in train.get_batch(test, o, T, cpu)]
        (x, y), = train.get_batch(data, batches[0][:8], T, cpu)  # the routes: 8 val crops
        routes = diagnostics.routing_stats(model(x, y, return_routes=True)[2])
    assert torch.stack(losses).mean().item() == pytest.approx(metrics(routed)[-1]["val_loss"],
                                                              rel=1e-6)
    done = summary(routed)
    assert torch.stack(tests).mean().item() == pytest.approx(done["final"]["test_loss"], rel=1e-6)
    assert done["routes"]["entropy_norm_mean"] == pytest.approx(routes["entropy_norm_mean"])


def test_the_printed_baseline_runs_and_is_the_same_run_without_routing(demo, tmp_path, capsys):
    out = tmp_path / "my run"  # a space: the commands are shell-quoted
    code, printed, _ = run(train.main, tiny(demo, out, *ROUTED, "--route_heads", "2",
                                            "--max_iters", "2", "--seed", "5", "--bias", "True",
                                            "--route_entropy_coef", "0.1"), capsys)
    described = next(x for x in printed.splitlines() if x.startswith("model: "))  # off default:
    assert "sequence_len 32, bias True, residual attnres (block 4, wav True, rd decoupled, " \
        "route_heads 2, route_entropy_coef 0.1)" in described
    line = next(x for x in printed.splitlines() if "--residual prenorm" in x)
    cmd = shlex.split(line.split("  # ")[0])
    assert cmd[:2] == ["python", "train.py"] and "--wav" not in cmd and "--route_heads" not in cmd
    assert "--route_entropy_coef" not in cmd  # a training setting of the routing (needs=) too
    assert run(train.main, cmd[2:])[0] == 0
    routed, baseline = summary(out), summary(f"{out}_prenorm")
    assert baseline["config"]["residual"] == "prenorm"
    for key in nanoroute.routing_fields():  # only the routing differs
        routed["config"].pop(key), baseline["config"].pop(key)
    for key in nanoroute.routing_fields(train.TrainSettings)[1:]:  # but "residual"
        routed["train"].pop(key), baseline["train"].pop(key)
    assert routed["config"] == baseline["config"]
    assert {k: v for k, v in routed["train"].items() if k != "out_dir"} == \
        {k: v for k, v in baseline["train"].items() if k != "out_dir"}


def test_a_setting_a_resume_changes_is_said_recorded_and_its_baseline_changes_alike(
        demo, tmp_path, capsys):
    import experiments
    out = trained(demo, tmp_path / "run", "--residual", "attnres", "--max_iters", 4,
                  "--stop_after", 1)
    saved = torch.load(out / "last.pt", weights_only=True)
    del saved["settings"]["route_entropy_coef"]  # a setting newer than the run: at its default
    del saved["settings"]["seed"]  # a fixed one too: another value is refused, as for any run
    del saved["config"]["fast_routing"]  # and a model field, which a resume may not change
    torch.save(saved, out / "last.pt")
    err = error_line(train.main, ["--out_dir", out, "--resume", "--seed", 7], capsys)
    assert "--seed 7 differs from the run's seed=1337" in err, err
    err = error_line(train.main, ["--out_dir", out, "--resume", "--fast_routing", "0"], capsys)
    assert "--fast_routing False differs from the run's fast_routing=True" in err, err
    resume = ["--out_dir", out, "--resume", "--lr", "0.01", "--route_entropy_coef", 0.1]
    code, printed, _ = run(train.main, [*resume, "--stop_after", 2], capsys)
    assert code == 0 and "note: --lr 0.01 from step 1 on (was 0.002)" in printed
    code, printed, _ = run(train.main, ["--out_dir", out, "--resume", "--lr", "0.005",
                                        "--route_entropy_coef", 0.2], capsys)
    assert code == 0 and summary(out)["changes"] == [
        dict(step=1, setting="lr", was=0.002, now=0.01),
        dict(step=1, setting="route_entropy_coef", was=0.0, now=0.1),
        dict(step=2, setting="lr", was=0.01, now=0.005),
        dict(step=2, setting="route_entropy_coef", was=0.1, now=0.2)]
    # the printed baseline starts at the run's first settings and says how it changed (but the
    # routing's own settings: the baseline has none)
    command, why = next(x for x in printed.splitlines() if "--residual prenorm" in x).split("  # ")
    assert why.endswith("; as this run: --stop_after 1, then --resume --lr 0.01; --stop_after 2, "
                        "then --resume --lr 0.005")
    flags = shlex.split(command)[2:]
    assert "--lr" not in flags and "--route_entropy_coef" not in flags
    base = flags[flags.index("--out_dir") + 1]
    for argv in ([*flags, "--stop_after", 1],  # done as it says
                 ["--out_dir", base, "--resume", "--lr", "0.01", "--stop_after", 2],
                 ["--out_dir", base, "--resume", "--lr", "0.005"]):
        assert run(train.main, argv)[0] == 0
    plain = trained(demo, tmp_path / "plain", "--residual", "prenorm", "--max_iters", 4)
    # the report pairs the two that changed alike, apart from a run that never changed
    groups = experiments.summarize(experiments.find_runs([out, base, plain])[0], "block")
    assert sorted(len(g["rows"]) for g in groups) == [1, 2]
    pair = next(g for g in groups if len(g["rows"]) == 2)
    assert ("changed at --resume", "lr 0.002 → 0.01 at step 1, lr 0.01 → 0.005 at step 2") in \
        pair["setup"]
    assert [row["delta"]["n"] for row in pair["rows"] if row is not pair["base"]] == [1]
    # a routing setting it changed names its row: not a run that had 0.1 throughout
    changed = next(row for row in pair["rows"] if row["variant"] == "block")
    assert "route_entropy_coef=0 → 0.1 at step 1 → 0.2 at step 2" in changed["label"]
    throughout = trained(demo, tmp_path / "throughout", "--residual", "attnres", "--max_iters", 4,
                         "--route_entropy_coef", 0.2, "--lr", 0.005)
    runs = experiments.find_runs([out, throughout])[0]
    assert len({r["row"] for r in runs}) == 2
    # nothing given anew: nothing recorded, the baseline as before
    again = trained(demo, tmp_path / "again", "--residual", "attnres", "--max_iters", 4,
                    "--stop_after", 2)
    capsys.readouterr()
    printed = run(train.main, ["--out_dir", again, "--resume", "--log_interval", 2], capsys)[1]
    assert "note: --" not in printed and summary(again)["changes"] == []
    assert next(x for x in printed.splitlines() if "--residual prenorm" in x).endswith("batches")


def test_the_route_entropy_loss_trains_the_routes_and_its_value(demo, tmp_path):
    for name, extra in (("none", []), ("0", ["--route_entropy_coef", 0]),
                        ("1", ["--route_entropy_coef", 1])):
        trained(demo, tmp_path / name, "--max_iters", 3, *extra)
    none, zero, one = (weights(tmp_path / name)["model"] for name in ("none", "0", "1"))
    assert all(torch.equal(none[k], zero[k]) for k in none)
    assert without_times(metrics(tmp_path / "none")) == without_times(metrics(tmp_path / "0"))
    config = nanoroute.GPTConfig(**dict(weights(tmp_path / "1")["config"], residual="prenorm"))
    routing = set(one) - set(nanoroute.GPT(config).state_dict())  # the pseudo-queries
    assert routing and all(not torch.equal(zero[k], one[k]) for k in routing)
    logged = [[x["loss"] for x in metrics(tmp_path / d) if x["type"] == "train"] for d in "01"]
    assert logged[0][0] == logged[1][0]  # the logged loss: the cross-entropy alone
    entropy = [summary(tmp_path / d)["routes"]["entropy_norm_mean"] for d in "01"]
    assert entropy[1] < entropy[0]  # it sharpens the routes; coef 0 is the run without it
    # its value: the mean over the reads of several sources, each read once (RD tied: two names)
    torch.manual_seed(0)
    shape = dict(vocab_size=23, sequence_len=16, n_layer=2, n_head=2, n_embd=16, residual="attnres")
    off, tied = (nanoroute.GPT(nanoroute.GPTConfig(**shape, rd=rd)) for rd in ("off", "tied"))
    with torch.no_grad():
        for p, q in zip(off.parameters(), tied.parameters()):  # the same parameters: tied is off
            p.normal_()
            q.copy_(p)
    idx = torch.randint(0, 23, (2, 12))
    routes = off(idx, return_routes=True)[2]
    several = [r["weights"] for r in routes if len(r["sources"]) > 1]  # not layer0.attn (e alone)
    want = sum(-torch.xlogy(w, w).sum(0).mean() for w in several) / len(several)
    torch.testing.assert_close(train.route_entropy(routes), want)
    torch.testing.assert_close(train.route_entropy(tied(idx, return_routes=True)[2]), want)


def test_a_training_setting_is_one_field(demo, tmp_path, monkeypatch, capsys):
    """A new TrainSettings field is a flag with its help, named in the printed training line,
    recorded in checkpoints, kept by --resume and repeated by the printed baseline, with no other
    edit; one fixed=True is refused at --resume, one needs=X where X is off names the variants
    that set X. needs= is the depth routing's: naming another training setting there fails."""
    @dataclasses.dataclass
    class Settings(train.TrainSettings):
        label_smoothing: float = train.option(0.0, "smoothing of the targets", low=0, high=1)
        warm_start: int = train.option(0, "its weights came from it", fixed=True)
        detail_coef: float = train.option(0.0, "a loss on WAV's details", needs="wav")
    monkeypatch.setattr(train, "TrainSettings", Settings)
    help_text = " ".join(train.build_parser().format_help().split())
    assert "smoothing of the targets (default: 0.0)" in help_text
    out = tmp_path / "r"
    code, printed, _ = run(train.main, tiny(demo, out, "--max_iters", "2", "--label_smoothing",
                                            "0.2", "--grad_clip", "0", "--stop_after", "1"), capsys)
    assert code == 0 and weights(out)["settings"]["label_smoothing"] == 0.2
    err = error_line(train.main, ["--out_dir", out, "--resume", "--warm_start", "3"], capsys)
    assert "--warm_start 3 differs from the run's warm_start=0" in err
    a, model = train.resolve_settings({"residual": "attnres", "detail_coef": 0.1})
    with pytest.raises(train.UsageError, match=r"--detail_coef 0.1: .*applies to: (.*)\)") as e:
        train.check_settings(a, 1, model)
    where = e.value.args[0].split("applies to: ")[1].rstrip(")").split(", ")
    assert "wav" in where and "block" not in where and "prenorm" not in where
    training = next(line for line in printed.splitlines() if line.startswith("training: "))
    assert "cosine to 0.0002 (grad_clip 0.0, eval_tokens 256, log_interval 1, label_smoothing " \
        "0.2); " in training  # off its default, 0 too
    code, printed, _ = run(train.main, ["--out_dir", out, "--resume"], capsys)
    assert code == 0 and "--label_smoothing 0.2" in printed
    code, _, err = run(train.main, tiny(demo, tmp_path / "s", "--label_smoothing", "2"), capsys)
    assert code == 2 and "--label_smoothing 2.0: must be in [0, 1)" in err
    for text, value in [("True", True), ("1", True), ("false", False), ("0", False)]:  # bool flags
        assert train.build_parser().parse_args(["--route_static", text]).route_static is value
    assert train.build_parser().parse_args(["--compile"]).compile is True  # alone: True
    for name in ("lr_schedule", "routing_block"):  # a training setting; GPTConfig's, not a field
        with pytest.raises(ValueError, match=f"needs='{name}': not a GPTConfig field.*check_set"):
            train.option(0.2, "the decaying fraction of the steps", needs=name)


class Unpicklable:  # an object weights_only=True refuses to unpickle (it could run code)
    pass


def test_folders_models_datasets_and_checkpoints_a_run_refuses(demo, routed, tmp_path, capsys):
    for name in checkpoint.RUN_FILES:  # any file of a run, also a finished run without checkpoints
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_text("x")
        err = error_line(train.main, tiny(demo, folder, "--max_iters", "1"), capsys)
        assert f"already holds a run ({name})" in err and "--resume" in err
        assert (folder / name).read_text() == "x"
    err = error_line(train.main, ["--out_dir", tmp_path / "none", "--resume"], capsys)
    assert "no last.pt" in err
    err = error_line(train.main, ["--out_dir", routed, "--resume", "--n_embd", "64"], capsys)
    assert "--n_embd 64 differs from the run's n_embd=32" in err
    # the seed made the run's weights: another would record a seed the run never had
    for data in ([], ["--data", demo]):  # with --data too (its folder, spelled another way)
        err = error_line(train.main, ["--out_dir", routed, "--resume", *data, "--seed", 5], capsys)
        assert "--seed 5 differs from the run's seed=" in err
    err = error_line(train.main, ["--out_dir", routed, "--resume", "--preset", "wav12"], capsys)
    assert "--preset wav12 sets rd=off, the run's is decoupled: drop --preset to resume" in err
    # its model given as the run's: its batch and schedule would still replace the run's
    saved = torch.load(routed / "last.pt", weights_only=True)
    same = [x for k in train.PRESETS["wav12"] if k in saved["config"]
            for x in (f"--{k}", saved["config"][k])]
    same += ["--max_iters", saved["settings"]["max_iters"]]  # (were it taken: no step to run)
    err = error_line(train.main, ["--out_dir", routed, "--resume", "--preset", "wav12", *same],
                     capsys)
    assert "--preset wav12 sets batch_size=64, the run's is" in err, err
    other = tmp_path / "other"
    prepare_data.prepare("demo", other, demo_mb=0.2, seed=3)  # another text, another vocabulary?
    meta = json.loads((other / "meta.json").read_text())
    if meta.get("chars") == json.loads((Path(demo) / "meta.json").read_text()).get("chars"):
        meta["dataset"] = "renamed"
        (other / "meta.json").write_text(json.dumps(meta))
    err = error_line(train.main, ["--out_dir", routed, "--resume", "--data", other], capsys)
    assert "is not the dataset" in err
    data, ckpt = (routed / "last.pt").read_bytes(), weights(routed)
    # a checkpoint of another code version: a tensor more in its model
    foreign = dict(ckpt, model={**ckpt["model"], "query.layer9_mlp": torch.zeros(32)})
    cases = {"flipped bytes": (data, "damaged (CRC"),
             "truncated": (data[:len(data) // 2], "damaged"),
             "not a checkpoint": (b"hello", "damaged"),
             "another version": (foreign, "does not fit this version of nanoroute"),
             "a pickled object": (dict(ckpt, extra=Unpicklable()), "damaged (UnpicklingError")}
    for case, (content, words) in cases.items():
        path = routed.parent / case / "last.pt"  # beside it: its data at the same place
        path.parent.mkdir()
        path.write_bytes(content) if isinstance(content, bytes) else torch.save(content, path)
        if case == "flipped bytes":
            flip_a_stored_byte(path)
        assert words in error_line(train.main, ["--out_dir", path.parent, "--resume"], capsys), case
    # a run made before a model field existed ran at its default: --dropout 0.1 differs from it
    path = routed.parent / "older" / "last.pt"
    path.parent.mkdir()
    config = {k: v for k, v in ckpt["config"].items() if k != "dropout"}
    torch.save(dict(ckpt, config=config), path)
    err = error_line(train.main, ["--out_dir", path.parent, "--resume", "--dropout", 0.1], capsys)
    assert "--dropout 0.1 differs from the run's dropout=0.0" in err


def stopped_after_step_3(cmd, stop):
    """cmd run until it logs step 3, then stop(proc): (exit code, stdout, stderr). It starts
    with SIGINT handled, as from a terminal: a suite run in the background (`cmd &` in a script)
    ignores it, and train.py keeps a SIGINT ignored at start ignored."""
    def from_a_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, preexec_fn=from_a_terminal)
    try:
        while "step 3 " not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read()
        stop(proc)
        printed, err = proc.communicate(timeout=600)  # a busy machine: minutes, a hang: never
    finally:
        proc.kill()
    return proc.returncode, printed, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_finishes_the_step_saves_and_resumes(demo, tmp_path, sig):
    out = tmp_path / "r"
    cmd = [sys.executable, ROOT / "train.py", *tiny(
        demo, out, "--max_iters", 10 ** 6, "--eval_interval", 10 ** 6, "--log_interval", 1)]
    code, printed, err = stopped_after_step_3(cmd, lambda proc: proc.send_signal(sig))
    assert code == 128 + sig, err
    stopped = next(x for x in printed.splitlines() if x.startswith("stopped by"))
    step = weights(out)["progress"]["step"]
    assert f"stopped by {sig.name} after step {step}; continue with: python train.py --out_dir" \
        in stopped
    assert metrics(out)[-1]["step"] == step and step >= 3
    assert run(train.main, ["--out_dir", out, "--resume", "--max_iters", step + 1])[0] == 0


def test_each_torchrun_process_takes_the_gpu_of_its_local_rank(monkeypatch):
    # on a second machine RANK is 8 or more, LOCAL_RANK 0..7: a GPU index is the local one
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "16")
    asked = []

    def chosen(name, local_rank=0, world=1):  # stops start() before it joins a process group
        asked.append((name, local_rank, world))
        raise train.UsageError("stop here")

    monkeypatch.setattr(train, "pick_device", chosen)
    with pytest.raises(train.UsageError):
        train.start(["--device", "cuda"])
    assert asked == [("cuda", 1, 16)]


def torchrun(*argv):  # train.py on two processes, on a free port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--master_port={port}", ROOT / "train.py", "--", *argv]


def test_torchrun_resume_is_bitwise_exact_and_matches_one_process(demo, tmp_path, monkeypatch):
    flags = [*TINY, *ROUTED, "--dropout", 0.1, "--max_iters", 4, "--eval_interval", 2,
             "--route_entropy_coef", 0.1]  # DDP returns the routes' graph too
    monkeypatch.setenv("NANOROUTE_PEAK_FLOPS", "1e12")  # an MFU on the CPU too

    def two_processes(out, *extra):
        cmd = torchrun(*flags, "--data", demo, "--out_dir", out, *extra)
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                              env=dict(ENV, NANOROUTE_PEAK_FLOPS="1e12"), timeout=240)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout
    printed = two_processes(tmp_path / "whole")
    assert "torchrun --nproc_per_node=2 train.py -- --residual prenorm" in printed
    printed = two_processes(tmp_path / "part", "--stop_after", 2)
    assert "continue with: torchrun --nproc_per_node=2 train.py --" in printed
    two_processes(tmp_path / "part", "--resume")
    assert same_weights(tmp_path / "whole", tmp_path / "part")
    assert without_times(metrics(tmp_path / "whole")) == without_times(metrics(tmp_path / "part"))
    rng = weights(tmp_path / "whole")["rng"]  # each process its own dropout masks
    assert len(rng) == 2 and not torch.equal(rng[0]["cpu"], rng[1]["cpu"])
    # one process: the same initial weights and evaluation crops (each process scores its rows)
    trained(demo, tmp_path / "one", *ROUTED, "--dropout", 0.1, "--max_iters", 4, "--stop_after", 3)
    assert metrics(tmp_path / "one")[0]["val_loss"] == pytest.approx(
        metrics(tmp_path / "whole")[0]["val_loss"], rel=1e-6)
    # MFU is one device's: per token a second, two processes give each half of the FLOPs

    def mfu_per_token_s(out):
        return [x["mfu"] / x["tok_per_s"] for x in metrics(out) if x.get("mfu")]
    (one, *_), (two, *_) = (mfu_per_token_s(tmp_path / x) for x in ("one", "whole"))
    assert two == pytest.approx(one / 2, rel=1e-3)
    # resumed on two processes: each draws its own dropout stream again
    printed = two_processes(tmp_path / "one", "--resume")
    assert "written by 1 process(es), not 2: dropout is reseeded" in printed
    rng = weights(tmp_path / "one")["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["cpu"], rng[1]["cpu"])


def test_under_torchrun_a_signal_to_one_process_stops_them_all(demo, tmp_path):
    def stop_one_worker(proc):  # one worker alone gets SIGTERM
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(children[-1]), signal.SIGTERM)
    # steps enough that a loaded machine signals long before the end (a tiny step takes ms), few
    # enough that a run the signal does not stop ends soon and fails here
    cmd = torchrun(*tiny(demo, tmp_path, "--max_iters", 5000, "--eval_interval", 10 ** 4))
    _, printed, err = stopped_after_step_3(cmd, stop_one_worker)
    step = weights(tmp_path)["progress"]["step"]
    assert f"stopped by SIGTERM after step {step}" in printed and step < 5000, printed + err[-2000:]


def test_a_resume_goes_on_at_the_runs_precision_and_notes_a_change_of_it(demo, tmp_path, capsys):
    """--dtype is the run's: a bare --resume of a bf16 run trains on in bf16, bitwise as one run;
    another --dtype, or auto resolving otherwise elsewhere, is noted, recorded and paired alike."""
    bf16 = ("--max_iters", 3, "--dtype", "bfloat16")
    straight = trained(demo, tmp_path / "straight", *bf16)
    out = trained(demo, tmp_path / "run", *bf16, "--stop_after", 1)
    code, printed, _ = run(train.main, ["--out_dir", out, "--resume"], capsys)
    assert code == 0 and "note: --" not in printed and "bfloat16" in printed
    assert summary(out)["precision"] == "bfloat16" and summary(out)["changes"] == []
    assert summary(out)["final"] == summary(straight)["final"]
    out = trained(demo, tmp_path / "changed", *bf16, "--stop_after", 1)
    code, printed, _ = run(train.main, ["--out_dir", out, "--resume", "--dtype", "auto"], capsys)
    assert code == 0 and "note: --dtype float32 from step 1 on (was bfloat16)" in printed
    assert summary(out)["changes"] == [dict(step=1, setting="dtype", was="bfloat16", now="float32")]
    command, why = next(x for x in printed.splitlines() if "--residual prenorm" in x).split("  # ")
    assert "--dtype bfloat16" in command and why.endswith("--resume --dtype float32")


def test_a_runs_time_counts_every_invocation(demo, tmp_path):
    """elapsed_s and wall_time_s are the run's, over each of its invocations: a resumed run's
    counts on from the seconds its checkpoint holds (here set to 1000, as if it had run so long)."""
    out = trained(demo, tmp_path / "run", "--max_iters", 3, "--eval_interval", 1, "--stop_after", 1)
    saved = torch.load(out / "last.pt", weights_only=True)
    saved["progress"]["seconds"] = 1000.0
    torch.save(saved, out / "last.pt")
    assert run(train.main, ["--out_dir", out, "--resume", "--stop_after", 2])[0] == 0
    assert run(train.main, ["--out_dir", out, "--resume"])[0] == 0  # its second resume
    timed = [line for line in metrics(out) if "elapsed_s" in line]  # the train lines
    assert {line["step"] for line in timed if line["elapsed_s"] >= 1000} == {2, 3}
    assert summary(out)["wall_time_s"] >= 1000


def test_bf16_autocast_and_compile(demo, tmp_path, monkeypatch):
    compiled, real, out = [], torch.compile, tmp_path / "c"
    monkeypatch.setattr(torch, "compile",
                        lambda model, **kw: compiled.append(model) or real(model, backend="eager"))
    trained(demo, out, "--max_iters", 1, "--compile", "--dtype", "bfloat16",
            "--route_entropy_coef", 0.1)
    assert len(compiled) == 1 and list(weights(out)["model"]) == list(compiled[0].state_dict())
    assert all(v.dtype == torch.float32 for v in weights(out)["model"].values())


@pytest.mark.optional
def test_wandb_gets_the_numbers_of_metrics_jsonl(demo, tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb", reason="needs wandb (optional: pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never upload from a test
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, real_log, out = [], wandb.Run.log, tmp_path / "r"
    monkeypatch.setattr(wandb.Run, "log", lambda self, data, step=None: (
        logged.append((step, dict(data))) or real_log(self, data, step=step)))
    trained(demo, out, "--max_iters", 2, "--wandb_project", "test", "--wandb_run", "t",
            "--residual", "attnres")
    lines = metrics(out)
    assert [step for step, _ in logged] == [x["step"] for x in lines]
    assert logged[1][1]["train/loss"] == lines[1]["loss"] \
        and logged[-1][1]["eval/val_loss"] == lines[-1]["val_loss"]
    # the routes' numbers too, whatever routing_stats gives (not its per-read dicts)
    routes = {k: v for k, v in lines[-1]["routes"].items() if isinstance(v, float)}
    assert routes and {f"eval/routes/{k}": v for k, v in routes.items()}.items() <= \
        logged[-1][1].items()
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


def test_peak_flops_of_known_gpus_only_and_bf16_from_capability_8(monkeypatch):
    for capability, dtype in (((7, 5), torch.float32), ((8, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert train.pick_dtype("auto", torch.device("cuda")) == dtype, capability
    for name, bf16 in (("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H100 80GB HBM3", 989e12),
                       ("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", None),
                       ("NVIDIA H100 NVL", None), ("NVIDIA RTX A1000", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert train.peak_flops(torch.device("cuda"), torch.bfloat16) == bf16, name
    assert train.peak_flops(torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv("NANOROUTE_PEAK_FLOPS", "2.5e12")  # any device's, given
    assert train.peak_flops(torch.device("cpu"), torch.float32) == 2.5e12
    for bad in ("fast", "0", "-1e12", "nan", "inf"):
        monkeypatch.setenv("NANOROUTE_PEAK_FLOPS", bad)
        message = f"NANOROUTE_PEAK_FLOPS={bad}: give one device's"
        with pytest.raises(train.UsageError, match=message):
            train.peak_flops(torch.device("cpu"), torch.float32)


def test_bool_flags_take_true_false_1_0_in_any_case():
    for text, value in (("True", True), ("true", True), ("1", True), ("False", False),
                        ("FALSE", False), ("0", False)):
        assert train.build_parser().parse_args(["--wav", text]).wav is value, text
    assert train.build_parser().parse_args(["--wav"]).wav is True  # alone: True


# each after --data DEMO --out_dir TMP/x --device cpu: a flag given twice, the last counts
@pytest.mark.parametrize("argv, words", [
    (["--learning_rate", "1"], "did you mean --lr?"),  # unknown flag
    (["--max_iter", "3"], "unrecognized arguments: --max_iter"),  # abbreviated flag
    (["--init_from", "out"], "--init_from out; see --help"),  # no hint: --resume is not a fine-tune
    (["--wav", "maybe"], "--wav: invalid true_or_false value"),
    (["--vocab_size", "9"], "unrecognized arguments: --vocab_size"),  # the data's
    (["--lr", "-1"], "--lr -1.0: must be at least 0"),
    (["--lr", "nan"], "--lr nan: must be at least 0 and finite"),
    (["--lr", "inf"], "--lr inf: must be at least 0 and finite"),
    (["--beta2", "1"], "--beta2 1.0: must be in [0, 1)"),
    (["--max_iters", "0"], "--max_iters 0: must be at least 1"),
    (["--max_tokens", "2X"], "--max_tokens: invalid count value"),
    (["--milestones", "1M,xyz"], "is not a token count"),
    (["--max_iters", "3", "--max_tokens", "1M"], "not both"),
    (["--wandb_run", "a"], "--wandb_run needs --wandb_project"),
    (["--batch_size", "8", "--micro_batch", "3"], "divides its share"),
    (["--device", "tpu"], "choose auto, cpu, cuda, cuda:N or mps"),
    (["--device", "cuda"], "not available here"),
    (["--preset", "rd_x"], "invalid choice: 'rd_x'"),
    (["--n_embd", "30"], "n_head=4: must divide n_embd=30"),
    (["--residual", "prenorm", "--wav", "True"], "applies only to"),  # routing without attnres
    (["--residual", "denseformer", "--route_entropy_coef", "0.1"],  # a training setting of it too
     "error: --route_entropy_coef 0.1: applies only to residual=attnres: add --residual attnres "
     f"(the variants it applies to: {', '.join(ROUTED_VARIANTS)})\n"),
    (["--sequence_len", "200000"], "does not fit"),
    # its first layer asks the CPU for 12 TB: refused at once, nothing touched
    (["--n_embd", "1000000"], "out of memory: lower --micro_batch"),
    (["--data", "{tmp}/data/demo_typo"], "does not exist"),
    (["--out_dir", " "], "give a folder name"),
    (["--out_dir", ""], "--out_dir: '': give a folder name"),
    (["--data", ""], "--data: '': give a folder name"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, words, demo, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --out_dir '' must not read as the working folder
    given = ["--data", demo, "--out_dir", tmp_path / "x", "--device", "cpu"]
    err = error_line(train.main, [*given, *(a.format(tmp=tmp_path) for a in argv)], capsys)
    assert words in err, err
    assert not (tmp_path / "x").exists()  # refused: not even an empty --out_dir
    assert not list(tmp_path.glob("*.pt"))


def test_as_a_command_bad_input_is_one_line_and_a_bare_data_name_is_under_data(tmp_path):
    done = subprocess.run([sys.executable, ROOT / "train.py", "--max_itres", "3"],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr == "error: unrecognized arguments: --max_itres 3 " \
        "(did you mean --max_iters?); see --help\n"
    done = subprocess.run([sys.executable, ROOT / "train.py", "--data", "text8", "--device", "cpu"],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert done.returncode == 2 and "data/text8" in done.stderr \
        and "python prepare_data.py text8" in done.stderr
    assert not (tmp_path / "text8").exists() and not (tmp_path / "out" / "last.pt").exists()


def test_explicit_flags_beat_a_preset_and_the_printed_baseline_keeps_all_but_the_routing(
        monkeypatch):
    a, model = train.resolve_settings({"preset": "wav12", "residual": "prenorm", "lr": 0.01})
    assert model["residual"] == "prenorm" and not model["wav"] and a.lr == 0.01
    # a preset of yours with a routing setting of training's: dropped too, not refused
    monkeypatch.setitem(train.PRESETS, "mine", dict(train.PRESETS["wav12"], route_entropy_coef=0.1))
    a, model = train.resolve_settings({"preset": "mine", "residual": "prenorm"})
    assert a.route_entropy_coef == 0 and model["residual"] == "prenorm"
    train.check_settings(a, 1, model)
    assert a.max_iters == train.PRESETS["wav12"]["max_iters"]  # the preset's other settings stay
    assert train.resolve_settings({"preset": "wav12", "max_tokens": 10**8})[0].max_tokens == 10**8
    a, model = train.resolve_settings({"preset": "rd_s"})
    train.check_settings(a, 8, model)  # on 8 GPUs: shares of 8 sequences, under its micro-batch 16
    # 2 processes, 6 sequences each, in forwards of 4 and 2: unequal, refused (12 % 4 is no test)
    a, model = train.resolve_settings({"batch_size": 12, "micro_batch": 4})
    with pytest.raises(train.UsageError, match="divides its share"):
        train.check_settings(a, 2, model)
    # resumed with its preset again, a run made with a smaller batch would silently take 64
    a, model = train.resolve_settings({"preset": "wav12", "batch_size": 8})
    ckpt = dict(config=model, settings=dataclasses.asdict(a))
    with pytest.raises(train.UsageError, match="--preset wav12 sets batch_size=64, the run's is 8"):
        train.resolve_settings({"preset": "wav12", "resume": True}, ckpt)
    assert train.resolve_settings({"resume": True}, ckpt)[0].batch_size == 8
    nanoroute.GPTConfig(**dict(model, vocab_size=256))  # a model train.py builds: PreNorm
    # the baseline of a preset's run, and of a run whose flags are GPTConfig's own defaults (not
    # train.py's small model): run as printed, each is the same run without the routing
    for explicit in ({"preset": "wav12"}, {"n_layer": 6, "n_head": 6, "n_embd": 384}):
        a, model = train.resolve_settings(explicit)
        flags, _ = train.baseline_flags(a, nanoroute.GPTConfig(**dict(model, vocab_size=256)))
        flags = list(map(str, flags))
        assert "--preset" not in flags and flags[:2] == ["--residual", "prenorm"]
        parsed = vars(train.build_parser().parse_args(flags))
        b, baseline = train.resolve_settings({k: v for k, v in parsed.items() if v is not None})
        skip = {*nanoroute.routing_fields(), *nanoroute.routing_fields(train.TrainSettings),
                "out_dir", "preset"}  # all else as the routed run
        assert {k: v for k, v in {**dataclasses.asdict(a), **model}.items() if k not in skip} == \
            {k: v for k, v in {**dataclasses.asdict(b), **baseline}.items() if k not in skip}
        assert baseline["residual"] == "prenorm" and not baseline["wav"]
    # the baseline of a token budget and of a named wandb run
    a, model = train.resolve_settings({"preset": "rd_s", "wandb_project": "p", "wandb_run": "r"})
    a.max_iters = 3815  # as setup computes it from the preset's --max_tokens 2B
    flags, _ = train.baseline_flags(a, nanoroute.GPTConfig(**dict(model, vocab_size=50257)))
    flags = list(map(str, flags))
    assert "--max_iters" not in flags and flags[flags.index("--wandb_run") + 1] == "r_prenorm"
    given = {k: v for k, v in vars(train.build_parser().parse_args(flags)).items() if v is not None}
    b, model = train.resolve_settings(given)  # the printed command is a run train.py accepts
    assert b.max_tokens == a.max_tokens and model["residual"] == "prenorm"
    stats = dict(reads={"readout": dict(sources=["emb", "C0", "C1", "P"],
                                        mean_weight=[0.2, 0.5, 0.1, 0.2])}, js_mean=None,
                 sources=["emb", "C0", "C1", "P"])  # as routing_stats gives them
    assert train.routing_summary(stats).splitlines()[1].split() == \
        ["readout", "C0", "0.50", "emb", "0.20", "P", "0.20", "..."]  # the heaviest first
    stats["reads"]["readout"]["mean_weight"] = [0.1, 0.3, 0.3, 0.3]  # equal weights: pool order
    assert train.routing_summary(stats).splitlines()[1].split()[1::2] == ["C0", "C1", "P", "..."]


def test_best_is_the_lowest_and_failures_keep_good_checkpoints(demo, tmp_path, monkeypatch, capsys):
    # a divergence stops the run and keeps the last good checkpoint
    err = error_line(train.main, tiny(demo, tmp_path / "d", "--lr", "1e6", "--grad_clip", "0",
                                      "--max_iters", "40", "--eval_interval", "1",
                                      "--warmup_iters", "0"), capsys)
    assert err.startswith("error: non-finite") and "last.pt is the last good step" in err
    assert all(p.isfinite().all() for p in weights(tmp_path / "d")["model"].values())
    out, flags = tmp_path / "r", ["--max_iters", 2, "--eval_interval", 1]
    trained(demo, out, *flags)
    assert run(train.main, ["--out_dir", out, "--resume", "--max_iters", 4, "--lr", 3.0])[0] == 0
    vals = {x["step"]: x["val_loss"] for x in metrics(out) if x["type"] == "eval"}
    best = weights(out, "best.pt")["progress"]
    assert vals[4] > min(vals.values()) == best["best_val_loss"] == vals[best["step"]]
    assert summary(out)["best_val_loss"] == min(vals.values())
    # a crash between the two writes of an improving step: best.pt ahead, last.pt behind
    real, writes = checkpoint.write_atomic, []

    def crash_at_step_2s_second_checkpoint(path, data):  # steps 0, 1, 2 each improve
        writes.append(path) if str(path).endswith(".pt") else None
        if len(writes) == 6 and str(path).endswith(".pt"):
            raise OSError(28, "No space left on device")
        real(path, data)
    monkeypatch.setattr(checkpoint, "write_atomic", crash_at_step_2s_second_checkpoint)
    assert run(train.main, tiny(demo, tmp_path / "c", "--max_iters", 3,
                                "--eval_interval", 1))[0] == 2
    progress = [weights(tmp_path / "c", f)["progress"] for f in ("best.pt", "last.pt")]
    assert progress[0]["step"] == 2 and progress[1]["step"] == 1  # best.pt never behind
    monkeypatch.setattr(checkpoint, "write_atomic", real)
    assert run(train.main, ["--out_dir", tmp_path / "c", "--resume", "--max_iters", 1])[0] == 0
    assert summary(tmp_path / "c")["best_val_loss"] == progress[0]["best_val_loss"]  # best.pt's


def test_a_stop_saves_its_step_the_last_one_finishes_an_ignored_signal_stays_so(demo, tmp_path):
    trained(demo, tmp_path, "--max_iters", 2, "--stop_after", 2)
    assert (tmp_path / "summary.json").exists()
    # a stop after step 3, whose last line is step 2's evaluation: step 3 is saved too
    trained(demo, tmp_path / "b", "--max_iters", 9, "--eval_interval", 2, "--log_interval", 5,
            "--stop_after", 3)
    saved = weights(tmp_path / "b")["progress"]
    assert metrics(tmp_path / "b")[-1]["step"] == 2 and saved["step"] == 3
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script starts it
    try:
        received, handlers = checkpoint.catch_stop_signals()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, old)

HELD = """
import torch, common
kept = common.keep_freed_memory()
def pages(): return int(open("/proc/self/statm").read().split()[1])  # resident, 4 KB pages
before = pages()
torch.ones(5 << 20)  # 20 MB filled, then freed
print(kept, pages() - before)
"""

@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.parametrize("script", ["train", "bench", "routing_time"])
def test_the_scripts_that_train_or_time_steps_keep_freed_memory(script, demo, tmp_path):
    argv = dict(train=tiny(demo, tmp_path / "run", "--max_iters", 1),
                bench=["--shape", "tiny", "--iters", 1, "--warmup", 0, "--gen_tokens", 0],
                routing_time=["--shape", "tiny", "--steps", 1, "--variants", "block"])[script]
    env = {k: v for k, v in ENV.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    ran = f"import {script}; {script}.main({[str(arg) for arg in argv]!r}); kept = 'ran'"
    out = subprocess.run([sys.executable, "-c", HELD.replace(
        "import torch, common\nkept = common.keep_freed_memory()", f"import torch\n{ran}")],
        env={**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tools'}"}, cwd=tmp_path, check=True,
        capture_output=True, text=True).stdout.splitlines()[-1].split()
    assert out[0] == "ran" and int(out[1]) > 5000  # the freed 20 MB still resident


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_stays_for_the_next_step_unless_the_user_set_malloc():
    env = {k: v for k, v in ENV.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    kept, held = subprocess.run([sys.executable, "-c", HELD], env=env, check=True,
                                capture_output=True, text=True).stdout.split()
    assert kept == "True" and int(held) > 5000  # the 5,120 pages of 20 MB
    # the user's own setting wins, and glibc gives the block back to the system
    kept, held = subprocess.run([sys.executable, "-c", HELD], env={**env, "MALLOC_ARENA_MAX": "2"},
                                check=True, capture_output=True, text=True).stdout.split()
    assert kept == "False" and int(held) < 1000
