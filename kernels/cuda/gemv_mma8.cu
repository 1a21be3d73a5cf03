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

// The one-token LoRA expand in the 8-bit GEMV's epilogue (gemv8_mma_*_lorax_t1): each
// output row j of module m (columns [col_m, col_m + out_m) of y) gets Σ_r t[m · r_pad + r] ·
// B_m[slot, j - col_m, r] added to its f32 value before the one rounding to bf16, so a one-token step
// needs no expand launch either. t comes from this launch's LoRA blocks, which count themselves done
// in `counter` (an int of this launch's own, 0 before it: the engine zeroes a step's counters in
// lora_group); a tile block waits for the count only once its sums are done (the LoRA blocks come
// first in the grid, so they are resident and finished long before: the wait finds a flag already
// set, as CUB's decoupled look-back does). The tile blocks write nothing back, so no atomics sit in
// their tails. Each lane of a tile's first warp prefetches its row's B to L2 at the start (B and the
// slot do not depend on the kernel before) and loads it into registers only in the epilogue, before
// the wait: holding it through the main loop cost that loop registers (docs/benchmarks.md, session
// 36).
#define GEX_MAX_CHUNKS 8  // 16-byte chunks of a B row at the largest r_pad (lora.cu's LORA_MAX_R, 64)
struct Gemv8Expand {
    const bf16_t* b[3];
    int out[3], col[3];
    const bf16_t* t_hi;
    const bf16_t* t_lo;
    const int* slots;
    const int* counter;
    int r_pad, n_modules, lora_blocks;
};

// The module and B row of output row `row` for `slot`, or null where no module has the row.
// (Unrolled, so that the struct's arrays stay in registers: a dynamic index would put them in
// local memory.)
__device__ __forceinline__ const bf16_t* gemv8_expand_b_row(const Gemv8Expand& ex, int slot, int row, int& mod) {
#pragma unroll
    for (int m = 0; m < 3; ++m) {
        if (m < ex.n_modules && row >= ex.col[m] && row < ex.col[m] + ex.out[m]) {
            mod = m;
            return ex.b[m] + ((u64)slot * ex.out[m] + (row - ex.col[m])) * ex.r_pad;
        }
    }
    return nullptr;
}

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// EXPAND: the one-token LoRA expand in the epilogue (`ex`, m = 1); a template parameter, so that the
// kernels without it keep their registers and schedule.
template <int FMT, int NT, bool EXPAND = false>
__device__ __forceinline__ void gemv8_mma_impl(void* __restrict__ y, int y_f32, const unsigned char* __restrict__ xq,
                                                  const float* __restrict__ xs, const unsigned char* __restrict__ w,
                                                  const float* __restrict__ ws, int m, int n, int k, int wpr, int block,
                                                  const Gemv8Expand* ex = nullptr) {
    __shared__ __align__(16) unsigned char ring_all[GST8_WARPS][GST8_STAGES * GST8_STAGE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles_per_block = GST8_WARPS / wpr;
    const int row0 = (block * tiles_per_block + warp / wpr) * 16;
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
    // The expand's B row (m = 1: lane r < 16 of a tile's first warp takes row row0 + r) into L2 while
    // the first weights stream (the slot is the host's, B no kernel's); read in the epilogue.
    int ex_slot = -1, ex_mod = 0;
    const bf16_t* ex_b = nullptr;
    if (EXPAND && part == 0 && live) {
        ex_slot = ex->slots[0];
        if (ex_slot >= 0 && lane < 16 && row0 + lane < n) ex_b = gemv8_expand_b_row(*ex, ex_slot, row0 + lane, ex_mod);
        if (ex_b != nullptr) asm volatile("prefetch.global.L2 [%0];" ::"l"(ex_b));
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
        // The expand's t: once the LoRA blocks have counted themselves, the warp copies every
        // module's t (hi, then lo) from L2 into its ring past the partial sums, and each lane
        // adds its row's Σ_r t[r] · B[r] (f32, t as hi + lo).
        float ex_delta = 0.f;
        if (EXPAND && ex_slot >= 0) {
            // B's loads go out first, so that the wait and t's loads overlap them.
            uint4 ex_bv[GEX_MAX_CHUNKS];
#pragma unroll
            for (int c = 0; c < GEX_MAX_CHUNKS; ++c)
                ex_bv[c] = (ex_b != nullptr && c < ex->r_pad / 8) ? reinterpret_cast<const uint4*>(ex_b)[c] : make_uint4(0u, 0u, 0u, 0u);
            if (lane == 0) {
                while (ld_acquire_gpu(ex->counter) < ex->lora_blocks) __nanosleep(32);
            }
            __syncwarp();
            bf16_t* ts = reinterpret_cast<bf16_t*>(ring + 2048);  // [2][n_modules * r_pad]
            const int tn = ex->n_modules * ex->r_pad, vecs = tn / 8;
            for (int v = lane; v < 2 * vecs; v += 32) {
                const uint4* src = reinterpret_cast<const uint4*>(v < vecs ? ex->t_hi : ex->t_lo) + (v < vecs ? v : v - vecs);
                reinterpret_cast<uint4*>(ts)[v] = __ldcg(src);
            }
            __syncwarp();
            if (lane < 16) {
                const u32* th = reinterpret_cast<const u32*>(ts + ex_mod * ex->r_pad);
                const u32* tl = reinterpret_cast<const u32*>(ts + tn + ex_mod * ex->r_pad);
#pragma unroll
                for (int c = 0; c < GEX_MAX_CHUNKS; ++c) {
                    if (c >= ex->r_pad / 8) break;
                    const u32 bw[4] = {ex_bv[c].x, ex_bv[c].y, ex_bv[c].z, ex_bv[c].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 h = th[4 * c + e], l = tl[4 * c + e];
                        const float b0 = __uint_as_float(bw[e] << 16), b1 = __uint_as_float(bw[e] & 0xffff0000u);
                        ex_delta = fmaf(__uint_as_float(h << 16), b0, ex_delta);
                        ex_delta = fmaf(__uint_as_float(l << 16), b0, ex_delta);
                        ex_delta = fmaf(__uint_as_float(h & 0xffff0000u), b1, ex_delta);
                        ex_delta = fmaf(__uint_as_float(l & 0xffff0000u), b1, ex_delta);
                    }
                }
            }
        }
        for (int i = lane; i < 16 * m; i += 32) {
            const int token = i >> 4, r = i & 15, row = row0 + r;
            if (row < n) {
                float s = reinterpret_cast<const float*>(ring_all[warp])[r * 8 * NT + token];
                for (int q = 1; q < wpr; ++q) s = gmma8_add<FMT>(s, reinterpret_cast<const float*>(ring_all[warp + q])[r * 8 * NT + token]);
                // m = 1 where an expand is given: lane i is row row0 + i, its delta its own.
                float v = gmma8_value<FMT>(s) * xs[token] * ws[row];
                if (EXPAND) v += ex_delta;
                if (y_f32) reinterpret_cast<float*>(y)[(u64)token * n + row] = v;
                else reinterpret_cast<bf16_t*>(y)[(u64)token * n + row] = f2bf(v);
            }
        }
    }
}

// gemv8_mma_*_lora_t1 (below): one token's LoRA shrink as extra blocks of the 8-bit GEMV's launch,
// t = scale · x · Aᵀ from the token's bf16 row x (LoRA stays bf16 over the 8-bit base), the rows of
// gemv.cu's gemv_lora_m1 (GemvLoraRows: row j is row j % r_pad of module j / r_pad's A for the token's
// slot). Why: before this, a one-token LoRA step over 8-bit weights launched those rows alone right
// before the base GEMV, and that launch's whole latency sat between the norm and the GEMV's weights
// (the GEMV's pdl_wait() waits for it to finish), about 3 µs per projection group on an H200
// (docs/benchmarks.md, session 36). Here the rows' blocks come first in the grid, so they are
// scheduled first and finish long before the base blocks; the expand follows the launch, or (the
// _lorax_t1 kernels) the tile blocks add it in their epilogue.
//
// Same sums as gemv_lora_m1 with `wpr` warps per row, bit for bit: each of a row's `wpr` parts is a
// contiguous share of k's 16-byte chunks, each lane accumulates its chunks in gemv_impl's order
// (UNROLL 8 loads in flight), the part's lanes are added by warp_sum and the parts in order. A block's
// 4 warps take its (row, part) items round robin: 4 / wpr rows a block for wpr ≤ 4, one row (and two
// parts a warp) for wpr 8.
#define GL8_UNROLL 8

__device__ __forceinline__ float gemv8_lora_part(const bf16_t* __restrict__ x, const bf16_t* __restrict__ arow, int k, int part,
                                                 int wpr, int lane, bool first_before_wait) {
    const int chunks = k >> 3;
    const int per = (chunks + wpr - 1) / wpr;
    const int cbeg = part * per, cend = min(chunks, cbeg + per);
    const uint4* wr = reinterpret_cast<const uint4*>(arow);
    uint4 wv[GL8_UNROLL];
    int c = cbeg + lane;
#pragma unroll
    for (int u = 0; u < GL8_UNROLL; ++u) {
        const int cu = c + 32 * u;
        wv[u] = cu < cend ? __ldcs(wr + cu) : make_uint4(0u, 0u, 0u, 0u);
    }
    if (first_before_wait) pdl_wait();  // x is the kernel before's output; A is not
    float acc = 0.f;
    for (; c < cend; c += 32 * GL8_UNROLL) {
        if (c != cbeg + lane) {
#pragma unroll
            for (int u = 0; u < GL8_UNROLL; ++u) {
                const int cu = c + 32 * u;
                wv[u] = cu < cend ? __ldcs(wr + cu) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < GL8_UNROLL; ++u) {
            const int cu = c + 32 * u;
            if (cu < cend) acc += dot8(wv[u], __ldg(reinterpret_cast<const uint4*>(x) + cu));
        }
    }
    return warp_sum(acc);
}

// The LoRA rows' share of the launch: block `block` of them (see above). `slot` < 0: nothing to do.
__device__ __forceinline__ void gemv8_lora_rows_block(const bf16_t* __restrict__ x, const GemvLoraRows& lora, int k, int wpr, int block,
                                                      int* done_counter) {
    __shared__ float lpart[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_block = max(1, GST8_WARPS / wpr);
    const int items = rows_per_block * wpr;
    pdl_trigger();
    bool waited = false;
    for (int item = warp; item < items; item += GST8_WARPS) {
        const int j = block * rows_per_block + item / wpr;
        float s = 0.f;
        if (j < lora.rows && lora.slot >= 0) {
            const int mod = j / lora.r_pad, local = j - mod * lora.r_pad;
            const bf16_t* arow = (mod == 0 ? lora.a0 : mod == 1 ? lora.a1 : lora.a2) + ((u64)lora.slot * lora.r_pad + local) * k;
            s = gemv8_lora_part(x, arow, k, item % wpr, wpr, lane, !waited);
            waited = true;
        }
        if (lane == 0) lpart[item] = s;
    }
    if (!waited) pdl_wait();
    __syncthreads();
    if (threadIdx.x < rows_per_block && lora.slot >= 0) {
        const int j = block * rows_per_block + threadIdx.x;
        if (j < lora.rows) {
            float s = 0.f;
            for (int p = 0; p < wpr; ++p) s += lpart[threadIdx.x * wpr + p];
            const float v = s * lora.scales[lora.slot];
            const bf16_t hi = f2bf(v);
            lora.t_hi[j] = hi;
            lora.t_lo[j] = f2bf(v - bf2f(hi));
        }
    }
    if (done_counter != nullptr) {
        // t written, then counted (threadFenceReduction's order) for the tile blocks' expand.
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(done_counter, 1);
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
#define GEMV8_MMA_BODY_e4m3(NT) gemv8_mma_impl<Q8_E4M3, NT>(y, y_f32, xq, xs, w, ws, m, n, k, wpr, blockIdx.x);
#else
#define GEMV8_MMA_BODY_e4m3(NT)
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GEMV8_MMA_BODY_i8(NT) gemv8_mma_impl<Q8_I8, NT>(y, y_f32, xq, xs, w, ws, m, n, k, wpr, blockIdx.x);
#else
#define GEMV8_MMA_BODY_i8(NT)
#endif
// gemv8_mma_{e4m3,i8}_lora_t1: one token's 8-bit GEMV and its LoRA shrink in one launch (see
// gemv8_lora_rows_block): blocks [0, lora_blocks) compute the LoRA rows from the bf16 row `x`, the
// rest the GEMV's tiles as gemv8_mma_*_t1's blocks [0, ...). m = 1; b*/out*/col*/counter unused
// (null counter). gemv8_mma_*_lorax_t1: the same, the tiles also adding the expand (Gemv8Expand;
// `counter` an int of this launch's own, 0 before it).
#define GEMV8_MMA_LORA(NAME, SUFFIX, IMPL)                                                                     \
    extern "C" __global__ void __launch_bounds__(GST8_WARPS * 32)                                               \
        NAME##SUFFIX(void* y, int y_f32, const unsigned char* xq, const float* xs, const unsigned char* w,     \
                       const float* ws, int n, int k, int wpr, const bf16_t* x, const bf16_t* a0, const bf16_t* a1, \
                       const bf16_t* a2, const int* slots, const float* scales, bf16_t* t_hi, bf16_t* t_lo,    \
                       int r_pad, int n_modules, int lora_wpr, int lora_blocks, const bf16_t* b0,              \
                       const bf16_t* b1, const bf16_t* b2, int out0, int out1, int out2, int col0, int col1,    \
                       int col2, int* counter) {                                                                \
        if ((int)blockIdx.x < lora_blocks) {                                                                    \
            const GemvLoraRows lora{a0, a1, a2, scales, t_hi, t_lo, slots[0], r_pad, n_modules * r_pad};        \
            gemv8_lora_rows_block(x, lora, k, lora_wpr, blockIdx.x, counter);                                   \
            return;                                                                                             \
        }                                                                                                       \
        const Gemv8Expand ex_v{{b0, b1, b2}, {out0, out1, out2}, {col0, col1, col2}, t_hi, t_lo, slots, counter, \
                               r_pad, n_modules, lora_blocks};                                                  \
        const Gemv8Expand* ex = &ex_v;                                                                          \
        IMPL                                                                                                    \
    }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define GEMV8_MMA_LORA_e4m3(EX) gemv8_mma_impl<Q8_E4M3, 1, EX>(y, y_f32, xq, xs, w, ws, 1, n, k, wpr, blockIdx.x - lora_blocks, ex);
#else
#define GEMV8_MMA_LORA_e4m3(EX)
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GEMV8_MMA_LORA_i8(EX) gemv8_mma_impl<Q8_I8, 1, EX>(y, y_f32, xq, xs, w, ws, 1, n, k, wpr, blockIdx.x - lora_blocks, ex);
#else
#define GEMV8_MMA_LORA_i8(EX)
#endif
GEMV8_MMA_LORA(gemv8_mma_e4m3, _lora_t1, GEMV8_MMA_LORA_e4m3(false))
GEMV8_MMA_LORA(gemv8_mma_i8, _lora_t1, GEMV8_MMA_LORA_i8(false))
GEMV8_MMA_LORA(gemv8_mma_e4m3, _lorax_t1, GEMV8_MMA_LORA_e4m3(true))
GEMV8_MMA_LORA(gemv8_mma_i8, _lorax_t1, GEMV8_MMA_LORA_i8(true))
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 1)
GEMV8_MMA(gemv8_mma_e4m3, GEMV8_MMA_BODY_e4m3, 2)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 1)
GEMV8_MMA(gemv8_mma_i8, GEMV8_MMA_BODY_i8, 2)
