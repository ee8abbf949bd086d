"""
Write text with a checkpoint trained by train.py, or look at how it routes through depth.

    python sample.py                                        # out/best.pt, 3 samples after a newline
    python sample.py --out_dir out/rd --start "Once upon a time" --num_samples 1
    python sample.py --out_dir out/rd --start FILE:prompt.txt --temperature 0.8 --top_k 20
    python sample.py --out_dir out/rd --routes              # routing heatmap over a val crop

Text is encoded and decoded through the dataset's meta.json (the --data folder the checkpoint was
trained on), so char-level and GPT-2-token checkpoints both work. Generation uses the model's KV cache.
"""

import math
import sys
import time
from pathlib import Path

import torch

import prepare_data
from nanoroute import GPT, GPTConfig, routing_stats
from prepare_data import UsageError
from train import (check_checkpoint_layout, check_checkpoint_settings, check_out_dir, check_same_dataset,
                   check_seed, command, find_data, first_line, load_checkpoint, out_of_memory, pick_device)

MIN_TEMPERATURE = 1e-6
SHADES = " ░▒▓█"  # weight in (0, .25], (.25, .5], (.5, .75], (.75, 1]; blank: the read cannot see it


def build_parser():
    p = prepare_data.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--out_dir", default="out", help="train.py's output folder (default: out)")
    p.add_argument("--ckpt", default="best", choices=("best", "last"), help="best.pt or last.pt (default: best)")
    p.add_argument("--data", metavar="DIR", help="dataset folder for meta.json (default: the one "
                   "the checkpoint was trained on, found from here or from the run folder)")
    p.add_argument("--start", help="prompt text, or FILE:path to read it from a file (default: a newline for "
                   "char level, <|endoftext|> for GPT-2 tokens; with --routes: the first sequence_len tokens of val)")
    p.add_argument("--num_samples", type=int, default=3, help="samples to write (default: 3)")
    p.add_argument("--max_new_tokens", type=int, default=300, help="tokens per sample (default: 300)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help=">= 1e-6 and finite; lower is more conservative (default: 0.8)")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens, >= 1 (default: 200)")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed (default: 1337)")
    p.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps "
                   "(default: auto)")
    p.add_argument("--routes", action="store_true", help="show the depth routing over the prompt instead of sampling")
    return p


def main(argv=None):
    try:
        sample(build_parser().parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a file that cannot be read (meta.json, a split, the GPT-2 vocabulary)
        print(f"error: cannot read {e.filename or 'a file'} ({e.strerror or e}); fix that and re-run",
              file=sys.stderr)
        sys.exit(2)


def sample(a):
    # settings first, so a typo fails before anything loads
    # below 1e-6 the logits / temperature can overflow to inf (NaN probabilities), and inf is not a temperature
    if not (MIN_TEMPERATURE <= a.temperature < math.inf):
        raise UsageError(f"--temperature {a.temperature}: must be > 0, at least {MIN_TEMPERATURE:g} and finite "
                         "(use --top_k 1 for greedy decoding)")
    if a.top_k < 1:
        raise UsageError(f"--top_k {a.top_k}: must be >= 1")
    for name in ("num_samples", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name} {getattr(a, name)}: must be a positive integer")
    check_seed(a.seed)
    check_out_dir(a.out_dir)

    # the checkpoint, its model and its dataset
    path = Path(a.out_dir) / f"{a.ckpt}.pt"
    train_it = command("train.py", ["--out_dir", a.out_dir])
    ckpt = load_checkpoint(path, f"no checkpoint at {path}: train one with {train_it}")
    check_checkpoint_settings(ckpt, path)
    try:
        config = GPTConfig(**ckpt["config"])
    except ValueError as e:
        raise UsageError(f"checkpoint {path} holds an invalid config: {e}; delete it or retrain") from None
    model = GPT(config)
    check_checkpoint_layout(ckpt, path, model)
    model.load_state_dict(ckpt["model"])
    dataset = ckpt["meta"]["dataset"]
    fix = f"give --data DIR, the prepared {dataset} dataset it was trained on"
    data_dir = a.data or find_data(ckpt["train_args"]["data"], path.parent, fix, dataset)
    meta = prepare_data.load_meta(data_dir)
    check_same_dataset(ckpt, path, meta, data_dir, "pass --data with the dataset it was trained on")
    device = pick_device(a.device)
    model.to(device).eval()
    decode = prepare_data.decoder(meta, data_dir)

    ids = prompt_ids(a, meta, data_dir, config)
    idx = torch.tensor([ids], dtype=torch.long, device=device)

    if a.routes:
        show_routes(model, idx, path, decode(ids))
        return
    check_memory(config, a, device)
    torch.manual_seed(a.seed)
    t0 = time.time()
    try:
        out = model.generate(idx.expand(a.num_samples, -1), a.max_new_tokens, a.temperature, a.top_k)
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        raise UsageError(f"out of memory generating {a.num_samples} samples ({first_line(str(e))}): "
                         "lower --num_samples") from None
    dt = time.time() - t0
    shown = 0 if a.start is not None else len(ids)  # a default prompt (<|endoftext|>, a newline) is not text
    for row in out.tolist():
        print(decode(row[shown:]))
        print("-" * 40)
    n = a.num_samples * a.max_new_tokens
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)


def prompt_ids(a, meta, data_dir, config):
    """The prompt's token ids: --start (or the file it names), else a default one; at most the
    last sequence_len of them."""
    if a.start is None and a.routes:
        ids = prepare_data.open_split(data_dir, "val", meta)[:config.sequence_len].tolist()
    elif a.start is None and meta["level"] == "gpt2":
        ids = [prepare_data.GPT2_EOT]
    elif a.start is None:  # a newline, or a space in a vocabulary without one (text8)
        ids = [next((meta["chars"].index(c) for c in "\n " if c in meta["chars"]), 0)]
    else:
        text = a.start
        if text.startswith("FILE:"):
            try:
                text = Path(text[5:]).read_text(encoding="utf-8")
            except OSError as e:
                raise UsageError(f"--start {a.start}: cannot read {text[5:]} ({e.strerror})") from None
            except UnicodeDecodeError as e:
                raise UsageError(f"--start {a.start}: {text[5:]} is not UTF-8 text (byte "
                                 f"{e.object[e.start]:#04x} at offset {e.start}); save it as UTF-8") from None
        ids = prepare_data.encoder(meta, data_dir)(text)
    if not ids:
        raise UsageError("--start is empty: give at least one character")
    if len(ids) > config.sequence_len:
        print(f"note: the prompt is {len(ids)} tokens, longer than sequence_len={config.sequence_len}: "
              f"using its last {config.sequence_len}", file=sys.stderr)
        ids = ids[-config.sequence_len:]
    return ids


def check_memory(config, a, device):
    """UsageError before generation when its KV cache (keys and values of every layer, sequence_len
    positions per sample, float32) is larger than the memory free on the device."""
    need = 2 * config.n_layer * a.num_samples * config.sequence_len * config.n_embd * 4
    free = free_memory(device)
    if free is not None and need > free:
        raise UsageError(f"--num_samples {a.num_samples} needs a {need / 1e9:,.1f} GB KV cache "
                         f"({config.n_layer} layers x {config.sequence_len} positions x {config.n_embd} "
                         f"wide, keys and values, per sample) but {device} has {free / 1e9:,.1f} GB "
                         "free: lower --num_samples")


def free_memory(device):
    """Bytes free on the device: CUDA's own count; on the CPU, MemAvailable of /proc/meminfo (Linux);
    None where it is not known (then an allocation that fails is caught instead)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib * 1024 if device.type == "cpu" else None


@torch.no_grad()
def show_routes(model, idx, path, prompt):
    """A terminal heatmap of every read's mean weight per source over the prompt, and RD's JS divergence."""
    cfg = model.config
    if cfg.residual != "attnres":
        raise UsageError(f"{path} is a residual={cfg.residual} model: it has no depth routing to show "
                         "(--routes needs a --residual attnres checkpoint)")
    stats = routing_stats(model(idx, return_routes=True)[2])
    reads, sources = stats["reads"], stats["sources"]
    short = [s.replace(".phase", ".ph").replace(".split", ".sp") for s in sources]
    width = 1 + max(4, *map(len, short))  # a cell is 4 wide ("█100"); 1 more keeps labels apart
    name_w = max(map(len, reads)) + 2
    snippet = prompt if len(prompt) <= 60 else "..." + prompt[-57:]
    print(f"depth routing of {path} over a {idx.size(1)}-token prompt: {snippet!r}")
    print(f"mean weight per source in %; shade {SHADES[1]} <=25 {SHADES[2]} <=50 {SHADES[3]} <=75 {SHADES[4]} >75, "
          "blank: not visible to that read; H: entropy of the read (nats)")
    print(" " * name_w + "".join(f"{s:>{width}}" for s in short) + "      H")
    for name, r in reads.items():
        weight = dict(zip(r["sources"], r["mean_weight"]))
        cells = []
        for s in sources:
            if s not in weight:
                cells.append(" " * width)
            else:
                w = weight[s]
                shade = SHADES[min(4, max(1, math.ceil(w * 4)))]
                cells.append(f"{shade}{round(100 * w):>3}".rjust(width))
        print(f"{name:<{name_w}}" + "".join(cells) + f"  {r['entropy'] + 0.0:5.2f}")
    if stats["js"]:
        print("\nRD: JS divergence between the QK and the V route, per attention layer (nats, max ln 2 = 0.693)")
        for layer, js in stats["js"].items():
            print(f"  {layer:<8} {js:.4f}  " + SHADES[4] * round(40 * js / math.log(2)))
        print(f"  {'mean':<8} {stats['js_mean']:.4f}")


if __name__ == "__main__":
    main()
