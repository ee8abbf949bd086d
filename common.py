"""
What every script shares: its one error line, its parser, and whole-file writes. A user's mistake is
one UsageError, printed by cli as one `error:` line, exit code 2; flags are never abbreviated
(ArgumentParser); a folder or file flag is never empty (folder_name, file_name); a count of tokens
reads 2B or 500M (count); a command printed for the user pastes into a shell (command); every file
is written whole or not at all (write_atomic). One small module, so that every script takes these
rules from one place and prepare_data.py holds only data.
"""

import argparse
import contextlib
import ctypes
import difflib
import functools
import json
import os
import platform
import re
import shlex
import sys
import tempfile
from pathlib import Path

class UsageError(Exception):
    """A problem the user can fix; its message says what failed and what to do."""

def cli(main, again=None):
    """main(argv=None) as a command: a UsageError or OSError is one `error:` line, exit code 2.
    again: what the same command does once more after a Ctrl-C, where it continues the work."""
    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(argv)
        except UsageError as e:
            message = str(e)
        # a full disk, a permission, a missing file: the user's to fix; other errors are bugs
        # and keep their traceback
        except OSError as e:
            message = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
        # Ctrl-C: one line, no traceback; 130 = 128 + SIGINT, as a shell reports it
        except KeyboardInterrupt:
            print("error: interrupted" + (f"; {again}" if again else ""), file=sys.stderr)
            sys.exit(130)
        # one line even when the message holds newlines
        print("error: " + " ".join(message.split()), file=sys.stderr)
        sys.exit(2)
    return run

# Names a user may bring from nanoGPT or habit, and this project's flag for each ("did you mean").
FLAG_SYNONYMS = {"learning_rate": "lr", "block_size": "sequence_len", "context_len": "sequence_len",
                 "n_layers": "n_layer", "n_heads": "n_head", "d_model": "n_embd",
                 "gradient_accumulation_steps": "grad_accum", "max_steps": "max_iters",
                 "iters": "max_iters", "out": "out_dir"}
# not nanoGPT's init_from: its checkpoint path (a fine-tune) is not what --resume does

class ArgumentParser(argparse.ArgumentParser):
    """argparse without abbreviations; a bad flag is one `error:` line naming the nearest flag."""

    def __init__(self, *args, **kwargs):
        # no abbreviations: --warm for --warmup_iters would break once another flag starts alike
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        wrong = re.search(r"unrecognized arguments: --?([\w-]+)", message)
        # the subcommands' flags too (experiments.py): the hint may name any of them
        parsers = [self] + [p for a in self._actions if isinstance(a, argparse._SubParsersAction)
                            for p in a.choices.values()]
        flags = {o[2:] for p in parsers for a in p._actions for o in a.option_strings
                 if o.startswith("--")}
        # a synonym counts only where its flag exists in this parser
        known = {f: f for f in flags} | {k: v for k, v in FLAG_SYNONYMS.items() if v in flags}
        close = difflib.get_close_matches(wrong[1], known, n=1, cutoff=0.7) if wrong else []
        hint = f" (did you mean --{known[close[0]]}?)" if close else ""
        self.exit(2, f"error: {message}{hint}; see --help\n")

def is_number(value):  # a number to log or tabulate: not a bool, which isinstance calls an int
    return isinstance(value, (int, float)) and not isinstance(value, bool)

def count(text):
    """Token counts: '2B' -> 2_000_000_000 (also M, K, plain integers); '1M,2M' -> a list."""
    if "," in str(text):
        return [count(part) for part in text.split(",")]
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmb]?)\s*", str(text), re.I)
    if not m:
        raise ValueError(f"{text!r} is not a token count such as 2B, 500M, 64K or 10000")
    # round, not int: 2.01 x 1e3 is 2009.999... in floating point
    return int(round(float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m[2].lower()]))

def true_or_false(text):  # an argparse type= for a bool flag: True/False/1/0
    if text.lower() not in ("true", "1", "false", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")

def command(script, flags, world=1):
    """A command line that works when pasted into a shell: each argument quoted where needed."""
    # --: keeps torchrun off the script's flags (train.py drops it)
    launcher = ["torchrun", f"--nproc_per_node={world}", script, "--"] if world > 1 else \
        ["python", script]
    return shlex.join([*launcher, *map(str, flags)])

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: a written file gets the mode any new file would (mkstemp's is 0600)

def folder_name(text):  # an argparse type=: '' or blanks would name the working folder
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give a folder name")
    return text

def file_name(text):  # folder_name's twin for a file flag: '' or blanks would name no file
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give a file name")
    return text

def leftover(name):
    """The glob pattern of what a kill inside write_atomic leaves of a file `name`: its temporary
    file, mkstemp's 8 random characters between write_atomic's prefix and suffix."""
    return f".{name}.????????.tmp"

def write_atomic(path, data):
    """Write `data` (bytes, or a function writing to a binary file) to path whole or not at all."""
    path = Path(path)
    # in the target's folder: os.replace is atomic within one file system only
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            # on disk before the rename: a crash never leaves the new name on missing data
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    # BaseException: a Ctrl-C mid-write removes the temporary file too
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

def own_file(path, ours, fix="give another path"):
    """An output path that may be written: new, or a file this script wrote before (ours(its text)
    is true). Anything else there, a user's file, is refused, not written over."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path} is a folder: give a file name")
    if path.exists() and not ours(path.read_text(encoding="utf-8", errors="replace")):
        raise UsageError(f"{path} exists and is not a file this script wrote: {fix} (it is not "
                         "written over)")
    return path

def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False).encode() + b"\n")

def keep_freed_memory():
    """Linux with glibc: the memory a training step frees stays in the process for the next step.
    By default glibc gives freed blocks of a few MB back to the system, and the next step maps
    them again, a page fault every 4 KB: a routed step frees more such blocks than PreNorm's and
    paid ~2 µs a fault (docs/speed.md). Left alone where the environment sets glibc's malloc
    (MALLOC_*, GLIBC_TUNABLES). Returns whether it applied: False elsewhere (macOS, musl)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name.startswith("MALLOC_") or name == "GLIBC_TUNABLES" for name in os.environ):
        return False
    libc = ctypes.CDLL(None)  # the C library this process runs on
    # mallopt (1: done): M_MMAP_THRESHOLD (-3) 32 MB, glibc's largest: a smaller block comes from
    # the heap, not mapped apart; M_TRIM_THRESHOLD (-1) its largest: the heap is not given back
    return libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 2**31 - 1) == 1
