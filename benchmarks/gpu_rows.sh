#!/usr/bin/env bash
# The benchmarks' rows on a real accelerator (issue 33), Keras on JAX, in one short run:
#
#     OUT=DIR [QUICK=1] bash benchmarks/gpu_rows.sh [ROW ...]
#
# from the repository root, on a machine whose JAX sees a GPU or TPU (no TensorFlow needed).
# ROWs (default: cnn lstm lora steps): cnn and lstm are bench_train.py (hand-written fit, the
# magic, a raw jax.jit loop; samples/s, TFLOP/s against the measured peak, the nominal peak in
# the JSON), cnn_auto the CNN under `--precision auto`, lora is bench_lora.py (tokens/s, MFU;
# plain Keras, the magic on NumPy and on grain), steps is bench_steps.py (the MLP at K = 1, 8,
# 32 against an on-device scan), first_cell is bench_first_cell.py on the chip (the whole
# first cell, the same cell again and after a restart, beside plain Keras: the MLP and the
# small Gemma LoRA cell), big_step is bench_big_step.py (a Gemma-2B-wide causal LM whose
# full fine-tuning step does not fit the chip: plain Keras, then the magic's memory plan). Sizes suit a chip, not the 2-core CPU: 128 a replica and 256
# steps a round (an epoch of CIFAR-10 at batch 128 is 390), 3 rounds; QUICK=1 runs 2 rounds of
# bench_train and 1 of the others, for a short lease. Each row has its own time limit, so one
# that hangs does not take the rest; each writes OUT/ROW.json.
set -u
OUT=${OUT:-bench_results/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2

row() {  # row NAME SECONDS SCRIPT ARGS...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S)): $*"
    timeout "$limit" "$PY" "$@" --json "$OUT/$name.json" || echo "== $name: ended with $?"
}

if [ "${QUICK:-}" = 1 ]; then train_rounds=(--quick) rounds=1; else train_rounds=() rounds=2; fi
train=(--per-replica 128 --steps 256 --attempts 1 "${train_rounds[@]}")
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(cnn lstm lora steps)
for name in "${rows[@]}"; do
    case $name in
        cnn) row cnn 300 benchmarks/bench_train.py --backend jax --model cnn "${train[@]}" ;;
        cnn_auto) row cnn_auto 300 benchmarks/bench_train.py --backend jax --model cnn \
                      "${train[@]}" --precision auto ;;
        lstm) row lstm 300 benchmarks/bench_train.py --backend jax --model lstm "${train[@]}" ;;
        lora) row lora 300 benchmarks/bench_lora.py --simulate 0 \
                  --ways plain_keras,magic_numpy,magic_grain --batch 32 --length 256 \
                  --steps 32 --rounds "$rounds" --repeats 2 ;;
        steps) row steps 240 benchmarks/bench_steps.py --ks 1,8,32 --rounds "$rounds" ;;
        first_cell) row first_cell 260 benchmarks/bench_first_cell.py --devices 0 \
                        --cells mlp,gemma --rounds 1 ;;
        big_step) row big_step 290 benchmarks/bench_big_step.py --length 4096 --batch 8 \
                      --steps 2 --layers 6 --seconds 140 ;;
        *) echo "gpu_rows: no row $name (cnn, cnn_auto, lstm, lora, steps, first_cell," \
                "big_step)"; exit 2 ;;
    esac
done
