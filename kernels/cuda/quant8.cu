// Per-token 8-bit activation quantization for the W8A8 linears (`--quantization fp8|int8`, issue 17),
// fused into the kernels that produce the activations so that no extra pass over memory is needed:
//
// - add_rmsnorm_quant_{e4m3,i8}: add_rmsnorm (rmsnorm.cu) that also writes the normalized row's
//   8-bit codes and its scale (input of q|k|v and gate|up);
// - silu_mul_quant_{e4m3,i8}: silu_mul (silu_mul.cu) with one block per row, likewise (input of down),
//   optionally rotated first (the online Walsh–Hadamard of `--quantization-rotation`);
// - attn_out_rows_written: called by the attention kernels once a block has written its share of the
//   attention output, quantizes each token's row in the block that completes it (input of o);
// - quant_rows_{e4m3,i8}: bf16 rows -> 8-bit codes (weights at load, and the attention output where
//   the kernels above cannot: after the rotation back of `--kv-cache-dtype fp8-hadamard-qkv`).
//
// Every row gets scale = max |v| / Q (Q = 448 for e4m3, 127 for int8; 0 for a zero row) and codes
// encode(v / scale), as the CPU's `rowquant::quantize_activations`: e4m3 rounds to nearest even and
// saturates (f2e4m3, rope_kv.cu), int8 rounds to nearest even and clamps to ±127. The fused kernels
// quantize the f32 value before any bf16 rounding (the CPU backend quantizes its f32 activations);
// their bf16 output is still written for the LoRA updates, which read bf16.
// silu uses expf, not __expf, for the same reason.
// Each row is one block's, held in registers (common.cuh's row chunks), so the values, their scale
// and their codes come from one read of the inputs.

#define Q8_E4M3 0
#define Q8_I8 1

template <int FMT>
__device__ __forceinline__ float q8_max() {
    return FMT == Q8_E4M3 ? 448.f : 127.f;
}

template <int FMT>
__device__ __forceinline__ unsigned char q8_encode(float v) {
    if (FMT == Q8_E4M3) return f2e4m3(v);
    const int q = min(max(__float2int_rn(v), -127), 127);
    return (unsigned char)(signed char)q;
}

// Max over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_max(float v, float* scratch /* >= 33 floats */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = (threadIdx.x < nwarps) ? scratch[threadIdx.x] : 0.f;
    if (warp == 0) {
        t = warp_max(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    const float r = scratch[32];
    __syncthreads();
    return r;
}

template <int FMT>
__device__ __forceinline__ float q8_scale(float amax) {
    return amax > 0.f ? amax / q8_max<FMT>() : 0.f;
}

// Codes of the 8 values v / scale (zeros for a zero row), stored as 8 bytes.
template <int FMT>
__device__ __forceinline__ void st8_codes(unsigned char* p, const float (&v)[8], float scale) {
    u32 w[2] = {0u, 0u};
    if (scale > 0.f) {
#pragma unroll
        for (int t = 0; t < 8; ++t) w[t >> 2] |= (u32)q8_encode<FMT>(v[t] / scale) << (8 * (t & 3));
    }
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
}

// The row's scale from the block's values (every thread's |v| max), written by thread 0, then the
// codes of the thread's chunks.
template <int FMT>
__device__ __forceinline__ void quantize_row_regs(const float (&v)[ROW_MAXC][8], int chunks, float amax, unsigned char* qr,
                                                  float* scale_out, float* scratch) {
    const float scale = q8_scale<FMT>(block_max(amax, scratch));
    if (threadIdx.x == 0) *scale_out = scale;
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) st8_codes<FMT>(qr + 8 * c, v[i], scale);
    }
}

// One block per row, the row in registers (common.cuh): hidden % 8 == 0, hidden ≤ 8 · ROW_MAXC ·
// blockDim.x. `out` may be null (no bf16 copy wanted). dws not null: delta is an 8-bit GEMM's
// unscaled output, scaled here by dxs[row] · dws[j] (scale_outer below, fused), or, with delta_i32,
// an int8 GEMM's int32 sums at delta_i32 instead (scale_outer_i32, fused). The token scale is read
// before this block overwrites scales[row] (dxs and scales may be the same buffer).
template <int FMT>
__device__ __forceinline__ void add_rmsnorm_quant_impl(float* __restrict__ residual, const bf16_t* __restrict__ delta,
                                                       const float* __restrict__ weight, bf16_t* __restrict__ out,
                                                       unsigned char* __restrict__ q, float* scales,
                                                       int hidden, float eps, const bf16_t* __restrict__ lora_d,
                                                       const int* __restrict__ lora_slots, const float* dxs,
                                                       const float* __restrict__ dws, const int* __restrict__ delta_i32) {
    __shared__ float scratch[33];
    pdl_trigger();  // the GEMV after this may start streaming its weights now
    const u64 row = blockIdx.x;
    const int chunks = hidden >> 3;
    float* x = residual + row * hidden;
    const bf16_t* d = delta ? delta + row * hidden : nullptr;
    const int* di = delta_i32 ? delta_i32 + row * hidden : nullptr;
    const bf16_t* ld = lora_delta_row(lora_d, lora_slots, row, hidden);
    const float sx = dws ? dxs[row] : 1.f;
    float v[ROW_MAXC][8];
    const float ss = residual_add_row(x, d, di, ld, sx, dws, chunks, v);
    // 1 / sqrt and w * (x * inv), as the CPU's rms_norm (rsqrtf would differ in the last bits).
    const float inv = 1.f / sqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) {
            float w[8];
            ld8_f32(weight + 8 * c, w);
#pragma unroll
            for (int t = 0; t < 8; ++t) {
                v[i][t] = w[t] * (v[i][t] * inv);
                amax = fmaxf(amax, fabsf(v[i][t]));
            }
            if (out) st8_bf16(out + row * hidden + 8 * c, v[i]);
        }
    }
    quantize_row_regs<FMT>(v, chunks, amax, q + row * hidden, scales + row, scratch);
}

// x <- H8 x for 8 values in registers (Sylvester's butterflies at strides 1, 2, 4, unnormalized).
__device__ __forceinline__ void hadamard8(float (&v)[8]) {
#pragma unroll
    for (int len = 1; len < 8; len <<= 1) {
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            if ((t & len) == 0) {
                const float a = v[t], b = v[t + len];
                v[t] = a + b;
                v[t + len] = a - b;
            }
        }
    }
}

// The row's values x <- H x, H the normalized Walsh–Hadamard matrix of each block of `had` values
// (a power of two >= 8 dividing the row; v zero past the row). Each stride where it is cheapest:
// 1-4 within a thread's 8 values, 8-128 across the lanes of a warp (a warp's 32 chunks are 256
// consecutive values) by shuffles, 256 and up (had > 256 only) in one pass over `row` (dynamic
// shared memory, 8 · chunks floats), each thread taking one column of had / 256 values. The
// butterflies are the CPU's (hadamard::rotate_heads), in its order of strides, and the
// normalization after them too: the results are the CPU's bit for bit.
__device__ __forceinline__ void hadamard_blocks_row(float (&v)[ROW_MAXC][8], int chunks, int had, float* row) {
    const int lane = threadIdx.x & 31;
    const int lane_span = min(had, 256) >> 3;  // chunks of a block within one warp
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        // Warp-uniform: every lane shuffles, lanes past the row hold zeros that no valid lane reads
        // (chunks is a multiple of had / 8, so groups of lane_span lanes are whole blocks or none).
        if (i * (int)blockDim.x + (int)(threadIdx.x & ~31u) < chunks) {
            hadamard8(v[i]);
            for (int m = 1; m < lane_span; m <<= 1) {
                const bool upper = lane & m;
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    const float o = __shfl_xor_sync(0xffffffffu, v[i][t], m);
                    v[i][t] = upper ? o - v[i][t] : v[i][t] + o;
                }
            }
        }
    }
    if (had > 256) {
#pragma unroll
        for (int i = 0; i < ROW_MAXC; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < chunks) {
#pragma unroll
                for (int t = 0; t < 8; ++t) row[8 * c + t] = v[i][t];
            }
        }
        __syncthreads();
        // Column p: values k·had + o + 256·j (j < r) of block k = p / 256, offset o = p % 256.
        const int r = had >> 8;
        for (int p = threadIdx.x; p < 8 * chunks / r; p += blockDim.x) {
            float* col = row + (p >> 8) * had + (p & 255);
            float x[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = j < r ? col[256 * j] : 0.f;
#pragma unroll
            for (int len = 1; len < 8; len <<= 1) {
                if (len < r) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        if ((j & len) == 0) {
                            const float a = x[j], b = x[j + len];
                            x[j] = a + b;
                            x[j + len] = a - b;
                        }
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < r) col[256 * j] = x[j];
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ROW_MAXC; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < chunks) {
#pragma unroll
                for (int t = 0; t < 8; ++t) v[i][t] = row[8 * c + t];
            }
        }
    }
    const float norm = 1.f / sqrtf((float)had);
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
#pragma unroll
        for (int t = 0; t < 8; ++t) v[i][t] *= norm;
    }
}

// One block per row as above (inter % 8 == 0); `out` may be null; gate_up unscaled when dws is not
// null (dws: the 2·inter row scales of [gate; up]), read as int32 sums from gate_up_i32 when that is
// not null. had > 0: the SwiGLU output is rotated by the block-diagonal Walsh–Hadamard matrix of
// blocks of `had` before its scale, codes and bf16 copy (down_proj's online rotation,
// `--quantization-rotation`; blocks over 256 need 4 · inter bytes of dynamic shared memory).
template <int FMT>
__device__ __forceinline__ void silu_mul_quant_impl(bf16_t* __restrict__ out, unsigned char* __restrict__ q,
                                                    float* scales, const bf16_t* __restrict__ gate_up,
                                                    int inter, const bf16_t* __restrict__ lora_d,
                                                    const int* __restrict__ lora_slots, const float* dxs,
                                                    const float* __restrict__ dws, const int* __restrict__ gate_up_i32,
                                                    int had) {
    __shared__ float scratch[33];
    extern __shared__ float silu_had_row[];
    pdl_trigger();
    const u64 row = blockIdx.x;
    const float sx = dws ? dxs[row] : 1.f;
    const int chunks = inter >> 3;
    const bf16_t* g = gate_up + row * 2 * inter;
    const bf16_t* u = g + inter;
    const int* gi = gate_up_i32 ? gate_up_i32 + row * 2 * inter : nullptr;
    const int* ui = gi ? gi + inter : nullptr;
    // The LoRA update of gate|up (silu_mul.cu), added to gate and up before SwiGLU.
    const bf16_t* ld = lora_delta_row(lora_d, lora_slots, row, 2 * (u64)inter);
    float v[ROW_MAXC][8] = {};
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) {
            float gv[8], uv[8];
            ld8_delta_scaled(g + 8 * c, gi ? gi + 8 * c : nullptr, gv, sx, dws ? dws + 8 * c : nullptr);
            ld8_delta_scaled(u + 8 * c, ui ? ui + 8 * c : nullptr, uv, sx, dws ? dws + inter + 8 * c : nullptr);
            if (ld) {
                add8_bf16(ld + 8 * c, gv);
                add8_bf16(ld + inter + 8 * c, uv);
            }
#pragma unroll
            for (int t = 0; t < 8; ++t) v[i][t] = gv[t] / (1.f + expf(-gv[t])) * uv[t];
        }
    }
    if (had > 0) hadamard_blocks_row(v, chunks, had, silu_had_row);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) {
#pragma unroll
            for (int t = 0; t < 8; ++t) amax = fmaxf(amax, fabsf(v[i][t]));
            if (out) st8_bf16(out + row * inter + 8 * c, v[i]);
        }
    }
    quantize_row_regs<FMT>(v, chunks, amax, q + row * inter, scales + row, scratch);
}

#define Q8_FAMILY(SUFFIX, FMT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) add_rmsnorm_quant_##SUFFIX(float* residual, const bf16_t* delta, const float* weight, \
                                                          bf16_t* out, unsigned char* q, float* scales, int hidden,  \
                                                          float eps, const bf16_t* lora_d, const int* lora_slots,    \
                                                          const float* dxs, const float* dws, const int* delta_i32) { \
        add_rmsnorm_quant_impl<FMT>(residual, delta, weight, out, q, scales, hidden, eps, lora_d, lora_slots, dxs, dws,  \
                                    delta_i32);                                                                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(1024) silu_mul_quant_##SUFFIX(bf16_t* out, unsigned char* q, float* scales,                 \
                                                       const bf16_t* gate_up, int inter, const bf16_t* lora_d,       \
                                                       const int* lora_slots, const float* dxs, const float* dws,    \
                                                       const int* gate_up_i32, int had) {                            \
        silu_mul_quant_impl<FMT>(out, q, scales, gate_up, inter, lora_d, lora_slots, dxs, dws, gate_up_i32, had);    \
    }
Q8_FAMILY(e4m3, Q8_E4M3)
Q8_FAMILY(i8, Q8_I8)

// bf16 rows -> 8-bit codes and one scale per row (the attention output, weights at load): one block
// per row as above (k % 8 == 0).
template <int FMT>
__device__ __forceinline__ void quant_rows_impl(unsigned char* __restrict__ q, float* __restrict__ scales,
                                                const bf16_t* __restrict__ x, int k) {
    __shared__ float scratch[33];
    pdl_trigger();
    const u64 row = blockIdx.x;
    const int chunks = k >> 3;
    float v[ROW_MAXC][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) {
            ld8_bf16(x + row * k + 8 * c, v[i]);
#pragma unroll
            for (int t = 0; t < 8; ++t) amax = fmaxf(amax, fabsf(v[i][t]));
        }
    }
    quantize_row_regs<FMT>(v, chunks, amax, q + row * k, scales + row, scratch);
}
// The attention output's quantizer (issue 17: every 8-bit input quantized inside the kernel that
// produces it). A token's attention output row (hq · d values) is written by several blocks (one per
// KV head, or per query head in attention_combine), so no block sees the whole row while it computes.
// Instead each block, once its writes are out, counts itself in a per-token counter; the block that
// completes a row (gridDim.y blocks write each one) reads the row back from L2 and writes its codes
// and scale, exactly as quant_rows would (the max of |v| does not depend on the order it is taken
// in), then sets the counter back to 0 for the next launch. No extra launch, no pass over HBM.
struct AttnOutQuant {
    unsigned char* q;  // [tokens, row_len] codes; null: the kernel does not quantize its output
    float* scales;     // [tokens]
    int* counters;     // [tokens], 0 between launches
    int fmt;           // Q8_E4M3 or Q8_I8
    int pad;
};

// One row of bf16 values written by other blocks of this launch (read through L2, not the
// non-coherent read-only path) -> codes and scale, by the whole block (blockDim.x a multiple of 32).
template <int FMT>
__device__ __forceinline__ void quantize_row_l2(const bf16_t* x, int k, unsigned char* q, float* scale_out, float* scratch) {
    const int chunks = k >> 3;
    float amax = 0.f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        bf16x8_to_f32(__ldcg(reinterpret_cast<const uint4*>(x) + c), v);
#pragma unroll
        for (int t = 0; t < 8; ++t) amax = fmaxf(amax, fabsf(v[t]));
    }
    const float scale = q8_scale<FMT>(block_max(amax, scratch));
    if (threadIdx.x == 0) *scale_out = scale;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        bf16x8_to_f32(__ldcg(reinterpret_cast<const uint4*>(x) + c), v);
        st8_codes<FMT>(q + 8 * c, v, scale);
    }
}

// The counting and the quantization, out of line (one call per block, so the attention kernels'
// register allocation does not carry it).
__device__ __noinline__ void attn_out_rows_count(unsigned char* q, float* scales, int* counters, int fmt, const bf16_t* out,
                                                 int row_len, int t0, int count) {
    __shared__ float scratch[33];
    __shared__ unsigned long long completed;
    __syncthreads();  // the block's writes of the rows, before thread 0 counts the block
    if (threadIdx.x == 0) {
        __threadfence();  // cumulative: covers the writes the barrier ordered before it
        unsigned long long mask = 0ull;
        for (int i = 0; i < count; ++i)
            if (atomicAdd(counters + t0 + i, 1) == (int)gridDim.y - 1) mask |= 1ull << i;
        completed = mask;
    }
    __syncthreads();
    const unsigned long long mask = completed;
    if (mask == 0ull) return;
    __threadfence();  // the other blocks' writes, seen through their counts
    for (int i = 0; i < count; ++i) {
        if (!((mask >> i) & 1ull)) continue;
        const u64 t = (u64)(t0 + i);
        if (fmt == Q8_I8) quantize_row_l2<Q8_I8>(out + t * row_len, row_len, q + t * row_len, scales + t, scratch);
        else quantize_row_l2<Q8_E4M3>(out + t * row_len, row_len, q + t * row_len, scales + t, scratch);
        if (threadIdx.x == 0) counters[t] = 0;
    }
}

// Called by every thread of a block after it has written its share of the output rows of tokens t0 ..
// t0 + count - 1 (count ≤ 64; rows of row_len bf16, row_len % 8 == 0). Block-uniform arguments.
__device__ __forceinline__ void attn_out_rows_written(const AttnOutQuant& aq, const bf16_t* out, int row_len, int t0, int count) {
    if (aq.q != nullptr) attn_out_rows_count(aq.q, aq.scales, aq.counters, aq.fmt, out, row_len, t0, count);
}

extern "C" __global__ void __launch_bounds__(1024) quant_rows_e4m3(unsigned char* q, float* scales, const bf16_t* x, int k) {
    quant_rows_impl<Q8_E4M3>(q, scales, x, k);
}
extern "C" __global__ void __launch_bounds__(1024) quant_rows_i8(unsigned char* q, float* scales, const bf16_t* x, int k) {
    quant_rows_impl<Q8_I8>(q, scales, x, k);
}

// The outer-scale epilogues below: each thread owns 8 consecutive outputs of a row (16 or 32 bytes),
// row i, columns j0..j0+8 (n a multiple of 8); false past the end.
__device__ __forceinline__ bool outer8_index(int m, int n, u64& i, int& j0) {
    const u64 per_row = (u64)(n >> 3);
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)m * per_row) return false;
    i = idx / per_row;
    j0 = (int)(idx - i * per_row) << 3;
    return true;
}

// Writes r[0..8] at element `at` of y (f32, or bf16 rounded to nearest even).
__device__ __forceinline__ void store8(void* y, int y_f32, u64 at, const float* r) {
    if (y_f32) {
        float4* p = reinterpret_cast<float4*>(static_cast<float*>(y) + at);
        p[0] = make_float4(r[0], r[1], r[2], r[3]);
        p[1] = make_float4(r[4], r[5], r[6], r[7]);
    } else {
        u32 w[4];
#pragma unroll
        for (int t = 0; t < 4; t++) w[t] = (u32)f2bf(r[2 * t]) | ((u32)f2bf(r[2 * t + 1]) << 16);
        *reinterpret_cast<uint4*>(static_cast<bf16_t*>(y) + at) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// y[i, j] *= xs[i] * ws[j] in place (y bf16 or f32): the row and token scales of a W8A8 GEMM that ran
// unscaled (cuBLASLt's FP8 GEMM where it offers no per-row scaling).
extern "C" __global__ void __launch_bounds__(256) scale_outer(void* __restrict__ y, int y_f32, const float* __restrict__ xs,
                                                             const float* __restrict__ ws, int m, int n) {
    u64 i;
    int j0;
    if (!outer8_index(m, n, i, j0)) return;
    const u64 at = i * (u64)n + j0;
    float r[8];
    if (y_f32) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(y) + at);
        const float4 a = p[0], b = p[1];
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int t = 0; t < 8; t++) r[t] = v[t];
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const bf16_t*>(y) + at);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int t = 0; t < 4; t++) {
            r[2 * t] = bf2f((bf16_t)(w[t] & 0xffffu));
            r[2 * t + 1] = bf2f((bf16_t)(w[t] >> 16));
        }
    }
    const float sx = xs[i];
#pragma unroll
    for (int t = 0; t < 8; t++) r[t] *= sx * ws[j0 + t];
    store8(y, y_f32, at, r);
}

// y[i, j] = acc[i, j] · xs[i] · ws[j] (y bf16 or f32; acc the exact int32 sums of an int8 GEMM that
// ran unscaled): the epilogue of cuBLASLt's int8 GEMM, the same expression in the same order as
// gemm_w8a8's int8 epilogue.
extern "C" __global__ void __launch_bounds__(256) scale_outer_i32(void* __restrict__ y, int y_f32, const int* __restrict__ acc,
                                                                 const float* __restrict__ xs, const float* __restrict__ ws, int m, int n) {
    u64 i;
    int j0;
    if (!outer8_index(m, n, i, j0)) return;
    const u64 at = i * (u64)n + j0;
    const int4* a = reinterpret_cast<const int4*>(acc + at);
    const int4 a0 = a[0], a1 = a[1];
    const int v[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const float sx = xs[i];
    float r[8];
#pragma unroll
    for (int t = 0; t < 8; t++) r[t] = (float)v[t] * sx * ws[j0 + t];
    store8(y, y_f32, at, r);
}
