"""bench.py: what it measured, checked on its structure (never on time); tools/gpu_check.sh."""

import json
import mmap
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bench
import nanoroute
import train
from conftest import ROOT, error_line

TINY = ["--shape", "tiny", "--device", "cpu", "--warmup", "1", "--gen_tokens", "0"]


def bench_json(tmp_path, *argv):
    path = tmp_path / "bench.json"
    flags = TINY[2:] if "--preset" in argv else TINY  # a preset is a shape: not both
    bench.main([*flags, "--json", str(path), *map(str, argv)])  # argv may end in -- FLAGS
    return json.loads(path.read_text())


@pytest.fixture
def training_forwards():
    """Which model ran each forward with gradients: (its nanoroute module, its residual)."""
    log = []

    def note(module, args):
        if type(module).__name__ == "GPT" and torch.is_grad_enabled():
            log.append((type(module).__module__, module.config.residual))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
    yield log
    handle.remove()


def test_rounds_interleave_every_model_and_the_numbers_add_up(tmp_path, training_forwards):
    (tmp_path / "old").mkdir()  # another version, in a folder: this code, its MLPs twice as wide
    old = Path(nanoroute.__file__).read_text().replace("4 * config.n_embd", "8 * config.n_embd")
    (tmp_path / "old" / "nanoroute.py").write_text(old)
    data = bench_json(tmp_path, "--variants", "prenorm,rezero,block", "--iters", 3, "--against",
                      tmp_path / "old", "--gen_tokens", 4, "--gen_repeats", 2)
    names = [v + version for v in ("prenorm", "rezero", "block") for version in ("", "@against")]
    assert list(data["first_steps"]) == list(data["variants"]) == names
    ran = [("nanoroute" + "_against" * n.endswith("@against"),
            nanoroute.VARIANTS[n.removesuffix("@against")]["residual"]) for n in names]
    # first steps, 1 warm-up round, 3 timed rounds, side by side; then each model's memory count
    assert training_forwards == ran * (1 + 1 + 3) + ran
    v = data["variants"]
    for name, r in v.items():
        version = "@against" * name.endswith("@against")
        assert r["ms_all"] == data["rounds_ms"][name] and len(r["ms_all"]) == 3
        assert (r["ms_median"], r["ms_min"]) == (statistics.median(r["ms_all"]), min(r["ms_all"]))
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["ms_median"] / 1e3))
        for base in ("prenorm", "block"):
            ref = v[base + version]  # ratios stay within one version of the code
            assert r[f"ratio_{base}"] == pytest.approx(r["ms_median"] / ref["ms_median"])
            rounds = [t / u for t, u in zip(r["ms_all"], ref["ms_all"])]
            quartiles = statistics.quantiles(rounds, n=4, method="inclusive")[::2]
            assert r[f"paired_ratio_{base}"] == pytest.approx([statistics.median(rounds),
                                                               *quartiles])
        parts = r["memory"]  # CPU: an exact count, part by part
        assert r["memory_bytes"] == sum(parts.values()) and len(parts) == 4
        assert parts["params"] == parts["grads"] == 4 * r["params"]  # float32; tied: once
        assert parts["adamw"] >= 2 * parts["params"] and parts["saved"] > 0
        prenorm = v["prenorm" + version]
        assert r["memory_ratio_prenorm"] == r["memory_bytes"] / prenorm["memory_bytes"]
        if not version:  # this code against that code, round by round
            rounds = [t / u for t, u in zip(r["ms_all"], v[name + "@against"]["ms_all"])]
            assert r["paired_ratio_against"][0] == pytest.approx(statistics.median(rounds))
            against = v[name + "@against"]["memory_bytes"]  # wider MLPs: more bytes
            assert r["memory_ratio_against"] == r["memory_bytes"] / against < 1
    gen = data["generation"]  # each variant's generation beside its --against twin's
    assert gen["new_tokens"] == 4 and list(gen["variants"]) == names
    for name, g in gen["variants"].items():  # KV cache and full recompute: the same tokens
        assert g["same_tokens"] and g["speedup"] == pytest.approx(g["recompute_ms"] / g["kv_ms"])
        version = "@against" * name.endswith("@against")
        base = gen["variants"]["prenorm" + version]["kv_ms"]  # per token against PreNorm's
        assert g["kv_ratio_prenorm"] == pytest.approx(g["kv_ms"] / base)
        if not version:
            twin = gen["variants"][name + "@against"]["kv_ms"]
            assert g["kv_ratio_against"] == pytest.approx(g["kv_ms"] / twin)
    assert data["complete"] and data["machine"]["command"].startswith("python bench.py --shape")


def test_a_bench_cut_short_keeps_what_it_measured_and_says_it_is_not_complete(tmp_path,
                                                                            monkeypatch):
    def cut(*args):  # Ctrl-C while generation is timed, the last part
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "time_generation", cut)
    with pytest.raises(SystemExit, match="130"):  # the shell's code for Ctrl-C
        bench_json(tmp_path, "--variants", "prenorm,block", "--iters", 1, "--gen_tokens", 2)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert not data["complete"] and list(data["variants"]) == ["prenorm", "block"]
    # an earlier bench's complete file, then one cut before its first step: it says so at once
    (tmp_path / "bench.json").write_text(json.dumps(dict(data, complete=True)))
    monkeypatch.setattr(bench, "build", cut)
    with pytest.raises(SystemExit, match="130"):
        bench_json(tmp_path, "--variants", "rd")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert not data["complete"] and data["variants"] == {} and "rd" in data["args"]["variants"]


def test_compile_raises_the_recompile_limit_and_counts_each_models_graphs(tmp_path):
    # with a limit of 1, the second model of the same GPT.forward would run eager: bench.py
    # raises it for its run, and each model's own backend counts what it compiled and ran
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            data = bench_json(tmp_path, "--variants", "prenorm,block", "--iters", 1, "--warmup",
                              0, "--compile", "--compile_backend", "aot_eager")
            assert torch._dynamo.config.recompile_limit == 1  # back as it was
    finally:
        torch._dynamo.reset()
    for name, r in data["variants"].items():
        assert r["compiled"] is True and r["graphs"] >= 1 and r["calls"] >= 2, name
        assert r["compile_s"] == max(0.0, r["first_step_s"] - r["ms_median"] / 1e3), name


def test_preset_shape_mfu_and_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "peak_flops", lambda device, dtype: 1e12)  # a CPU has none
    small = ["--n_layer", 1, "--n_embd", 16, "--n_head", 2, "--sequence_len", 8]
    # rd_m: its micro-batch of 16 and GPT-2's vocabulary; wav48: its batch of 64, <= 256 chars
    for preset, batch, vocab in (("rd_m", 16, 50257), ("wav48", 64, 256)):
        data = bench_json(tmp_path, "--preset", preset, *small, "--variants", "prenorm",
                          "--iters", 1, "--profile", "block")
        assert data["shape"] == dict(n_layer=1, n_embd=16, n_head=2, sequence_len=8,
                                     vocab_size=vocab, batch_size=batch)
        r = data["variants"]["prenorm"]
        model = nanoroute.GPT(nanoroute.GPTConfig(**{k: data["shape"][k]
                                                     for k in bench.MODEL_FIELDS}))
        flops = model.flops_per_token() * batch * 8 / (r["ms_median"] / 1e3)
        assert r["mfu"] == pytest.approx(flops / 1e12)
        assert data["args"]["shape"] is None and data["args"]["preset"] == preset
    assert "### Profile: block, 3 training steps" in capsys.readouterr().out
    # a preset's other model fields are its model's too: none is dropped without a word
    monkeypatch.setitem(train.PRESETS, "biased", dict(train.PRESETS["wav48"], bias=True))
    data = bench_json(tmp_path, "--preset", "biased", *small, "--variants", "block", "--iters", 1)
    config = nanoroute.GPTConfig(**bench.model_fields(data["shape"]), residual="attnres")
    assert data["shape"]["bias"] is True and config.bias
    assert data["variants"]["block"]["params"] == nanoroute.GPT(config).get_num_params()


@pytest.mark.parametrize("argv, says", [
    (["--variants", "prenorm,nope"], r"--variants 'prenorm,nope': unknown variant\(s\) nope;"),
    (["--profile", "nope"], "argument --profile: invalid choice: 'nope'"),
    (["--iters", "0"], "--iters 0: must be at least 1"),
    (["--shape", "s12", "--preset", "rd_m"], "--shape s12 and --preset rd_m: give one"),
    (["--n_head", "3"], "prenorm at this shape: n_head=3: must divide n_embd=32"),
    (["--compile", "--compile_backend", "nope"], "--compile_backend nope: not a torch.compile"),
    (["--device", "tpu"], "--device tpu: choose auto, cpu"),
    (["--against", "missing.py"], "--against missing.py: no such file"),
    (["--against", "not_nanoroute.py"], "not_nanoroute.py has no GPT and GPTConfig: is it a"),
    (["--against", "empty.py"], "empty.py has no GPT and GPTConfig: it is empty"),  # no git show
    (["--against", "old"], "nanoroute.py has no GPT and GPTConfig: it is empty"),  # its folder
    (["--against", "broken.py"], "importing broken.py failed: SyntaxError"),
    (["--against", "no_rd.py", "--variants", "rd"], "rd@against: the --against version cannot "
     "build it: TypeError: unexpected keyword argument 'rd': time it without --against, or leave"),
    (["--json", ""], "^error: argument --json: '': give a file name; see --help\n$"),
    (["--json", "notes.txt"], "notes.txt exists and is not a file this script wrote"),  # yours
    (["--json", "mine.json"], "mine.json exists and is not a file this script wrote"),  # JSON
    (["--json", "old"], "old is a folder: give a file name"),
    (["--against", ""], "^error: argument --against: '': give a file name; see --help\n$"),
    # a nanoGPT name hints at the flag it means only where that flag exists: bench has no max_iters
    (["--max_steps", "3"], "^error: unrecognized arguments: --max_steps 3; see --help\n$"),
    (["--iter", "3"], r"--iter 3 \(did you mean --iters\?\)"),
    # after --: train.py's training flags that its step reads, as train.py checks them
    (["--variants", "block", "--", "--max_iters", "3"], "--max_iters after --: the timed step "
     "does not read it"),  # a step reads no schedule: refused, not ignored
    (["--", "--batch_size", "16"], "--batch_size after --: the timed step does not read it"),
    (["--", "--n_layer", "3"], "--n_layer after --: a model field; bench.py builds the rows"),
    (["--", "--iters", "3"], "--iters 3 after --: not train.py's"),
    (["--", "--grad_clip", "-1"], "--grad_clip -1.0: must be at least 0"),
    (["--variants", "prenorm,block", "--", "--route_entropy_coef", "0.1"],
     "applies only to residual=attnres.*; here: leave prenorm out of --variants"),
    # a value no variant can take is the setting's error: no variant is blamed
    (["--variants", "prenorm,block", "--", "--lr", "nan"], "--lr nan: must be .*finite$"),
])
def test_bad_input_is_one_error_line(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_nanoroute.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def forward(self:\n")
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "old").mkdir()
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "mine.json").write_text('{"lr": 0.001}\n')
    (tmp_path / "old" / "nanoroute.py").write_text("")
    (tmp_path / "no_rd.py").write_text("from nanoroute import GPT\ndef GPTConfig(**fields):\n"
                                       "    raise TypeError(\"unexpected keyword argument 'rd'\")")
    err = error_line(bench.main, [*TINY, "--iters", "1", *argv], capsys)
    assert re.search(says, err), err


def test_a_model_field_added_to_the_flags_reaches_every_model(tmp_path, monkeypatch, capsys):
    # a field no shape has (here attnres_block, 1: Full AttnRes) is timed as given, not dropped
    monkeypatch.setattr(bench, "MODEL_FIELDS", (*bench.MODEL_FIELDS, "attnres_block"))
    data = bench_json(tmp_path, "--variants", "block", "--iters", 1, "--attnres_block", 1)
    assert data["shape"]["attnres_block"] == 1 and data["routing_blocks"] == {"block": 1}
    # one a variant sets itself (full: attnres_block 1) is one error line, nothing built
    err = error_line(bench.main, [*TINY, "--variants", "full", "--attnres_block", "2"], capsys)
    assert "full sets attnres_block=1 itself: leave out its flag or it" in err, err


def test_gpu_check_cpu_mode_runs_every_part(tmp_path):
    def check(folder):
        return subprocess.run(["bash", ROOT / "tools" / "gpu_check.sh", "cpu", folder], text=True,
                              capture_output=True, env=dict(os.environ, PYTHON=sys.executable))
    out = tmp_path / "check"
    proc = check(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {"bench_eager": "prenorm,block,wav,rd", "bench_compiled": "prenorm,block",
            "memory_rd_m": "prenorm,block,rd", "memory_wav48": "prenorm,block,wav"}
    status = [row.split()[:2] for row in (out / "status.txt").read_text().splitlines()]
    assert status == [[part, "0"] for part in ("tests", *runs)]
    for name, variants in runs.items():
        data = json.loads((out / f"{name}.json").read_text())
        assert data["complete"] and ",".join(data["variants"]) == variants, name
        compiled = {r.get("compiled") for r in data["variants"].values()}
        assert compiled == {True if name == "bench_compiled" else None}, name
    summary = (out / "summary.md").read_text()
    assert "| bench_compiled | 0 |" in summary and "| block | " in summary.split("## memory")[0]
    (tmp_path / "mine").mkdir()  # a folder of other files: refused, left alone
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    proc = check(tmp_path / "mine")
    assert (proc.returncode, proc.stderr.count("\n")) == (2, 1) and "error: " in proc.stderr
    failing = tmp_path / "failing_python"  # every part fails: status.txt says how, part by part
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    subprocess.run(["bash", ROOT / "tools" / "gpu_check.sh", "cpu", tmp_path / "failed"],
                   capture_output=True, env=dict(os.environ, PYTHON=str(failing)))
    rows = (tmp_path / "failed" / "status.txt").read_text().splitlines()
    assert [row.split()[:2] for row in rows] == [[part, "3"] for part in ("tests", *runs)]
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    # on a GPU (its commands recorded here, none run): the GPU tests, gpu12, compiled by inductor
    recorder, calls = tmp_path / "recording_python", tmp_path / "calls.txt"
    recorder.write_text(f'#!/bin/sh\necho "$NANOROUTE_TEST_DEVICE $*" >> {calls}\n')
    recorder.chmod(0o755)
    subprocess.run(["bash", ROOT / "tools" / "gpu_check.sh", tmp_path / "gpu"],
                   capture_output=True, env=dict(os.environ, PYTHON=str(recorder)))
    tests, eager, compiled = calls.read_text().splitlines()[:3]
    assert tests.startswith("cuda -m pytest") and tests.endswith("-m gpu")
    assert "--device cuda --gen_tokens 0 --shape gpu12" in eager
    assert "--shape gpu12" in compiled and "--compile --compile_backend inductor " in compiled


def test_models_start_paired_memory_counts_no_buffer_and_a_fallback_is_said(tmp_path, capsys,
                                                                             monkeypatch):
    no_gen = TINY[:TINY.index("--gen_tokens")]  # its default: min(256, sequence_len)
    assert bench.Bench(bench.build_parser().parse_args(no_gen), []).n_new == 32
    b = bench.Bench(bench.build_parser().parse_args([*TINY, "--iters", "2"]), [])
    # the default variants at 2 layers: WAV's automatic routing block is 4, the others' 2 (full: 1)
    assert b.out["routing_blocks"] == dict(block=2, wav=4, rd=2)
    assert "note: routing blocks block 2, wav 4, rd 2: a ratio" in capsys.readouterr().out
    deeper = bench.Bench(bench.build_parser().parse_args([*TINY, "--n_layer", "12"]), [])
    assert deeper.out["routing_blocks"] == dict(block=4, wav=4, rd=4)  # of the shape it runs
    assert "note: routing blocks" not in capsys.readouterr().out
    torch.manual_seed(123)  # whatever the random state: every model starts from the same seed
    prenorm, block = bench.build(b, "prenorm"), (torch.rand(3), bench.build(b, "block"))[1]
    assert torch.equal(prenorm.model.lm_head.weight, block.model.lm_head.weight)
    stored = {t.untyped_storage().data_ptr() for t in (*prenorm.model.parameters(),
                                                       *prenorm.model.buffers())}
    saved = bench.saved_bytes(prenorm.model, b.x, b.y, b.amp, stored, b.train)  # no weight, buffer
    assert bench.memory_parts(b, prenorm)["saved"] == saved
    b.out["first_steps"]["prenorm"] = dict(first_step_s=1.0)  # 1 first + 1 warm-up + 2 timed steps
    fell_back = bench.Model(prenorm.model, prenorm.model, prenorm.opt, dict(graphs=1, calls=3))
    assert bench.record(b, "prenorm", fell_back, [0.1, 0.2])["compiled"] is False
    def recompute_otherwise(model, idx, n):  # a reference that disagrees with the KV cache
        kv = model.generate(idx, n, top_k=1)
        return torch.cat([kv[:, :-1], (kv[:, -1:] + 1) % 256], 1)
    monkeypatch.setattr(bench, "generate_recompute", recompute_otherwise)
    gen = bench_json(tmp_path, "--variants", "prenorm", "--iters", 1, "--gen_tokens", 3)
    assert gen["generation"]["variants"]["prenorm"]["same_tokens"] is False  # said, not assumed
    assert "| prenorm |" in capsys.readouterr().out.split("### Generation")[1].split("NO")[0]


def test_routing_bytes_floor_is_below_the_kernels_passes_and_full_attnres_is_quadratic(
        monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    from routing_bytes import routing_bytes

    def config(n_layer, **row):
        return nanoroute.GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, sequence_len=16,
                         residual="attnres", **row)
    for row in (dict(), dict(attnres_block=1), dict(wav=True), dict(rd="decoupled")):
        must, now = routing_bytes(config(4, **row))
        assert 0 < must < now
    # every read of Full AttnRes reads every source before it: doubling the depth more than
    # triples its bytes; Block AttnRes's (blocks grow with the depth) about double
    full = [routing_bytes(config(n, attnres_block=1))[0] for n in (8, 16)]
    block = [routing_bytes(config(n))[0] for n in (8, 16)]
    assert full[1] / full[0] > 3 > block[1] / block[0]
    # the readout's floor: it reads each source it sees once, 3 passes (the details too with
    # wav_readout_details): the difference is the readout's pool, as the model counts it
    wav, both = (config(4, wav=True, wav_readout_details=on) for on in (False, True))
    readout = [nanoroute.GPT(c).pool_size(nanoroute.Read(4, "readout")) for c in (wav, both)]
    unit = 8 * 16 * 32 * 4  # routing_bytes' batch of 8, one (B, T, d) float32 tensor
    assert routing_bytes(both)[0] - routing_bytes(wav)[0] == 3 * (readout[1] - readout[0]) * unit
    # a model with sources of its own (counted in kernel_slots) is refused, not counted as Block's
    monkeypatch.setattr(nanoroute.GPT, "kernel_slots", lambda self: 99)
    with pytest.raises(ValueError, match="stores 99 completed sources a forward, routing_bytes"):
        routing_bytes(config(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_is_one_models_step_above_what_is_resident():
    def stepped(*flags):  # a model on the GPU, stepped once (cuBLAS's workspace stays resident)
        b = bench.Bench(bench.build_parser().parse_args([*TINY, "--device", "cuda", *flags]), [])
        m = bench.build(b, "prenorm")
        b.step(m)
        return b, m
    small = stepped()
    alone = bench.memory_parts(*small)
    large = stepped("--n_embd", "512", "--n_head", "4")
    assert bench.memory_parts(*large)["step_peak"] > alone["step_peak"]
    # the large model stays resident: neither its bytes nor its peak is the small one's
    again = bench.memory_parts(*small)
    assert again["step_peak"] == pytest.approx(alone["step_peak"], rel=0.05)
    assert again["params"] == 4 * small[1].model.get_num_params()  # float32 weights, tied once
    assert again["adamw"] >= 2 * again["params"]


def test_train_pys_loss_optimizer_and_update_are_those_of_every_timed_step(tmp_path, monkeypatch):
    steps, built = [], []  # the residual of each model a step ran on; the optimizers built
    plain, plain_optimizer, plain_update = train.step_loss, train.make_optimizer, train.update
    clipped = []  # the gradient norm of each update (train.py clips at its default, 1)

    def update(model, optimizer, a):
        norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        plain_update(model, optimizer, a)
        clipped.append((torch.stack(norms).norm().item(), a.grad_clip))

    def with_a_term(model, x, y, a):  # a user's new term, added where docs/training.md says
        total, cross_entropy = plain(model, x, y, a)
        steps.append(model.config.residual)
        return total + 0.1 * total.detach(), cross_entropy

    def optimizer(model, a, device_type):  # a user's optimizer, built where train.py builds it
        built.append(plain_optimizer(model, a, device_type))
        return built[-1]
    monkeypatch.setattr(train, "step_loss", with_a_term)
    monkeypatch.setattr(train, "make_optimizer", optimizer)
    monkeypatch.setattr(train, "update", update)
    bench_json(tmp_path, "--variants", "prenorm,block", "--iters", 2)
    # first steps, warm-up, 2 rounds, then the memory count's forward of each
    assert steps == ["prenorm", "attnres"] * (1 + 1 + 2 + 1)
    assert len(clipped) == 2 * 4 and {clip for _, clip in clipped} == {1.0}
    assert all(norm > 0 for norm, _ in clipped)  # after the backward, before zero_grad
    # at train.py's settings, and stepped: its state (AdamW's moments) exists
    assert len(built) == 2 and all(o.defaults["lr"] == train.TrainSettings().lr for o in built)
    assert all(o.state for o in built)
    steps.clear()
    built.clear()
    sys.path.insert(0, str(ROOT / "tools"))
    import routing_time
    clipped.clear()
    routing_time.main(["--shape", "tiny", "--variants", "prenorm,block", "--steps", "1"])
    assert steps == ["prenorm", "attnres"] * (2 + 1)  # alternating, as bench.py's: 2 warm up
    assert len(built) == 2 and all(o.state for o in built) and len(clipped) == len(steps)


def test_train_pys_flags_after_a_double_dash_reach_every_timed_step(tmp_path, monkeypatch):
    seen, plain = [], train.update

    def update(model, optimizer, a):  # the settings of the step that ran before it
        seen.append((a.grad_clip, a.route_entropy_coef, optimizer.defaults["lr"]))
        plain(model, optimizer, a)
    monkeypatch.setattr(train, "update", update)
    default = bench_json(tmp_path, "--variants", "block", "--iters", 1)
    assert set(seen) == {(1.0, 0.0, train.TrainSettings().lr)} and default["train_flags"] == {}
    seen.clear()
    given = bench_json(tmp_path, "--variants", "block", "--iters", 1, "--", "--grad_clip", 0,
                       "--route_entropy_coef", 0.5, "--lr", 0.01)
    assert len(seen) == 3 and set(seen) == {(0.0, 0.5, 0.01)}  # first, warm-up and timed steps
    assert given["train_flags"] == dict(grad_clip=0.0, route_entropy_coef=0.5, lr=0.01)
    # the memory count runs the step's loss too: an entropy on the routes keeps their graph
    saved = [run["variants"]["block"]["memory"]["saved"] for run in (default, given)]
    assert saved[1] > saved[0]
    sys.path.insert(0, str(ROOT / "tools"))
    import routing_time
    seen.clear()
    routing_time.main(["--shape", "tiny", "--variants", "block", "--steps", "1", "--",
                       "--grad_clip", "0.5"])
    assert {clip for clip, *_ in seen} == {0.5} and len(seen) == 3
    with pytest.raises(bench.UsageError, match="--batch_size after --: the timed step does not"):
        routing_time.main(["--shape", "tiny", "--variants", "block", "--steps", "1", "--",
                           "--batch_size", "3"])


def test_generation_is_timed_round_robin_as_the_steps_are(tmp_path, monkeypatch):
    order, plain = [], bench.generate_recompute

    def recompute(model, idx, n):
        order.append(model.config.residual)
        return plain(model, idx, n)
    monkeypatch.setattr(bench, "generate_recompute", recompute)
    bench_json(tmp_path, "--variants", "prenorm,block", "--iters", 1, "--gen_tokens", 2,
               "--gen_repeats", 2)
    assert order == ["prenorm", "attnres"] * (1 + 2)  # the warm-up, then each repeat's round


def test_routing_time_splits_a_step_into_its_forward_backward_and_update(monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import routing_time
    clock, plain = [0.0], train.update

    def update(model, optimizer, a):  # takes 10 s on the clock and touches 64 MB of new pages
        plain(model, optimizer, a)
        clock[0] += 10.0
        with mmap.mmap(-1, 64 << 20) as fresh:  # not malloc's: a heap it keeps may hold 64 MB
            np.frombuffer(fresh, dtype=np.uint8)[::4096] = 1  # a fault a page
    monkeypatch.setattr(train, "update", update)
    monkeypatch.setattr(routing_time.time, "perf_counter", lambda: clock[0])
    model = nanoroute.GPT(nanoroute.GPTConfig(**bench.model_fields(bench.SHAPES["tiny"])))
    x = torch.randint(0, 256, (2, 32))
    seconds = {}
    routing_time.step(model, train.make_optimizer(model, train.TrainSettings(), "cpu"), x, x,
                      train.TrainSettings(), seconds)
    assert (seconds["forward"], seconds["backward"], seconds["update"]) == (0.0, 0.0, 10.0)
    assert seconds["page faults"] >= 16 << 8  # 64 MB of 4 KB pages


def test_routing_time_times_the_kernels_parts_in_a_step_and_leaves_the_kernel_as_it_was(capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import routing_time
    before = {(owner, attr): owner.__dict__[attr] for owner, attr, _ in routing_time.PARTS}
    routing_time.main(["--shape", "tiny", "--variants", "block,prenorm", "--steps", "1"])
    rows = {}
    for line in capsys.readouterr().out.splitlines()[3:]:
        part, block, prenorm = line.strip("| ").split(" | ")
        rows[part] = float(block), float(prenorm)
    # every part runs in Block's step, none in PreNorm's, timed right after it
    for *_, part in routing_time.PARTS:
        assert rows[part][0] > 0 == rows[part][1], part
    assert all(owner.__dict__[attr] is fn for (owner, attr), fn in before.items())
    # a part called twice in a step counts both calls (a clock that ticks 1 s a reading)
    ticks = iter(range(100))
    seconds = {}
    part = routing_time.timed(seconds, "x", lambda: None)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(routing_time.time, "perf_counter", lambda: next(ticks))
        part(), part()
    assert seconds == {"x": 2.0}
    # the first two steps warm up, untimed: a step's parts as if they took 60 s, 60 s, then 1 s
    took = iter([60.0, 60.0, 1.0])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(routing_time, "step", lambda *args: args[-1].update(forward=next(took)))
        routing_time.main(["--shape", "tiny", "--variants", "block", "--steps", "1"])
    assert "| forward | 1000.0 |" in capsys.readouterr().out
