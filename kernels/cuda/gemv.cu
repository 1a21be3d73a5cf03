// Skinny GEMM for decode: y[m, n] = x[m, k] · w[n, k]ᵀ with m ≤ MAXM (1..8), bf16 in, f32
// accumulation, bf16 or f32 out. At small m the product is bound by reading w once, so the kernel is
// built for bandwidth: `wpr` warps share one output column (weight row), each taking a contiguous
// share of k (more blocks in flight when n is small), 16-byte loads, UNROLL (8 or 16) loads of w in flight per
// lane before any is used, x re-read through the read-only cache (it is small and hot). The warps of
// a row add their partial sums in a fixed order, so results do not depend on scheduling.
// Requires k % 8 == 0 and 16-byte aligned rows (true for every Llama shape).
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

template <int MAXM, int GEMV_UNROLL>
__device__ __forceinline__ void gemv_impl(void* __restrict__ y, int y_f32, const bf16_t* __restrict__ x,
                                          const bf16_t* __restrict__ w, int m, int n, int k, int wpr) {
    __shared__ float partial[GEMV_WARPS][MAXM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_block = GEMV_WARPS / wpr;
    const int row = blockIdx.x * rows_per_block + warp / wpr;
    const int part = warp % wpr;
    const int chunks = k >> 3;  // 8 bf16 per 16-byte chunk
    const int per = (chunks + wpr - 1) / wpr;
    const int cbeg = part * per, cend = min(chunks, cbeg + per);
    float acc[MAXM];
#pragma unroll
    for (int i = 0; i < MAXM; ++i) acc[i] = 0.f;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (u64)min(row, n - 1) * k);
    // The weights do not depend on the previous kernel: the first UNROLL loads go out before
    // pdl_wait(), overlapping that kernel's tail when launched with PDL; x is read only after it.
    uint4 wv[GEMV_UNROLL];
    int c = cbeg + lane;
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int cu = c + 32 * u;
        wv[u] = (row < n && cu < cend) ? __ldcs(wr + cu) : make_uint4(0u, 0u, 0u, 0u);  // streamed once
    }
    pdl_wait();
    if (row < n) {
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
    if (part == 0 && lane < m && row < n) {
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
