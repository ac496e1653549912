#!/usr/bin/env bash
# The GPU check sized for one lease of the `device` tool (15 minutes of device time, start included): the
# steps of ../shared/gpu/check.sh, each under its own time limit and smaller where the full one would not fit,
# so that a failure in one step leaves time for the next. Run from the project's root after
# `bash ../shared/gpu/wheels.sh` (EXTRA_WHEELS for packages added since), with `.whl` carried:
#
#   bash benchmarks/gpu_lease.sh            # logs and JSON packed into $OUT/gpu.tgz after every step
#   GPU_LEASE_DEVICE=cpu GPU_LEASE_SMALL=1 bash benchmarks/gpu_lease.sh   # a dry run of the script on a CPU
#
# Steps ($GPU_LEASE_STEPS; default `tests kernel engine_load model1b_load tree_cost model1b_nocompile engine_profile`,
# about 9 minutes): `tests` (the CUDA graphs', the draft model's, the one-read-per-step and the batched verification's
# tests, CUDA runs instead of skips; $GPU_LEASE_TESTS for other files: the kernel's and the fast runner's took 4
# more minutes on an H100 and passed there at 6541c88, benchmarks/results/gpu_h100_3.md), `kernel`
# (benchmarks/tree_attention.py, split-KV beside the whole-key launch, each also replayed from a CUDA graph),
# `engine_single` (greedy equality with plain decoding and tokens/s on the demo pair), `engine_load` (1 and 16
# concurrent requests: fused with and without PEARL's overlap, prompt_lookup_tree, draft_model; the JSON has each
# row's verifier milliseconds per step, split into host work until the one copy and the wait in it, the host
# milliseconds per step and its CUDA-graph counts), `model1b_load` (a Llama-3.2-1B-shaped target with random
# weights, built on the device while the tests run; the defaults: --compile and --cuda-graphs on for CUDA),
# `tree_cost` (benchmarks/verifier_step.py on that model: a 16- and a 64-node tree's verifier step at batch 1, and a
# 64-node one at batch 8, against plain decoding's, 512-token contexts: issue 32's "64 nodes at batch 1 in <= 1.1x"),
# `model1b_nocompile` (graphs of the eager layers: what compiling adds to graphs), `engine_profile` (ar, fused and
# draft_model, one request, under torch.profiler: operators by host and by device time), `model1b_nographs`
# (--cuda-graphs off: what the graphs give) and `model1b_eager` (--compile off too).
# An engine step that fails within a minute is run again with `--attention sdpa`, so that a kernel failure
# does not hide the engine's other results.
set -uo pipefail
STEPS=${GPU_LEASE_STEPS:-"tests kernel engine_load model1b_load tree_cost model1b_nocompile engine_profile"}; TESTS=${GPU_LEASE_TESTS:-}
DEV=${GPU_LEASE_DEVICE:-cuda}; SMALL=${GPU_LEASE_SMALL:-0}; PY=${GPU_LEASE_PYTHON:-python3}
RESULT=${OUT:-/tmp/gpu-lease-out}; LOGS=/tmp/gpu-lease; mkdir -p "$RESULT" "$LOGS"
if [ "$DEV" != cpu ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
prompts=.whl/prompts.jsonl; [ -f "$prompts" ] || prompts=../shared/data/stdlib_functions.jsonl
pack() { tar czf "$RESULT/gpu.tgz" -C "$LOGS" . 2>/dev/null; }
summary=()
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS CMD...: run under a time limit, keep the log, print its tail, pack the results
  local name=$1 limit=$2; shift 2; echo "== $name (${limit} s): $*"; local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 20 "$LOGS/$name.log" | cut -c1-200
  summary+=("$name rc=$rc $((SECONDS - t0))s"); pack; return $rc
}
engine() {  # engine NAME SECONDS ARGS...: specmesh bench, again with --attention sdpa if it fails at once
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  step "$name" "$limit" $PY -m specmesh bench --device "$DEV" --json "$LOGS/$name.json" "$@" && return 0
  if [ $((SECONDS - t0)) -lt 60 ]; then
    step "${name}_sdpa" "$limit" $PY -m specmesh bench --device "$DEV" --attention sdpa \
      --json "$LOGS/${name}_sdpa.json" "$@"
  fi
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
  $PY -c "import triton; print('triton', triton.__version__)" 2>/dev/null; } | tee "$LOGS/host.txt"

m=/tmp/llama1b-random  # built in the background while the tests run
$PY - "$m" "$SMALL" "$DEV" >"$LOGS/model1b_build.log" 2>&1 <<'PY' &
import os, shutil, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from specmesh.models import DEMO_DIR
out, small, dev = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
demo = str(DEMO_DIR / "target")
shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8) if not small else dict(hidden_size=128, intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=8192, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=0, **shape)
with torch.device(dev):  # random initialisation of 1.2B parameters: seconds on the device, minutes on a CPU
    model = LlamaForCausalLM(cfg)
model.to(torch.bfloat16).cpu().save_pretrained(out)
for f in os.listdir(demo):
    if f.startswith(("tokenizer", "special_tokens")):
        shutil.copy(os.path.join(demo, f), out)
print("built", out)
PY
build=$!

if [ "$SMALL" = 1 ]; then lim=4; new=16; conc="1 4"; t=(300 60 120 120 120 120 120 120 120 120); kernel=(--smoke)
  tree_steps=5
else lim=16; new=128; conc="1 16"; t=(100 80 90 130 80 60 60 60 60 60); kernel=(); tree_steps=50; fi
has tests && step tests "${t[0]}" $PY -m pytest -q -p no:cacheprovider -rfE ${TESTS:-tests/test_cuda_graphs.py tests/test_draft_model.py \
  tests/test_host_transfers.py tests/test_batched_verification.py}
has kernel && step kernel "${t[1]}" $PY benchmarks/tree_attention.py "${kernel[@]}" --json "$LOGS/tree_attention.json"
has engine_single && engine engine_single "${t[2]}" --prompts "$prompts" --limit $((lim / 4)) --max-new-tokens "$new" \
  --methods ar fused prompt_lookup_tree draft_model hf_ar
has engine_load && engine engine_load "${t[3]}" --prompts "$prompts" --limit "$lim" --max-new-tokens "$new" \
  --methods ar fused fused:overlap=false prompt_lookup_tree draft_model --concurrency $conc
wait "$build"; tail -n 3 "$LOGS/model1b_build.log"
has model1b_load && engine model1b_load "${t[4]}" --prompts "$prompts" --limit "$lim" --max-new-tokens $((new / 2)) \
  --target "$m" --methods ar prompt_lookup_tree --concurrency $conc
has tree_cost && step tree_cost "${t[9]}" $PY benchmarks/verifier_step.py --model-dir "$m" --device "$DEV" \
  --dtype bfloat16 --prompt-tokens 512 --cases plain1 tree16x1 tree64x1 plain8 tree64x8 --steps "$tree_steps" \
  --json "$LOGS/tree_cost.json"
has model1b_nographs && engine model1b_nographs "${t[5]}" --prompts "$prompts" --limit "$lim" \
  --max-new-tokens $((new / 2)) --target "$m" --methods ar --concurrency $conc --cuda-graphs off
has model1b_eager && engine model1b_eager "${t[6]}" --prompts "$prompts" --limit "$lim" --max-new-tokens $((new / 2)) \
  --target "$m" --methods ar --concurrency $conc --compile off --cuda-graphs off
has model1b_nocompile && engine model1b_nocompile "${t[8]}" --prompts "$prompts" --limit "$lim" \
  --max-new-tokens $((new / 2)) --target "$m" --methods ar --concurrency $conc --compile off
has engine_profile && engine engine_profile "${t[7]}" --prompts "$prompts" --limit $((lim / 4)) \
  --max-new-tokens "$new" --methods ar fused draft_model --concurrency 1 --profile "$LOGS/profile"
echo "== summary"; printf '%s\n' "${summary[@]}" | tee "$LOGS/summary.txt"; pack
