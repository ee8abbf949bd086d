"""What the scripts' tests share: a tiny demo dataset, a routed run, one thread, running main()."""

import contextlib
import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import prepare_data
import train

ROOT = Path(__file__).resolve().parent.parent  # the scripts, for subprocesses
# 2 layers x 32 wide, 32-token crops, 8 per batch: a step takes milliseconds
TINY = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--sequence_len", "32",
        "--batch_size", "8", "--eval_tokens", "256", "--log_interval", "1", "--warmup_iters", "2",
        "--device", "cpu"]
ROUTED = ["--residual", "attnres", "--rd", "decoupled", "--wav", "True", "--attnres_block", "4"]


@pytest.fixture(autouse=True)
def _one_thread_and_tf32_as_before():
    """One intra-op thread (on a small shared machine two threads wait on each other); TF32 as it
    was (train.py and bench.py turn it on in this process)."""
    threads, tf32 = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """A 0.2M-character demo dataset."""
    return prepare_data.prepare("demo", tmp_path_factory.mktemp("data") / "demo", demo_mb=0.2)


@pytest.fixture(scope="session")
def routed(demo, tmp_path_factory):
    """A finished routed run (ROUTED) of 4 steps with milestones, made in project/ as runs/routed
    with --data demo (data/demo, recorded relative to the run); what it printed: routed.out."""
    project = tmp_path_factory.mktemp("project")
    shutil.copytree(demo, project / "data" / "demo")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(project)
        trained("demo", "runs/routed", *ROUTED, "--max_iters", 4, "--eval_interval", 2,
                "--milestones", "512,1K", "--dropout", 0.1)  # sample.py: eval(), no dropout
    (project / "runs" / "routed.out").write_text(printed.getvalue())
    return project / "runs" / "routed"


def run(main, argv, capsys=None):
    """A script's main(argv) in this process: (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in argv]) or 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr() if capsys else ("", "")
    return code, out, err


def tiny(data, out_dir, *extra):
    """train.py's flags of a TINY run of the dataset data into out_dir, then extra."""
    return ["--data", data, "--out_dir", out_dir, *TINY, *extra]


def trained(data, out_dir, *extra, capsys=None):
    """A TINY run of data into out_dir, then extra, which train.py must finish; returns out_dir."""
    assert run(train.main, tiny(data, out_dir, *extra), capsys)[0] == 0
    return out_dir


def error_line(main, argv, capsys, quiet=False):
    """main(argv) must fail with exit 2 and one `error: ` line (quiet: nothing else); returns it."""
    code, out, err = run(main, argv, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    assert out == "" or not quiet, out
    return err


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def without_times(lines):  # what a resumed run must repeat exactly: all but the clock
    drop = ("elapsed_s", "tok_per_s", "ms_per_step", "mfu")
    return [{k: v for k, v in line.items() if k not in drop} for line in lines]


def summary(out_dir):
    return json.loads((Path(out_dir) / "summary.json").read_text())


def weights(out_dir, name="last.pt"):
    return torch.load(Path(out_dir) / name, weights_only=True)


def same_weights(a, b, name="last.pt"):
    """The model weights of name in run folders a and b are bitwise equal."""
    a, b = weights(a, name)["model"], weights(b, name)["model"]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flip_a_stored_byte(path):
    """One byte inside a stored tensor flipped: the checkpoint still loads, only a CRC tells."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 16)
    header = info.header_offset  # 30 bytes, then the name and the extra field, then the data
    start = header + 30 + int.from_bytes(data[header + 26:header + 28], "little") + \
        int.from_bytes(data[header + 28:header + 30], "little")
    data[start + 8] ^= 0xFF
    path.write_bytes(data)
