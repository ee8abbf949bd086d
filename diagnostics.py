"""
Routing diagnostics: what the routes of model(..., return_routes=True) say. routing_stats sums them
up per read (mean weights, weights per route head, entropy, RD's JS divergence); source_block and
source_legend order and name the sources. train.py, sample.py and experiments.py print these; a
user's analysis can start from them (docs/model.md). They read routes, not the model: nanoroute.py
holds the model alone.
"""

import math
import re

import torch

from nanoroute import WAV_BASES

# What a source's name says, for legends: a letter and a number (C<i>: block i), or a word; then
# what a suffix after its dot says (WAV's details, one per basis of WAV_BASES). A name not here is
# "named by the model"
SOURCE_KINDS = {"emb": "embedding", "C": "completed block i", "P": "partial block",
                "L": "layer i's output",
                **{f".{b}": f"WAV detail ({b} basis)"
                   for bases in WAV_BASES.values() for b in bases}}

def source_block(name):
    """The block of a source, by its name: -1 for emb, b for C<b> (L<b>) and its details, inf for P
    and any other name (pool order; a read in block b sees C<j> of age b - j)."""
    block = name.partition(".")[0]
    numbered = re.fullmatch(r"[A-Za-z]+(\d+)", block)
    return -1 if block == "emb" else int(numbered[1]) if numbered else math.inf

def source_legend(sources):
    """"emb: embedding, C<i>: completed block i, .phase: ..." for the kinds of name and suffix in
    `sources`, in pool order."""
    kinds = {}  # "C<i>": "C", "emb": "emb", ".phase": ".phase", in pool order
    for source in sources:
        block, dot, suffix = source.partition(".")
        kind = re.sub(r"\d+$", "", block)
        kinds[f"{kind}<i>" if kind != block else block] = kind
        if dot:  # a source of a block, C0.phase: the suffix says which
            kinds[dot + suffix] = dot + suffix
    return ", ".join(f"{label}: {SOURCE_KINDS.get(kind, 'named by the model')}"
                     for label, kind in kinds.items())

# The run-level numbers of routing_stats, each a column of experiments.py's report, whose heading
# defines it from here; "over reads": a mean over the reads named in "entropy_reads" (the report
# warns where rows' reads differ). routing_stats refuses a number that is not here
ROUTE_NUMBERS = {"entropy_norm_mean": dict(over_reads=True, about="the route entropy normalised"),
                 "js_mean": dict(over_reads=False, about="RD's route feeding the queries vs the "
                                 "values' (which, in brackets), nats")}

def js_divergence(p, q):
    """Jensen-Shannon divergence (nats, ≤ ln 2) of two routes (S, ...), mean over the rest."""
    p, q = p.double(), q.double()
    mid = 0.5 * (p + q)
    kl = lambda a: (torch.xlogy(a, a) - torch.xlogy(a, mid)).sum(0)  # noqa: E731
    return (0.5 * kl(p) + 0.5 * kl(q)).clamp(min=0).mean().item()

def routing_stats(routes):
    """Summary of model(..., return_routes=True)'s routes. "reads": {name: {"role", "sources",
    "mean_weight" (per source, mean over tokens and route heads), "head_weight" (per head, per
    source), "entropy" (nats, mean over tokens and heads; None where the route says
    distribution=False: DenseFormer's weights), "entropy_norm" (entropy / ln(number of sources):
    1 = uniform, so pools of different sizes compare; None for one source or no entropy)}};
    "sources": every source, in pool order; "entropy_norm_mean": over the reads of more than one
    source that every variant has (one a sublayer, RD: the one feeding the queries, and the
    readout), named in "entropy_reads"; "js": {"layer{j}": nats} (RD: the route feeding the
    queries vs the one feeding the values; not where both read one source, 0 by construction:
    layer 0's read e alone), "js_mean", "js_pair": what the two routes feed, e.g. "QK‖V"
    (RD_MODES says it), None without two routes."""
    reads = {}
    for r in routes:
        w, n = r["weights"], len(r["sources"])  # (S, B, T, H)
        entropy = None  # for learned weights (DenseFormer's), not a distribution
        if r.get("distribution", True):
            entropy = max(0.0, -torch.xlogy(w, w).sum(0).mean().item())  # max: no -0.0
        reads[r["name"]] = dict(role=r["read"].role, feeds=r.get("feeds", ""),
                                sources=r["sources"], mean_weight=w.mean((1, 2, 3)).tolist(),
                                head_weight=w.mean((1, 2)).t().tolist(), entropy=entropy,
                                entropy_norm=None if n == 1 or entropy is None else
                                entropy / math.log(n))
    # sorted by block (stable: a block keeps its own order, C0, C0.phase, C0.split)
    sources = sorted(dict.fromkeys(s for r in routes for s in r["sources"]), key=source_block)
    queries = {r["read"].layer: r for r in routes if "Q" in r.get("feeds", "")}
    values = {r["read"].layer: r for r in routes if "V" in r.get("feeds", "")}
    pairs = {j: (queries[j], values[j]) for j in queries if values[j] is not queries[j]}
    js = {f"layer{j}": js_divergence(q["weights"], v["weights"])
          for j, (q, v) in pairs.items() if len(q["sources"]) > 1}
    pair = next((f"{q['feeds']}‖{v['feeds']}" for q, v in pairs.values()), None)
    # a read that feeds keys or values alone is RD's extra route: the other variants lack it
    norms = {name: s["entropy_norm"] for name, s in reads.items()
             if s["entropy_norm"] is not None and ("Q" in s["feeds"] or not s["feeds"])}
    stats = dict(reads=reads, sources=sources, js=js, js_pair=pair,
                 js_mean=sum(js.values()) / len(js) if js else None,
                 entropy_norm_mean=sum(norms.values()) / len(norms) if norms else None,
                 entropy_reads=sorted(norms))  # the reads of that mean: a report compares like ones
    # a new number would be a report column that its heading never defines
    undefined = [k for k, v in stats.items() if isinstance(v, float) and k not in ROUTE_NUMBERS]
    if undefined:
        raise ValueError(f"routing_stats: {', '.join(undefined)}: define each in "
                         "diagnostics.ROUTE_NUMBERS (the report's heading says what it is)")
    return stats
