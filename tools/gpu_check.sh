#!/usr/bin/env bash
# Check a GPU end to end in one command (docs/speed.md, "Checking a GPU"):
#
#     bash tools/gpu_check.sh [cpu] [RESULTS_DIR]   # default: results/gpu_check(_cpu)
#
# Four parts, in this order, each writing its own file in RESULTS_DIR as it finishes (bench.py
# rewrites its JSON as it measures), so that a time limit loses only the part it cut:
#   1. tests.txt            the CUDA tests: NANOROUTE_TEST_DEVICE=cuda python -m pytest -v -m gpu
#                           (a line per test as it ends: a cut keeps the results so far)
#   2. bench_eager.json     bench.py at gpu12 (12 layers, n_embd 768, T 1024, B 16, bf16): prenorm,
#                           block, wav, rd: ms/step, tokens/s, MFU, peak memory, first step
#   3. memory_rd_m.json     one training step's peak memory at the rd_m and wav48 shapes (B = the
#      memory_wav48.json    preset's micro-batch), next to train.py's estimate
#   4. bench_compiled_VARIANT.json  part 2 compiled (torch.compile, inductor), one bench.py per
#                           variant, with its compile time: a 12-layer model takes minutes to
#                           compile, so a time limit keeps the variants compiled and timed before it
# then summary.md, the numbers of all parts in tables. Each part has a time limit (seconds,
# below; the compiled variants share one; on an H100 the whole check takes under 9 minutes): a
# variant left no time is "not_run" in status.txt. With `cpu`, the same parts run on the CPU at
# tiny shapes, compiled with aot_eager (inductor's code generation takes minutes per model on a
# CPU).
# Settings from the environment: GPU_CHECK_TESTS (pytest's selection, default "-m gpu"),
# GPU_CHECK_ITERS (timed steps per variant), GPU_CHECK_VARIANTS (default prenorm,block,wav,rd),
# GPU_CHECK_BACKEND (torch.compile's), GPU_CHECK_LIMITS ("tests eager memory compiled", seconds).
set -u
cd "$(dirname "$0")/.."

mode=cuda
if [ "${1:-}" = cpu ]; then
    mode=cpu
    shift
fi
out=${1:-results/gpu_check$([ $mode = cpu ] && echo _cpu)}
python=${PYTHON:-python}
variants=${GPU_CHECK_VARIANTS:-prenorm,block,wav,rd}
if [ $mode = cuda ]; then
    shape=(--shape gpu12 --device cuda)
    tiny=()
    backend=${GPU_CHECK_BACKEND:-inductor}
    test_env=(NANOROUTE_TEST_DEVICE=cuda)
    iters=${GPU_CHECK_ITERS:-10}
    limits=${GPU_CHECK_LIMITS:-190 45 35 215}  # 190 + 45 + 2 x 35 + 215 = 520 s
else
    shape=(--shape tiny --device cpu)
    tiny=(--n_layer 2 --n_embd 32 --n_head 2 --sequence_len 32 --batch_size 2 --vocab_size 256
          --device cpu)
    backend=${GPU_CHECK_BACKEND:-aot_eager}
    test_env=()
    iters=${GPU_CHECK_ITERS:-3}
    limits=${GPU_CHECK_LIMITS:-300 120 120 300}
fi
read -r limit_tests limit_eager limit_memory limit_compiled extra <<< "$limits"
for limit in "$limit_tests" "$limit_eager" "$limit_memory" "$limit_compiled"; do
    if ! [[ $limit =~ ^[1-9][0-9]*$ ]] || [ -n "$extra" ]; then  # timeout 0 would mean no limit
        echo "error: GPU_CHECK_LIMITS=\"$limits\": give four whole numbers of seconds, at least 1 each" \
             "(tests eager memory compiled)" >&2
        exit 2
    fi
done
# RESULTS_DIR: new, empty, or an earlier check's (its files are replaced); never another folder's
# files, never through a link
if [ -e "$out" ] && ! { [ -d "$out" ] && [ ! -L "$out" ] && { [ -f "$out/status.txt" ] || [ -z "$(ls -A "$out")" ]; }; }; then
    echo "error: $out is not an empty folder nor an earlier check's results: give a new RESULTS_DIR" >&2
    exit 2
fi
for name in status.txt tests.txt summary.md; do
    if [ -L "$out/$name" ]; then
        echo "error: $out/$name is a link, which this check does not follow: remove it or give a new RESULTS_DIR" >&2
        exit 2
    fi
done
mkdir -p "$out" || exit 2
: > "$out/status.txt"

part() {  # part NAME LIMIT COMMAND...: run it under a time limit, record its exit code and seconds
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (at most $limit s): $*"
    timeout "$limit" "$@"
    local rc=$?
    echo "$name $rc $((SECONDS - start))" >> "$out/status.txt"
    # on a line of its own: the part may have been cut in the middle of one
    [ $rc = 124 ] && printf '\n== %s: stopped at its time limit (%s s); what it wrote is kept\n' "$name" "$limit"
    return 0
}

bench=("$python" bench.py --gen_tokens 0 --iters "$iters")
# shellcheck disable=SC2086  # GPU_CHECK_TESTS is a list of pytest arguments
part tests "$limit_tests" env ${test_env[@]+"${test_env[@]}"} "$python" -m pytest -v \
    -p no:cacheprovider ${GPU_CHECK_TESTS:--m gpu} > "$out/tests.txt" 2>&1
tail -n 3 "$out/tests.txt"
part eager "$limit_eager" "${bench[@]}" --variants "$variants" "${shape[@]}" \
    --json "$out/bench_eager.json"
for preset in rd_m wav48; do
    [ $preset = rd_m ] && compared=prenorm,block,rd || compared=prenorm,block,wav
    part "memory_$preset" "$limit_memory" "$python" bench.py --preset $preset \
        --variants $compared --iters 1 --warmup 0 --gen_tokens 0 ${tiny[@]+"${tiny[@]}"} \
        --json "$out/memory_$preset.json"
done
compiled_end=$((SECONDS + limit_compiled))  # the compiled variants share one time limit
for variant in ${variants//,/ }; do
    left=$((compiled_end - SECONDS))
    if [ $left -le 0 ]; then
        echo "compiled_$variant not_run 0" >> "$out/status.txt"
        continue
    fi
    part "compiled_$variant" $left "${bench[@]}" --variants "$variant" \
        "${shape[@]}" --compile --compile_backend "$backend" --json "$out/bench_compiled_$variant.json"
done

"$python" - "$out" "$mode" "$variants" <<'EOF'
"""summary.md: every part's status and numbers, from the files the parts wrote."""
import json, sys
from pathlib import Path

out, mode, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
lines = [f"# GPU check ({mode})", "", "| part | exit code | seconds |", "|---|---|---|"]
for row in (out / "status.txt").read_text().split("\n"):
    if row:
        name, rc, seconds = row.split()
        what = {"0": "ok", "124": "124 (time limit)", "not_run": "not run (time limit used up)"}.get(rc, rc)
        lines.append(f"| {name} | {what} | {seconds} |")
tests = (out / "tests.txt").read_text().strip().splitlines() if (out / "tests.txt").exists() else []
lines += ["", f"tests: {tests[-1] if tests else 'no output'}", ""]


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def cell(value, spec):
    return "-" if value is None else format(value, spec)


def section(title, names):
    """A part's table, from its JSON files (the compiled part: one per variant)."""
    files = [data for data in map(load, names) if data is not None]
    if not files:
        return [f"## {title}: no {' or '.join(names)}", ""]
    machine, shape = files[0]["machine"], files[0]["shape"]
    done = "" if all(data.get("complete") for data in files) else " (incomplete: stopped before the end)"
    rows = [f"## {title}{done}", "", f"{machine['device_name']}, torch {machine['torch']}, "
            f"{machine['dtype']}; " + ", ".join(f"{k}={v}" for k, v in shape.items()), "",
            *(f"`{data['machine']['command']}`  " for data in files), "",
            "| variant | ms/step | tokens/s | MFU | memory MB | estimated MB | first step s | compiled |",
            "|---|---|---|---|---|---|---|---|"]
    for data in files:
        for variant, r in data["variants"].items():
            mfu = None if r.get("mfu") is None else 100 * r["mfu"]
            compiled = {None: "-", True: "yes", False: "NO (eager fallback)"}[r.get("compiled")]
            memory, estimate = r["memory_bytes"] / 2**20, r["memory_estimate_bytes"] / 2**20
            rows.append(f"| {variant} | {r['ms_median']:.1f} | {r['tokens_per_s']:.0f} | "
                        f"{cell(mfu, '.1f')} | {memory:.1f} | {estimate:.1f} | "
                        f"{r['first_step_s']:.1f} | {compiled} |")
        for variant, r in data.get("first_steps", {}).items():
            if variant not in data["variants"]:  # compiled, then the time limit came
                rows.append(f"| {variant} | - | - | - | - | - | {r['first_step_s']:.1f} | not timed |")
    return rows + [""]


lines += section("eager", ["bench_eager.json"])
lines += section("compiled", [f"bench_compiled_{v}.json" for v in variants])
lines += section("memory, rd_m", ["memory_rd_m.json"]) + section("memory, wav48", ["memory_wav48.json"])
(out / "summary.md").write_text("\n".join(lines))
print("\n".join(lines))
print(f"wrote {out}/summary.md")
EOF
