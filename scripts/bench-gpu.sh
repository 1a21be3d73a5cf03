#!/usr/bin/env bash
# The CUDA benchmarks of docs/benchmarks.md, from the prebuilt binaries in .device-bin/ (`make gpu-bins`
# where Rust is), on a GPU machine. Prints figures; asserts nothing.
#   bash scripts/bench-gpu.sh [micro] [decode] [tput128] [tput1000]   (default: all four)
#   bash scripts/bench-gpu.sh lora   (issue 16's LoRA figures: decode with 4 rank-32 adapters at batch
#   1/8/64/256, LoRA/base; prefill-heavy 1000 x 1000 in / 100 out with 4 adapters Zipf(1); 128/128 with
#   16 adapters Zipf(1); each printed beside the base run of the same workload)
#   bash scripts/bench-gpu.sh encoder   (MiniLM on the CUDA encoder, the forward alone and through the
#   server, bf16 and f32, and on torch fp32/fp16 where python3 has torch + transformers; ENC or
#   PEREGRINE_TEST_ENCODER names the folder)
# MAX_NUM_SEQS (default 256) and MAX_NUM_BATCHED_TOKENS (default 8192) set the scheduler's limits of
# the `throughput` runs; THROUGHPUT_ARGS adds other flags.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=.device-bin
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-/usr/local/cuda/lib64:/usr/local/nvidia/lib64}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
what=("$@"); [ ${#what[@]} -eq 0 ] && what=(micro decode tput128 tput1000)
tput() {  # input output [extra flags]
  local i=$1 o=$2; shift 2
  "$bin/peregrine-agent" throughput --model scripts/shapes/llama-3.1-8b.json --load-format dummy --device cuda \
    --num-prompts 1000 --input-len "$i" --output-len "$o" --max-model-len 2048 \
    --max-num-seqs "${MAX_NUM_SEQS:-256}" --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-8192}" ${THROUGHPUT_ARGS:-} "$@"
}
for w in "${what[@]}"; do
  echo "=== $w"
  case $w in
    micro) "$bin/micro" ;;
    decode) "$bin/cuda_bench" ;;
    tput128) tput 128 128 ;;
    tput1000) tput 1000 1000 ;;
    lora)
      "$bin/peregrine-agent" bench --model scripts/shapes/llama-3.1-8b.json --load-format dummy --device cuda \
        --context-len 128 --decode-tokens 128 --repeat 2 --max-model-len 2048 \
        --lora 4 --lora-rank 32 --max-lora-rank 32 --zipf-s 0 --batch-sizes 1,8,64,256
      MAX_NUM_SEQS=1024 MAX_NUM_BATCHED_TOKENS=16384 tput 1000 100 --lora 4 --lora-rank 32 --lora-dist zipf:1
      MAX_NUM_SEQS=1024 MAX_NUM_BATCHED_TOKENS=16384 tput 128 128 --lora 16 --max-loras 16 --lora-rank 32 --lora-dist zipf:1 ;;
    encoder)
      enc="${ENC:-${PEREGRINE_TEST_ENCODER:?set ENC to the all-MiniLM-L6-v2 folder}}"
      "$bin/encoder_bench" "$enc" --device cuda --gemm bf16 --forward-only
      "$bin/encoder_bench" "$enc" --device cuda --gemm f32 --forward-only
      python3 scripts/bench_torch_encoder_gpu.py "$enc" float16 --model-only
      "$bin/encoder_bench" "$enc" --device cuda --gemm bf16 --reps 4
      "$bin/encoder_bench" "$enc" --device cuda --gemm f32
      python3 scripts/bench_torch_encoder_gpu.py "$enc" float32
      python3 scripts/bench_torch_encoder_gpu.py "$enc" float16 ;;
    *) echo "unknown benchmark $w" >&2; exit 2 ;;
  esac
done
