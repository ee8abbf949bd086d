#!/usr/bin/env bash
# Check a machine with one CUDA GPU in one command (docs/speed.md, "Checking a GPU"):
#     bash tools/gpu_check.sh [RESULTS_DIR]     # default results/gpu_check
#     bash tools/gpu_check.sh cpu RESULTS_DIR   # the same parts on the CPU, tiny, aot_eager
# Each part has its own time limit and its own files, so a limit loses only that part (520 s in
# all): tests.txt (the GPU tests), bench_eager.json (gpu12: prenorm, block, wav, rd),
# bench_compiled.json (inductor: prenorm, block), memory_rd_m.json and memory_wav48.json (one
# step at each preset's shape: its real peak memory); then summary.md, the numbers of all parts.
set -u
cd "$(dirname "$0")/.."
python=${PYTHON:-python} mode=cuda
[ "${1:-}" = cpu ] && mode=cpu && shift
out=${1:-results/gpu_check}
if [ $mode = cuda ]; then
    export NANOROUTE_TEST_DEVICE=cuda
    device=(--device cuda) shape=(--shape gpu12) small=() backend=inductor iters=10
else  # every part in seconds, one thread each: the test suite runs it
    export OMP_NUM_THREADS=1
    device=(--device cpu) shape=(--shape tiny) backend=aot_eager iters=2
    small=(--n_layer 2 --n_embd 32 --n_head 2 --sequence_len 32 --batch_size 2)
fi
if [ -e "$out" ] && [ ! -f "$out/status.txt" ] && [ -n "$(ls -A "$out")" ]; then
    echo "error: $out is neither empty nor an earlier check's results: give a new RESULTS_DIR" >&2
    exit 2
fi
mkdir -p "$out" && : > "$out/status.txt" && rm -f "$out"/*.json || exit 2  # an earlier check's
part() {  # part NAME SECONDS COMMAND...: its output in NAME.txt, its exit code and seconds noted
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (at most $limit s): $*"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "$name $? $((SECONDS - start))" >> "$out/status.txt"
}
bench=("$python" bench.py "${device[@]}" --gen_tokens 0)
part tests 160 "$python" -m pytest -q -p no:cacheprovider -m gpu
part bench_eager 70 "${bench[@]}" "${shape[@]}" --variants prenorm,block,wav,rd --iters $iters \
    --json "$out/bench_eager.json"
part bench_compiled 210 "${bench[@]}" "${shape[@]}" --variants prenorm,block --iters $iters \
    --compile --compile_backend $backend --json "$out/bench_compiled.json"
for preset in rd_m wav48; do  # prenorm, block and the preset's own variant (rd, wav)
    part "memory_$preset" 40 "${bench[@]}" --preset $preset ${small[@]+"${small[@]}"} --iters 1 \
        --warmup 0 --variants "prenorm,block,${preset%%[0-9_]*}" --json "$out/memory_$preset.json"
done

"$python" - "$out" > "$out/summary.md" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("# GPU check\n\n| part | exit code | seconds |\n|---|---|---|")
for name, code, seconds in (row.split() for row in (out / "status.txt").read_text().splitlines()):
    print(f"| {name} | {code}{' (time limit)' * (code == '124')} | {seconds} |")
print(f"\ntests: {((out / 'tests.txt').read_text().strip().splitlines() or ['-'])[-1]}")
for name in ("bench_eager", "bench_compiled", "memory_rd_m", "memory_wav48"):
    if not (out / f"{name}.json").exists():
        print(f"\n## {name}: no results")
        continue
    data = json.loads((out / f"{name}.json").read_text())
    m, cut = data["machine"], "" if data["complete"] else " (cut short)"
    print(f"\n## {name}{cut}\n\n{m['device_name']}, torch {m['torch']}, {m['dtype']}: "
          f"`{m['command']}`\n\n| variant | ms/step | tokens/s | / prenorm | / block | MFU | "
          "memory MB | first step s | compiled |\n|---|---|---|---|---|---|---|---|---|")
    for v, r in data["variants"].items():
        cells = [(r["ms_median"], ".1f"), (r["tokens_per_s"], ".0f"), (r["ratio_prenorm"], ".3f"),
                 (r["ratio_block"], ".3f"), (r["mfu"] and 100 * r["mfu"], ".1f"),
                 (r["memory_bytes"] / 2**20, ".0f"), (r["first_step_s"], ".1f")]
        print(f"| {v} | " + " | ".join("-" if c is None else format(c, f) for c, f in cells)
              + f" | {r.get('compiled', '-')} |")
EOF
cat "$out/summary.md"
