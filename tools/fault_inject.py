"""
Fault injection: does the test suite notice small, realistic bugs in nanoroute's scripts?

    python tools/fault_inject.py                     # every fault, one at a time (long: one suite run each)
    python tools/fault_inject.py --jobs 2            # two faults at a time
    python tools/fault_inject.py --only train.py     # the faults of one file
    python tools/fault_inject.py --list              # print the faults, run nothing
    python tools/fault_inject.py --match "learned"   # the faults whose description says "learned"

For each fault it copies the repository's git-tracked files (as they are in the working tree) to a
temporary folder, applies that one edit, and runs the README's test command there, stopping at the
first failure: python -m pytest -q -x -p no:cacheprovider. A failing suite kills the fault; a passing
one lets it survive. To stop sooner, a small plugin runs the test sections nearest the edited file
first (train.py: "Training and sampling", then "Bad input", then the rest); every test still runs
unless one fails, so a fault is killed exactly when the suite in its usual order would fail.
A fault whose old snippet is not found exactly once is reported as stale (the code moved on: refresh
the snippet) and not counted. The unmodified copy is run first: if it fails, the counts mean nothing
and the tool says so. Prints killed/total per file and every survivor.
Exit code 0, except 2 for bad usage. This script is a tool for the tests, not part of the package.
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "_fault_order"]

# the sections of test_nanoroute.py (the words after "# " in their header lines) to run first, per file
SECTIONS_FIRST = {"nanoroute.py": ["Model"], "prepare_data.py": ["Data", "Training"],
                  "train.py": ["Training", "Bad input"], "sample.py": ["Training", "Bad input"],
                  "experiments.py": ["Experiments"], "bench.py": ["Benchmark"]}
# the plugin, written next to the copy's tests: reorders the collected tests, changes nothing else
ORDER_PLUGIN = """
import os, re

def pytest_collection_modifyitems(session, config, items):
    first = [s for s in os.environ.get("FAULT_SECTIONS_FIRST", "").split(",") if s]
    headers = {}  # test file -> [(line, section)]

    def rank(item):
        path, line = str(item.fspath), item.location[1]
        if path not in headers:
            text = open(path, encoding="utf-8").read().splitlines()
            headers[path] = [(i, t[2:]) for i, t in enumerate(text) if re.match(r"# [A-Z][a-z]+( [a-z]+)*:", t)]
        section = next((s for i, s in reversed(headers[path]) if i <= line), "")
        return next((k for k, f in enumerate(first) if section.startswith(f)), len(first))
    items[:] = sorted(items, key=rank)  # stable: the usual order inside each group
"""

# (file, old snippet, new snippet, what the fault does). Each is one small edit a person could make.
FAULTS = [
    # --- train.py: data, losses, accumulation, checkpoints, resume, DDP
    ("train.py", "np.random.default_rng([seed, step, micro])", "np.random.default_rng([seed, step, 0])",
     "every micro-step of a step reads the same crops"),
    ("train.py", "data[o + 1:o + 1 + T] for o in offsets", "data[o:o + T] for o in offsets",
     "targets are the inputs, not shifted by one"),
    ("train.py", "val_loss = evaluate(run.model, run.val_data, run.val_batches",
     "val_loss = evaluate(run.model, run.train_data, run.val_batches",
     "the logged val loss is measured on training text"),
    ("train.py", "test_loss = evaluate(run.model, test_data,", "test_loss = evaluate(run.model, run.val_data,",
     "the final test loss is measured on the val split"),
    ("train.py", "(loss / a.grad_accum).backward()", "loss.backward()",
     "gradient accumulation sums instead of averaging"),
    ("train.py", "loss = loss_sum / a.grad_accum", "loss = loss_sum",
     "the logged train loss is the sum over micro-steps"),
    ("train.py", "improved, run.best_val = val_loss < run.best_val,",
     "improved, run.best_val = val_loss != run.best_val,",
     "best.pt is overwritten by any different val loss, worse too"),
    # survives, harmlessly: --resume also takes best.pt's best_val_loss (the lower of the two), so
    # forgetting last.pt's copy changes nothing while best.pt exists, and it is written first
    ("train.py", 'run.best_val = ckpt["best_val_loss"]', "run.best_val = math.inf",
     "--resume forgets the best val loss"),
    ("train.py", 'torch.set_rng_state(states[run.rank]["torch"])', 'torch.set_rng_state(states[0]["torch"])',
     "every process resumes with rank 0's dropout RNG"),
    ("train.py", "    model.eval()\n    losses = []", "    losses = []",
     "evaluation runs with dropout on"),
    ("prepare_data.py", "f = _new_temp_file(path)", 'f = open(path, "wb")',
     "checkpoints, metrics and data are written in place, not to a temporary file renamed when complete"),
    ("train.py", 'if json.loads(line.decode("utf-8"))["step"] <= step:',
     'if json.loads(line.decode("utf-8"))["step"] < step:',
     "resume drops the log line of the checkpoint's own step"),
    ("train.py", "return a.lr * (step + 1) / a.warmup_iters", "return a.lr * step / a.warmup_iters",
     "warmup starts at lr 0 (off by one)"),
    ("train.py", "if before < n <= now]", "if before < n < now]",
     "a milestone hit exactly by a step is missed"),
    ("train.py", "        dist.all_reduce(loss)  # equal shares: the mean of the means is the global mean\n"
                 "        loss /= world", "        dist.all_reduce(loss)",
     "the DDP evaluation loss is the sum over processes"),
    ("train.py", "rows[run.rank::run.world]", "rows[:a.batch_size // run.world]",
     "every DDP process trains on the same rows"),
    ("train.py", 'if ckpt is not None and ckpt["config"]["vocab_size"] != meta["vocab_size"]:',
     "if False:", "--resume with another dataset's vocabulary is not caught"),

    # --- train.py: [outside] faults, designed from the docs, --help and the module by a reviewer who had
    # not read the tests
    ('train.py', '    if step < a.warmup_iters:\n',
     '    if step <= a.warmup_iters:\n',
     'warmup off by one: --warmup_iters 0 (allowed) crashes with ZeroDivisionError; with warmup 20'
     ' the lr of step 21 overshoots --lr [outside]'),
    ('train.py', 'max(1, max_iters - 1 - a.warmup_iters)',
     'max(1, max_iters - a.warmup_iters)',
     'the cosine no longer reaches --min_lr at the last step (--help/docs promise it): the last '
     "train line's lr is above min_lr [outside]"),
    ('train.py', '    if a.grad_clip > 0:\n',
     '    if a.grad_clip >= 0:\n',
     "--grad_clip 0 (documented 'off') clips every gradient to norm 0: the weights only decay, the"
     ' loss does not go down [outside]'),
    ('train.py', 'math.ceil(a.max_tokens / tokens_per_step)',
     'a.max_tokens // tokens_per_step',
     '--max_tokens rounds the step count down, not up (docs: ceil): 5000 tokens at 4,096 per step '
     'trains 1 step, not 2 [outside]'),
    ('train.py', 'if run.step % a.log_interval == 0 or run.step == 1:',
     'if run.step % a.log_interval == 0:',
     'no train line at step 1 (stdout and metrics.jsonl) unless --log_interval is 1 (docs: every '
     '--log_interval steps and at step 1) [outside]'),
    ('train.py', 'if before < n <= now]',
     'if before <= n < now]',
     "a milestone exactly on a step's token count is evaluated one step late; summary.json's "
     'milestones record the wrong step/tokens [outside]'),
    ('train.py', '["step"] <= step:',
     '["step"] < step:',
     "on --resume metrics.jsonl loses the eval line of the checkpoint's own step (docs: keeps the "
     'lines up to it) [outside]'),
    ('train.py', 'f.name not in ("out_dir", "preset", "resume", "stop_after")',
     'f.name not in ("out_dir", "preset", "resume", "stop_after", "dtype")',
     'the continue-with command (--stop_after / Ctrl-C) drops a given --dtype, which --resume does'
     ' not restore: pasted, it resumes in another precision [outside]'),
    ('train.py', 'return shlex.join([*launcher, *map(str, flags)])',
     'return " ".join([*launcher, *map(str, flags)])',
     'printed commands (next:, continue with:) are not shell-quoted: an --out_dir with a space '
     'breaks when pasted [outside]'),
    ('train.py', '"stop_after", "wandb_run"}',
     '"stop_after", "wandb_run", "seed"}',
     'the baseline command after next: drops a non-default --seed, so it is not paired with the '
     'run [outside]'),
    ('train.py', '    defaults["eval_tokens"] = default_eval_tokens(config.vocab_size, device)  # what it gets unasked\n',
     '',
     'the baseline command after next: always carries --eval_tokens 32768 (the resolved default) '
     'even when none was given [outside]'),
    ('train.py', 'if a.stop_after is not None and a.stop_after <= run.step',
     'if a.stop_after is not None and a.stop_after < run.step',
     "--stop_after N stops after step N+1, not N: 'stopped after step 31' for --stop_after 30 and "
     'last.pt holds step 31 [outside]'),
    ('train.py', '<= run.step < a.max_iters:',
     '<= run.step:',
     "--stop_after at or beyond --max_iters stops the run at its last step with 'stopped after', "
     'no summary.json or routing summary [outside]'),
    ('train.py', 'test_bpc=bpc(test_loss))',
     'test_bpc=bpc(val_loss))',
     "summary.json's final.test_bpc is the val bpc (copy-paste), not test_loss / ln 2 [outside]"),
    ('train.py', 'device.type == "cpu" and vocab_size > LARGE_VOCAB',
     'device.type == "cpu" or vocab_size > LARGE_VOCAB',
     'default --eval_tokens on CPU at char level (demo, vocab 53) is 8,192, not 32,768 [outside]'),
    ('train.py', 'if text.lower() in ("true", "1", "yes"):',
     'if text.lower() in ("true", "yes"):',
     'bool flags reject 1: --wav 1 / --resume 1 is an error, though docs and the --help epilog say'
     ' they take 1/0 [outside]'),
    ('train.py', '+ ("  ..." if len(read["sources"]) > top else ""))',
     '+ ("  ..." if len(read["sources"]) >= top else ""))',
     "the end-of-run routing summary marks reads with exactly 3 sources with '...' (README's "
     'layer1.mlp line shows none) [outside]'),
    ('train.py', 'run.wall_before, run.reached = ckpt.get("wall_time_s", 0.0), ckpt.get("milestones", {})',
     'run.wall_before, run.reached = ckpt.get("wall_time_s", 0.0), {}',
     'a resumed run forgets the milestones reached before the checkpoint: summary.json holds only '
     'those crossed after --resume [outside]'),
    ('train.py', '    cleanup.callback(release)\n',
     '',
     'OUT_DIR/train.lock is left behind after every run (docs: only while a run writes there); the'
     " next --resume says 'taking over' [outside]"),
    ('train.py', '        settings["max_tokens"] = None  # an explicit',
     '        pass  # an explicit',
     "an explicit --max_iters no longer beats a checkpoint's or preset's --max_tokens: resuming "
     'with --max_iters 800 does not extend the schedule [outside]'),

    # --- sample.py
    ("sample.py", "    torch.manual_seed(a.seed)\n", "", "--seed is ignored"),
    ("sample.py", "ids = ids[-config.sequence_len:]", "ids = ids[:config.sequence_len]",
     "a long prompt keeps its start, not its end"),
    ("sample.py", "model.to(device).eval()", "model.to(device)", "generation runs with dropout on"),
    ("sample.py", "a.max_new_tokens, a.temperature, a.top_k)", "a.max_new_tokens, a.temperature, None)",
     "--top_k is ignored"),
    ("sample.py", "a.max_new_tokens, a.temperature, a.top_k)", "a.max_new_tokens, 1.0, a.top_k)",
     "--temperature is ignored"),
    ("sample.py", "if not (MIN_TEMPERATURE <= a.temperature < math.inf):",
     "if not (0 <= a.temperature < math.inf):", "--temperature 0 is not refused"),
    ("sample.py", 'if meta["vocab_size"] != config.vocab_size:', "if False:",
     "a dataset with another vocabulary is not refused"),

    # --- prepare_data.py: downloads, verification, splits, decoding
    ("prepare_data.py", "if size is not None and path.stat().st_size != size:",
     "if size is not None and path.stat().st_size < size:", "a pinned file longer than the pin is accepted"),
    ("prepare_data.py", "if h.hexdigest() != sha256:", "if h.hexdigest() == sha256:", "the sha256 check is inverted"),
    ("prepare_data.py", "check = lambda path: _check_known(path, url) or (verify(path) if verify else None)",
     "check = lambda path: verify(path) if verify else None", "pinned sizes and hashes are never checked"),
    ("prepare_data.py", "    why = check(part)\n    if why:\n        part.unlink()",
     "    os.replace(part, dest)\n    part = dest\n    why = check(part)\n    if why:\n        part.unlink()",
     "a download is renamed to its final name before it is verified"),
    ("prepare_data.py", "have = 0  # the server ignored our Range", "pass  # the server ignored our Range",
     "a server that ignores Range gets its file appended to the partial one"),
    ("prepare_data.py", 'headers.update({"Range": f"bytes={have}-"} if have else {})',
     'headers.update({"Range": f"bytes={have + 1}-"} if have else {})', "a resumed download skips a byte"),
    # survives with urllib3 2, which raises on a body shorter than Content-Length before this check runs;
    # the check is what catches a cut connection under urllib3 1.x (requests allows both)
    ("prepare_data.py", "if length >= 0 and part.stat().st_size != have + length:", "if False:",
     "a connection closed early is not noticed"),
    ("prepare_data.py", "for attempt in range(retries + 1):", "for attempt in range(retries):",
     "one try fewer than --retries promises"),
    ("prepare_data.py", "        stories, n = [], 0", "        rng, stories, n = random.Random(seed), [], 0",
     "each demo split restarts the generator: val and test repeat train's stories"),
    ("prepare_data.py", "parts = dict(train=ids[:a], val=ids[a:b], test=ids[b:])",
     "parts = dict(train=ids[:a], val=ids[b:], test=ids[a:b])", "text8's val and test are swapped"),
    ("prepare_data.py", "return i + int(hits[0])", "return i + int(hits[0]) + 1",
     "fineweb's val/test cut is one token after the document boundary"),
    ("prepare_data.py", "and all(open_split(out, s, meta) is not None for s in meta[\"splits\"]))", ")",
     "a folder with a damaged split counts as finished"),
    ("prepare_data.py", "    if size != want:", "    if size is None:", "a split of the wrong size is read"),
    ("prepare_data.py",
     'return lambda ids: b"".join(table.get(int(i), unknown) for i in ids).decode("utf-8", "replace")',
     'return lambda ids: "".join(table.get(int(i), unknown).decode("utf-8", "replace") for i in ids)',
     "GPT-2 tokens are decoded one by one: characters split over tokens break"),

    # --- prepare_data.py: only what the project made is deleted or overwritten, no write follows a
    # link, every input checked where it enters, downloads say what they do (issues 20-22, 24)
    ("prepare_data.py", "_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW",
     "_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC", "a temporary file is written through a planted link"),
    ("prepare_data.py", "os.open(name, _NEW_FILE, 0o666)", "os.open(name, _NEW_FILE, 0o600)",
     "written files get mode 0600 (mkstemp's), not an ordinary file's"),
    ("prepare_data.py", "    except BaseException:\n        tmp.unlink(missing_ok=True)\n        raise",
     "    except BaseException:\n        raise", "a failed write leaves its temporary file behind"),
    ("prepare_data.py", "    if part.is_symlink():\n        raise UsageError",
     "    if False:\n        raise UsageError", "a link planted at NAME.part is met only by O_NOFOLLOW's bare OSError"),
    ("prepare_data.py", "if made_as is None and any(not _is_temp(p.name) for p in out.iterdir()):",
     "if False:", "a folder of someone else's files is prepared into (train.bin overwritten)"),
    ("prepare_data.py", "if made_as is None and any(not _is_temp(p.name) for p in out.iterdir()):",
     "if made_as is None and any(out.iterdir()):", "a run killed in its first write makes its folder foreign"),
    ("prepare_data.py", "    if made_as not in (None, name):", "    if False:",
     "a folder holding another dataset is prepared over"),
    ("prepare_data.py", "    for rel in made:\n", '    for rel in made + [f"downloads/{p.name}" for p in (out / "downloads").glob("*")]:\n',
     "clean-up deletes every file in downloads/, not only the recorded downloads"),
    ("prepare_data.py", 'pattern = r"downloads(/[\\w+-][\\w.+-]*)?"', 'pattern = r".+"',
     "a forged record makes clean-up delete files outside downloads/"),
    ("prepare_data.py", "if any(p.exists() or p.is_symlink() for p in (dest, dest.with_name(name + \".part\"))):",
     "if False:", "a file under a download's name that the records do not list is used (and may be deleted)"),
    ("prepare_data.py", "    if folder.is_symlink():\n        raise UsageError", "    if False:\n        raise UsageError",
     "downloads are written into a folder that is a planted link"),
    ("prepare_data.py", "    if path.exists() and not _is_progress(state):", "    if False:",
     "someone else's progress.json is overwritten"),
    ("prepare_data.py", 'if [p.name for p in out.iterdir()] == ["progress.json"]:', "if False:",
     "a failed first download leaves data/NAME/ with a lone progress.json"),
    ("prepare_data.py", "                folder.rmdir()", "                pass",
     "a failed first download leaves the empty folders it made"),
    ("prepare_data.py", '_remove_downloads(out, _valid_made(meta.get("made")) + ', "_remove_downloads(out, [] + ",
     "downloads kept by --keep_downloads are never deleted by a later run"),
    ("prepare_data.py", '"vocab_size": (lambda v: type(v) is int and 1 <= v <= 65536,', '"vocab_size": (lambda v: True,',
     "meta.json's vocab_size is not checked (a string reaches the model)"),
    ("prepare_data.py", 'if meta["level"] == "char" and not (_strings(chars) and len(chars) == meta["vocab_size"]):',
     'if meta["level"] == "char" and not len(chars or ()) == meta["vocab_size"]:',
     "meta.json's chars may be integers (sample.py's decoder fails)"),
    ("prepare_data.py", '"splits": (lambda v: isinstance(v, dict) and all(s in SPLITS and type(n) is int and n >= 0',
     '"splits": (lambda v: isinstance(v, dict) and all(s in SPLITS',
     "meta.json's token counts are not checked"),
    ("prepare_data.py", 'ok = ok and strings(state["chars"]) and strings(state.get("replaced"))', "ok = ok",
     "a damaged progress.json is trusted (tinystories' vocabulary of the wrong type)"),
    ("prepare_data.py", "return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, h.hexdigest()[:16]]",
     "return [stat.st_size, stat.st_mtime_ns]", "the token check's cache trusts a copy with the same size and mtime"),
    ("prepare_data.py", 'if not 0 <= value <= LIMITS["backoff"][2]:', "if False:",
     "NANOROUTE_RETRY_BACKOFF=-1 or abc is not refused"),
    ("prepare_data.py", "if k in o and not (number and low <= v <= high):", "if k in o and not (number and low <= v):",
     "no upper limits: --demo_mb 1e9 or --retries 1000000 runs for hours"),
    ("prepare_data.py", "        if k in o and not isinstance(o[k], bool):", "        if False:",
     "prepare(keep_downloads='yes') is taken as a switch"),
    ("prepare_data.py", "import numpy as np\n\n# requests", "import numpy as np\nimport requests\n\n# requests",
     "training and sampling import requests"),
    ("prepare_data.py", 'f"({_mirror_hint(url)})", flush=True)', 'f"({_mirror_hint(url)})", file=sys.stderr, flush=True)',
     "the retry lines go to stderr, where a failure promises one line"),
    ("prepare_data.py", 'f"{_mirror_hint(url)}, then re-run (the download resumes)"',
     '"check the network, then re-run (the download resumes)"', "the last download error does not name --base_url"),
    ("prepare_data.py", "wait = min(backoff * 2 ** attempt, MAX_WAIT)", "wait = min(backoff, MAX_WAIT)",
     "the wait between retries does not double"),
    ("prepare_data.py", "        why = check(dest)\n        if why is None:\n            return dest",
     "        return dest", "a finished download damaged since is used as it is"),
    ("prepare_data.py", "return n is not None and path.exists() and path.stat().st_size == n * np.dtype(dtype).itemsize",
     "return n is not None and path.exists()", "a resumed run counts a truncated split as done"),
    ("prepare_data.py", "k = next((k for k in range(len(EOT) - 1, 0, -1) if text.endswith(EOT[:k])), 0)", "k = 0",
     "a chunk boundary inside <|endoftext|> splits the marker"),
    ("prepare_data.py", "return i + int(hits[0])", "return mid + int(hits[0])",
     "fineweb's cut is wrong when the boundary lies past the first chunk"),
    ("prepare_data.py", "if total.isdigit() and int(total) == have:", "if total.isdigit():",
     "a partial file longer than the remote one is taken as whole"),
    ("prepare_data.py", 'if r.status_code == 206 and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):',
     "if False:", "a 206 of another range than asked is appended"),
    ("prepare_data.py", "with _one_at_a_time(out):", "with contextlib.nullcontext():",
     "two runs preparing one folder at once delete each other's files (a sweep's first runs on the demo)"),
    ("prepare_data.py", "tokens_ok = vocab and all(type(i) is int and all(c in byte_of for c in t) for t, i in vocab.items())",
     "tokens_ok = vocab", "a damaged encoder.json fails with a traceback"),

    # --- experiments.py: statistics of the report, the sweep
    ("experiments.py", "wins=sum(d < 0 for d in diffs)", "wins=sum(d <= 0 for d in diffs)", "a tie counts as a win"),
    ("experiments.py", "statistics.stdev(values) if len(values) > 1", "statistics.pstdev(values) if len(values) > 1",
     "population instead of sample standard deviation"),
    ("experiments.py", "and not name.endswith(\".v\")]", "]", "RD's value reads enter the route entropy"),
    ("experiments.py", '*(["--resume"] if resume else [])', "*([])", "an interrupted run is restarted, not resumed"),
    ("experiments.py", "(lambda v: v / math.log(2)) if level == \"char\"", "(lambda v: v / math.log(10)) if level == "
     "\"char\"", "bits per character in the wrong base"),
    ("experiments.py", "diffs = [value(r) - base[r[\"seed\"]] for r in runs",
     "diffs = [base[r[\"seed\"]] - value(r) for r in runs", "paired differences have the wrong sign"),

    # --- bench.py: ratios and counts
    ("bench.py", "{k: v / values[base] for k, v in values.items()}", "{k: values[base] / v for k, v in values.items()}",
     "ratios to the baseline are inverted"),
    ("bench.py", "rs = [t / b for t, b in zip(ts, times[base])]",
     "rs = [t / b for t, b in zip(ts, reversed(times[base]))]",
     "per-round ratios pair rounds that did not run side by side"),
    ("bench.py", "tokens_per_s=tokens_per_step / med)", "tokens_per_s=tokens_per_step / min(times_s))",
     "tokens/s from the fastest step, not the median"),
    ("bench.py", "grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)",
     "grads = 0", "the memory count leaves out the gradients"),
    ("bench.py", "idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)",
     "idx = torch.cat((idx, logits[:, -1].argmin(-1, keepdim=True)), dim=1)",
     "the recompute baseline is not greedy decoding"),
    ("bench.py", "bad = [v for v in names if v not in VARIANTS]", "bad = []", "an unknown variant name is not refused"),
    ("bench.py", 'module, variant = (bench.against, name[:-len("@against")])',
     'module, variant = (nanoroute, name[:-len("@against")])',
     "--against builds its variants from this code, not from the other version"),
    ("bench.py", '{"this": times[name], "that": times[name + "@against"]}, "that")["this"]',
     '{"this": times[name], "that": times[name + "@against"]}, "this")["that"]',
     "--against reports that code / this code"),
    ("bench.py", "{name: d[name + suffix] for name in variants}", "{name: d[name] for name in variants}",
     "ratios within the other version are taken from this version's times"),
    ("bench.py", "if not (hasattr(module, \"GPT\") and hasattr(module, \"GPTConfig\")):", "if False:",
     "--against a file that is not a nanoroute.py fails with a traceback"),

    # --- faults in the guards, the out_dir lock, signals, sweeps and first-run output
    ("train.py", "if not 0 <= getattr(a, name) < 1:", "if not -1 <= getattr(a, name) < 3:",
     "--beta1 2.0 reaches AdamW"),
    ("train.py", "if attempt or pid is None or process_alive(pid):", "if attempt or pid is None:",
     "a live run's lock on --out_dir is taken over"),
    ("train.py", "if lock_pid(path) == pid:", "if True:",
     "of two runs taking over a dead lock, the second removes the lock the first has just made"),
    ("train.py", "claim.touch(exist_ok=False)", "claim.touch()",
     "two runs taking over a dead lock may both remove it, the second removing the first's new lock"),
    ("train.py", "sys.exit(128 + e.signum)", "sys.exit(1)", "Ctrl-C and SIGTERM exit 1, not 130 / 143"),
    ("train.py", 'min(run.best_val, best["best_val_loss"])', 'max(run.best_val, best["best_val_loss"])',
     "resume keeps the worse of the two best losses"),
    ("train.py", "if config.routing_block == parent:", "if config.routing_block != parent:",
     "the note on a routing block other than the parent's is printed in the wrong case"),
    ("train.py", "vocab_size > LARGE_VOCAB", "vocab_size < LARGE_VOCAB",
     "the smaller --eval_tokens default goes to small vocabularies"),
    # killed only where wandb is installed (CI's second stage); without it the wandb test skips itself
    ("train.py", 'run.wandb.log(wandb_numbers(line), step=line["step"])',
     'run.wandb.log(wandb_numbers(line), step=line["step"] + 1)', "wandb logs every number one step late"),
    ("train.py", 'if name == "mps" and not torch.backends.mps.is_available():', "if False:",
     "--device mps without MPS fails later with a traceback"),
    # --- flags and the commands a run prints (issue 20)
    ("prepare_data.py", "super().__init__(*args, allow_abbrev=False, **kwargs)",
     "super().__init__(*args, allow_abbrev=True, **kwargs)", "flags may be abbreviated: --max_iter is --max_iters"),
    ("train.py", "return shlex.join([*launcher, *map(str, flags)])", 'return " ".join([*launcher, *map(str, flags)])',
     "printed commands are not shell-quoted: an --out_dir with a space breaks when pasted"),
    ("train.py", "skip = {*routing_fields(type(config)),", "skip = {*routing_fields(),",
     "the printed baseline keeps a routing field that a GPTConfig subclass adds"),
    ("train.py", '"stop_after", "wandb_run"}', '"stop_after", "wandb_run", "dtype", "device"}',
     "the printed baseline drops --dtype and --device"),
    ("train.py", 'defaults["eval_tokens"] = default_eval_tokens(config.vocab_size, device)', "pass",
     "the printed baseline repeats the automatic --eval_tokens"),
    ("train.py", "and value != getattr(default, f.name):", "and False:",
     "the printed resume command drops --device, which --resume does not restore"),
    # --- a run's data folder from any working folder (issue 20)
    ("train.py", "tried = [path] + [folder / path for folder in (here, *here.parents)]", "tried = [path]",
     "a run's data folder is looked for only from the current folder"),
    ("train.py", 'return dataset in (None, json.loads((folder / "meta.json").read_text())["dataset"])',
     "return True",
     "a folder above the run holding another dataset is taken for the run's data"),
    ("prepare_data.py", 'if entry["max_id"] >= meta["vocab_size"]:', 'if entry["max_id"] > meta["vocab_size"]:',
     "a token id equal to vocab_size passes the data check"),
    ("prepare_data.py", '    if progress is not None:\n        (out / "progress.json").unlink()',
     '    if False:\n        (out / "progress.json").unlink()',
     "a run killed after meta.json leaves its progress.json for good"),
    ("prepare_data.py", 'least = o["min_per_million"] * counts.sum() / 1e6', 'least = o["min_per_million"]',
     "--min_per_million is read as an absolute count"),
    ("prepare_data.py", "os.fsync(f.fileno())", "pass", "a file is renamed before it reaches the disk"),
    ("sample.py", "width = 1 + max(4, *map(len, short))", "width = max(4, *map(len, short))",
     "--routes column headers run together"),
    ("experiments.py", "return max(GPTConfig(n_layer=depth, **VARIANTS[v]).routing_block for v in routed)",
     "return min(GPTConfig(n_layer=depth, **VARIANTS[v]).routing_block for v in routed)",
     "a sweep gives its AttnRes variants a block WAV cannot use (not like for like)"),
    ("experiments.py", "_cores() // (jobs * per_run)", "_cores() // per_run", "--jobs N runs share no cores"),
    ("experiments.py", "    if why:\n        raise UsageError", "    if False:\n        raise UsageError",
     "a damaged summary.json is shown as an unfinished run"),
    # --- experiments.py: the report's statistics (issue 22), damaged run files, the sweep's signals,
    # progress, checks before the first run, and the plots' axes (issues 19, 20, 21, 24)
    ("experiments.py", 'diffs = [value(r) - base[r["seed"]] for r in runs if value(r) is not None',
     'diffs = [value(r) - value(b) for r, b in zip(runs, baseline_runs) if value(r) is not None',
     "paired differences pair runs by their position, not by seed"),
    ("experiments.py", 'key=lambda r: (r["seed"] is None, r["seed"] or 0))', 'key=lambda r: str(r["seed"]))',
     "seeds sort as text (10 before 2)"),
    ("experiments.py", 'for r in baseline_runs if r["seed"] is not None}', "for r in baseline_runs}",
     "a run without a seed pairs with a baseline run without one"),
    ("experiments.py", "labels = sorted(reached, key=reached.get)", "labels = sorted(reached)",
     "milestones in text order (10K before 2K), not token order"),
    ("experiments.py", 'if r["seed"] is not None and seen.setdefault(key, r["name"]) != r["name"]:', "if False:",
     "two runs of one variant and seed (two sweeps in one folder) are both counted, silently"),
    ("experiments.py", '.get("entropy_norm") or {}).items()', '.get("entropy") or {}).items()',
     "the report's route entropy is the raw one (WAV reads 3x the sources)"),
    ("experiments.py", "    return {} if why else info", "    return info",
     "a run.json that is a list (or has a field of the wrong type) is used as it is"),
    ("experiments.py", "return record if isinstance(record, dict) else None", "return record",
     "a metrics.jsonl line that is JSON but not an object is used as a record"),
    ("experiments.py", 'if not (isinstance(m, dict) and _is_number(m.get("tokens"))',
     'if False and (isinstance(m, dict) and _is_number(m.get("tokens"))',
     "a summary.json with damaged milestones passes the check"),
    ("experiments.py", "        if not where.is_dir():", "        if False:",
     "sweep --out under a file passes the check"),
    ("experiments.py", '    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)',
     "    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND", "a planted train.log link is followed"),
    ("experiments.py", "return next((s for s in STOP_SIGNALS if returncode in (128 + s, -s)), None)", "return None",
     "a run stopped by SIGINT/SIGTERM is FAILED and the sweep goes on"),
    ("experiments.py", "os.killpg(process.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)", "pass",
     "a stopped sweep leaves the other runs under way running"),
    ("experiments.py", "stderr=subprocess.STDOUT, start_new_session=True,", "stderr=subprocess.STDOUT,",
     "runs share the sweep's process group: the stop signal never reaches the other runs"),
    ("experiments.py", "            self._news(label, self.runs.pop(label))", "            self.runs.pop(label)",
     "a run's last evaluations are not shown before its end line"),
    ("experiments.py", "                if record[\"step\"] > self.last_eval:", "                if True:",
     "an evaluation is shown again (a resumed run's earlier ones, or after train.py rewrote metrics.jsonl)"),
    ("experiments.py", "            if not self.tty:\n", "            if True:\n",
     "on a terminal, a line per evaluation scrolls under the status line"),
    ("experiments.py", "            problems.append(str(e))", "            pass",
     "a data folder that is not prepared is not named by --dry_run, and the sweep starts its runs"),
    ("experiments.py", 'if Path(folder).name == "demo" and not os.path.lexists(folder):', "if False:",
     "a missing demo folder is refused instead of prepared"),
    ("experiments.py", "            train.build_parser().parse_args(list(extra))", "            list(extra)",
     "flags after -- are not checked by train.py's parser (--n_lay 3 reaches every run)"),
    ("experiments.py", "            if extra:\n", "            if False:\n", "report ignores flags after --"),
    ("experiments.py", "    ax.yaxis.set_major_formatter(_formatter(_plain))", "    pass",
     "the difference panel's ticks read like 4.43482×10⁻²"),
    ("experiments.py", "    ax.axhline(0, color=zero_color, linewidth=1.2)", "    pass",
     "the difference panel has no zero line"),
    ("experiments.py", "    if peaks[-1] <= 10 * typical or peaks[-1] == 0:", "    if True:",
     "the difference panel is linear even when one variant lies far off (small gaps vanish)"),
    ("experiments.py", "    for sign, end in ((1, hi), (-1, -lo)):", "    for sign, end in ((-1, -lo),):",
     "the symlog difference panel has no ticks past the linear band on the positive side"),
    ("experiments.py", 'fig = Figure(figsize=(8.0 * cols, 6.0 * rows), layout="constrained")',
     "fig = Figure(figsize=(8.0 * cols, 8.0 * rows))", "val_loss.png: a tall figure with a gap between its rows"),
    ("experiments.py", "    cols = min(PANELS_PER_ROW, len(groups))", "    cols = len(groups)",
     "val_loss.png of a sweep over many (dataset, depth) groups is one very wide row"),
    ("experiments.py", "figsize=(max(6.4, 2.6 + 0.8 * len(sources)),", "figsize=(1.0 + 0.55 * len(sources),",
     "routing heatmaps too narrow to read"),
    # --- nanoroute.py: generation, optimizer groups, diagnostics, config, routing and the fast kernel
    ("nanoroute.py", "logits = norm(V) @ query.float() + bias", "logits = V @ query.float() + bias",
     "the reference read drops the key RMSNorm"),
    ("nanoroute.py", "logits = dots * inv_rms[..., None] + biases.float().t()", "logits = dots + biases.float().t()",
     "phase 1 drops the key RMSNorm"),
    ("nanoroute.py", "norm_term = dlogit * dots * inv_rms.pow(3) * scale.square() / h.size(-1)",
     "norm_term = 0 * dlogit", "phase 2's backward drops the gradient through the key norm"),
    ("nanoroute.py", "with float32(h):  # float32 also when backward() is called under autocast",
     "with contextlib.nullcontext():", "phase 2's backward runs in bf16 under autocast"),
    ("nanoroute.py", "with float32(queries):  # float32 also when backward() is called under autocast",
     "with contextlib.nullcontext():", "phase 1's backward runs in bf16 under autocast"),
    ("nanoroute.py", "v = F.linear(x_v, w_v, b_v)", "v = F.linear(x_v, w_v)", "RD's value projection loses its bias"),
    ("nanoroute.py", 'if name.endswith(".attn.v") and not name.startswith("layer0.")}',
     'if name.endswith(".attn.v")}', "JS averages in layer 0 (0 by construction)"),
    ("nanoroute.py", '"split": 1 if l % m < m / 2 else -1', '"split": 1 if l % m <= m / 2 else -1',
     "the split basis puts the middle sublayer in the first half"),
    ("nanoroute.py", ".clamp(max=rho)", "", "the RMS-matching scale is not capped at rho"),
    ("nanoroute.py", "inv_rms = torch.rsqrt(scale.square() * ms + EPS)", "inv_rms = torch.rsqrt(ms + EPS)",
     "a detail's key norm ignores its RMS-matching scale (fast path)"),
    ("nanoroute.py", "bias = {None: query.new_zeros(()), **{basis: beta[k] for k, basis in enumerate(self.bases)}}",
     "bias = {None: query.new_zeros(()), **{basis: beta[0] for k, basis in enumerate(self.bases)}}",
     "every detail basis gets the first basis's bias"),
    ("nanoroute.py", "self.bases = list(self.detail_signs(0))", "self.bases = list(config.detail_bases)",
     "a basis added in detail_signs is ignored"),
    ("nanoroute.py", "pool, block = self.complete(l // m, block, pool), []",
     "pool, block = DepthRouting.complete(self, l // m, block, pool), []",
     "a source added in an override of complete is ignored"),
    ("nanoroute.py", "pool = [s for s in pool if s.basis is None or self.config.wav_readout_details]",
     "pool = [s for s in pool if s.basis is None]", "wav_readout_details is ignored"),
    ("nanoroute.py", "return 0.5 * (h[0] + h[1]), None", "return h[0], h[1]", "rd=average feeds the two routes apart"),
    # --- nanoroute.py: [outside] faults, designed from the docs and the model file by a reviewer who had not read the tests
    ('nanoroute.py', 'self.register_buffer("frozen_detail_bias", torch.full((len(self.bases),), config.wav_detail_bias),',
     'self.register_buffer("frozen_detail_bias", torch.zeros(len(self.bases)),',
     "rd=frozen_v + WAV: the value route's frozen detail bias is 0 instead of its initial value wav_detail_bias (docs: kept at its initial value); no other read uses it [outside]"),
    ('nanoroute.py', 'return -1 if block == "emb" else math.inf if block == "P" else int(block[1:])',
     'return -1 if block == "emb" else math.inf if block == "P" else int(block[1])',
     "routing_stats 'sources' order: block index read from its first digit, so C10, C11 sort right after C1 (>= 11 blocks) [outside]"),
    ('nanoroute.py', 'gamma = 0.1 if config.n_layer <= 18 else 1e-5 if config.n_layer <= 24 else 1e-6',
     'gamma = 0.1 if config.n_layer < 18 else 1e-5 if config.n_layer <= 24 else 1e-6',
     'LayerScale initial gamma off by one: an 18-layer model starts at 1e-5, CaiT (SPEC) says 0.1 up to 18 layers [outside]'),
    ('nanoroute.py', 'dropout_p=self.dropout if self.training else 0.0,',
     'dropout_p=self.dropout,',
     'attention dropout stays on in eval mode (and in generate): eval/generation non-deterministic when dropout > 0 [outside]'),
    ('nanoroute.py', 'return {name: p for name, p in self.named_parameters() if id(p) not in matrices}',
     'return {name: p for name, p in self.named_parameters() if p.dim() < 2}',
     "weight decay groups by nanoGPT's dim rule: 2-D routing/gain parameters (basis_coefficients, LayerScale gamma, ReZero alpha) get decayed [outside]"),
    ('nanoroute.py', 'return ("residual",) + tuple(f.name for f in fields(config_class) if f.metadata.get("needs"))',
     'return ("residual",) + tuple(f.name for f in fields(GPTConfig) if f.metadata.get("needs"))',
     "routing_fields ignores a subclass's routing fields (docstring: 'a subclass's too') [outside]"),
    ('nanoroute.py', 'with_details = [r for r in learned if r != "readout" or config.wav_readout_details]',
     'with_details = [r for r in self.read_names if not r.startswith("layer0.attn")\n                        and (r != "readout" or config.wav_readout_details)]',
     'rd=frozen_v + WAV: the value routes get a learned detail bias (docs: it stays frozen at its initial value, like the zero query) [outside]'),
    ('nanoroute.py', 'return h[0], h[1]  # decoupled, frozen_v: Q and K read h^QK, V reads h^V',
     'return h[1], h[0]  # decoupled, frozen_v: Q and K read h^QK, V reads h^V',
     'RD decoupled/frozen_v: routes swapped, Q/K read the value route and V the QK route (identical at init; frozen_v then freezes the QK route) [outside]'),
    ('nanoroute.py', 'if not 0.0 <= self.dropout < 1.0:',
     'if not 0.0 <= self.dropout <= 1.0:',
     'config validation accepts dropout=1.0 (documented range [0, 1)) [outside]'),
    ('nanoroute.py', 'pool = [s for s in pool if s.basis is None or self.config.wav_readout_details]',
     'pool = [s for s in pool if "." not in s.name or self.config.wav_readout_details]',
     "conservative readout filters by name: an extension's bias-free completed source (C<b>.diff) is dropped from the readout (docs: 'the final readout reads it too') [outside]"),
    ('nanoroute.py', 'return pool + self.block_sources(f"C{b}", block, b * self.config.routing_block)',
     'return pool + self.block_sources(f"C{b}", block, b)',
     "completed block b's first sublayer index is b, not b*m: C1.. get wrong phase/split signs (still zero-sum) or wrong learned-basis rows; C0 and P are right [outside]"),
    ('nanoroute.py', 'key = (values, str(device))',
     'key = values',
     'kernel constant cache ignores the device: after a CPU run, a model on another device gets the CPU constants (device mismatch) [outside]'),
    ('nanoroute.py', 'rows = self.block_coefficients(first, sublayers[-1] - first)[:len(partial)]',
     'rows = self.block_coefficients(first, sublayers[-1] - first)',
     "fast readout over a short last WAV block: the kernel merges P's detail sources too (conservative readout broken, fast != reference) only when 2*n_layer % m != 0 [outside]"),
    ('nanoroute.py', 'block.append(u.float())',
     'block.append(u)',
     "sources accumulate in bf16 under autocast (docs: float32 whatever the sublayers' dtype); fast and reference still agree to bf16 tolerance [outside]"),
    ('nanoroute.py', 'e = self.drop(self.wte(idx))',
     'e = self.wte(idx)',
     'no dropout on the embedding (docs: dropout on embeddings, attention and sublayer outputs); training is still stochastic [outside]'),
    ('nanoroute.py', 'wav_learned_bases: bool = setting(False, "learn the detail bases: a coefficient per sublayer and basis, "\n                                             "started at the signs (beyond WAV v1)", needs="wav")',
     'wav_learned_bases: bool = setting(False, "learn the detail bases: a coefficient per sublayer and basis, "\n                                             "started at the signs (beyond WAV v1)", needs="attnres")',
     'validation: wav_learned_bases=True without wav=True is silently accepted (an empty basis_coefficients) instead of a one-line ValueError [outside]'),
    ('nanoroute.py', 'return max(m, 4) if self.wav else m',
     'return max(m, 4)',
     'auto routing block (attnres_block=0) is at least 4 sublayers without WAV too: n_layer <= 8 gets 2-layer blocks instead of m = 2*ceil(n_layer/8) (12/24/48 layers unaffected) [outside]'),
    # --- nanoroute.py: issue 19's faults (the routing on plain tensors), and one in the tests' own harness
    ("test_nanoroute.py", "        for p in model.no_decay_parameters().values():\n            p.add_(",
     "        for p in [q for n, q in model.no_decay_parameters().items() if n.startswith(('query.', 'detail_bias.'))]:\n"
     "            p.add_(", "randomise_routing moves only parameters named query./detail_bias. (a new one stays put)"),
    ("nanoroute.py", "return dmix, dlse, dquery.to(query.dtype), dbias, None, None, dcoeffs,",
     "return dmix, dlse, dquery.to(query.dtype), dbias, None, None, None,",
     "the kernel drops the gradient of learned coefficients"),
    ("nanoroute.py", "learned = self.basis_coefficients[first:first + n].t()  # (bases, n)",
     "learned = self.basis_coefficients[first:first + n].t().detach()  # (bases, n)",
     "learned coefficients are built without gradient"),
    ("nanoroute.py", 'started at the signs (beyond WAV v1)", needs="wav")', 'started at the signs (beyond WAV v1)")',
     "a new routing field is left out of the one list (routing_fields)"),
    ("nanoroute.py", "if config.fast_routing and type(self).block_sources is not DepthRouting.block_sources:",
     "if False:", "an override of block_sources is silently ignored by the fast kernel"),
    ("nanoroute.py", "            self.seen = len(block)\n", "", "the kernel re-adds the block's updates at every read"),
    ("nanoroute.py", "key = i if self.learned else tuple(row[i] for row in self.coefficients)",
     "key = i if self.learned else tuple(row[0] for row in self.coefficients)",
     "the kernel groups updates by the first column's coefficients"),
    ("nanoroute.py", "if cached is None or cached[0] is not value:", "if cached is None:",
     "the kernel reuses a key norm for a source whose value changed"),
    ("nanoroute.py", "entropy_norm=entropy / math.log(n) if n > 1 else None)",
     "entropy_norm=entropy / math.log(n + 1) if n > 1 else None)", "normalised entropy divides by the wrong pool size"),
    ("nanoroute.py", "            self.basis_coefficients = nn.Parameter(torch.tensor(signs))  # (2·n_layer, bases)",
     "            self.basis_coefficients = nn.Parameter(torch.tensor(signs).abs())  # (2·n_layer, bases)",
     "learned bases do not start at the signs"),
    ("nanoroute.py", "dmix, dlse, dbias = a[0][..., None] * dh,", "dmix, dlse, dbias = dh,",
     "phase 2's backward drops the merge weight of the phase-1 summary"),
    ("nanoroute.py", "logits = logits / temperature", "logits = logits / 1.0", "generate ignores temperature"),
    ("nanoroute.py", "logits[logits < v[:, [-1]]] = -float(\"inf\")", "logits[logits <= v[:, [-1]]] = -float(\"inf\")",
     "top-k keeps k - 1 tokens"),
    ("nanoroute.py", "context = idx[:, -cfg.sequence_len:]", "context = idx[:, :cfg.sequence_len]",
     "generation past sequence_len reads the start of the text, not its end"),
    ("nanoroute.py", "decay = [p for p in self.parameters() if not any(p is q for q in no_decay)]",
     "decay = [p for p in self.parameters() if p.dim() >= 1]", "pseudo-queries and gains get weight decay"),
    ("nanoroute.py", "return (0.5 * kl(p) + 0.5 * kl(q)).clamp(min=0).mean().item()",
     "return (0.5 * kl(p) + 0.5 * kl(q)).clamp(min=0).sum().item()", "JS divergence summed over tokens"),
    ("nanoroute.py", "if not 0.0 <= self.dropout < 1.0:", "if not 0.0 <= self.dropout <= 2.0:",
     "dropout 1.5 is accepted"),
]


def snapshot():
    """{path: bytes} of the git-tracked files of the working tree, read once: every fault then starts
    from the same code and tests, even if the files are edited while the tool runs."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    names = [n for n in files.stdout.split("\0") if n and (ROOT / n).is_file()]
    return {name: (ROOT / name).read_bytes() for name in names}


def run_suite(files, fault, timeout):
    """Apply one fault (None: none) to a fresh copy and run the tests: (status, seconds, first failure)."""
    with tempfile.TemporaryDirectory(prefix="nanoroute_fault_") as tmp:
        tmp = Path(tmp)
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        (tmp / "_fault_order.py").write_text(ORDER_PLUGIN, encoding="utf-8")
        env = _clean_env()
        if fault is not None:
            file, old, new, _ = fault
            env["FAULT_SECTIONS_FIRST"] = ",".join(SECTIONS_FIRST.get(file, []))
            text = (tmp / file).read_text(encoding="utf-8")
            if text.count(old) != 1:
                return "stale", 0.0, f"old snippet found {text.count(old)} times"
            (tmp / file).write_text(text.replace(old, new), encoding="utf-8")
        t0 = time.time()
        try:
            run = subprocess.run(TEST_COMMAND, cwd=tmp, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return "killed", time.time() - t0, f"timed out after {timeout} s"
        failed = re.search(r"^(FAILED|ERROR) (.+?)(?: - |$)", run.stdout, re.M)
        why = failed[2] if failed else (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        return ("survived" if run.returncode == 0 else "killed"), time.time() - t0, why


def _clean_env():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    for name in ("NANOROUTE_BASE_URL", "NANOROUTE_TEST_DEVICE"):
        env.pop(name, None)
    return env


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--jobs", type=int, default=1, help="faults tested at the same time (default 1)")
    p.add_argument("--only", metavar="FILE", help="only the faults of this file, e.g. train.py")
    p.add_argument("--timeout", type=int, default=900, help="seconds per suite run; longer counts as killed")
    p.add_argument("--match", metavar="TEXT", help="only the faults whose description contains TEXT")
    p.add_argument("--list", action="store_true", help="print the faults and exit")
    a = p.parse_args(argv)
    files = sorted({f[0] for f in FAULTS})
    if a.only is not None and a.only not in files:
        p.error(f"--only {a.only}: no faults for it; choose one of {', '.join(files)}")
    if a.jobs < 1:
        p.error(f"--jobs {a.jobs}: must be at least 1")
    faults = [f for f in FAULTS if a.only in (None, f[0]) and (a.match or "") in f[3]]
    if a.list:
        for i, (file, old, _, what) in enumerate(faults, 1):
            found = (ROOT / file).read_text(encoding="utf-8").count(old)
            print(f"{i:3d} {file:<16} {what}" + ("" if found == 1 else f"  [stale: found {found} times]"))
        return 0

    print(f"{len(faults)} faults, {a.jobs} at a time; first the unmodified suite", flush=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        files = snapshot()
        baseline = pool.submit(run_suite, files, None, a.timeout)
        futures = {pool.submit(run_suite, files, f, a.timeout): i for i, f in enumerate(faults)}
        status, seconds, why = baseline.result()
        if status != "survived":
            print(f"WARNING: the unmodified suite fails ({why}): every fault will look killed", flush=True)
        else:
            print(f"unmodified suite passes ({seconds:.0f} s)", flush=True)
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            status, seconds, why = results[i]
            file, _, _, what = faults[i]
            print(f"{status:<8} {file:<16} {what} ({seconds:.0f} s; {why})", flush=True)

    print("\nper file: killed / counted (stale faults are not counted)")
    for file in files:
        mine = [results[i][0] for i, f in enumerate(faults) if f[0] == file]
        counted = [s for s in mine if s != "stale"]
        if mine:
            killed = counted.count("killed")
            rate = f"{100 * killed / len(counted):.0f}%" if counted else "-"
            print(f"  {file:<16} {killed:3d} / {len(counted):<3d} {rate:>5}" +
                  (f"   ({mine.count('stale')} stale)" if "stale" in mine else ""))
    for label in ("survived", "stale"):
        rows = [(faults[i], r) for i, r in sorted(results.items()) if r[0] == label]
        if rows:
            print(f"\n{label}:")
            for (file, _, _, what), (_, _, why) in rows:
                print(f"  {file}: {what}" + (f" ({why})" if label == "stale" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
