// The row-wise 8-bit GEMV on tensor cores, for decode steps of 1..16 tokens (issue 17):
//   y[i, j] = (Σ_k xq[i, k] · wq[j, k]) · xs[i] · ws[j]
// the same contract as gemv_fp8.cu's kernels (token scale, then row scale, in the epilogue).
//
// Why: gemv_fp8.cu's e4m3 kernel decodes every weight and activation code to f32 on the CUDA cores
// (about 48 conversions per 16 weight bytes, the activations again for every token), so from 2
// tokens on conversions, not HBM, bound it and it lost to cuBLASLt. Here a warp feeds 16 weight rows straight into
// mma.sync m16n8k32 (e4m3 × e4m3 → f32, sm_89+; s8 × s8 → s32, sm_80+) as the A operand and up to 8
// tokens as B (one column each): no conversions, and 2..8 tokens cost what 1 costs (16 take two
// column tiles). Most of the tensor core's work is wasted at 1 token; it has plenty to spare.
//
// Layout: a dot product may visit k in any order as long as weights and activations agree, so each
// lane loads whole 16-byte chunks. Per pair of k-steps (64 codes), lane (g = lane / 4, t = lane % 4)
// loads chunk 4p + t of weight rows g and g + 8 and, for the B operand, of token g; bytes 0..7 of
// those chunks are the first mma's a0..a3 / b0..b1 (PTX: a0/a2 hold row g at k 4t.. and 16 + 4t..,
// a1/a3 row g + 8, b0/b1 token g at the same k), bytes 8..15 the second's. Lanes of tokens past m,
// and chunks past k, feed zeros.
//
// `wpr` warps share a tile of 16 rows, each a contiguous share of the pairs, in rounds of U pairs (2U
// weight loads of 16 bytes per lane), the next round's loads issued before this round's mma (two
// rounds in flight), the first before pdl_wait() (weights do not depend on the kernel before).
// Every round the mma results go into the lane's f32
// accumulator by an ordinary add: Hopper's fp8 mma keeps ~14 bits when it adds into its accumulator,
// so the chain it sees is at most 2U steps long.
// Measured (H100, docs/benchmarks.md session 14): 2..16 tokens cost what one does, but at one token
// it is no faster than gemv_fp8.cu's kernel and slower on gate|up (each row is read in 64-byte
// pieces, 16 rows per load), so it is opt-in (`PEREGRINE_GEMV8=tensor`). int8 sums are exact s32 (bit-identical to the dp4a
// kernel's). The warps of a tile add their partial sums in a fixed order, and an output column
// depends on its own token alone, so a token's result is the same for any m ≤ 16: batch invariant.
// k % 16 == 0 and 16-byte aligned rows.
#define GMMA8_WARPS 8

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// a += b in the accumulator's own arithmetic (f32 for e4m3, s32 carried in float bits for int8).
template <int FMT>
__device__ __forceinline__ float gmma8_add(float a, float b) {
    return a + b;
}
template <>
__device__ __forceinline__ float gmma8_add<Q8_I8>(float a, float b) {
    return __int_as_float(__float_as_int(a) + __float_as_int(b));
}
template <int FMT>
__device__ __forceinline__ float gmma8_value(float a) {
    return a;
}
template <>
__device__ __forceinline__ float gmma8_value<Q8_I8>(float a) {
    return (float)__float_as_int(a);
}

// NT column tiles of 8 tokens (m ≤ 8 * NT).
template <int FMT, int NT, int U>
__device__ __forceinline__ void gemv8_mma_impl(void* __restrict__ y, int y_f32, const unsigned char* __restrict__ xq,
                                               const float* __restrict__ xs, const unsigned char* __restrict__ w,
                                               const float* __restrict__ ws, int m, int n, int k, int wpr) {
    __shared__ float partial[GMMA8_WARPS][16][8 * NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles_per_block = GMMA8_WARPS / wpr;
    const int row0 = (blockIdx.x * tiles_per_block + warp / wpr) * 16;
    const int part = warp % wpr;
    const int chunks = k >> 4;
    const int pairs = (chunks + 3) >> 2;
    const int per = (pairs + wpr - 1) / wpr;
    const int pbeg = part * per, pend = min(pairs, pbeg + per);
    const bool live = row0 < n;  // the same for the whole warp: mma.sync needs every lane
    const uint4* wlo = reinterpret_cast<const uint4*>(w + (u64)min(row0 + g, n - 1) * k);
    const uint4* whi = reinterpret_cast<const uint4*>(w + (u64)min(row0 + g + 8, n - 1) * k);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    // Two rounds of U pairs in flight: the next round's loads go out before this round's mma.
    uint4 wa[U], wb[U], na[U], nb[U];
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    pdl_trigger();
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = (pbeg + u) * 4 + t;
        const bool in = live && pbeg + u < pend && c < chunks;
        wa[u] = in ? __ldcs(wlo + c) : zero;  // streamed once
        wb[u] = in ? __ldcs(whi + c) : zero;
    }
    pdl_wait();
    if (live) {
        for (int p = pbeg; p < pend; p += U) {
            if (p + U < pend) {  // warp-uniform
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = (p + U + u) * 4 + t;
                    const bool in = p + U + u < pend && c < chunks;
                    na[u] = in ? __ldcs(wlo + c) : zero;
                    nb[u] = in ? __ldcs(whi + c) : zero;
                }
            }
            float fresh[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) fresh[nt][i] = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (p + u < pend) {  // warp-uniform
                    const int c = (p + u) * 4 + t;
                    const u32 a0[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};
                    const u32 a1[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const int token = nt * 8 + g;
                        const uint4 xv = (token < m && c < chunks) ? __ldg(reinterpret_cast<const uint4*>(xq + (u64)token * k) + c) : zero;
                        mma8<FMT>(fresh[nt], a0, xv.x, xv.y);
                        mma8<FMT>(fresh[nt], a1, xv.z, xv.w);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[nt][i] = gmma8_add<FMT>(acc[nt][i], fresh[nt][i]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                wa[u] = na[u];
                wb[u] = nb[u];
            }
        }
    }
    // Lane (g, t) holds rows g (c0, c1) and g + 8 (c2, c3) for tokens 8 nt + 2t and 8 nt + 2t + 1.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        partial[warp][g][nt * 8 + 2 * t] = acc[nt][0];
        partial[warp][g][nt * 8 + 2 * t + 1] = acc[nt][1];
        partial[warp][g + 8][nt * 8 + 2 * t] = acc[nt][2];
        partial[warp][g + 8][nt * 8 + 2 * t + 1] = acc[nt][3];
    }
    __syncthreads();
    if (part == 0 && live) {
        // Consecutive lanes take consecutive rows of one token: coalesced stores.
        for (int i = lane; i < 16 * m; i += 32) {
            const int token = i >> 4, r = i & 15, row = row0 + r;
            if (row < n) {
                float s = partial[warp][r][token];
                for (int q = 1; q < wpr; ++q) s = gmma8_add<FMT>(s, partial[warp + q][r][token]);
                const float v = gmma8_value<FMT>(s) * xs[token] * ws[row];
                if (y_f32) reinterpret_cast<float*>(y)[(u64)token * n + row] = v;
                else reinterpret_cast<bf16_t*>(y)[(u64)token * n + row] = f2bf(v);
            }
        }
    }
}

#endif

// The kernels exist on every target; below their architecture (e4m3: sm_89, int8: sm_80) they are
// empty and the host never launches them.
#define GEMV8_MMA(NAME, BODY, NT, U)                                                                      \
    extern "C" __global__ void __launch_bounds__(GMMA8_WARPS * 32)                                        \
        NAME##_t##NT##_u##U(void* y, int y_f32, const unsigned char* xq, const float* xs,                 \
                            const unsigned char* w, const float* ws, int m, int n, int k, int wpr) {      \
        BODY(NT, U)                                                                                       \
    }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define GEMV8_MMA_BODY_e4m3(NT, U) gemv8_mma_impl<Q8_E4M3, NT, U>(y, y_f32, xq, xs, w, ws, m, n, k, wpr);
#else
#define GEMV8_MMA_BODY_e4m3(NT, U)
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GEMV8_MMA_BODY_i8(NT, U) gemv8_mma_impl<Q8_I8, NT, U>(y, y_f32, xq, xs, w, ws, m, n, k, wpr);
#else
#define GEMV8_MMA_BODY_i8(NT, U)
#endif
// Rounds of 2 and 4 pairs (`PEREGRINE_GEMV8_MMA_UNROLL`).
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 1, 2)
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 2, 2)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 1, 2)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 2, 2)
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 1, 4)
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 2, 4)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 1, 4)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 2, 4)
