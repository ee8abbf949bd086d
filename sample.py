"""
Write text with a checkpoint trained by train.py, or look at how it routes through depth.

    python sample.py                                     # out/best.pt: 3 samples after a newline
    python sample.py --out_dir out_rd --start "Once upon a time" --num_samples 1
    python sample.py --out_dir out_rd --start FILE:prompt.txt --temperature 0.8 --top_k 20
    python sample.py --out_dir out_rd --routes           # every read's weights over a val crop

Text goes through the dataset the run was trained on (found from any working folder, or --data).
"""

import math
import sys
import time
from pathlib import Path

import torch

import checkpoint
import common
import prepare_data
from common import UsageError, command
from diagnostics import routing_stats, source_legend
from train import pick_device

SHADES = " ░▒▓█"  # a weight in (0, .25], (.25, .5], (.5, .75], (.75, 1]; blank: not seen

def build_parser():
    p = common.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("--out_dir", type=common.folder_name, default="out",
                   help="train.py's run folder (default: out)")
    p.add_argument("--ckpt", default="best", choices=("best", "last"),
                   help="best.pt or last.pt (default: best)")
    p.add_argument("--data", type=common.folder_name, metavar="DIR",
                   help="the dataset folder (default: the run's own)")
    p.add_argument("--start", help="prompt text, or FILE:path to read it (UTF-8); default: a "
                   "newline for char level, <|endoftext|> for GPT-2 tokens; with --routes the "
                   "first sequence_len tokens of val")
    p.add_argument("--num_samples", type=int, default=3, help="samples (default: 3)")
    p.add_argument("--max_new_tokens", type=int, default=300, help="tokens each (default: 300)")
    p.add_argument("--temperature", type=float, default=0.8, help="> 0 (default: 0.8)")
    p.add_argument("--top_k", type=int, default=200,
                   help="among the k likeliest, ties with the k-th too (default: 200); 1: greedy")
    p.add_argument("--seed", type=int, default=1337, help="the same seed writes the same text")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--routes", action="store_true", help="how it routes over the prompt, not text")
    return p

def check_flags(parser, a):
    """Each flag's value, and the flags that would change nothing together: one UsageError."""
    # every flag but these is the text's (a new one too): --routes draws no tokens, so one off its
    # default would change nothing: refused, not ignored
    routes_flags = ("out_dir", "ckpt", "data", "start", "device", "routes")
    unused = [f"--{n}" for n, value in vars(a).items()
              if a.routes and n not in routes_flags and value != parser.get_default(n)]
    if unused:
        raise UsageError(f"--routes writes no text: {', '.join(unused)} would be ignored; drop "
                         + ("them" if len(unused) > 1 else "it"))
    # --top_k 1 is greedy: it draws nothing, so a temperature or a seed would change nothing
    idle = [f"--{n} {getattr(a, n)}" for n in ("temperature", "seed")
            if a.top_k == 1 and getattr(a, n) != parser.get_default(n)]
    if idle:
        raise UsageError(f"--top_k 1 is greedy: {' and '.join(idle)} would change nothing; drop "
                         + ("them" if len(idle) > 1 else "it") + " or --top_k 1")
    if not 0 < a.temperature < math.inf:  # NaN fails too
        raise UsageError(f"--temperature {a.temperature}: must be > 0 and finite")
    for name in ("num_samples", "max_new_tokens", "top_k"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name} {getattr(a, name)}: must be at least 1")
    if not 0 <= a.seed < 2 ** 63:
        raise UsageError(f"--seed {a.seed}: must be in [0, 2**63)")

@common.cli
def main(argv=None):
    parser = build_parser()
    a = parser.parse_args(argv)
    check_flags(parser, a)
    device = pick_device(a.device)
    path, train_it = Path(a.out_dir) / f"{a.ckpt}.pt", command("train.py", ["--out_dir", a.out_dir])
    ckpt = checkpoint.load(path, f"no checkpoint at {path}: train one with {train_it}")
    # eval(): no dropout while it writes
    model = checkpoint.model_from(ckpt, path).to(device).eval()
    # the run's own dataset: its vocabulary turns text into ids and back
    data_dir, meta = checkpoint.open_data(ckpt, a.out_dir, a.data)
    ids = prompt_ids(a, meta, data_dir, model.config.sequence_len)
    idx, decode = torch.tensor([ids], device=device), prepare_data.decoder(meta, data_dir)
    if a.routes:
        return show_routes(model, idx, path, decode(ids))
    # right before sampling: the same seed and flags write the same text
    torch.manual_seed(a.seed)
    t0 = time.time()
    try:
        # every sample in one batch: the prompt is expanded (a view), not copied
        out = model.generate(idx.expand(a.num_samples, -1), a.max_new_tokens, a.temperature,
                             a.top_k)
    except RuntimeError as e:  # CUDA's OutOfMemoryError, or the CPU's "can't allocate memory"
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        raise UsageError(f"out of memory generating {a.num_samples} samples at once: lower "
                         "--num_samples") from None
    dt = time.time() - t0
    shown = 0 if a.start is not None else len(ids)  # a default prompt is not the text's
    for row in out.tolist():
        print(decode(row[shown:]) + "\n" + "-" * 40)
    n = a.num_samples * a.max_new_tokens
    # on stderr: stdout holds the text alone, ready to redirect
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)

def prompt_ids(a, meta, data_dir, sequence_len):
    if a.start is not None:
        text = a.start
        if text.startswith("FILE:"):
            try:
                text = Path(text[5:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"--start {a.start}: cannot read it as UTF-8 text ({e})") from None
        ids = prepare_data.encoder(meta, data_dir)(text)
    elif a.routes:
        # --routes without --start: real text, one the model did not train on
        ids = prepare_data.open_split(data_dir, "val", meta)[:sequence_len].tolist()
    elif meta["level"] == "gpt2":
        ids = [prepare_data.GPT2_EOT]
    elif meta["level"] == "char":  # a newline, or a space in a vocabulary without one (text8)
        ids = [next((meta["chars"].index(c) for c in "\n " if c in meta["chars"]), 0)]
    else:  # another level: a newline, as its encoder writes it
        ids = prepare_data.encoder(meta, data_dir)("\n")
    if not ids:
        raise UsageError(f"--start {a.start!r} is empty: give at least one character")
    if len(ids) > sequence_len:
        print(f"note: the prompt is {len(ids)} tokens, longer than sequence_len={sequence_len}: "
              f"using its last {sequence_len}", file=sys.stderr)
    # the last tokens: the text continues from the prompt's end
    return ids[-sequence_len:]

def cell(weight, distribution):  # a share in percent, "█100", or a learned weight, "-0.25"
    return f"{shade(weight)}{round(100 * weight):>3}" if distribution else f"{weight:.2f}"

def shade(weight):
    # never blank: blank means a source the read does not see; a weight of 0 was seen
    return SHADES[min(4, max(1, math.ceil(weight * 4)))]

@torch.no_grad()
def show_routes(model, idx, path, prompt):
    """Every read's heatmap over the prompt (then each route head's), and RD's JS divergences;
    DenseFormer's learned weights per layer."""
    stats = routing_stats(model(idx, return_routes=True)[2])
    if not stats["reads"]:
        raise UsageError(f"{path} is a residual={model.config.residual} model: it has no depth "
                         "routing or learned mixing weights to show (--routes needs a model that "
                         "records routes: --residual attnres, or one that mixes with learned "
                         "weights)")
    snippet = prompt if len(prompt) <= 60 else "..." + prompt[-57:]
    print(f"depth routing of {path} over a {idx.size(1)}-token prompt: {snippet!r}")
    print(f"sources: {source_legend(stats['sources'])}")
    if any(r["entropy"] is not None for r in stats["reads"].values()):
        print(f"mean weight per source in %: shade {SHADES[1]} <=25 {SHADES[2]} <=50 {SHADES[3]} "
              f"<=75 {SHADES[4]} >75, blank: not seen by that read; H: entropy of the read (nats)")
    if any(r["entropy"] is None for r in stats["reads"].values()):
        print("learned weights (no H): as they are, any real numbers, not a distribution")
    heatmap(stats["sources"], stats["reads"])
    heads = model.config.route_heads
    for k in range(heads if heads > 1 else 0):  # MHAR: head k reads with slice k of the width
        print(f"\nroute head {k} of {heads}:")
        heatmap(stats["sources"], stats["reads"], head=k)
    if stats["js"]:
        q, v = stats["js_pair"].split("‖")  # what each route feeds, from RD_MODES
        print(f"\nRD: JS divergence between the {q} and the {v} route, per attention layer (nats, "
              "at most ln 2 = 0.693)")
        for layer, js in stats["js"].items():
            print(f"  {layer:<8} {js:.4f}  " + SHADES[4] * round(40 * js / math.log(2)))
        print(f"  {'mean':<8} {stats['js_mean']:.4f}")

def heatmap(sources, reads, head=None):  # head None: the mean over route heads, and entropies
    # short source names keep a row of many sources within a terminal's width
    short = [s.replace(".phase", ".ph").replace(".split", ".sp") for s in sources]
    width, name_width = 1 + max(5, *map(len, short)), 2 + max(map(len, reads))
    print(" " * name_width + "".join(f"{s:>{width}}" for s in short) + "      H" * (head is None))
    for name, r in reads.items():
        weights = r["mean_weight"] if head is None else r["head_weight"][head]
        cells = {s: cell(w, r["entropy"] is not None) for s, w in zip(r["sources"], weights)}
        row = "".join(cells.get(s, "").rjust(width) for s in sources)  # blank: not seen
        entropy = "" if r["entropy"] is None else f"  {r['entropy']:5.2f}"
        print(f"{name:<{name_width}}{row}" + entropy * (head is None))

if __name__ == "__main__":
    main()
