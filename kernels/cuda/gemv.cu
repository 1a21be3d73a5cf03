// Skinny GEMM for decode: y[m, n] = x[m, k] · w[n, k]ᵀ with m ≤ MAXM (1..8), bf16 in, f32
// accumulation, bf16 or f32 out. At small m the product is bound by reading w once, so the kernel is
// built for bandwidth: `wpr` warps share one output column (weight row), each taking a contiguous
// share of k (more blocks in flight when n is small), 16-byte loads, UNROLL (8 or 16) loads of w in flight per
// lane before any is used, x re-read through the read-only cache (it is small and hot). The warps of
// a row add their partial sums in a fixed order, so results do not depend on scheduling.
// Requires k % 8 == 0 and 16-byte aligned rows (true for every Llama shape).
//
// SILU (gemv_silu_*): the gate/up projection with SwiGLU in its epilogue, y[m, n] = silu(x · gate_j) *
// (x · up_j) for the fused weight [gate; up] of 2n rows: a block's rows come in pairs (gate j, up j),
// so the activation is written straight away and silu_mul's kernel (and its launch) disappear from
// batch-1..8 decode steps. The two dot products are rounded to bf16 first, as the unfused path does.
//
// LORA (gemv_lora_m1): one token's LoRA shrink computed by the same launch, as extra rows after the
// base weight's n: row n + j is row j % r_pad of module j / r_pad's A for the token's slot, and its
// sum, times the slot's scale, goes to t (as bf16 hi + lo, lora.cu's layout: t_hi[j], t_lo[j])
// instead of y. A decode step of one token then needs no shrink launch of its own: the expand follows
// the GEMV (see cuda/lora.rs, where the side stream's shrink -> expand chain was longer than a short
// base GEMV at batch 1).
#define GEMV_WARPS 8

// The LoRA rows of gemv_lora_m1 (see the top). slot < 0: none (the token has no adapter).
struct GemvLoraRows {
    const bf16_t* a0;
    const bf16_t* a1;
    const bf16_t* a2;
    const float* scales;
    bf16_t* t_hi;
    bf16_t* t_lo;
    int slot, r_pad, rows;  // rows: n_modules * r_pad
};

__device__ __forceinline__ float dot8(const uint4 a, const uint4 b) {
    const u32 av[4] = {a.x, a.y, a.z, a.w};
    const u32 bv[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s += __uint_as_float(av[i] << 16) * __uint_as_float(bv[i] << 16);
        s += __uint_as_float(av[i] & 0xffff0000u) * __uint_as_float(bv[i] & 0xffff0000u);
    }
    return s;
}

template <int MAXM, int GEMV_UNROLL, bool SILU = false, bool LORA = false>
__device__ __forceinline__ void gemv_impl(void* __restrict__ y, int y_f32, const bf16_t* __restrict__ x,
                                          const bf16_t* __restrict__ w, int m, int n, int k, int wpr,
                                          const GemvLoraRows* lora = nullptr) {
    __shared__ float partial[GEMV_WARPS][MAXM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_block = GEMV_WARPS / wpr;
    // SILU: local row 2i + u of the block is weight row (u ? n : 0) + j, j = its pair's output column
    // (wpr <= 4, so a block holds whole pairs); `n` counts output columns, the weight has 2n rows.
    const int vrow = blockIdx.x * rows_per_block + warp / wpr;
    const int row = SILU ? ((vrow & 1) ? n : 0) + (vrow >> 1) : vrow;
    const int nrows = SILU ? 2 * n : n;
    const int part = warp % wpr;
    const int chunks = k >> 3;  // 8 bf16 per 16-byte chunk
    const int per = (chunks + wpr - 1) / wpr;
    const int cbeg = part * per, cend = min(chunks, cbeg + per);
    float acc[MAXM];
#pragma unroll
    for (int i = 0; i < MAXM; ++i) acc[i] = 0.f;
    bool live = SILU ? (vrow >> 1) < n : row < n;
    const bf16_t* wrow = w + (u64)max(min(row, nrows - 1), 0) * k;  // a valid row (n may be 0 with LORA)
    int lora_row = -1;  // LORA: this warp's column of t, or -1
    if constexpr (LORA) {
        const int j = vrow - n;
        if (j >= 0 && j < lora->rows && lora->slot >= 0) {
            const int mod = j / lora->r_pad, local = j - mod * lora->r_pad;
            wrow = (mod == 0 ? lora->a0 : mod == 1 ? lora->a1 : lora->a2) + ((u64)lora->slot * lora->r_pad + local) * k;
            live = true;
            lora_row = j;
        }
    }
    const uint4* wr = reinterpret_cast<const uint4*>(wrow);
    // The weights do not depend on the previous kernel: the first UNROLL loads go out before
    // pdl_wait(), overlapping that kernel's tail when launched with PDL; x is read only after it.
    uint4 wv[GEMV_UNROLL];
    int c = cbeg + lane;
    pdl_trigger();  // a GEMV right after this one (gate/up -> down) may start streaming its weights
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int cu = c + 32 * u;
        wv[u] = (live && cu < cend) ? __ldcs(wr + cu) : make_uint4(0u, 0u, 0u, 0u);  // streamed once
    }
    pdl_wait();
    if (live) {
        // Every iteration has UNROLL guarded loads in flight before any is used, also the last,
        // partial one: with several warps per row a lane may own fewer than UNROLL chunks in all.
        for (; c < cend; c += 32 * GEMV_UNROLL) {
            if (c != cbeg + lane) {
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; ++u) {
                    const int cu = c + 32 * u;
                    wv[u] = cu < cend ? __ldcs(wr + cu) : make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int cu = c + 32 * u;
                if (cu < cend) {
#pragma unroll
                    for (int i = 0; i < MAXM; ++i) {
                        if (i < m) acc[i] += dot8(wv[u], __ldg(reinterpret_cast<const uint4*>(x + (u64)i * k) + cu));
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXM; ++i) {
        const float s = warp_sum(acc[i]);
        if (lane == 0) partial[warp][i] = s;
    }
    __syncthreads();
    if constexpr (SILU) {
        // Row sums first (into the first warp's slot of each row), then the pairs combined.
        __shared__ float rowsum[GEMV_WARPS][MAXM];
        if (part == 0 && lane < m) {
            float s = 0.f;
            for (int p = 0; p < wpr; ++p) s += partial[warp + p][lane];
            rowsum[warp / wpr][lane] = s;
        }
        __syncthreads();
        const int pairs = rows_per_block / 2;
        for (int i = threadIdx.x; i < pairs * m; i += blockDim.x) {
            const int pr = i / m, r = i % m;
            const int j = (blockIdx.x * rows_per_block) / 2 + pr;
            if (j < n) {
                const float g = bf2f(f2bf(rowsum[2 * pr][r])), u = bf2f(f2bf(rowsum[2 * pr + 1][r]));
                reinterpret_cast<bf16_t*>(y)[(u64)r * n + j] = f2bf(g / (1.f + __expf(-g)) * u);
            }
        }
    } else if (part == 0 && lane < m && row < n) {
        float s = 0.f;
        for (int p = 0; p < wpr; ++p) s += partial[warp + p][lane];
        if (y_f32) reinterpret_cast<float*>(y)[(u64)lane * n + row] = s;
        else reinterpret_cast<bf16_t*>(y)[(u64)lane * n + row] = f2bf(s);
    } else if (LORA && part == 0 && lane == 0 && lora_row >= 0) {
        float s = 0.f;
        for (int p = 0; p < wpr; ++p) s += partial[warp + p][0];
        const float v = s * lora->scales[lora->slot];
        const bf16_t hi = f2bf(v);
        lora->t_hi[lora_row] = hi;
        lora->t_lo[lora_row] = f2bf(v - bf2f(hi));
    }
}

#define GEMV(M, U)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
        gemv_m##M##_u##U(void* y, int y_f32, const bf16_t* x, const bf16_t* w, int m, int n, int k,     \
                         int wpr) {                                                                     \
        gemv_impl<M, U>(y, y_f32, x, w, m, n, k, wpr);                                                  \
    }
GEMV(1, 8)
GEMV(2, 8)
GEMV(4, 8)
GEMV(8, 8)
GEMV(1, 16)
GEMV(2, 16)
GEMV(4, 16)
GEMV(8, 16)

// gemv_lora_m1: one token's y = x · wᵀ (bf16 out) and its LoRA shrink (see the top); grid covers
// n + n_modules * r_pad rows. n = 0: the shrink alone (for a base projection of 8-bit weights).
// `slots`: the token's slot, read before pdl_wait() (the host writes it before the step, no kernel
// does).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_lora_m1(bf16_t* y, const bf16_t* x, const bf16_t* w, int n, int k, int wpr, const bf16_t* a0,
                 const bf16_t* a1, const bf16_t* a2, const int* slots, const float* scales, bf16_t* t_hi,
                 bf16_t* t_lo, int r_pad, int n_modules) {
    const GemvLoraRows lora{a0, a1, a2, scales, t_hi, t_lo, slots[0], r_pad, n_modules * r_pad};
    gemv_impl<1, 8, false, true>(y, 0, x, w, 1, n, k, wpr, &lora);
}

// gemv_silu_m{M}: the gate/up projection with SwiGLU fused (see the top); unroll 8, wpr 1, 2 or 4.
#define GEMV_SILU(M)                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
        gemv_silu_m##M(bf16_t* y, const bf16_t* x, const bf16_t* w, int m, int n, int k, int wpr) {    \
        gemv_impl<M, 8, true>(y, 0, x, w, m, n, k, wpr);                                                \
    }
GEMV_SILU(1)
GEMV_SILU(2)
GEMV_SILU(4)
GEMV_SILU(8)
