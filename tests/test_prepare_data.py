"""prepare_data.py: each dataset from tiny stand-ins served by a local HTTP server (no test touches
the internet), the downloads' rules, the folder rules, and what train.py / sample.py read back."""

import gzip
import hashlib
import http.server
import importlib.util
import io
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

import common
import prepare_data as pd
import train
from common import UsageError
from conftest import error_line, run, trained

SCRIPT = str(Path(pd.__file__).resolve())


class Mirror(http.server.BaseHTTPRequestHandler):
    """Serves `files` by name, honouring Range; `status` forces an HTTP error, `cut_once` sends
    half a file and hangs up, `stall_once` sends half and then nothing until the client hangs up
    (`hung_up`: whether it did, within 30 s), `ignore_range` answers with the whole file."""
    files, log, status, cut_once, ignore_range = {}, [], {}, set(), False
    stall_once, hung_up = set(), []

    def log_message(self, *args):
        pass

    def do_GET(self):
        name, asked = self.path.lstrip("/"), self.headers.get("Range")
        self.log.append((name, asked))
        if name in self.status or name not in self.files:
            return self.send_error(self.status.get(name, 404))
        data = self.files[name]
        start = int(asked[len("bytes="):-1]) if asked and not self.ignore_range else 0
        if start >= len(data) > 0:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
        else:
            self.send_response(206 if start else 200)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        body = data[start:] if start < len(data) else b""
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if name in self.cut_once | self.stall_once:
            body = body[:len(body) // 2]
            self.close_connection = True
        self.wfile.write(body)
        self.cut_once.discard(name)
        if name in self.stall_once:
            self.stall_once.discard(name)
            self.wfile.flush()
            self.hung_up.append(self.client_hangs_up(seconds=30))

    def client_hangs_up(self, seconds):
        for _ in range(seconds * 10):
            if select.select([self.connection], [], [], 0.1)[0]:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
        return False


@pytest.fixture
def mirror(monkeypatch):
    handler = type("Handler", (Mirror,), dict(files={}, log=[], status={}, cut_once=set(),
                                              stall_once=set(), hung_up=[]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("NANOROUTE_BASE_URL", handler.url)
    monkeypatch.setenv("NANOROUTE_RETRY_BACKOFF", "0")
    monkeypatch.setattr(pd, "OFFICIAL", {})

    def serve(files):  # the official sizes and hashes become the stand-ins': they are checked
        handler.files.update(files)
        for name, data in files.items():
            size, sha = OFFICIAL.get(name, (None, None))
            pd.OFFICIAL[name] = (size and len(data), sha and hashlib.sha256(data).hexdigest())
    handler.serve = serve
    yield handler
    server.shutdown()
    server.server_close()


OFFICIAL = dict(pd.OFFICIAL)  # the real table, before the fixture replaces it
TS_TRAIN, TS_VALID = "TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt"


def text8_zip(n=2000, seed=0):
    text = "".join(np.random.default_rng(seed).choice(list("abcdefghijklmnopqrstuvwxyz   "), n))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("text8", text)
    return text, buf.getvalue()


def shard(tokens, magic=20240520):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, 1, len(tokens)
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


def gpt2_files():
    """A tiny encoder.json / vocab.bpe: the 256 byte tokens, three merges, and <|endoftext|>."""
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]  # as themselves; others: 256 on
    others = [b for b in range(256) if b not in shown]
    vocab = {chr(c): b for b, c in zip(shown + others, shown + list(range(256, 256 + len(others))))}
    vocab.update({"he": 256, "Ġt": 257, "Ġthe": 258, pd.EOT: 50256})
    bpe = "#version: 0.2\nh e\nĠ t\nĠt he\n"
    return {"encoder.json": json.dumps(vocab).encode(), "vocab.bpe": bpe.encode()}


def files_in(folder):
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


# --- The datasets ---

def test_demo_is_deterministic_whole_stories_and_every_split_in_the_vocabulary(tmp_path, capsys):
    a = pd.prepare("demo", tmp_path / "a", demo_mb=0.05)
    b = pd.prepare("demo", tmp_path / "b", demo_mb=0.05)
    c = pd.prepare("demo", tmp_path / "c", demo_mb=0.05, seed=7)
    assert files_in(a) == files_in(b)
    assert (a / "val.bin").read_bytes() != (c / "val.bin").read_bytes()
    meta = pd.load_meta(a)
    assert meta["level"] == "char" and meta["dtype"] == "uint8" and meta["format_version"] == 1
    assert meta["source"] == "generated (seed 1337)"
    assert meta["options"] == dict(seed=1337, demo_mb=0.05)
    n = meta["splits"]
    assert 0.88 < n["train"] / sum(n.values()) < 0.92 and sorted(files_in(a)) == [
        "meta.json", "test.bin", "train.bin", "val.bin"]  # no progress.json, no temporary file
    texts, decode = pd.demo_stories(1337, 0.05), pd.decoder(meta, a)
    for split in pd.SPLITS:  # every split decodes back to its stories, whole
        assert decode(pd.open_split(a, split)) == texts[split] and texts[split].endswith("\n\n")
    assert set(texts["val"] + texts["test"]) <= set(meta["chars"])
    small = pd.prepare("demo", tmp_path / "small", demo_mb=0.005, seed=0)  # 'R' in val or test
    assert "R" not in pd.demo_stories(0, 0.005)["train"] and "R" in pd.load_meta(small)["chars"]
    pd.open_split(small, "val"), pd.open_split(small, "test")  # every id in the vocabulary
    assert decode([meta["vocab_size"] + 3]) == "\ufffd"  # a padded head's extra ids: harmless
    capsys.readouterr()
    pd.prepare("demo", tmp_path / "a", demo_mb=0.05)
    assert "already prepared" in capsys.readouterr().out and files_in(a) == files_in(b)
    # a folder made before an option existed (seed, say) was made at its default: nothing to do
    (a / "meta.json").write_text(json.dumps(dict(meta, options=dict(demo_mb=0.05))))
    pd.prepare("demo", tmp_path / "a", demo_mb=0.05)
    assert "already prepared" in capsys.readouterr().out
    encode = pd.encoder(meta, a)  # the char encoder: a round trip, and unknown characters named
    assert decode(encode('Lily said, "Hi!"\n')) == 'Lily said, "Hi!"\n'
    with pytest.raises(UsageError, match="'€' '☃'; remove or replace them"):
        encode("10 € ☃")


def test_text8_from_a_mirror_its_download_resumed_by_range_or_from_zero(mirror, tmp_path, capsys,
                                                                       monkeypatch):
    text, zipped = text8_zip(2099)  # no multiple of 100: val is [90 %, 95 %), test the rest
    mirror.serve({"text8.zip": zipped})
    mirror.cut_once.add("text8.zip")  # half the file, then the server hangs up: resumed by Range
    out = pd.prepare("text8", tmp_path / "t8")
    asked = [r for name, r in mirror.log if r]
    assert len(asked) == 1 and 0 < int(asked[0][len("bytes="):-1]) < len(zipped)
    meta = pd.load_meta(out)
    ids = np.array([" abcdefghijklmnopqrstuvwxyz".index(c) for c in text])
    assert meta["vocab_size"] == 27 and meta["source"] == [mirror.url + "/text8.zip"]
    for split, part in zip(pd.SPLITS, (ids[:1889], ids[1889:1994], ids[1994:])):
        assert pd.open_split(out, split).tolist() == part.tolist()
    assert sorted(files_in(out)) == ["meta.json", "test.bin", "train.bin", "val.bin"]
    # a server that stalls halfway: the client hangs up (its read timeout), then resumes by Range;
    # the other downloads keep the usual timeouts (a busy machine may pause a read for a second)
    mirror.stall_once.add("text8.zip")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pd, "TIMEOUT", (10, 3))
        out = pd.prepare("text8", tmp_path / "stalled")
    assert mirror.hung_up == [True] and mirror.log[-1][1] == f"bytes={len(zipped) // 2}-"
    assert pd.open_split(out, "test").tolist() == ids[1994:].tolist()
    # cut again, without retries: it fails and keeps the part; a server ignoring Range sends it all
    mirror.cut_once.add("text8.zip")
    line = error_line(pd.main, ["text8", "--out", tmp_path / "kept", "--retries", 0], capsys)
    assert "failed after 1 tries" in line and "it resumes" in line
    part = tmp_path / "kept" / "downloads" / "text8.zip.part"
    assert 0 < part.stat().st_size < len(zipped)
    mirror.ignore_range = True
    out = pd.prepare("text8", tmp_path / "kept", keep_downloads=True)
    assert mirror.log[-1] == ("text8.zip", f"bytes={len(zipped) // 2}-")  # asked, got it all
    assert (out / "downloads" / "text8.zip").read_bytes() == zipped
    # a later job made anew (a damaged split) reuses the kept file and leaves it: not its own
    (out / "train.bin").write_bytes(b"\0")
    asked = len(mirror.log)
    assert pd.prepare("text8", out) == out and len(mirror.log) == asked
    assert (out / "downloads" / "text8.zip").read_bytes() == zipped


def test_tinystories_vocabulary_end_of_text_and_rare_characters(mirror, tmp_path, monkeypatch):
    train = 'Tom saw a cat.\n<|endoftext|>\nLily said "hi" to Tom. é!\n<|endoftext|>\nThe cat ran.'
    valid = "Tom saw Lily. Zoë ran.\n<|endoftext|>\n"
    mirror.serve({TS_TRAIN: train.encode(), TS_VALID: valid.encode()})
    monkeypatch.setattr(pd, "CHUNK", 16)  # stories cut across chunks; a chunk ends at a line's end
    plain = train.replace(pd.EOT, "")
    out = pd.prepare("tinystories", tmp_path / "ts", min_per_million=1.5e6 / len(plain))  # 1.5x
    meta = pd.load_meta(out)
    frequent = sorted(c for c in set(plain) if plain.count(c) >= 2)
    assert meta["chars"] == frequent + [pd.EOT, "\ufffd"]
    assert set(meta["splits"]) == {"train", "val"}
    assert meta["replaced"] == sorted(c for c in set(plain) if plain.count(c) == 1)
    # made before --v1 existed (its default, False, then): not downloaded nor made again
    options = {k: v for k, v in meta["options"].items() if k != "v1"}
    (out / "meta.json").write_text(json.dumps(dict(meta, options=options)))
    asked = len(mirror.log)
    pd.prepare("tinystories", tmp_path / "ts", min_per_million=1.5e6 / len(plain))
    assert len(mirror.log) == asked and (out / "meta.json").read_text().count('"v1"') == 0

    def ids(text):
        stories = [[frequent.index(c) if c in frequent else len(frequent) + 1 for c in s]
                   for s in text.split(pd.EOT)]
        return stories[0] + [i for s in stories[1:] for i in [len(frequent)] + s]
    assert pd.open_split(out, "train").tolist() == ids(train)
    assert pd.open_split(out, "val").tolist() == ids(valid)
    assert pd.encoder(meta, out)("Tom<|endoftext|>") == ids("Tom<|endoftext|>")
    assert pd.decoder(meta, out)(ids("Tom<|endoftext|>a")) == "Tom<|endoftext|>a"
    train = b"ab<|endoftext|>ba\xff"  # an undecodable byte is '\ufffd', which keeps its own id
    mirror.serve({"TinyStories-train.txt": train, "TinyStories-valid.txt": b"ab"})
    out = pd.prepare("tinystories", tmp_path / "v1", v1=True, min_per_million=0)
    assert pd.load_meta(out)["chars"] == ["a", "b", pd.EOT, "\ufffd"]
    assert pd.load_meta(out)["source"][0].endswith("/TinyStories-train.txt")


@pytest.mark.optional  # with tiktoken (CI's second stage) it encodes; without, one line says so
def test_fineweb_edu_shards_split_and_gpt2_decoding(mirror, tmp_path, capsys):
    val = [50256, 1, 2, 3, 50256, 4, 5, 6, 7, 50256, 8, 9, 10, 11, 50256, 12]  # middle: 8
    mirror.serve({"finewebedu_val_000000.bin": shard(val), **gpt2_files(),
                  "finewebedu_train_000001.bin": shard([50256, 100, 101]),
                  "finewebedu_train_000002.bin": shard([50256, 258, 50000])})
    out = pd.prepare("fineweb_edu", tmp_path / "fw", shards=2)
    meta = pd.load_meta(out)
    assert meta["level"] == "gpt2" and meta["dtype"] == "uint16" and meta["vocab_size"] == 50257
    assert meta["splits"] == {"train": 6, "val": 9, "test": 7}  # cut at the first EOT >= middle
    assert pd.open_split(out, "train").tolist() == [50256, 100, 101, 50256, 258, 50000]
    assert pd.open_split(out, "test").tolist() == val[9:]
    assert sorted(files_in(out)) == ["encoder.json", "meta.json", "test.bin", "train.bin",
                                     "val.bin", "vocab.bpe"]
    assert pd.decoder(meta, out)([258, 99, 97, 116, 50256]) == " thecat<|endoftext|>"
    if importlib.util.find_spec("tiktoken"):  # optional: without it, one line naming it
        assert pd.encoder(meta, out)(" the cat<|endoftext|>") == [258, 32, 99, 97, 116, 50256]
    else:
        with pytest.raises(UsageError, match="pip install tiktoken"):
            pd.encoder(meta, out)
    mirror.serve({"finewebedu_val_000000.bin": shard([50256, 50257])})  # one id past GPT-2's
    line = error_line(pd.main, ["fineweb_edu", "--shards", 1, "--out", tmp_path / "bad"], capsys)
    assert "token id 50257 is not a GPT-2 token" in line


@pytest.mark.parametrize("n, dtype", [(256, "uint8"), (257, "uint16")])
def test_a_vocabulary_of_256_ids_is_one_byte_a_token(n, dtype, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ids 0..255 fit a byte: one more is two bytes a token
    Path("chars.txt").write_text("".join(chr(0x4E00 + i) for i in range(n)) * 4, encoding="utf-8")
    out = pd.prepare("textfile", input="chars.txt")
    meta = pd.load_meta(out)
    assert meta["vocab_size"] == n and meta["dtype"] == dtype
    width = np.dtype(dtype).itemsize
    assert (out / "train.bin").stat().st_size == meta["splits"]["train"] * width


def test_textfile_splits_records_its_hash_and_is_made_anew_when_it_changes(tmp_path, monkeypatch,
                                                                              capsys):
    monkeypatch.chdir(tmp_path)
    Path("story.txt").write_text("once upon a time ☃\n" * 10, encoding="utf-8")  # 190 characters
    out = pd.prepare("textfile", input="story.txt")
    meta = pd.load_meta(out)
    assert out == Path("data/story") and meta["splits"] == {"train": 171, "val": 9, "test": 10}
    assert meta["chars"] == sorted(set("once upon a time ☃\n")) and meta["dtype"] == "uint8"
    assert meta["options"]["sha256"] == hashlib.sha256(Path("story.txt").read_bytes()).hexdigest()
    val = pd.decoder(meta, out)(pd.open_split(out, "val"))
    assert val == ("once upon a time ☃\n" * 10)[171:180]
    pd.prepare("textfile", input="story.txt")
    assert "already prepared" in capsys.readouterr().out
    Path("story.txt").write_bytes(b"caf\xe9")  # changed: prepared anew, which fails...
    assert "is not UTF-8" in error_line(pd.main, ["textfile", "--input", "story.txt"], capsys)
    with pytest.raises(UsageError, match="not a finished dataset"):  # ...and reads unfinished
        pd.load_meta(out)
    Path("story.txt").write_text("another story\n", encoding="utf-8")
    pd.prepare("textfile", input="story.txt")
    assert "wrote data/story" in capsys.readouterr().out
    assert pd.load_meta(out)["splits"] == {"train": 12, "val": 1, "test": 1}
    # a run resumes only on its own text, told apart by the splits' SHA-256
    Path("story.txt").write_text("once upon a time\n" * 120, encoding="utf-8")
    meta = pd.load_meta(pd.prepare("textfile", input="story.txt"))
    assert meta["sha256"]["val"] == hashlib.sha256((out / "val.bin").read_bytes()).hexdigest()
    trained(out, "run", "--max_iters", 1)
    Path("story.txt").write_text("time upon a once\n" * 120, encoding="utf-8")  # same characters
    pd.prepare("textfile", input="story.txt")
    assert pd.load_meta(out)["chars"] == meta["chars"]
    err = error_line(train.main, ["--out_dir", "run", "--resume"], capsys)
    assert "is not the dataset the run in" in err


# --- Downloads: resumed, retried, checked by name ---

def test_retries_say_so_wait_twice_as_long_then_fail(mirror, tmp_path, monkeypatch, capsys):
    waits = []
    monkeypatch.setattr(pd.time, "sleep", waits.append)
    monkeypatch.setenv("NANOROUTE_RETRY_BACKOFF", "150")
    mirror.status["text8.zip"] = 503
    code, out, err = run(pd.main, ["text8", "--out", tmp_path / "a", "--retries", 4], capsys)
    assert waits == [150, 300, 600, 600]  # doubling, at most 600 s a wait
    assert out.count("text8.zip: HTTP 503; retry") == 4 and len(mirror.log) == 5
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "re-run" in err
    assert "failed after 5 tries (HTTP 503)" in err
    mirror.status["text8.zip"], mirror.log[:] = 429, []  # too many requests: retried, not fatal
    error_line(pd.main, ["text8", "--out", tmp_path / "b", "--retries", 1], capsys)
    assert len(mirror.log) == 2
    mirror.status["text8.zip"] = 404  # and --base_url beats NANOROUTE_BASE_URL
    monkeypatch.setenv("NANOROUTE_BASE_URL", "http://127.0.0.1:9")
    line = error_line(pd.main, ["text8", "--out", tmp_path / "c", "--base_url", mirror.url], capsys)
    assert f"HTTP 404 Not Found for {mirror.url}/text8.zip" in line and "--base_url" in line
    monkeypatch.setenv("NANOROUTE_RETRY_BACKOFF", "soon")
    line = error_line(pd.main, ["text8", "--out", tmp_path / "d"], capsys)
    assert "NANOROUTE_RETRY_BACKOFF=soon" in line


def test_a_download_not_the_official_file_is_refused_by_name_or_ids(mirror, tmp_path, capsys):
    for served, why in [(b"\n<!DOCTYPE html><html>404</html>", "an HTML or XML page"),
                        (gzip.compress(b"Once upon a time"), "a gzip-compressed body"),
                        (b"", "an empty file")]:  # a mirror's page, a gzip body, an empty file
        mirror.serve({TS_TRAIN: served, TS_VALID: b"Once upon a time"})
        line = error_line(pd.main, ["tinystories", "--out", tmp_path / why], capsys)
        assert f"TinyStoriesV2-GPT4-train.txt from {mirror.url}" in line and why in line
        assert "deleted: re-run" in line and list(files_in(tmp_path / why)) == ["progress.json"]
    text, zipped = text8_zip()
    mirror.serve({"text8.zip": zipped, **gpt2_files()})
    pd.OFFICIAL["text8.zip"] = (len(zipped) + 1, None)
    line = error_line(pd.main, ["text8", "--out", tmp_path / "t8"], capsys)
    assert f"{len(zipped)} bytes, expected {len(zipped) + 1}" in line
    pd.OFFICIAL["encoder.json"] = (None, "0" * 64)
    line = error_line(pd.main, ["fineweb_edu", "--out", tmp_path / "fw"], capsys)
    assert "encoder.json" in line and "SHA-256 is not the official file's" in line
    assert list(files_in(tmp_path / "fw")) == ["progress.json"]
    other, out = io.BytesIO(), tmp_path / "other"  # no official SHA-256 is known for text8.zip:
    with zipfile.ZipFile(other, "w") as z:  # the size alone lets other text through
        z.writestr("text8", "Other text, 2 digits and CAPITALS.")
    mirror.serve({"text8.zip": other.getvalue()})
    line = error_line(pd.main, ["text8", "--out", out], capsys)
    assert "holds token id 255, but vocab_size is 27" in line
    assert sorted(files_in(out)) == ["progress.json", "test.bin", "train.bin", "val.bin"]
    mirror.serve({"text8.zip": zipped})
    pd.prepare("text8", out)  # the same command downloads it again
    assert pd.decoder(pd.load_meta(out), out)(pd.open_split(out, "test")) in text


# --- Folders: only this script's, resumed after a failure, read back with clear errors ---

def test_a_folder_this_script_did_not_prepare_is_refused_and_untouched(demo, tmp_path, capsys):
    mine = tmp_path / "mine"
    for name in ("train.bin", "progress.json", "downloads/photo.jpg"):
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_bytes(b"the user's")
    before = files_in(mine)
    assert "give a new or empty folder" in error_line(pd.main, ["demo", "--out", mine], capsys)
    assert files_in(mine) == before
    dotted = tmp_path / "dotted"  # hidden files only (.git, .env): not empty either
    (dotted / ".git").mkdir(parents=True)
    assert "give a new or empty folder" in error_line(pd.main, ["demo", "--out", dotted], capsys)
    assert [p.name for p in dotted.iterdir()] == [".git"]
    before = files_in(demo)
    assert "holds the demo dataset" in error_line(pd.main, ["text8", "--out", demo], capsys)
    assert files_in(demo) == before


def test_a_stopped_write_leaves_no_temporary_file_and_a_stopped_run_resumes(mirror, tmp_path,
                                                                            monkeypatch, capsys):
    umask = os.umask(0)
    os.umask(umask)
    common.write_atomic(tmp_path / "a.json", b"{}")
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file
    for other in (0o077, 0o002):  # a private umask, a shared group's: common reads it at import
        code = f"import os; os.umask({other}); import common; common.write_atomic('b.json', b'')"
        subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True,
                       env=dict(os.environ, PYTHONPATH=str(Path(common.__file__).parent)))
        assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o666 & ~other
        (tmp_path / "b.json").unlink()

    def interrupted(f):
        f.write(b"half")
        assert len(os.listdir(tmp_path)) == 2  # its temporary file beside it: one file system
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        common.write_atomic(tmp_path / "a.json", interrupted)
    assert os.listdir(tmp_path) == ["a.json"] and (tmp_path / "a.json").read_bytes() == b"{}"
    text, zipped = text8_zip()
    mirror.serve({"text8.zip": zipped})
    fsync, calls = os.fsync, []

    def fail_once_at_train_bin(fd):
        calls.append(fd)
        if len(calls) == 3:  # progress.json twice, then train.bin
            raise OSError(5, "Input/output error")
        fsync(fd)
    monkeypatch.setattr(os, "fsync", fail_once_at_train_bin)
    out = tmp_path / "t8"
    assert "Input/output error" in error_line(pd.main, ["text8", "--out", out], capsys)
    assert sorted(files_in(out)) == ["downloads/text8.zip", "progress.json"]
    pd.prepare("text8", out)
    assert sorted(files_in(out)) == ["meta.json", "test.bin", "train.bin", "val.bin"]
    assert [name for name, _ in mirror.log] == ["text8.zip"]  # the download was kept


def test_load_meta_and_open_split_name_the_fix_and_datasets_nearby(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pd.prepare("demo", demo_mb=0.01)
    with pytest.raises(UsageError) as e:
        pd.load_meta("data/demo_typo")
    assert "data/demo_typo does not exist; prepared datasets: data/demo;" in str(e.value)
    assert "python prepare_data.py DATASET --out data/demo_typo" in str(e.value)
    pd.prepare("demo", "runs/demo", demo_mb=0.01)  # the prepared folders next to it too
    with pytest.raises(UsageError, match="prepared datasets: data/demo, runs/demo;"):
        pd.load_meta("runs/demo_typo")
    assert pd.dataset_folder("runs") == Path("data/runs")  # a bare name: data/NAME, unless
    assert pd.dataset_folder("demo") == Path("data/demo")  # ./NAME is a prepared dataset
    Path("here").mkdir()
    Path("here/meta.json").write_text("{}")
    assert pd.dataset_folder("here") == Path("here")
    Path("x").mkdir()  # a job started as fineweb_edu --shards 3
    Path("x/progress.json").write_text('{"dataset": "fineweb_edu", "options": {"shards": 3}}')
    with pytest.raises(UsageError, match="run: python prepare_data.py fineweb_edu --shards 3"):
        pd.load_meta("x")
    meta = json.loads(Path("data/demo/meta.json").read_text())
    Path("data/demo/meta.json").write_text(json.dumps({**meta, "vocab_size": "53"}))
    fix = 'damaged .no "vocab_size" int.; prepare it again: python prepare_data.py demo --demo_mb'
    with pytest.raises(UsageError, match=fix + " 0.01 --out data/demo$"):
        pd.load_meta("data/demo")
    # open_split checks the size and every token id, read in chunks: a bad id past the first
    monkeypatch.setattr(pd, "CHUNK", 64)
    out, val = Path("runs/demo"), Path("runs/demo/val.bin").read_bytes()
    fix = f"again: python prepare_data.py demo --demo_mb 0.01 --out {out}"
    cases = [(val[:-1] + bytes([200]), "holds token id 200, but vocab_size is 51"),  # another's
             (val[:-1] + bytes([51]), "holds token id 51, but vocab_size is 51"),  # the first past
             (val + b"\0", f"holds {len(val) + 1} bytes, not {len(val)} tokens"),  # a byte too many
             (val[:-7], re.escape(fix))]
    for content, match in cases:
        (out / "val.bin").write_bytes(content)
        with pytest.raises(UsageError, match=match):
            pd.open_split(out, "val")
    pd.prepare("demo", out, demo_mb=0.01)  # the command it names repairs it
    assert len(pd.open_split(out, "val")) == len(val)


@pytest.mark.parametrize("argv, words", [
    (["wikipedia"], "unknown dataset 'wikipedia'"),
    (["fineweb_edu", "--shards", "0"], "--shards 0: must be from 1 to 99"),
    (["demo", "--demo_mb", "-1"], "--demo_mb -1.0: must be from 0.001 to 100"),
    (["demo", "--demo_mb", "nan"], "--demo_mb nan: must be"),
    (["text8", "--retries", "-1"], "--retries -1: must be from 0 to 100"),
    (["demo", "--shards", "3"], "--shards does not apply to demo"),
    (["textfile"], "textfile needs --input"),
    (["textfile", "--input", "no/such.txt"], "No such file or directory"),
    (["demo", "--sed", "3"], "unrecognized arguments: --sed 3 (did you mean --seed?)"),
    (["demo", "--out", "{tmp}/file/demo"], "Not a directory"),
    (["demo", "--out", ""], "argument --out: '': give a folder name"),
    (["demo", "--out", " "], "argument --out: ' ': give a folder name"),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)  # so that a check that let a bad value through writes nothing here
    (tmp_path / "file").write_text("not a folder")
    assert words in error_line(pd.main, [a.format(tmp=tmp_path) for a in argv], capsys)


def test_ctrl_c_is_one_line_saying_whether_the_same_command_continues(tmp_path, capsys,
                                                                     monkeypatch):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pd, "prepare", stopped)  # Ctrl-C while it prepares: kept, resumed
    with pytest.raises(SystemExit) as e:
        pd.main(["demo", "--out", str(tmp_path / "d")])
    assert e.value.code == 130
    assert "error: interrupted; the same command keeps what is done" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # sample.py, bench.py: nothing to continue, no promise
        common.cli(stopped)()
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


def test_training_and_sampling_import_it_without_the_download_packages(tmp_path):
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ["requests", "urllib3", "tqdm",
                                                                  "tiktoken"])
    code = (f"import sys; {blocked}; import prepare_data as pd; "
            f"out = pd.prepare('demo', {str(tmp_path / 'd')!r}, demo_mb=0.01); "
            "print(len(pd.open_split(out, 'val', pd.load_meta(out))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(SCRIPT).parent)
    assert r.returncode == 0 and int(r.stdout.split()[-1]) > 0, r.stderr


def test_help_lists_the_datasets_and_another_level_is_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        pd.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in pd.DATASETS)
    assert all(f"--{k}" in out for d in pd.DATASETS.values() for k in d.options)
    (tmp_path / "t.txt").write_text("text")  # textfile's --input
    for name, d in pd.DATASETS.items():  # both ends of a range are in it ("from 1 to 99")
        for k, opt in {**pd.RUN_OPTIONS, **d.options}.items():
            for end in (opt.low, opt.high) if opt.low is not None else ():
                given = {k: end, **({"input": tmp_path / "t.txt"} if "input" in d.options else {})}
                assert pd._options(name, given)[0][k] == end, (name, k, end)

    # decoder, encoder and train.py's bpc know char and gpt2: "byte" would decode as code points
    def bytes_of_text(o, fetch):
        return dict(level="byte", dtype="uint8", vocab_size=256), dict(train=np.arange(9))
    monkeypatch.setitem(pd.DATASETS, "bytes", pd.Dataset(bytes_of_text, "", {}))
    with pytest.raises(ValueError, match="level 'byte'"):
        pd.prepare("bytes", tmp_path / "bytes")
    assert not (tmp_path / "bytes" / "meta.json").exists()
