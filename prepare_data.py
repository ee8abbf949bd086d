"""
`python prepare_data.py NAME [--out DIR] [options]` prepares a dataset (docs/data.md, SPEC.md):
a folder (default data/NAME) of train.bin, val.bin, test.bin (tinystories: no test), flat token ids
(uint8 if the vocabulary fits in 256 ids, else uint16), and meta.json (never pickle), written last.
Rules: (1) every file is written whole or not at all (write_atomic); a download grows in NAME.part
(resumed with HTTP Range) and is renamed once checked by its name. (2) Only this job's downloads
(its progress.json records them) and temporary files are deleted; the same command resumes it.
(3) A non-empty folder without a meta.json or progress.json of this script is refused, as is
another dataset's; the same dataset with other options (or a changed --input) is prepared anew.
"""

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import random
import re
import sys
import time
import zipfile
import zlib
from collections import namedtuple
from pathlib import Path

import numpy as np

from common import ArgumentParser, UsageError, cli, folder_name, write_atomic, write_json

FORMAT_VERSION, SPLITS = 1, ("train", "val", "test")
EOT = "<|endoftext|>"  # story / document separator, kept as one reserved symbol
REPLACEMENT = "\ufffd"  # '�': the one symbol every rare TinyStories character maps to
GPT2_VOCAB, GPT2_EOT = 50257, 50256
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER = 20240520, 1, 256 * 4  # llm.c: 256 int32, then uint16
CHUNK = 1 << 23  # characters / tokens / bytes handled at a time: bounded memory on huge files
MAX_WAIT = 600  # seconds: the longest wait between two tries of a download
TIMEOUT = (10, 60)  # seconds to connect, and without a byte: a stalled server is retried
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
OFFICIAL = {  # name: (bytes, sha256) of an official file, None if unknown; whoever serves it
    "text8.zip": (31344016, None),
    "encoder.json": (None, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "vocab.bpe": (None, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}
Option = namedtuple("Option", "default help low high", defaults=(None, None))  # None: required
RUN_OPTIONS = {  # how to run, not what to make: not in meta.json (a dataset's own are in DATASETS)
    "base_url": Option(None, "a mirror: files are fetched as URL/<filename> (NANOROUTE_BASE_URL)"),
    "retries": Option(5, "per download; waits double from NANOROUTE_RETRY_BACKOFF s", 0, 100),
    "keep_downloads": Option(False, "keep this job's raw downloads in OUT/downloads/"),
}

# --- Downloads: into OUT/downloads/NAME.part, resumed with Range, checked by name, renamed. ---
def _download(out, progress, o, rel, url):
    dest = out / rel
    part = dest.with_name(dest.name + ".part")
    if dest.exists():  # checked before its rename
        return dest
    if rel not in progress["made"]:  # recorded before its first byte (rule 2)
        progress["made"].append(rel)
        write_json(out / "progress.json", progress)
    dest.parent.mkdir(exist_ok=True)
    for attempt in range(o["retries"] + 1):
        try:
            _fetch(url, part)
            break
        except ConnectionError as e:  # _fetch's word for "a retry may help"
            if attempt == o["retries"]:
                raise UsageError(f"download of {url} failed after {attempt + 1} tries ({e}); check "
                                 "the network or --base_url, then re-run: it resumes") from None
            wait = min(o["backoff"] * 2 ** attempt, MAX_WAIT)
            print(f"{dest.name}: {e}; retry {attempt + 1}/{o['retries']} in {wait:g} s", flush=True)
            time.sleep(wait)
    if why := _problem(part, dest.name):
        part.unlink()
        raise UsageError(f"{dest.name} from {url} is not the real file ({why}); it was deleted: "
                         "re-run to download it again (from another --base_url if a mirror's)")
    return part.replace(dest)

def _fetch(url, part):
    """Append to part what the server has after its bytes (HTTP Range). ConnectionError: retry."""
    import requests  # noqa: PLC0415 (here: train.py and sample.py import this module)
    import urllib3  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415
    have = part.stat().st_size if part.exists() else 0
    headers = {"Accept-Encoding": "identity"}  # bytes as stored: sizes and Range offsets agree
    headers.update({"Range": f"bytes={have}-"} if have else {})
    try:
        with requests.get(url, headers=headers, stream=True, timeout=TIMEOUT) as r:
            if r.status_code in (408, 429) or r.status_code >= 500:
                raise ConnectionError(f"HTTP {r.status_code}")
            if r.status_code not in (200, 206, 416):
                raise UsageError(f"HTTP {r.status_code} {r.reason} for {url}; check the dataset "
                                 "name and --base_url / NANOROUTE_BASE_URL")
            if r.status_code != 200 and f"bytes {have}-" not in r.headers.get("Content-Range", ""):
                part.unlink(missing_ok=True)  # 416: nothing after `have`; or another range
                raise ConnectionError(f"HTTP {r.status_code} for bytes {have}-, restarting")
            have = have if r.status_code == 206 else 0  # 200: the whole file, so start over
            length = int(r.headers.get("Content-Length", -1))
            with open(part, "ab" if have else "wb") as f, tqdm(
                    total=have + length if length >= 0 else None, initial=have, unit="B",
                    unit_scale=True, desc=part.name[:-5], disable=None) as bar:
                # raw: the bytes as sent; read1: whatever arrived, so a cut loses nothing received
                while chunk := r.raw.read1(1 << 20):
                    bar.update(f.write(chunk))
        if length >= 0 and part.stat().st_size != have + length:
            raise ConnectionError("connection closed early")
    except (requests.ConnectionError, requests.Timeout, urllib3.exceptions.HTTPError) as e:
        raise ConnectionError(f"{type(e).__name__} talking to {url.split('/')[2]}") from None

def _problem(path, name):
    """Why path is not the file `name`: by the official size and SHA-256, else by its kind."""
    size, sha256 = OFFICIAL.get(name, (None, None))
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, expected {size}"
    if sha256 is not None:
        same = hashlib.sha256(path.read_bytes()).hexdigest() == sha256  # small files only
        return None if same else "its SHA-256 is not the official file's"
    with open(path, "rb") as f:
        head = f.read(SHARD_HEADER)
    if not head:
        return "an empty file"
    for start, kind in ((b"\x1f\x8b", "a gzip-compressed body"), (b"<", "an HTML or XML page")):
        if head.lstrip().startswith(start):  # a mirror's error page, or a body it compressed
            return kind
    if name.endswith(".zip"):  # text8.zip must hold text8, whole (testzip checks every CRC)
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip() if Path(name).stem in z.namelist() else "no " + Path(name).stem
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            bad = str(e)
        return bad and f"not a whole zip: {bad}"
    if name.endswith(".bin"):  # an llm.c shard: its header, then as many GPT-2 tokens as it says
        magic, version, n = np.frombuffer(head.ljust(SHARD_HEADER, b"\0"), dtype="<i4")[:3]
        if magic != SHARD_MAGIC or version != SHARD_VERSION or n <= 0:
            return "no llm.c shard header"
        if path.stat().st_size != SHARD_HEADER + 2 * int(n):
            return f"{path.stat().st_size} bytes, but its header says {n} tokens"
        top = np.memmap(path, dtype="<u2", mode="r", offset=SHARD_HEADER).max()
        return f"token id {top} is not a GPT-2 token" if top >= GPT2_VOCAB else None

# --- The datasets: (options, fetch) -> (meta.json's fields, {split: arrays of token ids}). ---
def _chunks(a):
    return (a[i:i + CHUNK] for i in range(0, len(a), CHUNK))

def _char_encoder(chars, default=-1):
    """text -> the id of each character, by a code point table (EOT has no single code point)."""
    lut = np.full(0x110000, default, dtype=np.int32)
    lut[[ord(c) for c in chars if len(c) == 1]] = [i for i, c in enumerate(chars) if len(c) == 1]
    return lambda text: lut[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]

def _char_meta(chars, **fields):
    dtype = "uint8" if len(chars) <= 256 else "uint16"
    return dict(level="char", dtype=dtype, vocab_size=len(chars), chars=chars, **fields)

def _by_position(ids):  # 90 / 5 / 5 % in order: text8's standard 90M / 5M / 5M
    a, b = len(ids) * 90 // 100, len(ids) * 95 // 100
    return dict(train=[ids[:a]], val=[ids[a:b]], test=[ids[b:]])

# demo: short stories from a small grammar, generated offline from a seed.
_NAMES = ("Lily:she Tom:he Mia:she Ben:he Sara:she Max:he Anna:she Leo:he Zoe:she Sam:he Emma:she "
          "Jack:he Lucy:she Finn:he Ruby:she Noah:he Ella:she Jake:he Amy:she Tim:he Rosa:she "
          "Omar:he Ivy:she Dan:he Nina:she Hugo:he Kate:she Ravi:he Maya:she Eli:he Lena:she "
          "Otto:he").split()
_WORDS = {k: v.split("|") for k, v in dict(
    place="park|forest|beach|garden|village|library|river|hill|market|farm|school|castle|lake|"
          "meadow|bakery|harbor|cave|zoo|field|kitchen|attic|bridge|mountain|island",
    object="red ball|kite|little boat|blue hat|shiny key|big book|drum|lantern|map|teddy bear|"
           "cake|basket|feather|smooth stone|shell|whistle|box|umbrella|apple|flower|toy car|rope|"
           "bell|ring|scarf|cup|paper star|letter",
    animal="cat|dog|bird|fox|rabbit|owl|frog|duck|bear|mouse|turtle|horse|lion|fish|bee|squirrel",
    adj="happy|tiny|brave|curious|sleepy|kind|shy|clever|silly|gentle|proud|quiet|friendly|busy|"
        "grumpy|bright|old|funny|lonely|little",
    feeling="happy|sad|scared|excited|surprised|tired|proud|worried|angry|calm",
    time="One sunny morning|One rainy day|One cold winter night|On a windy afternoon|Early one day|"
         "One warm summer evening|Long ago|Once upon a time",
    act="play in the sun|read books|sing songs|run fast|draw pictures|build sand castles|"
        "climb trees|bake cookies|dance|look at the stars|swim in the lake|ride a bike|"
        "pick flowers|fly a kite",
    rel="mom|dad|grandma|grandpa|little brother|big sister|dog|best friend",
    water="river|pond|lake|mud|well|sea", weather="rain|snow|get dark|blow hard",
    spot="bed|big rock|old tree|table|stairs|bench", trap="mud|hole|net|bush|fence|tall grass",
    lesson="share|be kind|tell the truth|help others|be patient|listen to mom|try again|say sorry",
).items()}
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
     "{He} shared {his} {object} with {F}, and they both laughed.", "They looked everywhere, and "
     "at last they found it under the {spot}.", "{N} was brave and helped the {animal}."],
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

def _demo(o, fetch):
    texts = demo_stories(o["seed"], o["demo_mb"])
    chars = sorted(set("".join(texts.values())))  # every split's: a rare 'Z' may be in val only
    meta = _char_meta(chars, source=f"generated (seed {o['seed']})")
    return meta, {split: [_char_encoder(chars)(text)] for split, text in texts.items()}

# text8: the first 10^8 bytes of cleaned Wikipedia, a-z and space.
def _text8(o, fetch):
    chars = list(" abcdefghijklmnopqrstuvwxyz")
    with zipfile.ZipFile(fetch("downloads/text8.zip", "http://mattmahoney.net/dc")) as z:
        # latin-1 reads any byte; one not in the vocabulary is id 255, which prepare refuses
        ids = _char_encoder(chars)(z.read("text8").decode("latin-1")).astype(np.uint8)
    return _char_meta(chars), _by_position(ids)

# textfile: a local UTF-8 file (docs/data.md, "Adding a dataset", walks through it).
def _textfile(o, fetch):
    try:
        text = Path(o["input"]).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--input {o['input']} is not UTF-8 text ({e.reason}, byte {e.start})")
    if not text:
        raise UsageError(f"--input {o['input']} is empty")
    chars = sorted(set(text))
    return _char_meta(chars, source=o["input"]), _by_position(_char_encoder(chars)(text))

# tinystories: character level, the vocabulary from train, read in chunks (train is ~2 GB).
def _read_chunks(path):  # whole lines, ~CHUNK bytes at a time: no piece cuts EOT in two
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        while lines := f.readlines(CHUNK):
            yield "".join(lines)

def _tinystories(o, fetch):
    prefix = "TinyStories-" if o["v1"] else "TinyStoriesV2-GPT4-"
    url = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main"
    paths = {s: fetch(f"downloads/{prefix}{name}.txt", url)
             for s, name in (("train", "train"), ("val", "valid"))}
    counts = np.zeros(0x110000, dtype=np.int64)
    for text in _read_chunks(paths["train"]):
        counts += np.bincount(np.frombuffer(text.replace(EOT, "").encode("utf-32-le"), np.uint32),
                              minlength=0x110000)
    least = max(1, o["min_per_million"] * counts.sum() / 1e6)  # small files keep ordinary ones
    counts[ord(REPLACEMENT)] = 0  # its own id, however common
    chars = [chr(c) for c in np.flatnonzero(counts >= least)] + [EOT, REPLACEMENT]
    rare = [chr(c) for c in sorted(np.flatnonzero((counts > 0) & (counts < least)),
                                   key=lambda c: -counts[c])]  # commonest first
    if rare:
        print(f"{len(rare)} rare characters become '\ufffd':", *map(repr, rare[:40]))
    encode, eot = _char_encoder(chars, len(chars) - 1), np.array([len(chars) - 2])

    def encoded(path):  # EOT between the stories of each chunk
        for text in _read_chunks(path):
            yield np.concatenate([x for story in text.split(EOT) for x in (eot, encode(story))][1:])
    return _char_meta(chars, replaced=rare), {split: encoded(p) for split, p in paths.items()}

# fineweb_edu: llm.c shards of GPT-2 tokens.
def _fineweb_edu(o, fetch):
    for name in ("encoder.json", "vocab.bpe"):  # next to the splits, not in downloads/: kept
        fetch(name, "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main")
    url = "https://huggingface.co/datasets/kjj0/finewebedu10B-gpt2/resolve/main"
    shards = ["val_000000", *(f"train_{i:06d}" for i in range(1, o["shards"] + 1))]
    val, *train = [np.memmap(fetch(f"downloads/finewebedu_{s}.bin", url), dtype="<u2", mode="r",
                             offset=SHARD_HEADER) for s in shards]
    # SPEC's split: val cut at its first EOT from the middle on (a document start), else mid-way
    hits = np.flatnonzero(val[len(val) // 2:] == GPT2_EOT)
    cut = len(val) // 2 + (int(hits[0]) if hits.size else 0)
    splits = dict(train=(c for s in train for c in _chunks(s)), val=_chunks(val[:cut]),
                  test=_chunks(val[cut:]))
    return dict(level="gpt2", dtype="uint16", vocab_size=GPT2_VOCAB), splits

Dataset = namedtuple("Dataset", "prepare help options")  # options ({name: Option}) decide the data
DATASETS = {
    "demo": Dataset(_demo, "generated stories, 2M characters, offline in ~1 s", {
        "seed": Option(1337, "generator seed", 0, 2 ** 63 - 1),
        "demo_mb": Option(2.0, "size in millions of characters", 0.001, 100)}),
    "text8": Dataset(_text8, "Wikipedia, 27 characters, 90M/5M/5M; a 31 MB zip", {}),
    "tinystories": Dataset(_tinystories, "children's stories, characters, train/val; 2.2 GB", {
        "v1": Option(False, "the V1 files (GPT-3.5 and GPT-4 stories) instead of V2 (GPT-4)"),
        "min_per_million": Option(0.5, "rarer characters per million become '\ufffd'", 0, 10**6)}),
    "fineweb_edu": Dataset(_fineweb_edu, "FineWeb-Edu in GPT-2 tokens, train/val/test; 200 MB a "
                           "shard", {"shards": Option(20, "100M-token train shards", 1, 99)}),
    "textfile": Dataset(_textfile, "a local UTF-8 text file, characters, 90/5/5 %", {
        "input": Option(None, "the file (out: data/<its stem>; a changed file is made anew)")}),
}

# --- The API train.py and sample.py use. ---
# The levels decoder and encoder know, and no other; each with the unit its loss is also given in
# (train.py's eval lines and summary, the report): bits per character, perplexity per GPT-2 token
LEVELS = {"char": ("bpc", lambda nats: nats / math.log(2)), "gpt2": ("ppl", math.exp)}

def prepared(name, out, meta, recorded):
    """True if out holds dataset `name` made with these options, every split whole (a damaged
    one: prepared anew). An option added since the folder was made counts at its default there,
    as the code ran then."""
    defaults = {k: opt.default for k, opt in DATASETS[name].options.items()}
    if not meta or meta.get("options") is None or {**defaults, **meta["options"]} != recorded:
        return False
    try:
        return all(open_split(out, split) is not None for split in load_meta(out)["splits"])
    except UsageError:
        return False

def prepare(name, out_dir=None, **options):
    """Prepare dataset `name` into out_dir (default data/NAME) by the rules of the top."""
    o, recorded = _options(name, options)
    out = Path(out_dir or Path("data") / Path(recorded.get("input") or name).stem)
    meta, progress = _read_json(out / "meta.json"), _read_json(out / "progress.json") or {}
    owner = (meta or progress).get("dataset")
    if owner not in DATASETS and out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} is not empty and holds no meta.json or progress.json of "
                         "prepare_data.py: give a new or empty folder with --out")
    if owner in DATASETS and owner != name:
        raise UsageError(f"{out} holds the {owner} dataset; prepare {name} in another --out folder")
    if prepared(name, out, meta, recorded):
        (out / "progress.json").unlink(missing_ok=True)  # of a run killed after meta.json
        print(f"{out} is already prepared")
        return out
    progress, sources = {"dataset": name, "options": recorded, "made": progress.get("made", [])}, []
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "progress.json", progress)  # first: from now on the folder is this job's
    (out / "meta.json").unlink(missing_ok=True)  # prepared anew: unfinished until rewritten

    def fetch(rel, official):  # a download into out/rel, from the official folder or --base_url
        sources.append(f"{o['base_url'] or official}/{Path(rel).name}")
        return _download(out, progress, o, rel, sources[-1])
    meta, splits = DATASETS[name].prepare(o, fetch)
    if meta["level"] not in LEVELS:
        raise ValueError(f"dataset {name} returns level {meta['level']!r}: use \"char\" "
                         "(Unicode characters) or \"gpt2\", or add one to LEVELS (with its unit), "
                         "decoder and encoder")
    meta = {"dataset": name, **meta, "source": meta.get("source", sources), "splits": {}}
    meta["sha256"] = {}  # each split's: what tells a run's text from other text (checkpoint.py)
    dtype = np.dtype(meta["dtype"])
    for split, chunks in splits.items():  # each written whole; its size says how many tokens
        path, digest = out / f"{split}.bin", hashlib.sha256()
        write_atomic(path, lambda f: f.writelines(_hashed(chunks, dtype, digest)))
        meta["splits"][split] = path.stat().st_size // dtype.itemsize
        meta["sha256"][split] = digest.hexdigest()
    for rel in [] if o["keep_downloads"] else progress["made"]:  # this job's downloads only
        if Path(rel).parent == Path("downloads"):
            (out / rel).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty yet, or holding something else
                (out / "downloads").rmdir()
    # every id in the vocabulary, checked once the downloads are deleted: the same command then
    # fetches again a file of the official size that holds other text (text8.zip: no SHA-256)
    for split in meta["splits"]:
        open_split(out, split, meta)
    write_json(out / "meta.json", {**meta, "format_version": FORMAT_VERSION, "options": recorded})
    (out / "progress.json").unlink()
    print(f"wrote {out}: {meta['splits']} tokens, vocab {meta['vocab_size']}")
    return out

def _hashed(chunks, dtype, digest):  # each chunk's bytes, added to digest as they are written
    for chunk in chunks:
        data = np.asarray(chunk, dtype).tobytes()
        digest.update(data)
        yield data

def _options(name, options):
    """(every option of the run, the options that decide the data), each checked."""
    if name not in DATASETS:
        raise UsageError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")
    own = DATASETS[name].options
    o = {k: opt.default for k, opt in {**RUN_OPTIONS, **own}.items()}
    for k, v in options.items():
        if k not in o:
            raise UsageError(f"--{k} does not apply to {name} (--help lists its options)")
        if v is not None:
            o[k] = os.fspath(v) if isinstance(v, Path) else v  # a path is recorded as a string
    for k, opt in {**RUN_OPTIONS, **own}.items():  # the flags' types are argparse's to check
        if o[k] is None and k in own:
            raise UsageError(f"{name} needs --{k} ({opt.help})")
        if opt.low is not None and not opt.low <= o[k] <= opt.high:  # nan and inf fail too
            raise UsageError(f"--{k} {o[k]}: must be from {opt.low} to {opt.high}")
    o["base_url"] = (o["base_url"] or os.environ.get("NANOROUTE_BASE_URL") or "").rstrip("/")
    backoff = os.environ.get("NANOROUTE_RETRY_BACKOFF") or "1"
    o["backoff"] = float(backoff) if re.fullmatch(r"\d+(\.\d*)?|\.\d+", backoff) else -1
    if not 0 <= o["backoff"] <= MAX_WAIT:
        raise UsageError(f"NANOROUTE_RETRY_BACKOFF={backoff}: give seconds from 0 to {MAX_WAIT}")
    recorded = {k: o[k] for k in own}
    if "input" in own:  # a local file is recorded by its content: a changed file is made anew
        recorded["sha256"] = hashlib.sha256(Path(o["input"]).read_bytes()).hexdigest()
    return o, recorded

def _read_json(path):  # None if missing, unreadable or not an object
    with contextlib.suppress(OSError, ValueError):
        obj = json.loads(path.read_text(encoding="utf-8"))
        return obj if isinstance(obj, dict) else None

def _command(folder, name=None, options=None):
    """The command that prepares folder as dataset `name` (a placeholder if None)."""
    if name not in DATASETS:
        return f"python prepare_data.py DATASET --out {folder} (DATASET: {', '.join(DATASETS)})"
    options, words = options if isinstance(options, dict) else {}, ["python prepare_data.py", name]
    for k, opt in DATASETS[name].options.items():
        v = options.get(k, opt.default)
        words += [] if v == opt.default or v is False else [f"--{k}" if v is True else f"--{k} {v}"]
    return " ".join(words + [f"--out {folder}"])

def dataset_folder(name):
    """--data as a folder: a bare NAME is ./NAME if that is a prepared dataset, else data/NAME."""
    bare = len(Path(name).parts) == 1 and not (Path(name) / "meta.json").exists()
    return Path("data") / name if bare else Path(name)

def load_meta(folder):
    """folder/meta.json, checked for what train.py and sample.py read; UsageError names the fix."""
    folder = Path(folder)
    path = folder / "meta.json"
    if not path.exists():  # the command that prepares it, and the prepared folders nearby
        progress = _read_json(folder / "progress.json") or {}
        what = "is not a finished dataset (no meta.json)" if folder.exists() else "does not exist"
        near = sorted({str(p.parent) for d in {Path("data"), folder.parent}
                       for p in d.glob("*/meta.json")})
        found = f"; prepared datasets: {', '.join(near)}" if near else ""
        fix = _command(folder, progress.get("dataset", folder.name), progress.get("options"))
        raise UsageError(f"data folder {folder} {what}{found}; to prepare it there, run: {fix}")
    meta = _read_json(path) or {}
    need = dict(dataset=str, level=str, dtype=str, vocab_size=int, splits=dict,
                **({"chars": list} if meta.get("level") == "char" else {}))
    wrong = [f'no "{k}" {t.__name__}' for k, t in need.items() if type(meta.get(k)) is not t]
    wrong += [] if meta.get("dtype") in ("uint8", "uint16") else ['no "dtype" uint8 or uint16']
    wrong += [] if meta.get("level") in LEVELS else [f'"level" not one of {", ".join(LEVELS)}']
    if wrong:
        fix = _command(folder, meta.get("dataset"), meta.get("options"))
        raise UsageError(f"{path} is damaged ({wrong[0]}); prepare it again: {fix}")
    return meta

def open_split(folder, split, meta=None):
    """One split as a read-only np.memmap, checked: its size, and every id below vocab_size."""
    folder = Path(folder)
    meta = meta or load_meta(folder)
    if split not in meta["splits"]:
        raise UsageError(f"{folder} has no '{split}' split (it has: {', '.join(meta['splits'])})")
    path, n, dtype = folder / f"{split}.bin", meta["splits"][split], meta["dtype"]
    size = path.stat().st_size if path.exists() else None
    fix = f"prepare it again: {_command(folder, meta['dataset'], meta.get('options'))}"
    if size != n * np.dtype(dtype).itemsize:
        raise UsageError(f"{path} holds {size or 0} bytes, not {n} tokens of {dtype}; {fix}")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    top = max((int(c.max()) for c in _chunks(tokens)), default=-1)
    if top >= meta["vocab_size"]:
        raise UsageError(f"{path} holds token id {top}, but vocab_size is {meta['vocab_size']}: "
                         f"it is not this dataset's; {fix}")
    return tokens

def _gpt2_table(folder):
    """{id: bytes} from the folder's encoder.json (its ids are also GPT-2's BPE merge ranks)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in bs]  # shown as the characters from chr(256) on
    byte_of = {chr(c): b for b, c in zip(bs + others, bs + list(range(256, 256 + len(others))))}
    try:
        vocab = json.loads((Path(folder) / "encoder.json").read_text(encoding="utf-8"))
        return {i: bytes(byte_of[c] for c in token) for token, i in vocab.items()}
    except (ValueError, KeyError, AttributeError):
        raise UsageError(f"{folder}/encoder.json is not GPT-2's: prepare the folder again, "
                         f"{_command(folder, 'fineweb_edu')}") from None

def decoder(meta, folder):
    """ids -> text. Ids outside the vocabulary (a padded model head) decode to '\ufffd'."""
    if meta["level"] == "char":
        c = meta["chars"]
        return lambda ids: "".join(c[i] if 0 <= i < len(c) else REPLACEMENT for i in map(int, ids))
    table = _gpt2_table(folder)  # byte-level BPE decodes without tiktoken: join the bytes
    unknown = REPLACEMENT.encode()
    return lambda ids: b"".join(table.get(int(i), unknown) for i in ids).decode("utf-8", "replace")

def encoder(meta, folder):
    """text -> ids. Char level: UsageError names the characters outside the vocabulary."""
    if meta["level"] == "gpt2":
        try:
            import tiktoken  # noqa: PLC0415 (optional: only GPT-2 level prompts need it)
        except ImportError:
            raise UsageError("a GPT-2 prompt needs tiktoken: pip install tiktoken") from None
        ranks = {b: i for i, b in _gpt2_table(folder).items() if i != GPT2_EOT}
        enc = tiktoken.Encoding(name="gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                special_tokens={EOT: GPT2_EOT})
        return lambda text: enc.encode(text, allowed_special={EOT})
    index = {c: i for i, c in enumerate(meta["chars"])}

    def encode(text):  # EOT typed in a prompt is its one symbol
        pieces = [p for p in re.split(f"({re.escape(EOT)})", text) if p]
        missing = sorted({c for p in pieces if p not in index for c in p if c not in index})
        if missing:  # tinystories' rare ones are in meta.json's "replaced"
            raise UsageError(f"characters not in the {meta['dataset']} vocabulary: "
                             f"{' '.join(map(repr, missing))}; remove or replace them")
        return [i for p in pieces for i in ([index[p]] if p in index else map(index.get, p))]
    return encode

# --- Command line: a flag for every option of RUN_OPTIONS and DATASETS. ---
@functools.partial(cli, again="the same command keeps what is done and resumes a download")
def main(argv=None):
    listing = "\n".join(f"  {name:<12} {d.help}" for name, d in DATASETS.items())
    p = ArgumentParser(description="Prepare a dataset folder for train.py.", epilog="datasets:\n"
                       + listing, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="dataset: " + ", ".join(DATASETS))
    p.add_argument("--out", type=folder_name, help="output folder (default: data/NAME)")
    owners = {}  # flag -> the datasets that take it (two datasets may share an --input)
    for owner, opts in [("", RUN_OPTIONS)] + [(n, d.options) for n, d in DATASETS.items()]:
        for k, opt in opts.items():
            owners.setdefault(k, (opt, []))[1].append(owner)
    for k, (opt, names) in owners.items():
        rng = f" (default {opt.default}, {opt.low} to {opt.high})" if opt.high else ""
        kind = str if opt.default is None else type(opt.default)
        how = dict(action="store_true") if kind is bool else dict(type=kind)
        owner = ", ".join(names) + ": " if any(names) else ""
        p.add_argument(f"--{k}", default=None, help=owner + opt.help + rng, **how)
    args = p.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if v is not None and k not in ("name", "out")}
    prepare(args.name, args.out, **options)

if __name__ == "__main__":
    sys.exit(main())
