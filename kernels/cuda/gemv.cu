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
#define GEMV_WARPS 8

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

template <int MAXM, int GEMV_UNROLL, bool SILU = false>
__device__ __forceinline__ void gemv_impl(void* __restrict__ y, int y_f32, const bf16_t* __restrict__ x,
                                          const bf16_t* __restrict__ w, int m, int n, int k, int wpr) {
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
    const bool live = SILU ? (vrow >> 1) < n : row < n;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (u64)min(row, nrows - 1) * k);
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
