"""Fixtures the scripts' tests share: a tiny demo dataset, one thread, running a script's main."""

import json
from pathlib import Path

import pytest
import torch

import prepare_data

ROOT = Path(__file__).resolve().parent.parent  # the scripts, for subprocesses
# 2 layers x 32 wide, 32-token crops, 8 per batch: a step takes milliseconds
TINY = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--sequence_len", "32",
        "--batch_size", "8", "--eval_tokens", "256", "--log_interval", "1", "--warmup_iters", "2",
        "--device", "cpu"]


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


def run(main, argv, capsys=None):
    """A script's main(argv) in this process: (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in argv]) or 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr() if capsys else ("", "")
    return code, out, err


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
