// RoPE (rotate-half, as transformers' Llama) fused with the paged KV-cache write.
// qkv: [n, (Hq + 2*Hkv) * D] bf16, the fused q/k/v projection of each token (+ bias when not null, f32;
// an 8-bit projection's unscaled output or int32 sums with its token and row scales, see below).
// cos_t/sin_t: [max_pos, D/2] f32 tables (Llama-3 frequency scaling already applied on the host).
// slots[t] = block * block_size + offset of token t's position.
// Writes the rotated q to q_out [n, Hq*D] and the rotated k and plain v into the caches:
// - rope_kv_write: bf16 caches, both [blocks, Hkv, block_size, D];
// - rope_kv_write_fp8: e4m3 bytes (scale 1, saturating, one rounding from f32), K as
//   [blocks, Hkv, block_size, D] and V transposed within each block, [blocks, Hkv, D, block_size]
//   (the layout attention_mma.cu's fp8 kernels read).
// - rope_kv_write_fp8s (`--kv-cache-dtype fp8-scaled*`): e4m3 of x / s with one f32 scale
//   s = max |x| / 448 per token and KV head (0 for a zero head), so each head vector uses e4m3's whole
//   range instead of falling into its subnormals below 2^-6. Each (block, KV head) of K and of V is
//   then block_size * (D + 4) bytes: the codes in fp8's layout ([block_size, D] for K, [D, block_size]
//   for V), then block_size f32 scales (kv_scaled_chunk). Every head is staged in shared memory for
//   its max (the CPU backend's KvElem::Fp8E4m3PerHead is the reference).
// - rope_kv_write_i8s (`--kv-cache-dtype int8*`): the same layout and scales with int8 codes,
//   round(x / s) with s = max |x| / 127 (KvElem::Int8PerHead).
// The _had variants (`--kv-cache-dtype fp8`/`fp8-hadamard`) also rotate every q and k head by the
// normalized Walsh-Hadamard matrix H = H_D / sqrt(D) (Sylvester's +-1 matrix; D a power of two up to
// 128) after RoPE and before rounding: scores q.k are unchanged (H is orthogonal), while k's outlier
// dimensions are spread over the whole head before they are rounded to the cache's type. The
// log2(D) butterfly passes run in registers and warp shuffles (rope_kv_write_warp_impl; the CPU
// backend's hadamard::rotate is the reference, same pass order and f32 operations).
// The _had_v variants (`--kv-cache-dtype fp8-hadamard-qkv`) rotate every v head too before it is
// rounded: the attention output is then H times the true one per head, and hadamard_heads rotates it
// back (H is its own inverse) before o_proj and its LoRA adapter read it.
// The rotated variants (_had*) and the per-head-scaled ones where the head dimension has a warp
// layout (rope_warp_values; the unrotated scaled ones then named _fp8s_w, _i8s_w) run one warp per
// head: rope_kv_write_warp_impl, grid (tokens, ceil((Hq + 2*Hkv) / ROPE_WARP_HEADS)), 32 *
// ROPE_WARP_HEADS threads. rope_kv_write_impl (grid (tokens, ceil((Hq + 2*Hkv) / ROPE_HEADS)), 256
// threads) is the fallback of the unrotated ones for the other head dimensions.

// f32 -> e4m3 byte, round to nearest even, saturating to +-448 (sm_89+; never launched below).
__device__ __forceinline__ unsigned char f2e4m3(float x) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(0.f), "f"(x));
    return (unsigned char)(r & 0xffu);
#else
    return (unsigned char)(0.f * x);
#endif
}

// Heads per block: a block rotates (or, for v, copies) ROPE_HEADS heads of one token, so a decode
// step of one token spreads over several SMs instead of looping in one block.
#define ROPE_HEADS 4

// Largest head dimension of the rotated and per-head-scaled caches (one warp holds a head in at most
// ROPE_WARP_MAXV values a lane; the block kernel stages ROPE_HEADS of them in shared memory).
#define ROPE_HAD_MAX_D 128

// Every rope_kv_write kernel's parameters (see the top of this file), and the same names as arguments.
#define ROPE_KV_PARAMS                                                                                            \
    const bf16_t *__restrict__ qkv, const float *__restrict__ bias, const int *__restrict__ positions,              \
        const float *__restrict__ cos_t, const float *__restrict__ sin_t, const int *__restrict__ slots,          \
        bf16_t *__restrict__ q_out, void *__restrict__ k_cache, void *__restrict__ v_cache, int hq, int hkv, int d, \
        int block_size, const bf16_t *__restrict__ lora_d, const int *__restrict__ lora_slots,                    \
        const float *__restrict__ dxs, const float *__restrict__ dws, const int *__restrict__ qkv_i32
#define ROPE_KV_ARGS \
    qkv, bias, positions, cos_t, sin_t, slots, q_out, k_cache, v_cache, hq, hkv, d, block_size, lora_d, lora_slots, dxs, dws, qkv_i32

// Stores rotated value y of column c0 of q/k head h (q heads first) for token t.
template <bool F8>
__device__ __forceinline__ void rope_store_qk(float y, int h, int c0, u64 t, bf16_t* __restrict__ q_out, void* __restrict__ k_cache,
                                              int hq, int hkv, int d, int block_size, u64 blk, u64 off) {
    if (h < hq) {
        q_out[t * (u64)(hq * d) + h * d + c0] = f2bf(y);
    } else {
        const u64 at = ((blk * hkv + (h - hq)) * block_size + off) * d + c0;
        if constexpr (F8) static_cast<unsigned char*>(k_cache)[at] = f2e4m3(y);
        else static_cast<bf16_t*>(k_cache)[at] = f2bf(y);
    }
}

// A scaled fp8 cache's (block, KV head) chunk: block_size * (d + 4) bytes, codes then f32 scales.
__device__ __forceinline__ u64 kv_scaled_chunk(u64 blk, int hkv, int h, int d, int block_size) {
    return (blk * hkv + h) * (u64)block_size * (u64)(d + 4);
}

// Stores value x of column i of v head h for the token at (blk, off): e4m3 V is transposed within
// its block ([D, block_size]), bf16 V is not.
template <bool F8>
__device__ __forceinline__ void rope_store_v(float x, int h, int i, void* __restrict__ v_cache, int hkv, int d, int block_size,
                                             u64 blk, u64 off) {
    if constexpr (F8) static_cast<unsigned char*>(v_cache)[((blk * hkv + h) * d + i) * block_size + off] = f2e4m3(x);
    else static_cast<bf16_t*>(v_cache)[((blk * hkv + h) * block_size + off) * d + i] = f2bf(x);
}

// f32 (already divided by its head's scale, so within +-127) -> int8 code as a byte, rounded half
// away from zero as the CPU's KvElem::Int8PerHead.
__device__ __forceinline__ unsigned char f2i8(float x) {
    return (unsigned char)(signed char)(int)fminf(fmaxf(roundf(x), -127.f), 127.f);
}

// Column `col` of token t's q|k|v as the RoPE kernels read it: an 8-bit projection that left its
// scales here (dws not null) gave the unscaled bf16 output, or with qkv_i32 the int8 GEMM's int32
// sums, times dxs[t] · dws[col] (quant8.cu's scale_outer, fused); then the bias and the token's q|k|v
// LoRA update (lora.cu's expand wrote it beside qkv), added as the bias is.
struct QkvRowInput {
    const bf16_t* row;
    const int* row_i32;
    float sx;
    const float* dws;
    const float* bias;
    const bf16_t* ld;
    __device__ __forceinline__ float operator()(int col) const {
        float x = row_i32 ? (float)row_i32[col] : bf2f(row[col]);
        if (dws) x *= sx * dws[col];
        if (bias) x += bias[col];
        if (ld) x += bf2f(ld[col]);
        return x;
    }
};

__device__ __forceinline__ QkvRowInput qkv_row_input(const bf16_t* qkv, const int* qkv_i32, const float* dxs,
                                                     const float* dws, const float* bias, const bf16_t* lora_d,
                                                     const int* lora_slots, u64 t, int width) {
    return QkvRowInput{qkv + t * width, qkv_i32 ? qkv_i32 + t * width : nullptr, dws ? dxs[t] : 1.f, dws, bias,
                       lora_delta_row(lora_d, lora_slots, t, width)};
}

// The one-block-per-ROPE_HEADS-heads kernel: the unrotated caches, for head dimensions without a
// warp layout (the bf16 and fp8 caches also without the 16-byte kernel's d % 16 == 0).
// SC: a scaled 8-bit cache (only with F8's layout): every head of the block is staged for its
// max |x|; I8: its codes are int8 (scale max / 127), else e4m3 (max / 448).
template <bool F8, bool SC, bool I8 = false>
__device__ __forceinline__ void rope_kv_write_impl(ROPE_KV_PARAMS) {
    const u64 t = blockIdx.x;
    const int half = d >> 1;
    const QkvRowInput input = qkv_row_input(qkv, qkv_i32, dxs, dws, bias, lora_d, lora_slots, t, (hq + 2 * hkv) * d);
    const int pos = positions[t];
    const float* c = cos_t + (u64)pos * half;
    const float* s = sin_t + (u64)pos * half;
    const int slot = slots[t];
    const u64 blk = (u64)(slot / block_size), off = (u64)(slot % block_size);
    // This block's heads [h0, h1) of the q, k, v heads in qkv order.
    const int h0 = blockIdx.y * ROPE_HEADS, h1 = min(h0 + ROPE_HEADS, hq + 2 * hkv);
    // q and k heads: one thread per rotated pair.
    const int r1 = min(h1, hq + hkv);
    static_assert(F8 || !SC, "only an fp8 cache is scaled");
    static_assert(SC || !I8, "an int8 cache is always scaled");
    constexpr float QMAX = I8 ? 127.f : 448.f;
    // SC: the block's RoPE'd q/k heads and its v heads, staged for the scaled cache's max.
    __shared__ float staged[SC ? ROPE_HEADS * ROPE_HAD_MAX_D : 1];
    for (int p = h0 * half + threadIdx.x; p < r1 * half; p += blockDim.x) {
        const int h = p / half, i = p % half;
        const int c0 = h * d + i, c1 = c0 + half;
        const float x0 = input(c0), x1 = input(c1);
        const float y0 = x0 * c[i] - x1 * s[i];
        const float y1 = x1 * c[i] + x0 * s[i];
        if constexpr (SC) {
            staged[(h - h0) * d + i] = y0;
            staged[(h - h0) * d + i + half] = y1;
        } else {
            rope_store_qk<F8>(y0, h, i, t, q_out, k_cache, hq, hkv, d, block_size, blk, off);
            rope_store_qk<F8>(y1, h, i + half, t, q_out, k_cache, hq, hkv, d, block_size, blk, off);
        }
    }
    // v heads [v0, v1) of this block (relative to the first v head).
    const int vstart = (hq + hkv) * d;
    const int v0 = max(h0 - (hq + hkv), 0), v1 = h1 - (hq + hkv);
    if constexpr (SC) {
        // Staged like q/k (no RoPE), at their place among the block's heads.
        for (int e = v0 * d + threadIdx.x; e < v1 * d; e += blockDim.x) {
            staged[(hq + hkv + e / d - h0) * d + e % d] = input(vstart + e);
        }
        __syncthreads();
        const int nst = h1 - h0;
        // One warp per head: max |x| of the cached (k and v) heads, s = max / QMAX.
        __shared__ float head_scale[ROPE_HEADS];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        for (int hh = warp; hh < nst; hh += blockDim.x >> 5) {
            float m = 0.f;
            if (h0 + hh >= hq) {
                for (int i = lane; i < d; i += 32) m = fmaxf(m, fabsf(staged[hh * d + i]));
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            }
            if (lane == 0) head_scale[hh] = m / QMAX;
        }
        __syncthreads();
        unsigned char* kc = static_cast<unsigned char*>(k_cache);
        unsigned char* vc = static_cast<unsigned char*>(v_cache);
        for (int e = threadIdx.x; e < nst * d; e += blockDim.x) {
            const int hh = e / d, h = h0 + hh, i = e % d;
            const float x = staged[e];
            if (h < hq) {
                q_out[t * (u64)(hq * d) + h * d + i] = f2bf(x);
                continue;
            }
            const float sc = head_scale[hh];
            // A zero head stays zero: codes 0 and scale 0 (no division by 0).
            const unsigned char code = sc > 0.f ? (I8 ? f2i8(x / sc) : f2e4m3(x / sc)) : (unsigned char)0;
            const bool is_k = h < hq + hkv;
            const int kvh = is_k ? h - hq : h - hq - hkv;
            unsigned char* chunk = (is_k ? kc : vc) + kv_scaled_chunk(blk, hkv, kvh, d, block_size);
            chunk[is_k ? off * d + i : (u64)i * block_size + off] = code;
            if (i == 0) reinterpret_cast<float*>(chunk + (u64)block_size * d)[off] = sc;
        }
    } else {
        // v heads: copied as they are.
        for (int e = v0 * d + threadIdx.x; e < v1 * d; e += blockDim.x) {
            rope_store_v<F8>(input(vstart + e), e / d, e % d, v_cache, hkv, d, block_size, blk, off);
        }
    }
}

#define ROPE_KV_WRITE(NAME, F8, SC, I8) \
    extern "C" __global__ void NAME(ROPE_KV_PARAMS) { rope_kv_write_impl<F8, SC, I8>(ROPE_KV_ARGS); }
ROPE_KV_WRITE(rope_kv_write, false, false, false)
ROPE_KV_WRITE(rope_kv_write_fp8, true, false, false)
ROPE_KV_WRITE(rope_kv_write_fp8s, true, true, false)
ROPE_KV_WRITE(rope_kv_write_i8s, true, true, true)

// Heads per block of the one-warp-per-head kernels (ROPE_WARP_HEADS warps).
#define ROPE_WARP_HEADS 4
// Values per lane at most.
#define ROPE_WARP_MAXV 4

// A head of d values held by one warp: V values per lane, lane l holding [l V, l V + V), over the
// first d / V lanes. V is the smallest of 1..ROPE_WARP_MAXV with (d / 2) % V == 0 (each RoPE pair
// (i, i + d/2) then sits at one index of two lanes d / 2V apart) and d / V <= 32; 0 where none is
// (rope_kv_write_impl's fallback). rope_kv.rs's `rope_warp_values` is the same rule.
__device__ __forceinline__ int rope_warp_values(int d) {
    for (int v = 1; v <= ROPE_WARP_MAXV; ++v) {
        if ((d / 2) % v == 0 && d / v <= 32) return v;
    }
    return 0;
}

// The unnormalized Walsh-Hadamard transform H_D of one head held as rope_warp_values lays it out
// (D a power of two, so its `lanes` = D / V are too): pass `len` turns each pair (lo, lo + len) into
// (a + b, a - b), in the order and with the f32 operations of the CPU's hadamard::rotate; the passes
// with len < V run inside each lane's values, the others between lanes len / V apart (lanes past
// `lanes` hold zeros and only meet each other). Warp-uniform.
__device__ __forceinline__ void had_warp(float (&x)[ROPE_WARP_MAXV], int v, int lanes, int lane) {
#pragma unroll
    for (int len = 1; len < ROPE_WARP_MAXV; len <<= 1) {
        if (len < v) {
#pragma unroll
            for (int k = 0; k + len < ROPE_WARP_MAXV; ++k) {
                if ((k & len) == 0 && k + len < v) {
                    const float a = x[k], e = x[k + len];
                    x[k] = a + e;
                    x[k + len] = a - e;
                }
            }
        }
    }
    for (int m = 1; m < lanes; m <<= 1) {
        const bool lo = (lane & m) == 0;
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) {
            const float o = __shfl_xor_sync(0xffffffffu, x[k], m);
            x[k] = lo ? x[k] + o : o - x[k];
        }
    }
}

// rope_kv_write with one warp per head: the rotated caches (HAD: q and k; HADV: v too, only with
// HAD) and the per-head-scaled ones (SC, I8 as rope_kv_write_impl), for head dimensions with a warp
// layout. RoPE's partner values and the butterflies move by shuffles, a scaled head's max by a warp
// reduction: no shared memory and no block barrier. (The block kernel it replaces for these staged
// every head in shared memory for 7 barrier-separated passes and cost the fp8 cache 4.5 % of decode
// tokens/s at batch 256 and 8 % of 1000 x 128/128 throughput against fp8-plain on an H200,
// docs/benchmarks.md session 33.)
template <bool F8, bool HAD, bool HADV, bool SC, bool I8>
__device__ __forceinline__ void rope_kv_write_warp_impl(ROPE_KV_PARAMS) {
    static_assert(HAD || !HADV, "v is rotated only together with q and k");
    static_assert(F8 || !SC, "only an fp8 cache is scaled");
    static_assert(SC || !I8, "an int8 cache is always scaled");
    constexpr float QMAX = I8 ? 127.f : 448.f;
    const u64 t = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.y * ROPE_WARP_HEADS + (threadIdx.x >> 5);
    if (h >= hq + 2 * hkv) return;  // whole warps
    const int v = rope_warp_values(d), lanes = d / v, half = d >> 1;
    const bool active = lane < lanes;
    const int i0 = lane * v;
    const QkvRowInput input = qkv_row_input(qkv, qkv_i32, dxs, dws, bias, lora_d, lora_slots, t, (hq + 2 * hkv) * d);
    float x[ROPE_WARP_MAXV];
#pragma unroll
    for (int k = 0; k < ROPE_WARP_MAXV; ++k) x[k] = active && k < v ? input(h * d + i0 + k) : 0.f;
    const bool qk = h < hq + hkv;
    if (qk) {
        // RoPE: value i's partner i +- d/2 sits at the same index of the lane lanes/2 away.
        const int hl = lanes >> 1;
        const bool first = lane < hl;
        const int src = !active ? lane : first ? lane + hl : lane - hl;
        const int j0 = active ? (first ? lane : lane - hl) * v : 0;
        const u64 at = (u64)positions[t] * half + j0;
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) {
            const float o = __shfl_sync(0xffffffffu, x[k], src);
            if (active && k < v) {
                const float c = cos_t[at + k], s = sin_t[at + k];
                x[k] = first ? x[k] * c - o * s : x[k] * c + o * s;
            }
        }
    }
    if (HAD && (qk || HADV)) {
        had_warp(x, v, lanes, lane);
        const float norm = 1.f / sqrtf((float)d);
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) x[k] *= norm;
    }
    if (h < hq) {
        bf16_t* q = q_out + t * (u64)(hq * d) + h * d + i0;
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) {
            if (active && k < v) q[k] = f2bf(x[k]);
        }
        return;
    }
    const int slot = slots[t];
    const u64 blk = (u64)(slot / block_size), off = (u64)(slot % block_size);
    const int kvh = qk ? h - hq : h - hq - hkv;
    if constexpr (SC) {
        float m = 0.f;
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) m = fmaxf(m, fabsf(x[k]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float sc = m / QMAX;
        unsigned char* chunk = static_cast<unsigned char*>(qk ? k_cache : v_cache) + kv_scaled_chunk(blk, hkv, kvh, d, block_size);
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) {
            if (!active || k >= v) continue;
            const int i = i0 + k;
            // A zero head stays zero: codes 0 and scale 0 (no division by 0).
            const unsigned char code = sc > 0.f ? (I8 ? f2i8(x[k] / sc) : f2e4m3(x[k] / sc)) : (unsigned char)0;
            chunk[qk ? off * d + i : (u64)i * block_size + off] = code;
        }
        if (lane == 0) reinterpret_cast<float*>(chunk + (u64)block_size * d)[off] = sc;
    } else {
#pragma unroll
        for (int k = 0; k < ROPE_WARP_MAXV; ++k) {
            if (!active || k >= v) continue;
            if (qk) rope_store_qk<F8>(x[k], h, i0 + k, t, q_out, k_cache, hq, hkv, d, block_size, blk, off);
            else rope_store_v<F8>(x[k], kvh, i0 + k, v_cache, hkv, d, block_size, blk, off);
        }
    }
}

#define ROPE_KV_WRITE_WARP(NAME, F8, HAD, HADV, SC, I8)                                 \
    extern "C" __global__ void __launch_bounds__(ROPE_WARP_HEADS * 32) NAME(ROPE_KV_PARAMS) { \
        rope_kv_write_warp_impl<F8, HAD, HADV, SC, I8>(ROPE_KV_ARGS);                          \
    }
ROPE_KV_WRITE_WARP(rope_kv_write_had, false, true, false, false, false)
ROPE_KV_WRITE_WARP(rope_kv_write_fp8_had, true, true, false, false, false)
ROPE_KV_WRITE_WARP(rope_kv_write_had_v, false, true, true, false, false)
ROPE_KV_WRITE_WARP(rope_kv_write_fp8_had_v, true, true, true, false, false)
ROPE_KV_WRITE_WARP(rope_kv_write_fp8s_w, true, false, false, true, false)
ROPE_KV_WRITE_WARP(rope_kv_write_fp8s_had, true, true, false, true, false)
ROPE_KV_WRITE_WARP(rope_kv_write_fp8s_had_v, true, true, true, true, false)
ROPE_KV_WRITE_WARP(rope_kv_write_i8s_w, true, false, false, true, true)
ROPE_KV_WRITE_WARP(rope_kv_write_i8s_had, true, true, false, true, true)
ROPE_KV_WRITE_WARP(rope_kv_write_i8s_had_v, true, true, true, true, true)

// The unrotated variants with 16-byte accesses (d % 16 == 0): each thread takes one item, 8
// consecutive RoPE pairs of a q or k head (values i0..i0+7 and their partners i0+half..) or 8 values of
// a v head; grid: (tokens, ceil(items / blockDim.x)). The one-pair-per-thread loop above moved the
// step's q|k|v at 0.9 TB/s (57 us a layer for 2,048 tokens on an H100, ncu): 2-byte accesses, a
// division per pair.
// 8 values of this token's q|k|v from column col (a multiple of 8): the projection's output (or int32
// sums), scaled (dws), plus bias and LoRA update, as rope_kv_write_impl's input().
__device__ __forceinline__ void rope_load8(float (&v)[8], int col, const bf16_t* row, const int* row_i32, float sx,
                                           const float* __restrict__ dws, const float* __restrict__ bias,
                                           const bf16_t* ld) {
    ld8_delta_scaled(row + col, row_i32 ? row_i32 + col : nullptr, v, sx, dws ? dws + col : nullptr);
    if (bias) {
        float b[8];
        ld8_f32(bias + col, b);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] += b[k];
    }
    if (ld) add8_bf16(ld + col, v);
}

// 8 values as e4m3 bytes (low byte first), one 8-byte store.
__device__ __forceinline__ void st8_e4m3(unsigned char* p, const float (&v)[8]) {
    u32 w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        w[h] = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) w[h] |= (u32)f2e4m3(v[4 * h + k]) << (8 * k);
    }
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
}

template <bool F8>
__device__ __forceinline__ void rope_kv_write_vec_impl(ROPE_KV_PARAMS) {
    const u64 t = blockIdx.x;
    const int half = d >> 1, per_qk = half >> 3, per_v = d >> 3;
    const int qk_items = (hq + hkv) * per_qk;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    if (item >= qk_items + hkv * per_v) return;
    const int width = (hq + 2 * hkv) * d;
    const bf16_t* row = qkv + t * width;
    const int* row_i32 = qkv_i32 ? qkv_i32 + t * width : nullptr;
    const float sx = dws ? dxs[t] : 1.f;
    const bf16_t* ld = lora_delta_row(lora_d, lora_slots, t, width);
    const int slot = slots[t];
    const u64 blk = (u64)(slot / block_size), off = (u64)(slot % block_size);
    if (item < qk_items) {
        const int h = item / per_qk, i0 = (item % per_qk) * 8;
        const int c0 = h * d + i0;
        float x0[8], x1[8], cs[8], sn[8], y0[8], y1[8];
        rope_load8(x0, c0, row, row_i32, sx, dws, bias, ld);
        rope_load8(x1, c0 + half, row, row_i32, sx, dws, bias, ld);
        const int pos = positions[t];
        ld8_f32(cos_t + (u64)pos * half + i0, cs);
        ld8_f32(sin_t + (u64)pos * half + i0, sn);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            y0[k] = x0[k] * cs[k] - x1[k] * sn[k];
            y1[k] = x1[k] * cs[k] + x0[k] * sn[k];
        }
        if (h < hq) {
            bf16_t* q = q_out + t * (u64)(hq * d) + h * d + i0;
            st8_bf16(q, y0);
            st8_bf16(q + half, y1);
        } else {
            const u64 at = ((blk * hkv + (h - hq)) * block_size + off) * d + i0;
            if constexpr (F8) {
                st8_e4m3(static_cast<unsigned char*>(k_cache) + at, y0);
                st8_e4m3(static_cast<unsigned char*>(k_cache) + at + half, y1);
            } else {
                st8_bf16(static_cast<bf16_t*>(k_cache) + at, y0);
                st8_bf16(static_cast<bf16_t*>(k_cache) + at + half, y1);
            }
        }
    } else {
        const int e = item - qk_items, h = e / per_v, i0 = (e % per_v) * 8;
        float x[8];
        rope_load8(x, (hq + hkv + h) * d + i0, row, row_i32, sx, dws, bias, ld);
        if constexpr (F8) {
            // e4m3 V is transposed within its block: each value its own row of block_size bytes.
#pragma unroll
            for (int k = 0; k < 8; ++k) rope_store_v<true>(x[k], h, i0 + k, v_cache, hkv, d, block_size, blk, off);
        } else {
            st8_bf16(static_cast<bf16_t*>(v_cache) + ((blk * hkv + h) * block_size + off) * d + i0, x);
        }
    }
}

#define ROPE_KV_WRITE_VEC(NAME, F8) \
    extern "C" __global__ void __launch_bounds__(128) NAME(ROPE_KV_PARAMS) { rope_kv_write_vec_impl<F8>(ROPE_KV_ARGS); }
ROPE_KV_WRITE_VEC(rope_kv_write_vec, false)
ROPE_KV_WRITE_VEC(rope_kv_write_fp8_vec, true)

// x <- H x for every head of x [n, heads * d] bf16, in place (H = H_D / sqrt(D), D a power of two up
// to ROPE_HAD_MAX_D): rotates the attention output of a cache whose v heads were rotated (_had_v) back
// to the true one. f32 inside, one bf16 rounding on the way out. One warp per head (had_warp), each
// block ROPE_WARP_HEADS heads of one token. grid: (n, ceil(heads / ROPE_WARP_HEADS)).
extern "C" __global__ void __launch_bounds__(ROPE_WARP_HEADS * 32) hadamard_heads(bf16_t* x, int heads, int d) {
    const int lane = threadIdx.x & 31, h = blockIdx.y * ROPE_WARP_HEADS + (threadIdx.x >> 5);
    if (h >= heads) return;  // whole warps
    const int v = rope_warp_values(d), lanes = d / v;
    const bool active = lane < lanes;
    bf16_t* head = x + (u64)blockIdx.x * (u64)(heads * d) + (u64)h * d + lane * v;
    float y[ROPE_WARP_MAXV];
#pragma unroll
    for (int k = 0; k < ROPE_WARP_MAXV; ++k) y[k] = active && k < v ? bf2f(head[k]) : 0.f;
    had_warp(y, v, lanes, lane);
    const float norm = 1.f / sqrtf((float)d);
#pragma unroll
    for (int k = 0; k < ROPE_WARP_MAXV; ++k) {
        if (active && k < v) head[k] = f2bf(y[k] * norm);
    }
}
