// The row-wise 8-bit GEMV on tensor cores, for decode steps of 1..16 tokens (issue 17):
//   y[i, j] = (Σ_k xq[i, k] · wq[j, k]) · xs[i] · ws[j]
// the same contract as gemv_fp8.cu's kernels (token scale, then row scale, in the epilogue).
//
// Why: gemv_fp8.cu's e4m3 kernel decodes every weight and activation code to f32 on the CUDA cores
// (about 48 conversions per 16 weight bytes, the activations again for every token), so from 2
// tokens on conversions, not HBM, bound it and it lost to cuBLASLt. Here a warp feeds 16 weight rows
// straight into mma.sync m16n8k32 (e4m3 × e4m3 → f32, sm_89+; s8 × s8 → s32, sm_80+) as the A operand
// and up to 8 tokens as B (one column each): no conversions, and 2..8 tokens cost what 1 costs (16
// take two column tiles). Most of the tensor core's work is wasted at 1 token; it has plenty to spare.
//
// Loads: each warp streams its 16 rows in 256-byte pieces with cp.async (a half-warp reads one row's
// piece: 256 contiguous bytes) into a ring of GST8_STAGES pieces of its own, so two pieces (8 KB a
// warp) are in flight while it multiplies the third, without holding them in registers. The first
// pieces go out before pdl_wait() (weights do not depend on the kernel before). Warps never wait for
// each other until the end: the ring is the warp's own, ordered by cp.async.wait_group and
// __syncwarp. (An earlier version loaded 64-byte pieces of each row straight into registers, two
// rounds in flight: at one token it was no faster than the CUDA-core kernel, and on every shape
// slower than this one; docs/benchmarks.md, session 16.)
//
// Fragments: a dot product may visit k in any order as long as weights and activations agree, so
// each lane reads whole 16-byte chunks. For pair q (64 codes) of a piece, lane (g = lane / 4,
// t = lane % 4) takes chunk 4q + t of rows g and g + 8 and the same chunk of token g; bytes 0..7 of
// those chunks are the first mma's a0..a3 / b0..b1 (PTX: a0/a2 hold row g at k 4t.. and 16 + 4t..,
// a1/a3 row g + 8, b0/b1 token g at the same k), bytes 8..15 the second's. Lanes of tokens past m,
// and chunks past k, feed zeros. In shared memory a row's chunk c lies at c ^ (4 · (row & 1)): the 8
// lanes of a 16-byte access phase (rows g, g + 1, chunks 4q..4q + 3) then touch distinct banks, and
// so do the copies (a row's 16 chunks from 16 lanes).
//
// Each piece's 8 mma go into a fresh f32 accumulator that is then added to the lane's total: Hopper's
// fp8 mma keeps ~14 bits when it adds into its accumulator, so the chain it sees is 8 steps long. int8
// sums are exact s32 (bit-identical to the dp4a kernel's). `wpr` warps share a tile of 16 rows, each a
// contiguous share of the pieces; they add their partial sums in a fixed order, and an output column
// depends on its own token alone, so a token's result is the same for any m ≤ 16: batch invariant.
// k % 16 == 0 and 16-byte aligned rows.
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


#define GST8_WARPS 4
#define GST8_STAGES 3
#define GST8_PIECE 256                          // bytes of each of a tile's 16 rows per stage
#define GST8_STAGE_BYTES (16 * GST8_PIECE)      // 4 KB; 4 warps × 3 stages = 48 KB a block


// A lane's share of the tile's copies: rows 2i + (lane / 16) for i < 8, 16-byte chunk lane % 16 of
// each row's piece. Fixed once per warp; rows past n and chunks past k are copied as zeros (from a
// valid address).
struct Gst8Lane {
    const unsigned char* src;  // row row0 + lane / 16, chunk lane % 16 of piece 0
    u32 dst;                   // its place in slot 0 of the ring
    int row, col;              // that row, and the chunk's first column in piece 0
};

// Piece `piece` into ring slot `slot`: 8 copies of 16 bytes per lane.
__device__ __forceinline__ void gst8_load(const Gst8Lane& l, int slot, int piece, const unsigned char* __restrict__ w, int n,
                                          int k) {
    const int col = piece * GST8_PIECE + l.col;
    const bool in_k = col < k;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const bool in = in_k && l.row + 2 * i < n;
        cp_async16(l.dst + slot * GST8_STAGE_BYTES + 2 * i * GST8_PIECE, in ? l.src + (u64)(2 * i) * k + piece * GST8_PIECE : w,
                   in ? 16 : 0);
    }
}

template <int FMT, int NT>
__device__ __forceinline__ void gemv8_mma_impl(void* __restrict__ y, int y_f32, const unsigned char* __restrict__ xq,
                                                  const float* __restrict__ xs, const unsigned char* __restrict__ w,
                                                  const float* __restrict__ ws, int m, int n, int k, int wpr) {
    __shared__ __align__(16) unsigned char ring_all[GST8_WARPS][GST8_STAGES * GST8_STAGE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles_per_block = GST8_WARPS / wpr;
    const int row0 = (blockIdx.x * tiles_per_block + warp / wpr) * 16;
    const int part = warp % wpr;
    const int chunks = k >> 4;
    const int pieces = (k + GST8_PIECE - 1) / GST8_PIECE;
    const int per = (pieces + wpr - 1) / wpr;
    const int pbeg = part * per, pend = min(pieces, pbeg + per);
    const bool live = row0 < n;  // the same for the whole warp: mma.sync needs every lane
    unsigned char* ring = ring_all[warp];
    Gst8Lane gl;
    gl.row = row0 + (lane >> 4);
    gl.col = (lane & 15) << 4;
    gl.src = w + (u64)min(gl.row, n - 1) * k + gl.col;
    // A row's chunk c at c ^ (4 · (row & 1)); this lane's rows all have the parity of lane / 16.
    gl.dst = smem_addr(ring) + (lane >> 4) * GST8_PIECE + (((lane & 15) ^ ((lane >> 4) << 2)) << 4);
    pdl_trigger();
#pragma unroll
    for (int s = 0; s < GST8_STAGES - 1; ++s) {
        if (live && pbeg + s < pend) gst8_load(gl, s, pbeg + s, w, n, k);
        cp_async_commit();  // empty groups keep the count uniform
    }
    pdl_wait();
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    if (live) {
        for (int p = pbeg; p < pend; ++p) {
            const int i = p - pbeg;
            // This piece's activations (L1/L2) go out before the wait for its weights.
            uint4 xv[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int token = nt * 8 + g, c = p * (GST8_PIECE / 16) + 4 * q + t;
                    xv[nt][q] = (token < m && c < chunks) ? __ldg(reinterpret_cast<const uint4*>(xq + (u64)token * k) + c) : zero;
                }
            cp_async_wait<GST8_STAGES - 2>();
            __syncwarp();  // every lane's copies of piece p landed; every lane is done with piece p - 1
            if (p + GST8_STAGES - 1 < pend) gst8_load(gl, (i + GST8_STAGES - 1) % GST8_STAGES, p + GST8_STAGES - 1, w, n, k);
            cp_async_commit();
            const unsigned char* sb = ring + (i % GST8_STAGES) * GST8_STAGE_BYTES;
            float fresh[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) fresh[nt][e] = 0.f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int sc = ((4 * q + t) ^ ((g & 1) << 2)) << 4;  // rows g and g + 8 share the parity
                const uint4 wa = *reinterpret_cast<const uint4*>(sb + g * GST8_PIECE + sc);
                const uint4 wb = *reinterpret_cast<const uint4*>(sb + (g + 8) * GST8_PIECE + sc);
                const u32 a0[4] = {wa.x, wb.x, wa.y, wb.y};
                const u32 a1[4] = {wa.z, wb.z, wa.w, wb.w};
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    mma8<FMT>(fresh[nt], a0, xv[nt][q].x, xv[nt][q].y);
                    mma8<FMT>(fresh[nt], a1, xv[nt][q].z, xv[nt][q].w);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] = gmma8_add<FMT>(acc[nt][e], fresh[nt][e]);
        }
    }
    cp_async_wait<0>();
    __syncwarp();
    // The partial sums go into the warp's own ring (its copies have all landed and been read).
    float* partial = reinterpret_cast<float*>(ring);  // [16][8 * NT]
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        partial[g * 8 * NT + nt * 8 + 2 * t] = acc[nt][0];
        partial[g * 8 * NT + nt * 8 + 2 * t + 1] = acc[nt][1];
        partial[(g + 8) * 8 * NT + nt * 8 + 2 * t] = acc[nt][2];
        partial[(g + 8) * 8 * NT + nt * 8 + 2 * t + 1] = acc[nt][3];
    }
    __syncthreads();
    if (part == 0 && live) {
        for (int i = lane; i < 16 * m; i += 32) {
            const int token = i >> 4, r = i & 15, row = row0 + r;
            if (row < n) {
                float s = reinterpret_cast<const float*>(ring_all[warp])[r * 8 * NT + token];
                for (int q = 1; q < wpr; ++q) s = gmma8_add<FMT>(s, reinterpret_cast<const float*>(ring_all[warp + q])[r * 8 * NT + token]);
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
#define GEMV8_MMA(NAME, BODY, NT)                                                                         \
    extern "C" __global__ void __launch_bounds__(GST8_WARPS * 32)                                         \
        NAME##_t##NT(void* y, int y_f32, const unsigned char* xq, const float* xs, const unsigned char* w, \
                     const float* ws, int m, int n, int k, int wpr) {                                     \
        BODY(NT)                                                                                          \
    }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define GEMV8_MMA_BODY_e4m3(NT) gemv8_mma_impl<Q8_E4M3, NT>(y, y_f32, xq, xs, w, ws, m, n, k, wpr);
#else
#define GEMV8_MMA_BODY_e4m3(NT)
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GEMV8_MMA_BODY_i8(NT) gemv8_mma_impl<Q8_I8, NT>(y, y_f32, xq, xs, w, ws, m, n, k, wpr);
#else
#define GEMV8_MMA_BODY_i8(NT)
#endif
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 1)
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 2)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 1)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 2)
