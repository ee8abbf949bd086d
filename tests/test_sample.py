"""sample.py on tiny trained runs: text, prompts, the routes view, the run's own data, bad input."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import prepare_data
import sample
from conftest import ROOT, error_line, run, trained

SEP = "-" * 40 + "\n"


@pytest.fixture(scope="module")
def heads(demo, tmp_path_factory):
    """A 4-step run with 2 route heads (beside conftest's routed: WAV + RD in blocks of 4)."""
    out = tmp_path_factory.mktemp("runs") / "heads"
    return trained(demo, out, "--max_iters", 4, "--residual", "attnres", "--route_heads", 2)


def sample_text(capsys, out_dir, *flags):
    code, out, err = run(sample.main, ["--out_dir", out_dir, "--device", "cpu", *flags], capsys)
    assert code == 0, err
    return out


def test_text_prompts_settings_checkpoint_and_data(routed, demo, tmp_path, monkeypatch, capsys):
    def text(*flags):
        return sample_text(capsys, routed, "--num_samples", 2, "--max_new_tokens", 9, *flags)
    code, out, err = run(sample.main, ["--out_dir", routed, "--start", "Once upon",
                                       "--num_samples", 2, "--max_new_tokens", 20], capsys)
    samples = out.split(SEP)  # each: the prompt, 20 new characters and print's newline
    assert code == 0 and samples[2:] == [""] and "40 tokens in" in err and "tok/s" in err
    assert all(s.startswith("Once upon") and len(s) == 9 + 20 + 1 for s in samples[:2])
    assert text("--seed", 5) == text("--seed", 5) != text("--seed", 6)
    greedy = text("--top_k", 1)  # top_k reaches generate: 1 is greedy, as a tiny temperature is
    assert text("--temperature", 1e-4, "--seed", 3) == greedy != text()
    assert text("--temperature", 1.0, "--seed", 3) != greedy
    assert text("--temperature", 1e-45, "--seed", 4) == greedy  # the likeliest, not NaN
    assert text("--temperature", 1e30, "--top_k", 3).count(SEP) == 2  # even among the top 3
    monkeypatch.chdir(tmp_path)  # FILE: a UTF-8 file, relative to the working folder
    (tmp_path / "prompt.txt").write_text("Tom saw a cat.", encoding="utf-8")
    assert text("--start", "FILE:prompt.txt") == text("--start", "Tom saw a cat.")
    long = "Lily had a red ball. Tom saw a cat by the big old tree."  # 56 > sequence_len 32
    code, out, err = run(sample.main, ["--out_dir", routed, "--start", long, "--num_samples", 1,
                                       "--max_new_tokens", 3], capsys)
    assert out.startswith(long[-32:]) and "using its last 32" in err  # it keeps the prompt's end
    default = text()  # char level: after a newline, which is not printed
    assert [s for s in default.split(SEP) if s] == \
        [s[1:] for s in text("--start", "\n").split(SEP) if s]
    # --ckpt last, and the data of a run sampled from another folder, or moved
    flags = ["--num_samples", 1, "--max_new_tokens", 5, "--start", "Once"]
    only_last = routed.parent / "only_last"  # next to it: the same way to the data
    only_last.mkdir(exist_ok=True)
    shutil.copy(routed / "last.pt", only_last)
    assert sample_text(capsys, only_last, "--ckpt", "last", *flags).startswith("Once")
    code, _, err = run(sample.main, ["--out_dir", only_last, *flags], capsys)
    assert code == 2 and err == f"error: no checkpoint at {only_last / 'best.pt'}: train one " \
                                f"with python train.py --out_dir {only_last}\n"
    monkeypatch.chdir(tmp_path)  # another working folder: the data is found from the run's
    assert sample_text(capsys, routed, *flags).startswith("Once")
    monkeypatch.chdir(routed.parent)
    assert sample_text(capsys, routed.name, *flags).startswith("Once")
    moved = tmp_path / "far" / "away" / "run"
    shutil.copytree(routed, moved)
    err = error_line(sample.main, ["--out_dir", moved, *flags], capsys)
    assert "give --data with the demo dataset" in err
    assert sample_text(capsys, moved, "--data", demo, *flags).startswith("Once")


def cells(line):
    return re.findall(r"([░▒▓█]) *(\d+)", line)


def test_routes_view(routed, heads, demo, tmp_path, capsys):
    lines = sample_text(capsys, routed, "--routes", "--start", "Once upon").splitlines()
    assert lines[0] == f"depth routing of {routed / 'best.pt'} over a 9-token prompt: 'Once upon'"
    assert lines[1] == ("sources: emb: embedding, C<i>: completed block i, P: partial block, "
                        ".phase: WAV detail (phase basis), .split: WAV detail (split basis)")
    assert lines[3].split() == ["emb", "C0", "P", "P.ph", "P.sp", "H"]  # the readout: no details
    rows = {line.split()[0]: line for line in lines if line.startswith(("layer", "readout"))}
    assert list(rows) == ["layer0.attn", "layer0.attn.v", "layer0.mlp", "layer1.attn",
                          "layer1.attn.v", "layer1.mlp", "readout"]
    assert cells(rows["layer0.attn"]) == [("█", "100")]  # it sees the embedding alone: blanks
    assert len(cells(rows["readout"])) == 2 and len(cells(rows["layer1.mlp"])) == 4
    for name, row in rows.items():  # percentages of one read add up to 100 (each rounded)
        assert abs(sum(int(p) for _, p in cells(row)) - 100) <= 2, name
        assert re.search(r"  \d\.\d\d$", row), name  # its entropy, in nats: at most ln(sources)
        assert float(row.split()[-1]) <= math.log(len(cells(row))) + 0.005, name
    js = lines[next(i for i, line in enumerate(lines) if "JS divergence" in line) + 1:]
    assert [line.split()[0] for line in js] == ["layer1", "mean"]  # layer 0 reads e alone
    val = prepare_data.open_split(demo, "val")[:32]  # the default prompt: the start of val
    text = prepare_data.decoder(prepare_data.load_meta(demo), demo)(val)
    first = sample_text(capsys, routed, "--routes").splitlines()[0]
    shown = "..." + text[-57:] if len(text) > 60 else text
    assert first.endswith(f"over a 32-token prompt: {shown!r}")
    ckpt = torch.load(routed / "best.pt", weights_only=True)  # the V route the QK route: JS 0
    for name in ("query.layer1_attn", "detail_bias.layer1_attn"):
        ckpt["model"][name.replace("attn", "attn_v")] = ckpt["model"][name]
    torch.save(ckpt, tmp_path / "best.pt")
    lines = sample_text(capsys, tmp_path, "--routes", "--data", demo).splitlines()
    assert [x.split() for x in lines[-2:]] == [["layer1", "0.0000"], ["mean", "0.0000"]]
    # route heads: the mean, then a block per head; here head 0 reads sharply, head 1 evenly
    ckpt = torch.load(heads / "best.pt", weights_only=True)
    ckpt["model"]["query.readout"][:16] = 50.0  # the readout's query, on head 0's slice
    torch.save(ckpt, tmp_path / "best.pt")
    lines = sample_text(capsys, tmp_path, "--routes", "--data", demo).splitlines()
    assert lines[0].startswith(f"depth routing of {tmp_path / 'best.pt'} over a 32-token prompt")
    assert [line for line in lines if line.startswith("route head")] == \
        ["route head 0 of 2:", "route head 1 of 2:"]
    mean, head0, head1 = ([int(p) for _, p in cells(line)] for line in lines
                          if line.startswith("readout"))
    assert len(mean) == 3 and max(head1) <= 34 < max(head0)  # over emb, C0, C1
    assert all(abs(m - (a + b) / 2) <= 1 for m, a, b in zip(mean, head0, head1))
    shades = [sample.shade(w) for w in (0, .25, .26, .5, .51, .75, .76, 1)]
    assert shades == list("░░▒▒▓▓██")
    # learned mixing weights (DenseFormer's), and a model with none
    for residual in ("denseformer", "prenorm"):
        trained(demo, tmp_path / residual, "--max_iters", 1, "--residual", residual, capsys=capsys)
    routes = json.loads((tmp_path / "denseformer" / "summary.json").read_text())["routes"]
    assert routes["entropy_norm_mean"] is None  # train.py records them; no distribution
    ckpt = torch.load(tmp_path / "denseformer" / "best.pt", weights_only=True)
    for j, weights in enumerate(([-1.0, 2.0], [0.5, -0.25, 1.5])):  # any real numbers
        ckpt["model"][f"dwa_weights.{j}"] = torch.tensor(weights)
    torch.save(ckpt, tmp_path / "best.pt")
    lines = sample_text(capsys, tmp_path, "--routes", "--data", demo).splitlines()
    assert lines[1] == "sources: emb: embedding, L<i>: layer i's output"
    assert lines[3].split() == ["emb", "L0", "L1", "H"]
    assert [line.split() for line in lines[4:]] == [["layer0.dwa", "-1.00", "2.00"],
                                                    ["layer1.dwa", "0.50", "-0.25", "1.50"]]
    code, out, err = run(sample.main, ["--out_dir", tmp_path / "prenorm", "--routes"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "residual=prenorm model: it has no depth routing or learned mixing weights" in err


def test_ctrl_c_is_one_line_with_no_promise_to_continue(routed, monkeypatch, capsys):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(sample.checkpoint, "load", stopped)  # Ctrl-C as it loads
    with pytest.raises(SystemExit) as e:
        sample.main(["--out_dir", str(routed)])
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


def test_gpt2_level_run_starts_after_endoftext_and_decodes_its_tokens(tmp_path, capsys):
    data, splits = tmp_path / "gpt2", {"train": 4000, "val": 1000}  # random ids, made-up tokens
    data.mkdir()
    tokens = {f"Ġt{i}": i for i in range(prepare_data.GPT2_EOT)} | {"<|endoftext|>": 50256}
    (data / "encoder.json").write_text(json.dumps(tokens))
    for split, n in splits.items():
        np.random.default_rng(n).integers(0, 50257, n, np.uint16).tofile(data / f"{split}.bin")
    meta = dict(dataset="gpt2_standin", level="gpt2", dtype="uint16", vocab_size=50257)
    (data / "meta.json").write_text(json.dumps(dict(meta, splits=splits)))
    trained(data, tmp_path / "run", "--max_iters", 2, "--n_layer", 1, "--n_embd", 16,
            "--sequence_len", 16, capsys=capsys)
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    assert final["val_ppl"] == pytest.approx(math.exp(final["val_loss"]))  # the level's unit
    text = sample_text(capsys, tmp_path / "run", "--num_samples", 1, "--max_new_tokens", 4)
    assert re.fullmatch(r"( t\d+|<\|endoftext\|>){4}\n" + SEP, text), text


# what --routes takes; any other flag (a new one too) writes text alone: refused with --routes
ROUTES_FLAGS = {"help", "out_dir", "ckpt", "data", "start", "device", "routes"}


@pytest.mark.parametrize("flag", [a.dest for a in sample.build_parser()._actions
                                  if a.dest not in ROUTES_FLAGS])
def test_routes_refuses_every_flag_of_the_text_alone(flag, routed, capsys):
    for other in (sample.build_parser().get_default(flag) + 1, 0):  # off its default (0 too)
        err = error_line(sample.main, ["--out_dir", routed, "--routes", f"--{flag}", other], capsys)
        assert f"--{flag} would be" in err, err


def test_a_prompt_file_is_read_as_utf8_in_any_locale(routed, tmp_path):
    # in a locale that is not UTF-8 (C without Python's UTF-8 mode, here ASCII) é is read too, and
    # found outside the vocabulary, not called "not UTF-8"
    (tmp_path / "prompt.txt").write_text("Tom saw a café.", encoding="utf-8")
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    done = subprocess.run([sys.executable, ROOT / "sample.py", "--out_dir", routed, "--start",
                           f"FILE:{tmp_path / 'prompt.txt'}"], capture_output=True, env=env)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2 and "characters not in the demo vocabulary" in err, err


def test_routes_refuses_a_flag_added_to_sample_py(routed, monkeypatch, capsys):
    build_parser = sample.build_parser

    def with_a_flag_of_yours():  # a sampling option a user adds (min-p, say)
        parser = build_parser()
        parser.add_argument("--min_p", type=float, default=0.0)
        return parser
    monkeypatch.setattr(sample, "build_parser", with_a_flag_of_yours)
    err = error_line(sample.main, ["--out_dir", routed, "--routes", "--min_p", "0.1"], capsys)
    assert "--routes writes no text: --min_p would be ignored" in err


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "0"], "--temperature 0.0: must be > 0 and finite"),
    (["--temperature", "nan"], "--temperature nan: must be > 0 and finite"),
    (["--temperature", "inf"], "--temperature inf: must be > 0 and finite"),
    (["--top_k", "0"], "--top_k 0: must be at least 1"),
    (["--top_k", "1", "--temperature", "0.5"], "--top_k 1 is greedy: --temperature 0.5 would"),
    (["--top_k", "1", "--seed", "7"], "--top_k 1 is greedy: --seed 7 would change nothing"),
    (["--num_samples", "0"], "--num_samples 0: must be at least 1"),
    (["--seed", "-1"], r"--seed -1: must be in \[0, 2\*\*63\)"),
    (["--start", "FILE:empty.txt"], "--start 'FILE:empty.txt' is empty"),
    (["--start", "FILE:latin1.txt"], "--start FILE:latin1.txt: cannot read it as UTF-8 text"),
    (["--start", "Zoë"], "characters not in the demo vocabulary: 'ë'"),
    (["--out_dir", "."], "checkpoint best.pt does not fit this version of nanoroute: .*size"),
    (["--data", "other"], "other is not the dataset .* was trained on \\(demo, vocab 53\\)"),
    (["--num_samples", 10 ** 13], "out of memory generating 10{13} samples at once: lower --num_s"),
    (["--out_dir", ""], "^error: argument --out_dir: '': give a folder name; see --help\n$"),
    (["--data", ""], "^error: argument --data: '': give a folder name; see --help\n$"),
])
def test_bad_input_is_one_error_line(flags, says, routed, demo, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("Zoé".encode("latin-1"))
    meta = json.loads(shutil.copytree(demo, tmp_path / "other").joinpath("meta.json").read_text())
    (tmp_path / "other" / "meta.json").write_text(json.dumps(dict(meta, dataset="other")))
    ckpt = torch.load(routed / "best.pt", weights_only=True)  # weights of another shape
    torch.save(dict(ckpt, config=dict(ckpt["config"], n_embd=64)), tmp_path / "best.pt")
    err = error_line(sample.main, ["--out_dir", routed, "--max_new_tokens", 2, *flags], capsys,
                     quiet=True)
    assert re.search(says, err), err
