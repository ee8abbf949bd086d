"""
Prepare the datasets nanoroute trains on (SPEC.md, "Data the project prepares").

    python prepare_data.py demo                      # generated offline in seconds; train.py's default
    python prepare_data.py text8                     # 31 MB zip, 27 characters, 90M/5M/5M
    python prepare_data.py tinystories               # ~2.2 GB of text, characters, train/val
    python prepare_data.py fineweb_edu --shards 20   # GPT-2 tokens, 100M per train shard

Output contract: a prepared dataset is a folder (default data/NAME/) holding

    train.bin, val.bin, test.bin   flat arrays of token ids, no header: uint8 when the vocabulary
                                   fits in 256 ids, else uint16. tinystories has no test.bin.
                                   Read them with open_split() or np.memmap(path, dtype, mode="r").
    meta.json                      {"dataset", "level": "char" | "gpt2", "dtype", "vocab_size",
                                    "chars": the character of each id, in id order (char level only),
                                    "replaced": characters mapped to the replacement symbol, commonest
                                    first (tinystories only),
                                    "splits": {"train": n_tokens, ...}, "source": URLs or
                                    "generated (seed S)", "format_version": 1, "options": {...}}
    encoder.json, vocab.bpe        gpt2 level only: GPT-2's BPE files, to turn ids back into text.
    checked.json                   written by train.py: the largest token id of each split, a cache
                                   of its data check (keyed by each file's size, times, inode and
                                   a hash of its first and last 64 KiB).

meta.json is written last, atomically: a folder with a valid meta.json is finished. Each .bin and
.json is written to a new temporary file next to it, flushed to the disk and renamed when complete
(write_atomic); each download goes to NAME.part and is renamed only once verified. So an interrupted
run never leaves a file that looks complete, and re-running the same command resumes it (finished
downloads and splits are kept; progress.json tracks them and the downloads this script made).
Only what these records name is ever deleted, a folder holding files this script did not make is
never written into, and no write follows a symbolic link.
Never pickle. With --base_url URL or $NANOROUTE_BASE_URL, every file is fetched as URL/<filename>.
"""

import argparse
import contextlib
import difflib
import functools
import errno
import hashlib
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np

# requests, urllib3 and tqdm are imported in _fetch, when something is downloaded: training and
# sampling import this module too, and need only numpy from it.

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
EOT = "<|endoftext|>"  # story / document separator, kept as one reserved symbol
REPLACEMENT = "\ufffd"  # '�': the one symbol every rare TinyStories character maps to
GPT2_VOCAB, GPT2_EOT = 50257, 50256
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER = 20240520, 1, 256 * 4  # llm.c: 256 int32, then uint16
CHUNK = 1 << 23  # characters / tokens handled at a time, so memory stays bounded on huge files
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

TEXT8_URL = "http://mattmahoney.net/dc/text8.zip"
TINYSTORIES_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
FINEWEB_URL = "https://huggingface.co/datasets/kjj0/finewebedu10B-gpt2/resolve/main/"
GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# (bytes, sha256) of official files, checked only when the file comes from that exact URL: a mirror's
# files are checked by their structure instead (zip test, shard header, JSON), so tests can serve
# tiny stand-ins. The GPT-2 hashes are the ones tiktoken pins.
KNOWN = {
    TEXT8_URL: (31344016, None),
    GPT2_URL + "encoder.json": (None, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    GPT2_URL + "vocab.bpe": (None, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}

# name: (line for --help, the options that decide its data, with their defaults)
DATASETS = {
    "demo": ("generated stories, ~2 MB, char level, offline in ~1 s; train.py's default",
             {"seed": 1337, "demo_mb": 2.0}),
    "text8": ("Wikipedia text, 27 chars, 90M/5M/5M; 31 MB zip from mattmahoney.net/dc", {}),
    "tinystories": ("children's stories, char level, train/val; ~2.2 GB of text from "
                    "huggingface.co/datasets/roneneldan/TinyStories", {"v1": False, "min_per_million": 0.5}),
    "fineweb_edu": ("FineWeb-Edu in GPT-2 tokens, train/val/test; 200 MB per 100M-token shard from "
                    "huggingface.co/datasets/kjj0/finewebedu10B-gpt2", {"shards": 20}),
}
RUN_OPTIONS = {"base_url": None, "retries": 5, "backoff": None, "keep_downloads": False}  # how, not what
# every number a user can give (flag or API): (type, lowest, highest, unit). backoff also comes from
# $NANOROUTE_RETRY_BACKOFF; each retry waits backoff * 2**attempt seconds, at most MAX_WAIT.
LIMITS = {"seed": (int, 0, 2 ** 63 - 1, ""),
          "demo_mb": (float, 0.001, 100, " million characters"),  # 100: 45 s, 0.9 GB of memory
          "retries": (int, 0, 100, ""),
          "backoff": (float, 0, 600, " seconds"),
          "shards": (int, 1, 99, ""),  # the dataset has 99 train shards
          "min_per_million": (float, 0, 1_000_000, " per million characters")}
MAX_WAIT = 600


class _Transient(Exception):
    """A download failure worth retrying: network hiccup, cut connection, HTTP 5xx."""


# -----------------------------------------------------------------------------
# Downloads: streamed, resumed with Range, verified, renamed.

def _write(f, data):
    return f.write(data)  # every byte the scripts write to a file that matters goes through here (tests inject faults)


def download(url, dest, retries=5, backoff=1.0, verify=None):
    """Fetch url to dest via dest.part; verify(path) returns None or why the file is bad. A dest that
    exists is checked again (it was verified before its rename, but may be damaged since): a bad one
    is deleted and fetched again. Each retry prints a line; the wait doubles from `backoff` seconds."""
    dest = Path(dest)
    check = lambda path: _check_known(path, url) or (verify(path) if verify else None)
    if dest.exists():
        why = check(dest)
        if why is None:
            return dest
        print(f"{dest} is damaged ({why}); downloading it again", flush=True)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    if part.is_symlink():
        raise UsageError(f"{part} is a symbolic link, not a partial download; remove it and re-run")
    for attempt in range(retries + 1):
        try:
            _fetch(url, part)
            break
        except _Transient as e:
            if attempt == retries:
                raise UsageError(f"download of {url} failed after {retries + 1} tries ({e}); "
                                 f"{_mirror_hint(url)}, then re-run (the download resumes)") from None
            wait = min(backoff * 2 ** attempt, MAX_WAIT)
            print(f"{dest.name}: {e}; try {attempt + 2} of {retries + 1} in {wait:.3g} s "
                  f"({_mirror_hint(url)})", flush=True)
            time.sleep(wait)
    why = check(part)
    if why:
        part.unlink()
        raise UsageError(f"{dest.name} from {url} is corrupt or truncated ({why}); it was deleted, "
                        "re-run to download it again")
    os.replace(part, dest)
    return dest


def _mirror_hint(url):
    if any(url.startswith(u) for u in (TEXT8_URL, TINYSTORIES_URL, FINEWEB_URL, GPT2_URL)):
        return "check the network, or fetch the same files from a mirror with --base_url URL"
    return "check the network and the mirror given by --base_url / NANOROUTE_BASE_URL"


def _fetch(url, part):
    import requests  # noqa: PLC0415 (here, not on top: see the imports)
    import urllib3  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415
    have = part.stat().st_size if part.exists() else 0
    headers = {"Accept-Encoding": "identity"}  # bytes as stored: sizes and Range offsets must agree
    headers.update({"Range": f"bytes={have}-"} if have else {})
    try:
        with requests.get(url, headers=headers, stream=True, timeout=(10, 60)) as r:
            if r.status_code == 416 and have:  # nothing after `have`: the part may already be whole
                total = r.headers.get("Content-Range", "").rpartition("/")[2]
                if total.isdigit() and int(total) == have:
                    return
                part.unlink()
                raise _Transient("partial file longer than the remote one, restarting")
            if r.status_code in (408, 429) or r.status_code >= 500:
                raise _Transient(f"HTTP {r.status_code}")
            if r.status_code not in (200, 206):
                raise UsageError(f"HTTP {r.status_code} {r.reason} for {url}; check the dataset name and "
                                "--base_url / $NANOROUTE_BASE_URL")
            if r.status_code == 206 and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                part.unlink()
                raise _Transient("server sent another range than asked, restarting")
            if r.status_code == 200:
                have = 0  # the server ignored our Range: start over rather than append a second copy
            length = int(r.headers.get("Content-Length", -1))
            with _open_part(part, append=have > 0) as f, tqdm(
                    total=have + length if length >= 0 else None, initial=have, unit="B",
                    unit_scale=True, desc=part.name[:-5], disable=None) as bar:
                # read1 hands over whatever arrived, so a cut connection loses nothing already received
                while chunk := r.raw.read1(1 << 20):
                    _write(f, chunk)
                    bar.update(len(chunk))
            if length >= 0 and part.stat().st_size != have + length:
                raise _Transient("connection closed early")
    except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.HTTPError) as e:
        raise _Transient(f"{type(e).__name__} talking to {url.split('/')[2]}") from None
    except requests.RequestException as e:  # a URL requests cannot fetch (InvalidURL, ...)
        raise UsageError(f"download of {url} failed ({type(e).__name__}: {e}); check --base_url / "
                         "NANOROUTE_BASE_URL") from None


def _open_part(part, append):
    """part opened to append (or truncated): never through a symbolic link (O_NOFOLLOW)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    return open(part, "ab" if append else "wb", opener=lambda path, _: os.open(path, flags, 0o666))


def _check_known(path, url):
    size, sha256 = KNOWN.get(url, (None, None))
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, expected {size}"
    if sha256 is not None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        if h.hexdigest() != sha256:
            return "sha256 differs from the official file"
    return None


def _url(official, base_url):
    return f"{base_url.rstrip('/')}/{official.rsplit('/', 1)[1]}" if base_url else official


# -----------------------------------------------------------------------------
# Writing outputs: atomically, and remembering finished splits in progress.json.

def _write_bin(path, chunks, dtype):
    """Write token arrays to path atomically; returns the number of tokens."""
    n = 0

    def write(f):
        nonlocal n
        for c in chunks:
            c = np.ascontiguousarray(c, dtype=dtype)
            f.write(c.tobytes())
            n += c.size
    write_atomic(path, write)
    return n


def _todo(out, state, splits, dtype):
    """The splits still to write: done means listed in progress.json with a file of that length."""
    def done(split):
        path, n = out / f"{split}.bin", state["splits"].get(split)
        return n is not None and path.exists() and path.stat().st_size == n * np.dtype(dtype).itemsize
    return [s for s in splits if not done(s)]


def _finish_split(out, state, split, chunks, dtype):
    state["splits"][split] = _write_bin(out / f"{split}.bin", chunks, dtype)
    write_json(out / "progress.json", state)


# -----------------------------------------------------------------------------
# The records of what this project made in a folder (meta.json, progress.json). Nothing else is ever
# deleted, and a folder without them is written into only if it is empty.

def _read_object(path):
    """The JSON object in path; None if it is missing, unreadable or not an object."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _is_progress(state):
    return (isinstance(state, dict) and state.get("dataset") in DATASETS
            and isinstance(state.get("options"), dict) and isinstance(state.get("splits"), dict))


def _made_as(out):
    """The dataset a folder was prepared (or started) as, by this project's records; None without any."""
    meta = _read_object(out / "meta.json")
    if meta is not None and meta.get("dataset") in DATASETS and "format_version" in meta:
        return meta["dataset"]
    progress = _read_object(out / "progress.json")
    return progress["dataset"] if _is_progress(progress) else None


def _claim(out, name):
    """UsageError unless out may be prepared as `name`: empty, or recorded as `name` (finished or not).
    So someone else's files are never overwritten or deleted, and another dataset is never replaced."""
    made_as = _made_as(out)
    if made_as is None and any(not p.name.endswith(".tmp") for p in out.iterdir()):
        raise UsageError(f"{out} is not empty and holds no dataset of prepare_data.py (no meta.json or "
                         "progress.json of one): nothing is written there, so that none of its files is "
                         "overwritten or deleted; give a new or empty folder")
    if made_as not in (None, name):
        raise UsageError(f"{out} holds the {made_as} dataset; prepare {name} in another folder (or "
                         f"delete {out} first if it is no longer needed)")


def _load_progress(out, name, recorded):
    """progress.json of an unfinished folder: the splits done (reused if the options are the same) and
    "made", the downloads this project made there, which only clean-up deletes (kept whatever the
    options). A finished folder prepared again brings the downloads its meta.json records as kept."""
    path = out / "progress.json"
    state = _read_object(path)
    if path.exists() and not _is_progress(state):
        raise UsageError(f"{path} was not written by prepare_data.py; move it away (it is never "
                         "overwritten) and re-run")
    if state is None:
        made = (_read_object(out / "meta.json") or {}).get("made")
    else:
        made = state["made"] if "made" in state else _made_before_records(out)
    if state is None or state["options"] != recorded or not _progress_ok(state):
        state = {"options": recorded, "splits": {}}  # nothing done so far is reusable
    return {**state, "dataset": name, "made": _valid_made(made)}


def _valid_made(made):
    """The entries of a "made" record that name downloads/ or a file in it (nothing else is deleted)."""
    pattern = r"downloads(/[\w+-][\w.+-]*)?"  # no "..", no subfolder
    if not isinstance(made, list):
        return []
    return [m for m in made if isinstance(m, str) and re.fullmatch(pattern, m)]


def _progress_ok(state):
    """Whether what progress.json records has the types this script writes (else it starts over)."""
    strings = lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v)
    ok = all(s in SPLITS and type(n) is int and n >= 0 for s, n in state["splits"].items())
    if "chars" in state:  # tinystories' vocabulary, from its first pass
        ok = ok and strings(state["chars"]) and strings(state.get("replaced"))
        ok = ok and isinstance(state.get("replaced_share"), (int, float))
    return ok


def _made_before_records(out):
    """The downloads of a progress.json written before "made" was recorded: that version always made
    downloads/ and put only its downloads there."""
    folder = out / "downloads"
    if not folder.is_dir() or folder.is_symlink():
        return []
    return ["downloads"] + [f"downloads/{p.name.removesuffix('.part')}" for p in folder.iterdir()]


def _download(out, state, o, name, url, verify=None):
    """download() into out/downloads/, recorded in progress.json before its first byte: clean-up deletes
    only recorded downloads, and a file there that is not recorded is not this project's to use."""
    rel, folder = f"downloads/{name}", _downloads_folder(out)
    dest = out / rel
    if rel not in state["made"]:
        if any(p.exists() or p.is_symlink() for p in (dest, dest.with_name(name + ".part"))):
            raise UsageError(f"{dest} was not downloaded by prepare_data.py (progress.json does not "
                             "list it); move it away and re-run")
        state["made"] += ([] if folder.exists() else ["downloads"]) + [rel]
        write_json(out / "progress.json", state)
    folder.mkdir(exist_ok=True)
    return download(url, dest, o["retries"], o["backoff"], verify)


def _downloads_folder(out):
    """out/downloads, unless it is a symbolic link: no download is written or deleted through one."""
    folder = out / "downloads"
    if folder.is_symlink():
        raise UsageError(f"{folder} is a symbolic link; downloads are written and deleted only in a real "
                         "folder: remove the link and re-run")
    return folder


def _remove_downloads(out, made):
    """Delete the downloads progress.json records (with their .part), then downloads/ if this project
    made it and it is empty now: nothing else (and nothing through a downloads/ link)."""
    if made:
        _downloads_folder(out)
    for rel in made:
        if rel != "downloads":
            (out / rel).unlink(missing_ok=True)
            (out / (rel + ".part")).unlink(missing_ok=True)
    if "downloads" in made:
        with contextlib.suppress(OSError):  # not empty: it holds something else
            (out / "downloads").rmdir()


def _tidy_after_failure(out, state):
    """A failed run leaves no empty downloads/ this project made, nor a progress.json alone in its
    folder (it records nothing worth keeping then); prepare() then removes the folders it made, if
    they are empty."""
    if "downloads" in state["made"]:
        with contextlib.suppress(OSError):
            (out / "downloads").rmdir()
    if [p.name for p in out.iterdir()] == ["progress.json"]:
        (out / "progress.json").unlink()


def _chunks(a, n=None):
    n = n or CHUNK
    return (a[i:i + n] for i in range(0, len(a), n))


def _char_lut(chars, default):
    """Code point -> id table (single-character entries only); everything else gets `default`."""
    lut = np.full(0x110000, default, dtype=np.int32)
    for i, c in enumerate(chars):
        if len(c) == 1:
            lut[ord(c)] = i
    return lut


def _codepoints(text):
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


# -----------------------------------------------------------------------------
# demo: short stories from a small grammar, generated offline from a seed.

_NAMES = ("Lily:she Tom:he Mia:she Ben:he Sara:she Max:he Anna:she Leo:he Zoe:she Sam:he Emma:she "
          "Jack:he Lucy:she Finn:he Ruby:she Noah:he Ella:she Jake:he Amy:she Tim:he Rosa:she Omar:he "
          "Ivy:she Dan:he Nina:she Hugo:he Kate:she Ravi:he Maya:she Eli:he Lena:she Otto:he").split()
_WORDS = dict(
    place="park forest beach garden village library river hill market farm school castle lake meadow "
          "bakery harbor cave zoo field kitchen attic bridge mountain island".split(),
    object="red ball|kite|little boat|blue hat|shiny key|big book|drum|lantern|map|teddy bear|cake|"
           "basket|feather|smooth stone|shell|whistle|box|umbrella|apple|flower|toy car|rope|bell|"
           "ring|scarf|cup|paper star|letter".split("|"),
    animal="cat dog bird fox rabbit owl frog duck bear mouse turtle horse lion fish bee squirrel".split(),
    adj="happy tiny brave curious sleepy kind shy clever silly gentle proud quiet friendly busy "
        "grumpy bright old funny lonely little".split(),
    feeling="happy sad scared excited surprised tired proud worried angry calm".split(),
    time="One sunny morning|One rainy day|One cold winter night|On a windy afternoon|Early one day|"
         "One warm summer evening|Long ago|Once upon a time".split("|"),
    act="play in the sun|read books|sing songs|run fast|draw pictures|build sand castles|climb trees|"
        "bake cookies|dance|look at the stars|swim in the lake|ride a bike|pick flowers|fly a kite"
        .split("|"),
    rel="mom|dad|grandma|grandpa|little brother|big sister|dog|best friend".split("|"),
    water="river pond lake mud well sea".split(), weather="rain|snow|get dark|blow hard".split("|"),
    spot="bed|big rock|old tree|table|stairs|bench".split("|"),
    trap="mud|hole|net|bush|fence|tall grass".split("|"),
    lesson="share|be kind|tell the truth|help others|be patient|listen to mom|try again|say sorry"
           .split("|"),
)
_BEATS = [  # a story takes one or more sentences from each beat, in order
    ["{time}, there was a {adj} {kind} named {N}.", "Once upon a time, there was a {adj} {animal} "
     "named {N}.", "{N} was a {adj} {kind} who lived near the {place}.",
     "{time}, {N} went to the {place} with {his} {rel}."],
    ["{He} loved to {act} every day.", "{He} had a {object} that {he} liked very much.",
     "Every morning, {N} liked to {act} with {F}.", "{N} and {his} friend {F} liked to play at the "
     "{place}.", "{He} felt very {feeling} that day."],
    ["One day, {he} found a {object2} near the {place2}.", "Suddenly, {N} saw a {adj2} {animal} by "
     "the {place}.", "Then {F} came to visit with a {object2}.", "When {he} got to the {place2}, "
     "{he} saw something {adj2} under a tree."],
    ['"Look at this {object}!" said {N}.', '{F} asked, "Can I play with your {object}?"',
     '"Yes, you can," {N} said with a smile.', '"I am so {feeling}," said {N}. "Will you help me?"',
     '"Where are you going?" asked the {animal}.', '"Let\'s go to the {place2}!" said {F}.',
     '"Oh no!" cried {N}. "My {object} is gone!"', '"What is that?" asked {F}.'],
    ["But then the {object} fell into the {water}.", "Suddenly, it began to {weather}.",
     "{F} felt {feeling2} because {fhe} could not find {fhis} {object2}.",
     "The {animal} was stuck in the {trap}, and it could not get out."],
    ["{N} and {F} worked together to get it back.", "{N} thought hard and had a {adj2} idea.",
     "{He} shared {his} {object} with {F}, and they both laughed.", "They looked everywhere, and at "
     "last they found it under the {spot}.", "{N} was brave and helped the {animal}."],
    ['"Thank you, {F}," said {N}. "You are a good friend."', "From that day on, {N} and {F} were "
     "best friends.", "{N} learned that it is good to {lesson}.", "They went home {feeling2} and "
     "tired.", "That night, {N} went to bed with a big smile."],
]


def _story(rng):
    (n, he), (f, fhe) = rng.sample([x.split(":") for x in _NAMES], 2)
    w = {k: rng.choice(v) for k, v in _WORDS.items()}
    w.update({k + "2": rng.choice(_WORDS[k]) for k in ("place", "object", "adj", "feeling")})
    w.update(N=n, F=f, he=he, He=he.title(), his="his" if he == "he" else "her",
             fhe=fhe, fhis="his" if fhe == "he" else "her", kind="boy" if he == "he" else "girl")
    sentences = [s.format(**w) for i, beat in enumerate(_BEATS)
                 for s in rng.sample(beat, 1 if i == 0 else rng.choice((1, 1, 2)))]
    sentences += ["The end."] if rng.random() < 0.3 else []
    cut = rng.randint(4, len(sentences) - 1)  # paragraph breaks inside the story
    paragraphs = [sentences[:2], sentences[2:cut], sentences[cut:]]
    story = "\n".join(" ".join(p) for p in paragraphs if p) + "\n\n"
    return re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", story)  # a apple -> an apple


def demo_stories(seed=1337, demo_mb=2.0):
    """{split: text}: ~90/5/5 % of demo_mb million characters, split at story boundaries."""
    rng, texts = random.Random(seed), {}
    for split, share in zip(SPLITS, (0.90, 0.05, 0.05)):
        stories, n = [], 0
        while n < share * demo_mb * 1e6:
            stories.append(_story(rng))
            n += len(stories[-1])
        texts[split] = "".join(stories)
    return texts


def _prepare_demo(out, o, state):
    texts = demo_stories(o["seed"], o["demo_mb"])
    chars = sorted(set("".join(texts.values())))
    lut = _char_lut(chars, -1)
    for split in _todo(out, state, SPLITS, "uint8"):
        _finish_split(out, state, split, [lut[_codepoints(texts[split])]], "uint8")
    return dict(level="char", dtype="uint8", vocab_size=len(chars), chars=chars,
                source=f"generated (seed {o['seed']})")


# -----------------------------------------------------------------------------
# text8: the first 10^8 bytes of cleaned Wikipedia, a-z and space.

def _check_zip(member):
    def check(path):
        try:
            with zipfile.ZipFile(path) as z:
                if member not in z.namelist():
                    return f"no '{member}' inside"
                bad = z.testzip()  # reads every member and checks its CRC
                return f"bad CRC in {bad}" if bad else None
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            return f"not a valid zip: {e}"
    return check


def _prepare_text8(out, o, state):
    url, chars = _url(TEXT8_URL, o["base_url"]), list(" abcdefghijklmnopqrstuvwxyz")
    todo = _todo(out, state, SPLITS, "uint8")
    if todo:
        path = _download(out, state, o, "text8.zip", url, _check_zip("text8"))
        with zipfile.ZipFile(path) as z:
            data = np.frombuffer(z.read("text8"), dtype=np.uint8)
        ids = _char_lut(chars, 255)[:256].astype(np.uint8)[data]
        if (ids == 255).any() or (url == TEXT8_URL and len(ids) != 10 ** 8):
            path.unlink()
            raise UsageError(f"{path} does not hold text8 (characters other than a-z and space, or not "
                            "10^8 of them); it was deleted, re-run to download it again")
        # Proportional 90/5/5 %: exactly the standard 90M / 5M / 5M for the official 10^8 characters.
        a, b = len(ids) * 90 // 100, len(ids) * 95 // 100
        parts = dict(train=ids[:a], val=ids[a:b], test=ids[b:])
        for split in todo:
            _finish_split(out, state, split, [parts[split]], "uint8")
    return dict(level="char", dtype="uint8", vocab_size=len(chars), chars=chars, source=[url])


# -----------------------------------------------------------------------------
# tinystories: character level, vocabulary from train, streamed in chunks (the train file is ~2 GB).

def _read_chunks(path):
    """Yield the text of path in pieces of ~CHUNK characters that never cut EOT in two."""
    carry = ""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        while piece := f.read(CHUNK):
            text = carry + piece
            k = next((k for k in range(len(EOT) - 1, 0, -1) if text.endswith(EOT[:k])), 0)
            carry, text = text[len(text) - k:], text[:len(text) - k]
            yield text
    if carry:
        yield carry


def _encode_stream(path, lut, eot_id):
    eot = np.array([eot_id], dtype=np.int32)
    for text in _read_chunks(path):
        parts = []
        for i, story in enumerate(text.split(EOT)):
            parts += [eot, lut[_codepoints(story)]] if i else [lut[_codepoints(story)]]
        yield np.concatenate(parts)


def _prepare_tinystories(out, o, state):
    prefix = "TinyStories-" if o["v1"] else "TinyStoriesV2-GPT4-"
    names = dict(train=prefix + "train.txt", val=prefix + "valid.txt")
    urls = {s: _url(TINYSTORIES_URL + n, o["base_url"]) for s, n in names.items()}
    get = lambda s: _download(out, state, o, names[s], urls[s])
    if "chars" not in state:  # first pass over train: character frequencies
        counts = np.zeros(0x110000, dtype=np.int64)
        for text in _read_chunks(get("train")):
            counts += np.bincount(_codepoints(text.replace(EOT, "")), minlength=0x110000)
        # a frequency, not a count: a small file keeps its ordinary characters (a 2M-character file at
        # the former 1000 occurrences lost 'q', 'Z' and ':')
        least = o["min_per_million"] * counts.sum() / 1e6
        seen = np.flatnonzero(counts)
        frequent = [chr(c) for c in seen if counts[c] >= least and chr(c) != REPLACEMENT]
        # the replacement symbol has its own id, however rare: it is never listed as replaced by itself
        rare = [c for c in seen if counts[c] < least and chr(c) != REPLACEMENT]
        rare = sorted(rare, key=lambda c: -counts[c])
        # ids: frequent characters by code point, then EOT, then the replacement symbol (last id)
        state["chars"] = frequent + [EOT, REPLACEMENT]
        state["replaced"] = [chr(c) for c in rare]  # commonest first
        state["replaced_share"] = float(counts[rare].sum() / max(1, counts.sum()))
        write_json(out / "progress.json", state)
    chars = state["chars"]
    if state["replaced"]:
        shown = " ".join(map(repr, state["replaced"][:40])) + (" ..." if len(state["replaced"]) > 40 else "")
        print(f"{len(state['replaced'])} characters rarer than --min_per_million {o['min_per_million']:g} "
              f"({100 * state['replaced_share']:.3g}% of train) become {REPLACEMENT!r}: {shown}")
    dtype = "uint8" if len(chars) <= 256 else "uint16"
    lut = _char_lut(chars, len(chars) - 1)  # rare and unseen characters -> the replacement symbol
    for split in _todo(out, state, ("train", "val"), dtype):
        _finish_split(out, state, split, _encode_stream(get(split), lut, len(chars) - 2), dtype)
    return dict(level="char", dtype=dtype, vocab_size=len(chars), chars=chars, replaced=state["replaced"],
                source=list(urls.values()))


# -----------------------------------------------------------------------------
# fineweb_edu: llm.c shards of GPT-2 tokens.

def _check_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header.size < 256:
        return "shorter than the 1024-byte llm.c header"
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION or header[2] <= 0:
        return f"bad header (magic {header[0]}, version {header[1]}, {header[2]} tokens)"
    want, size = SHARD_HEADER + 2 * int(header[2]), path.stat().st_size
    return f"{size} bytes, but its header says {header[2]} tokens ({want} bytes)" if size != want else None


def _shard_tokens(path):
    why = _check_shard(path)
    if why is None:
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=SHARD_HEADER)
        bad = next((int(c.max()) for c in _chunks(tokens) if c.size and c.max() >= GPT2_VOCAB), None)
        why = None if bad is None else f"token id {bad} is not a GPT-2 token"
    if why:
        path.unlink()
        raise UsageError(f"{path} is corrupt ({why}); it was deleted, re-run to download it again")
    return tokens


def _val_test_cut(tokens):
    """First EOT at or after the middle (llm.c starts each document with EOT), else the middle."""
    mid = len(tokens) // 2
    for i in range(mid, len(tokens), CHUNK):
        hits = np.flatnonzero(tokens[i:i + CHUNK] == GPT2_EOT)
        if hits.size:
            return i + int(hits[0])
    return mid


def _check_encoder_json(path):
    try:
        problem = _encoder_problem(json.loads(path.read_text(encoding="utf-8")))
    except ValueError as e:  # not JSON, or not UTF-8
        problem = str(e)
    return problem and f"not GPT-2's encoder.json: {problem}"


def _check_vocab_bpe(path):
    with open(path, "rb") as f:
        return None if f.read(8) == b"#version" else "not GPT-2's vocab.bpe"


def _prepare_fineweb(out, o, state):
    sources = []
    for name, check in (("encoder.json", _check_encoder_json), ("vocab.bpe", _check_vocab_bpe)):
        sources.append(_url(GPT2_URL + name, o["base_url"]))
        download(sources[-1], out / name, o["retries"], o["backoff"], check)  # kept: part of the dataset
    names = ["finewebedu_val_000000.bin"]
    names += [f"finewebedu_train_{i:06d}.bin" for i in range(1, o["shards"] + 1)]
    urls = [_url(FINEWEB_URL + n, o["base_url"]) for n in names]
    shard = lambda i: _shard_tokens(_download(out, state, o, names[i], urls[i], _check_shard))
    todo = _todo(out, state, SPLITS, "uint16")
    if "val" in todo or "test" in todo:
        # SPEC's deterministic split: the official val shard, cut at the first document boundary at
        # or after its middle; the first part is val, the rest is test.
        tokens = shard(0)
        cut = _val_test_cut(tokens)
        for split in [s for s in ("val", "test") if s in todo]:
            part = tokens[:cut] if split == "val" else tokens[cut:]
            _finish_split(out, state, split, _chunks(part), "uint16")
    if "train" in todo:
        shards = [shard(i) for i in range(1, len(names))]  # fetch and check all before writing
        _finish_split(out, state, "train", (c for s in shards for c in _chunks(s)), "uint16")
    return dict(level="gpt2", dtype="uint16", vocab_size=GPT2_VOCAB, source=sources + urls,
                tokenizer=dict(encoder="encoder.json", vocab_bpe="vocab.bpe", eot=GPT2_EOT))


BUILDERS = dict(demo=_prepare_demo, text8=_prepare_text8, tinystories=_prepare_tinystories,
                fineweb_edu=_prepare_fineweb)


# -----------------------------------------------------------------------------
# The API train.py and sample.py use.

def prepare(name, out_dir=None, **options):
    """Prepare dataset `name` into out_dir (default data/NAME); a finished folder is left as is. A folder
    that holds files this project did not make, or another dataset, is refused (UsageError). After a
    failure, the folders this call made are removed again if nothing worth keeping is in them."""
    o, recorded = _options(name, options)
    out = Path(out_dir) if out_dir else Path("data") / name
    new_folders = _missing_folders(out)  # out and the parents this call creates, deepest first
    writable_folder(out, "--out")
    try:
        with _one_at_a_time(out):
            return _prepare_into(out, name, o, recorded)
    except BaseException:
        for folder in new_folders:
            with contextlib.suppress(OSError):  # not empty: a resumable download, or someone else's
                folder.rmdir()
        raise


@contextlib.contextmanager
def _one_at_a_time(folder):
    """One prepare() at a time in a folder (the train.py runs of a sweep may all prepare the demo at
    once): an exclusive flock on the folder itself, so no lock file is left. No lock without fcntl."""
    try:
        import fcntl  # noqa: PLC0415 (POSIX only)
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run preparing {folder}", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _prepare_into(out, name, o, recorded):
    _claim(out, name)
    if _finished(out, name, recorded):
        _tidy_finished(out, o["keep_downloads"])
        print(f"{out} is already prepared (delete its meta.json to prepare it again)")
        return out
    state = _load_progress(out, name, recorded)
    write_json(out / "progress.json", state)  # first: the folder is this dataset's before any file
    (out / "meta.json").unlink(missing_ok=True)  # unfinished from here until meta.json is rewritten
    try:
        meta = {"dataset": name, **BUILDERS[name](out, o, state)}
    except BaseException:
        _tidy_after_failure(out, state)
        raise
    if not o["keep_downloads"]:
        _remove_downloads(out, state["made"])  # before meta.json: a finished folder has none left
    meta["splits"] = {s: state["splits"][s] for s in SPLITS if s in state["splits"]}
    meta.update(format_version=FORMAT_VERSION, options=recorded)
    if o["keep_downloads"] and state["made"]:
        meta["made"] = state["made"]  # so that a later run may reuse them, or delete them
    write_json(out / "meta.json", meta)  # from now on the folder is finished
    (out / "progress.json").unlink()
    counts = ", ".join(f"{s} {n:,}" for s, n in meta["splits"].items())
    print(f"wrote {out}: {counts} tokens ({meta['level']}, vocab {meta['vocab_size']}, {meta['dtype']})")
    return out


def _tidy_finished(out, keep_downloads):
    """A finished folder keeps no downloads unless --keep_downloads (meta.json records those it
    keeps), nor the progress.json of a run killed right after its meta.json."""
    meta, progress = load_meta(out), _read_object(out / "progress.json")
    progress = progress if _is_progress(progress) else None
    if not keep_downloads:
        _remove_downloads(out, _valid_made(meta.get("made")) + _valid_made((progress or {}).get("made")))
        if "made" in meta:
            del meta["made"]
            write_json(out / "meta.json", meta)
            print(f"deleted the downloads kept in {out / 'downloads'} (--keep_downloads keeps them)")
    if progress is not None:
        (out / "progress.json").unlink()


def _options(name, options):
    """Every option of a run, checked where it enters (flags, API, environment): (options, the ones
    that decide the data, recorded in meta.json)."""
    if name not in DATASETS:
        raise UsageError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")
    defaults = DATASETS[name][1]
    for k in options:
        if k not in defaults and k not in RUN_OPTIONS:
            allowed = ", ".join(f"--{a}" for a in defaults) or "none"
            raise UsageError(f"option --{k} does not apply to {name} (its own options: {allowed})")
    o = {**RUN_OPTIONS, **defaults, **{k: v for k, v in options.items() if v is not None}}
    o["base_url"] = o["base_url"] or os.environ.get("NANOROUTE_BASE_URL") or None
    if o["base_url"] and not (isinstance(o["base_url"], str) and re.match(r"https?://", o["base_url"])):
        raise UsageError(f"--base_url / NANOROUTE_BASE_URL must start with http:// or https:// "
                        f"(got '{o['base_url']}')")
    if o["backoff"] is None:
        o["backoff"] = _seconds_from_env("NANOROUTE_RETRY_BACKOFF", 1.0)
    for k, (kind, low, high, unit) in LIMITS.items():
        v = o.get(k)
        number = isinstance(v, int) or kind is float and isinstance(v, float)
        number = number and not isinstance(v, bool)
        if k in o and not (number and low <= v <= high):  # nan and inf fail the range too
            raise UsageError(f"--{k} {v}: must be {'an integer' if kind is int else 'a number'} from "
                             f"{low} to {high}{unit}")
    for k in ("v1", "keep_downloads"):
        if k in o and not isinstance(o[k], bool):
            raise UsageError(f"--{k} is a switch: True or False (got {o[k]!r})")
    return o, {k: o[k] for k in defaults}


def _missing_folders(path):
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _seconds_from_env(name, default):
    text = os.environ.get(name) or str(default)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= LIMITS["backoff"][2]:  # nan and inf fail too
        raise UsageError(f"{name}={text}: must be a number of seconds from 0 to {LIMITS['backoff'][2]} "
                         "(the wait before the first retry of a download; it doubles at each retry)")
    return value


def os_error_line(e, flag):
    """An OSError as one line with what to do; `flag` is the script's output-folder flag."""
    what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    if e.errno == errno.ENOSPC:
        return f"{what}; free some disk space (or use {flag} on a bigger disk) and re-run"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{what}; choose a writable folder with {flag}"
    return f"{what}; fix that and re-run"


def writable_folder(path, flag):
    """path, created if needed, after checking that a file can be written in it; else UsageError
    naming the flag (a file in the way, a path under a file, no permission, a read-only disk)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UsageError(f"cannot write to output folder {path} ({e.strerror or e}); choose a writable "
                         f"folder with {flag}") from None
    return path


def _finished(out, name, recorded):
    try:
        meta = load_meta(out)
        return (meta["dataset"] == name and meta.get("options") == recorded
                and all(open_split(out, s, meta) is not None for s in meta["splits"]))
    except UsageError:
        return False


def _command(data_dir, name=None):
    """The command that prepares data_dir: dataset `name`, else the one its progress.json or folder
    name says, else a placeholder that lists the datasets."""
    name = name or _started_as(data_dir) or (data_dir.name if data_dir.name in DATASETS else None)
    if name is None:
        return f"python prepare_data.py DATASET --out {data_dir} (DATASET: {', '.join(DATASETS)})"
    if data_dir.resolve() == (Path("data") / name).resolve():
        return f"python prepare_data.py {name}"
    return f"python prepare_data.py {name} --out {data_dir}"


def _started_as(data_dir):
    """The dataset an unfinished folder was being prepared as: its progress.json's, else the one its
    downloads are from; None if neither says."""
    progress = _read_object(data_dir / "progress.json")
    if _is_progress(progress):
        return progress["dataset"]
    downloads = [p.name for p in (data_dir / "downloads").glob("*")]  # whole or .part
    for name, prefix in (("text8", "text8.zip"), ("tinystories", "TinyStories"), ("fineweb_edu", "finewebedu_")):
        if any(d.startswith(prefix) for d in downloads):
            return name
    return None


def dataset_folder(name):
    """--data as a folder: a bare name (no slash) is ./NAME when that is a prepared dataset, else
    data/NAME, where `python prepare_data.py NAME` puts it."""
    path = Path(name)
    if len(path.parts) == 1 and not (path / "meta.json").exists():
        return Path("data") / path
    return path


def load_meta(data_dir):
    """Read and check data_dir/meta.json; UsageError says which command prepares the folder."""
    d = Path(data_dir)
    path = d / "meta.json"
    if not path.exists():
        what = "does not exist" if not d.exists() else "is not a finished dataset (no meta.json)"
        raise UsageError(f"data folder {d} {what}; run: {_command(d)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path} ({e}); prepare it again: {_command(d)}") from None
    problem = _meta_problem(meta)
    if problem:  # prepare() takes the folder back only if its records name one of the datasets
        name = _made_as(d)
        fix = "prepare it again" if name else f"if {d} holds nothing else of value, delete it and run"
        raise UsageError(f"{path} is not a nanoroute dataset (format {FORMAT_VERSION}): {problem}; "
                         f"{fix}: {_command(d, name)}")
    return meta


def _strings(v):
    return isinstance(v, list) and all(isinstance(c, str) and c for c in v)


# what each field of meta.json must be: (test, the words for the error); "chars" is checked below
_META_FIELDS = {
    "format_version": (lambda v: type(v) is int and v == FORMAT_VERSION, str(FORMAT_VERSION)),
    "dataset": (lambda v: isinstance(v, str), "a dataset name"),
    "level": (lambda v: v in ("char", "gpt2"), '"char" or "gpt2"'),
    "dtype": (lambda v: v in ("uint8", "uint16"), '"uint8" or "uint16"'),
    "vocab_size": (lambda v: type(v) is int and 1 <= v <= 65536, "an integer from 1 to 65536"),
    "splits": (lambda v: isinstance(v, dict) and all(s in SPLITS and type(n) is int and n >= 0
                                                     for s, n in v.items()),
               'the token count of each split, e.g. {"train": 900, "val": 50}'),
    "source": (lambda v: isinstance(v, (str, list)), "the URLs or the generator it came from"),
}
_META_OPTIONAL = {"options": (lambda v: isinstance(v, dict), "an object"),
                  "replaced": (_strings, "a list of characters"), "made": (_strings, "a list of paths")}


def _meta_problem(meta):
    """What is wrong with a parsed meta.json, naming the field; None if nothing."""
    if not isinstance(meta, dict):
        return f"it holds a JSON {type(meta).__name__}, not an object"
    for field, (ok, want) in {**_META_FIELDS, **_META_OPTIONAL}.items():
        if field not in meta and field in _META_FIELDS:
            return f'field "{field}" is missing'
        if field in meta and not ok(meta[field]):
            return f'field "{field}" must be {want} (it is {json.dumps(meta[field])[:40]})'
    chars = meta.get("chars")
    if meta["level"] == "char" and not (_strings(chars) and len(chars) == meta["vocab_size"]):
        return 'field "chars" must list the character (a string) of each of the vocab_size ids'
    return None


def open_split(data_dir, split, meta=None):
    """The tokens of one split as a read-only np.memmap, checked against meta's token count."""
    d = Path(data_dir)
    meta = meta or load_meta(d)
    if split not in meta["splits"]:
        raise UsageError(f"{d} has no '{split}' split (it has: {', '.join(meta['splits'])})")
    path, n = d / f"{split}.bin", meta["splits"][split]
    want = n * np.dtype(meta["dtype"]).itemsize
    size = path.stat().st_size if path.exists() else None
    if size != want:
        have = "missing" if size is None else f"{size} bytes"
        raise UsageError(f"{path} is {have}, expected {want} bytes ({n} tokens); prepare it again: "
                        f"{_command(d, meta['dataset'])}")
    if n == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(n,))


def check_tokens(data_dir, meta, splits):
    """UsageError unless every token id of these splits is below meta's vocab_size (a wrong dtype in
    meta.json, or a .bin from another dataset, shows up as ids out of range). The scan reads each file
    once, in chunks (bounded memory, seconds per GB); its result is cached in checked.json next to
    the files, keyed by each file's _fingerprint, so later runs skip it."""
    d = Path(data_dir)
    want = "uint8" if meta["vocab_size"] <= 256 else "uint16"
    if meta["dtype"] != want:
        raise UsageError(f"{d / 'meta.json'} says dtype {meta['dtype']} for vocab_size {meta['vocab_size']}, "
                         f"which is stored as {want}; prepare it again: {_command(d, meta['dataset'])}")
    cache_path = d / "checked.json"
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    changed = False
    for split in splits:
        tokens, path = open_split(d, split, meta), d / f"{split}.bin"
        key = _fingerprint(path)
        entry = cache.get(split)
        if not (isinstance(entry, dict) and entry.get("file") == key and isinstance(entry.get("max_id"), int)):
            entry = dict(file=key, max_id=max((int(c.max()) for c in _chunks(tokens) if c.size), default=-1))
            cache[split], changed = entry, True
        if entry["max_id"] >= meta["vocab_size"]:
            raise UsageError(f"{path} holds token id {entry['max_id']}, but meta.json's vocab_size is "
                             f"{meta['vocab_size']} (dtype {meta['dtype']}): the file does not belong to this "
                             f"meta.json; prepare it again: {_command(d, meta['dataset'])}")
    if changed:
        try:
            write_json(cache_path, cache)
        except OSError:
            pass  # a read-only dataset folder: the check still ran, it is only not cached
    return cache


def _fingerprint(path):
    """What tells a file's content apart cheaply: its size, modification and change times, inode, and
    a hash of its first and last 64 KiB. A copy made with cp -p or rsync -t keeps the size and the
    modification time, but gets a new change time (which no tool can set) or inode; the hash also
    catches a rewrite within the change time's tick."""
    stat, h, part = path.stat(), hashlib.sha256(), 1 << 16
    with open(path, "rb") as f:
        h.update(f.read(part))
        f.seek(max(part, stat.st_size - part))
        h.update(f.read(part))
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, h.hexdigest()[:16]]


def _bytes_to_unicode():
    """GPT-2's map from each byte to a printable character, as used in encoder.json."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _encoder_problem(vocab):
    """Why vocab, encoder.json's content, is not GPT-2's encoder.json, else None: an object of
    byte-level tokens (each character one byte of GPT-2's table) and their ids below GPT2_VOCAB,
    <|endoftext|> at GPT2_EOT. Checked where the file is downloaded (a mirror's, with no hash) and
    where it is read."""
    if not isinstance(vocab, dict) or not vocab:
        return "not a JSON object of tokens and their ids"
    chars = set(_bytes_to_unicode().values())
    for token, i in vocab.items():
        if not (type(i) is int and 0 <= i < GPT2_VOCAB and all(c in chars for c in token)):
            return f"{token!r}: {i!r} is not a byte-level token and an id below {GPT2_VOCAB}"
    if vocab.get(EOT) != GPT2_EOT:
        return f"{EOT} is not id {GPT2_EOT}"
    return None


def _gpt2_table(data_dir):
    """{id: bytes} from the local encoder.json (its ids are also GPT-2's BPE merge ranks)."""
    path = Path(data_dir) / "encoder.json"
    if not path.exists():
        raise UsageError(f"{path} is missing; prepare the folder again: "
                        f"{_command(Path(data_dir), 'fineweb_edu')}")
    vocab = _read_object(path)
    problem = _encoder_problem(vocab)
    if problem:
        raise UsageError(f"{path} is not GPT-2's encoder.json ({problem}); prepare the "
                         f"folder again: {_command(Path(data_dir), 'fineweb_edu')}")
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    return {i: bytes(byte_of[c] for c in tok) for tok, i in vocab.items()}


def decoder(meta, data_dir):
    """ids -> text. Ids outside the vocabulary (a padded model head) decode to '\ufffd'."""
    if meta["level"] == "char":
        chars = meta["chars"]
        return lambda ids: "".join(chars[i] if 0 <= i < len(chars) else REPLACEMENT for i in map(int, ids))
    table = _gpt2_table(data_dir)  # byte-level BPE decodes without tiktoken: join the bytes
    unknown = REPLACEMENT.encode()
    return lambda ids: b"".join(table.get(int(i), unknown) for i in ids).decode("utf-8", "replace")


def encoder(meta, data_dir):
    """text -> ids. Char level: UsageError names characters outside the vocabulary."""
    if meta["level"] == "gpt2":
        table = _gpt2_table(data_dir)
        try:
            import tiktoken
        except ImportError:
            raise UsageError("encoding a GPT-2 prompt needs tiktoken: pip install tiktoken") from None
        special = {EOT: next(i for i, b in table.items() if b == EOT.encode())}
        enc = tiktoken.Encoding(name="gpt2-local", pat_str=GPT2_PATTERN, special_tokens=special,
                                mergeable_ranks={b: i for i, b in table.items() if i != special[EOT]})
        return lambda text: enc.encode(text, allowed_special={EOT})
    index = {c: i for i, c in enumerate(meta["chars"])}
    reserved = [c for c in meta["chars"] if len(c) > 1]  # typed in a prompt, EOT means its own symbol
    splitter = re.compile("(" + "|".join(map(re.escape, reserved)) + ")") if reserved else None

    def encode(text):
        pieces = splitter.split(text) if splitter else [text]
        missing = sorted({c for p in pieces if p not in reserved for c in p if c not in index})
        replaced = [c for c in missing if c in meta.get("replaced", ())]
        if replaced:  # in the text, but rarer than --min_per_million when the folder was prepared
            threshold = meta.get("options", {}).get("min_per_million")
            threshold = f"{threshold:g}" if isinstance(threshold, (int, float)) else "it had"
            raise UsageError(f"characters not in the {meta['dataset']} vocabulary: {' '.join(map(repr, missing))}; "
                            f"{' '.join(map(repr, replaced))} became {REPLACEMENT!r} in the training data "
                            f"(rarer than --min_per_million {threshold}): remove them, "
                            f"or prepare the data again with a lower --min_per_million")
        if missing:
            raise UsageError(f"characters not in the {meta['dataset']} vocabulary: "
                            f"{' '.join(map(repr, missing))}; remove or replace them")
        ids = []
        for p in pieces:
            ids += [index[p]] if p in reserved else [index[c] for c in p]
        return ids
    return encode



# =============================================================================
# Below this banner: what every script shares, each rule in one place. A user's mistake is one
# UsageError, printed by one handler (cli) as one `error:` line with exit code 2; flags are never
# abbreviated; every file the project writes goes through write_atomic.
# =============================================================================

class UsageError(Exception):
    """A problem the user can fix (bad input, a missing or damaged file); its message says what
    failed and what to do. cli prints it as one `error: ...` line and exits with code 2."""


def cli(main):
    """A script's main(argv=None) as a command: a UsageError, or an OSError (a full disk, a folder
    that cannot be written), is one `error:` line and exit code 2; anything else is a bug and keeps
    its traceback."""
    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(argv)
        except UsageError as e:
            message = str(e)
        except OSError as e:
            message = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
        print("error: " + " ".join(message.split()), file=sys.stderr)
        sys.exit(2)
    return run


# Names a user may bring from nanoGPT or habit, and this project's flag for each ("did you mean").
FLAG_SYNONYMS = {"learning_rate": "lr", "block_size": "sequence_len", "context_len": "sequence_len",
                 "n_layers": "n_layer", "n_heads": "n_head", "d_model": "n_embd",
                 "gradient_accumulation_steps": "grad_accum", "max_steps": "max_iters",
                 "iters": "max_iters", "out": "out_dir", "init_from": "resume"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse as every script uses it: no abbreviations (--max_iter is refused, not taken for
    --max_iters), and a bad flag is one `error:` line, exit code 2, naming the nearest flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        wrong = re.search(r"unrecognized arguments: --?([\w-]+)", message)
        flags = {o[2:] for a in self._actions for o in a.option_strings if o.startswith("--")}
        flags |= {f for p in self._subparsers_of() for a in p._actions for o in a.option_strings
                  if o.startswith("--") for f in [o[2:]]}
        known = {f: f for f in flags} | {k: v for k, v in FLAG_SYNONYMS.items() if v in flags}
        close = difflib.get_close_matches(wrong[1], known, n=1, cutoff=0.7) if wrong else []
        hint = f" (did you mean --{known[close[0]]}?)" if close else ""
        print(f"error: {message}{hint}; see --help", file=sys.stderr)
        sys.exit(2)

    def _subparsers_of(self):
        return [p for a in self._actions if isinstance(a, argparse._SubParsersAction)
                for p in a.choices.values()]


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: a written file gets the mode any new file would (mkstemp's is 0600)


def write_atomic(path, data):
    """Write path whole or not at all: `data` (bytes, or a function that writes to a binary file)
    goes to a new temporary file in the same folder (mkstemp: a fresh name, so a link planted at a
    fixed name is never followed), which is fsynced and then renamed over path (os.replace). On any
    failure the temporary file is removed and path is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False).encode() + b"\n")


# -----------------------------------------------------------------------------
# Command line.

def _parser():
    listing = "\n".join(f"  {n:<12} {d[0]}" for n, d in DATASETS.items())
    p = ArgumentParser(
        description="Prepare a dataset folder (train.bin, val.bin, test.bin, meta.json) for train.py.",
        epilog=f"datasets:\n{listing}\n\nmirror: --base_url URL or NANOROUTE_BASE_URL=URL fetches every "
               "file as URL/<filename>.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="dataset: " + ", ".join(DATASETS))
    p.add_argument("--out", help="output folder (default: data/NAME)")
    p.add_argument("--base_url", help="mirror holding the files by name (env: NANOROUTE_BASE_URL)")
    p.add_argument("--retries", type=int, help="retries per download, 0 to 100 (default 5); the wait "
                   "doubles from NANOROUTE_RETRY_BACKOFF seconds (default 1)")
    p.add_argument("--keep_downloads", action="store_true", default=None,
                   help="keep raw downloads in OUT/downloads/ after preparing (a later run without it "
                   "deletes them)")
    p.add_argument("--seed", type=int, help="demo: generator seed (default 1337)")
    p.add_argument("--demo_mb", type=float, help="demo: corpus size in millions of characters, 0.001 to "
                   "100 (default 2)")
    p.add_argument("--v1", action="store_true", default=None,
                   help="tinystories: the V1 files (GPT-3.5 and GPT-4 stories) instead of V2 (GPT-4)")
    p.add_argument("--min_per_million", type=float, help="tinystories: characters rarer than this many per "
                   "million characters of train become the replacement symbol (default 0.5: on the full V2 "
                   "train file ~1,100 occurrences; on a 2M-character file every character seen; 0 keeps all)")
    p.add_argument("--shards", type=int,
                   help="fineweb_edu: 100M-token train shards to fetch, 1 to 99 (default 20)")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if v is not None and k not in ("name", "out")}
    try:
        prepare(args.name, args.out, **options)
        return 0
    except KeyboardInterrupt:
        msg = "interrupted; re-run the same command to resume (finished downloads and splits are kept)"
    except UsageError as e:
        msg = str(e)
    except OSError as e:
        msg = os_error_line(e, "--out")
    print("error: " + " ".join(msg.split()), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
