"""checkpoint.py: every folder a kill can leave is continued by --resume or started over by a plain
run, with the uninterrupted run's result; what a run reads is checked first; a folder a running
train.py writes is refused to any other."""

import dataclasses
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest
import torch

import checkpoint
import nanoroute
import train
from conftest import (ROOT, error_line, flip_a_stored_byte, metrics, run, same_weights, tiny,
                      trained, weights, without_times)

FLAGS = ["--max_iters", 2, "--eval_interval", 1, "--device", "cpu"]  # saves at steps 0, 1, 2
NOT_MINE = ".last.pt.notmine.tmp"  # a name write_atomic never makes (7 characters, not 8)


def test_every_folder_a_kill_leaves_is_resumed_or_started_over(demo, tmp_path, monkeypatch, capsys):
    whole, real, states = tmp_path / "whole", checkpoint.write_atomic, []

    def copy_then_write(path, data):  # the folder as a kill before or inside this write leaves it
        state = shutil.copytree(whole, tmp_path / str(len(states)))
        if len(states) % 2:  # mid-write: half the bytes in write_atomic's temporary file
            fd, _ = tempfile.mkstemp(dir=state, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(bytes(data)[:len(data) // 2])
        (state / NOT_MINE).write_text("a file of the user's")
        states.append(state)
        real(path, data)
    monkeypatch.setattr(checkpoint, "write_atomic", copy_then_write)
    assert run(train.main, tiny(demo, whole, *FLAGS))[0] == 0
    monkeypatch.setattr(checkpoint, "write_atomic", real)
    assert len(states) >= 7  # metrics.jsonl, best.pt, last.pt at step 0, and on
    for i, state in enumerate(states):
        if (state / "last.pt").exists():  # a save finished: a plain run refuses, --resume goes on
            assert "already holds a run" in error_line(train.main, tiny(demo, state, *FLAGS), capsys)
            code, _, err = run(train.main, ["--out_dir", state, "--resume", *FLAGS[4:]], capsys)
        else:  # stopped in its first save: --resume says how to start it over, which does
            code, _, err = run(train.main, ["--out_dir", state, "--resume"], capsys)
            assert code == 2 and "train without --resume first" in err, (i, err)
            started = (state / "metrics.jsonl").exists()
            code, out, err = run(train.main, tiny(demo, state, *FLAGS), capsys)
            assert ("stopped in its first save" in out) == started, (i, out)
        assert code == 0, (i, err)
        assert [p.name for p in state.glob(".*")] == [NOT_MINE], i  # its own leftovers alone go
        assert without_times(metrics(state)) == without_times(metrics(whole)), i
        assert same_weights(whole, state, "best.pt") and same_weights(whole, state), i


def test_resume_checks_best_pt_and_reads_files_and_a_saved_run_stays(demo, tmp_path, capsys):
    out = tmp_path / "r"
    assert run(train.main, tiny(demo, out, *FLAGS))[0] == 0
    best = (out / "best.pt").read_bytes()
    flip_a_stored_byte(out / "best.pt")
    torch.load(out / "best.pt", weights_only=True)  # the damage a bare torch.load does not see
    err = error_line(train.main, ["--out_dir", out, "--resume", "--max_iters", 3], capsys)
    assert "best.pt is damaged (CRC" in err, err
    (out / "last.pt").unlink()
    for make in (lambda p: p.symlink_to("/dev/zero"), os.mkdir, os.mkfifo):
        make(out / "last.pt")
        assert "last.pt is not a file" in error_line(train.main, ["--out_dir", out, "--resume"],
                                                     capsys)
        shutil.rmtree(out / "last.pt") if (out / "last.pt").is_dir() else (out / "last.pt").unlink()
    (out / "best.pt").write_bytes(best)
    (out / "summary.json").unlink()  # a user kept best.pt and the metrics of the run: no new run
    err = error_line(train.main, tiny(demo, out, *FLAGS), capsys)
    assert "already holds a run (best.pt, metrics.jsonl)" in err
    assert (out / "best.pt").read_bytes() == best


def test_resume_refuses_an_optimizer_state_of_parameters_in_another_order(demo, tmp_path, capsys):
    # AdamW's state follows the parameters by position: a model that orders them otherwise (a
    # refactor) would take each moment of another parameter, of the same shape without a word
    out = tmp_path / "r"
    assert run(train.main, tiny(demo, out, *FLAGS))[0] == 0
    saved = (out / "last.pt").read_bytes()
    groups = torch.load(out / "last.pt", weights_only=True)["params"]
    assert "lm_head.weight" not in groups[0]  # tied: once, as wte.weight
    assert [len(g) > 1 for g in groups] == [True, True]  # matrices; the routing's queries
    for g, group in enumerate(groups):  # two swapped in either group: the flat position named
        ckpt = torch.load(io.BytesIO(saved), weights_only=True)
        names = ckpt["params"][g]
        names[0], names[1] = names[1], names[0]
        torch.save(ckpt, out / "last.pt")
        err = error_line(train.main, ["--out_dir", out, "--resume", "--max_iters", 3], capsys)
        i = sum(len(earlier) for earlier in groups[:g])
        assert f"its optimizer state is of other parameters, in their order (#{i}: " \
            f"['{names[0]}'], here ['{names[1]}'])" in err, err


def test_a_gpus_own_random_state_is_saved_and_put_back(monkeypatch):
    # dropout on a GPU draws from its own generator: without its state a resume there would draw
    # other masks. A CPU has no GPU: the device's calls are stand-ins that keep a state here.
    first, other = torch.arange(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    for kind in ("cuda", "mps"):
        held = {kind: first}
        module = getattr(torch, kind)
        monkeypatch.setattr(module, "get_rng_state", lambda device, k=kind: held[k].clone())
        monkeypatch.setattr(module, "set_rng_state", lambda s, device, k=kind: held.update({k: s}))
        gpu = torch.device(kind)
        saved = checkpoint.rng_state(gpu)
        assert torch.equal(saved[kind], first) and torch.equal(saved["cpu"], torch.get_rng_state())
        torch.rand(1)  # both generators move on
        held[kind] = other
        checkpoint.set_rng_state(saved, gpu)
        assert torch.equal(held[kind], first) and torch.equal(torch.get_rng_state(), saved["cpu"])
        held[kind] = other
        checkpoint.set_rng_state(saved, torch.device("cpu"))  # resumed on a CPU: the CPU's alone
        assert torch.equal(held[kind], other)
        checkpoint.set_rng_state(checkpoint.rng_state(torch.device("cpu")), gpu)  # and back
        assert torch.equal(held[kind], other)


def saved_on_a_gpu(path, to):
    """The checkpoint at path as a GPU run saves it: each tensor's storage says cuda:0."""
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(to, "w") as out:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("/data.pkl"):  # pickled strings: X, a 4-byte length, text
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            out.writestr(info.filename, data)


def test_a_checkpoint_saved_on_a_gpu_loads_on_a_machine_without_one(routed, tmp_path):
    saved_on_a_gpu(routed / "best.pt", tmp_path / "best.pt")
    if not torch.cuda.is_available():  # torch.load puts a tensor back where it was saved
        with pytest.raises(RuntimeError, match="CUDA device"):
            torch.load(tmp_path / "best.pt", weights_only=True)
    moved = checkpoint.load(tmp_path / "best.pt", "none")["model"]
    original = checkpoint.load(routed / "best.pt", "none")["model"]
    assert all(moved[k].device.type == "cpu" and torch.equal(moved[k], v)
               for k, v in original.items())


def test_a_folder_a_live_run_writes_is_refused_until_it_ends(demo, tmp_path, capsys):
    out = tmp_path / "live"  # still training: a --resume beside it would write into its files
    flags = tiny(demo, out, "--max_iters", 10 ** 6, "--eval_interval", 2, "--device", "cpu")
    live = subprocess.Popen([sys.executable, ROOT / "train.py", *map(str, flags)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    try:
        for _ in range(6000):  # a busy machine: minutes to its first save
            if (out / "last.pt").exists():
                break
            assert live.poll() is None, "the live run ended before its first save"
            time.sleep(0.1)
        # a save in progress there (its temporary file) is the live run's: refused, left alone
        saving = out / ".last.pt.abcd1234.tmp"
        saving.write_bytes(b"half")
        # a resume (of 1 step: were it let through, it would end at once) and a new run
        for argv in (["--out_dir", out, "--resume", "--max_iters", 1], tiny(demo, out)):
            assert "in use by another train.py, still running" in error_line(train.main, argv,
                                                                              capsys)
        assert saving.read_bytes() == b"half"
    finally:
        live.kill()  # SIGKILL: nothing saved, and its lock goes with it
        live.wait()
    step = weights(out)["progress"]["step"]
    assert run(train.main, ["--out_dir", out, "--resume", "--max_iters", step + 1])[0] == 0


def test_the_lock_lasts_until_train_main_returns_and_goes_with_any_end(demo, tmp_path,
                                                                      monkeypatch, capsys):
    out, seen, real = tmp_path / "run", [], train.next_commands
    resume = [sys.executable, ROOT / "train.py", "--out_dir", out, "--resume"]

    def another_resume(run):  # the summary is written; the folder is still this run's
        seen.append(subprocess.run(resume, capture_output=True, text=True))
        return real(run)
    monkeypatch.setattr(train, "next_commands", another_resume)
    trained(demo, out, *FLAGS)
    assert seen[0].returncode == 2 and "in use by another train.py" in seen[0].stderr
    # a train.main that fails once it holds the lock (a model flag the run does not have) frees it
    error_line(train.main, ["--out_dir", out, "--resume", "--n_layer", 3], capsys)
    assert subprocess.run([*resume, "--max_iters", "3"], capture_output=True).returncode == 0


def test_a_checkpoint_holding_apart_what_the_model_ties_is_refused():
    # an embedding and head saved apart (a model that unties them), loaded into one that ties
    # them: load_state_dict would keep the head's matrix as the embedding too, without a word
    config = nanoroute.GPTConfig(n_layer=1, n_embd=16, n_head=2, sequence_len=8, vocab_size=32)
    state = {k: v.clone() for k, v in nanoroute.GPT(config).state_dict().items()}
    ckpt = dict(config=dataclasses.asdict(config), model=state)
    model = checkpoint.model_from(ckpt, "tied.pt")
    assert model.wte.weight is model.lm_head.weight and torch.equal(model.wte.weight,
                                                                    state["wte.weight"])
    state["wte.weight"] += 1
    with pytest.raises(checkpoint.UsageError, match="checkpoint apart.pt holds wte.weight and "
                       "lm_head.weight apart, and this model ties them"):
        checkpoint.model_from(ckpt, "apart.pt")
