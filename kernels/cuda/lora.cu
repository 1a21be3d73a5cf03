// Multi-LoRA on the GPU, grouped by adapter (SGMV): after a base projection y = x · Wᵀ, each token
// adds its own adapter's update y += scale · (x · Aᵀ) · Bᵀ, read from slot stacks (every slot's rows
// padded with zeros to the same r_pad, a multiple of 16; a module the adapter does not target is all
// zeros, so it adds exactly 0).
//
// Once per step, lora_group sorts the token indices by slot into segments (ascending token index
// within a slot; base-model tokens, slot -1, in none). Then per projection group (q|k|v, o, gate|up,
// down) two launches cover every segment and every module of the group:
// - lora_shrink_sgmv: t_part[split, i, :] = x[i, split's k range] · A[slot_i]ᵀ on tensor cores
//   (mma.sync m16n8k16 bf16, f32 accumulate), one block per (k split, work tile, module), a work tile
//   being up to 16 tokens of one slot (one mma row tile): A is read once per tile and split, not once per token, the
//   long reduction (4096, 14336) spreads over blocks, and so does a long (prefill) segment. When the
//   tiles alone fill the GPU (prefill-sized steps) the grid has one split and each block walks every
//   chunk of the fan-in itself, summing in registers in the same order. Only the
//   slot's own rank is computed (8-column tiles up to its rank), not r_pad. The last block of a
//   (tile, module) to finish (a counter) sums the splits in a fixed order into t = scale · Σ,
//   stored as bf16 hi + lo (t ≈ hi + lo to about 16 bits of mantissa, so the tensor-core expand loses
//   nothing against an f32 t), and sets the counter back to 0 for the next launch.
// - lora_expand_sgmv: y[i, cols] += t_hi · Bᵀ + t_lo · Bᵀ on tensor cores, one block per (128-column
//   tile of one module's output, work tile), written straight into the (fused) output, rounded to bf16;
//   or (`overwrite`) into a separate update buffer that the output's consumer adds.
//
// Batch invariance: a token's result depends only on its own row: mma rows are independent, the k
// splits depend on k alone, and every sum runs in a fixed order, whatever else is in the batch.
// The kernels are launched with programmatic dependent launch where the GPU has it: each waits for
// the previous kernel before reading, and lets the next one start its prologue at once.

#define LORA_MAX_R 64     // largest r_pad (shrink: 8 accumulator tiles of 8 ranks per warp)
#define LORA_KC 256       // fan-in per shrink block (its 4 warps take 64 each)
#define LORA_EXPAND_COLS 128  // output columns per expand block (its 4 warps take 32 each)
#define LORA_TILE 16      // tokens per work tile (one mma row tile): a segment spreads over blocks
#define LORA_RUN (16 * LORA_MAX_R / 128)  // a shrink thread's share of a tile's 16 x r sums
#define LORA_EXPAND_VECS (LORA_TILE * LORA_EXPAND_COLS / 8 / 128)  // an expand thread's 16-byte vectors of y per tile

// Segments of the step: seg[s] = first position of slot s in `order`, seg[num_slots] = tokens with a
// slot; and the work tiles: tiles[0] = their count, then (slot, first position within the slot's
// segment) per tile of up to LORA_TILE tokens (at most ceil(n / LORA_TILE) + num_slots tiles).
// One block of 1024 threads; a ballot-and-count pass per slot keeps token order within a slot.
// It also zeroes `zero_len` ints at `zero` (the step's counters of the 8-bit GEMV's LoRA expand, one
// per launch: gemv_mma8.cu), which no kernel before it reads.
extern "C" __global__ void __launch_bounds__(1024) lora_group(int* __restrict__ order, int* __restrict__ seg,
                                                             int* __restrict__ tiles, const int* __restrict__ slots,
                                                             int n, int num_slots, int* __restrict__ zero, int zero_len) {
    __shared__ int warp_counts[32];
    __shared__ int base;
    // No pdl_trigger(): kernels after this one read the tables before their pdl_wait()
    // (lora_expand_body prefetches B by them), so none may start before these are written.
    pdl_wait();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    if (tid < zero_len) zero[tid] = 0;
    if (tid == 0) base = 0;
    __syncthreads();
    for (int s = 0; s < num_slots; ++s) {
        if (tid == 0) seg[s] = base;
        for (int c = 0; c < n; c += blockDim.x) {
            const int i = c + tid;
            const bool mine = i < n && slots[i] == s;
            const u32 ballot = __ballot_sync(0xffffffffu, mine);
            if (lane == 0) warp_counts[warp] = __popc(ballot);
            __syncthreads();
            int before = base;
            for (int w = 0; w < warp; ++w) before += warp_counts[w];
            if (mine) order[before + __popc(ballot & ((1u << lane) - 1u))] = i;
            __syncthreads();
            if (tid == 0) {
                int total = 0;
                for (int w = 0; w < nwarps; ++w) total += warp_counts[w];
                base += total;
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        seg[num_slots] = base;
        int count = 0;
        for (int s = 0; s < num_slots; ++s) {
            const int len = seg[s + 1] - seg[s];
            for (int m = 0; m < len; m += LORA_TILE, ++count) {
                tiles[1 + 2 * count] = s;
                tiles[2 + 2 * count] = m;
            }
        }
        tiles[0] = count;
    }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// Two consecutive bf16 (4-byte aligned) as one register.
__device__ __forceinline__ u32 lora_ld2(const bf16_t* p) { return *reinterpret_cast<const u32*>(p); }

// d += a (16x16, row) * b (16x8, col), the PTX ISA's m16n8k16 fragment layout.
__device__ __forceinline__ void lora_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Stores v (a scaled sum) as t ≈ hi + lo at token i, column `at` of t.
__device__ __forceinline__ void lora_store_t(bf16_t* t_hi, bf16_t* t_lo, u64 at, float v) {
    const bf16_t hi = f2bf(v);
    t_hi[at] = hi;
    t_lo[at] = f2bf(v - bf2f(hi));
}

// The last block of a tile: every split's partial sum of each (token, rank) of the tile added in
// split order from 0, scaled, stored as t (zeros past the slot's rank up to r_pad). Threads
// `first`, `first + stride`, ... share the tile's len * r_pad values.
__device__ __forceinline__ void lora_sum_splits(bf16_t* t_hi, bf16_t* t_lo, const float* t_part, const int* order,
                                                int start, int len, int n, int R, int mod, int r_pad, int rank,
                                                float scale, int splits, int first, int stride) {
    for (int e = first; e < len * r_pad; e += stride) {
        const int row = e / r_pad, col = e % r_pad;
        const u64 at = (u64)order[start + row] * R + mod * r_pad + col;
        float v = 0.f;
        if (col < rank) {
            for (int s = 0; s < splits; ++s) v += __ldcg(t_part + (u64)s * n * R + at);
            v *= scale;
        }
        lora_store_t(t_hi, t_lo, at, v);
    }
}

__device__ __forceinline__ void lora_cp16(void* smem, const void* gmem, bool fill) {
    unsigned dst;
    asm volatile("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }\n" : "=r"(dst) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void lora_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void lora_cp_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void lora_cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
extern __shared__ __align__(16) bf16_t lora_stage_smem[];

// Row of the split kernel's staged chunk in bf16: 8 more than LORA_KC (528 bytes), so that a warp's
// 4-byte fragment reads (rows g, columns 2q) hit 32 distinct banks.
#define LORA_CROW (LORA_KC + 8)

// t_hi, t_lo: [n, R] bf16 with R = n_modules * r_pad (module m's ranks at columns m * r_pad), zeros
// past each slot's rank; t_part: [splits, n, R] f32 partial sums; counters: 3 i32 per tile, 0
// between launches; x rows `x_stride` apart; a_m: module m's A stack for this layer, [slots, r_pad,
// k] bf16; ranks, scales: one per slot. grid: (ceil(k / LORA_KC), max tiles, n_modules); block: 128;
// dynamic shared memory: (LORA_TILE + r_pad) rows of LORA_CROW bf16. k a multiple of 16.
// Each chunk's 16 rows of x and the slot's rows of A are first copied into shared memory, with
// 16-byte cp.async where `aligned` (x, A and their row strides 16-byte aligned), else 4 bytes at a
// time; the mma fragments are then read from there. (Read straight from global memory, 4 bytes per
// lane, the fragments kept L1 busy with eight lines per warp load: ncu on an H200, 4 adapters x 256
// tokens, q|k|v took 21 µs at 60 % L1 and 5 % DRAM throughput.) The same mma, in the same order, on
// the same values: the same bits as before.
extern "C" __global__ void __launch_bounds__(128) lora_shrink_sgmv(
    bf16_t* __restrict__ t_hi, bf16_t* __restrict__ t_lo, float* __restrict__ t_part, int* __restrict__ counters,
    const bf16_t* __restrict__ x, int x_stride, const bf16_t* __restrict__ a0, const bf16_t* __restrict__ a1,
    const bf16_t* __restrict__ a2, const int* __restrict__ order, const int* __restrict__ seg,
    const int* __restrict__ tiles, const int* __restrict__ ranks, const float* __restrict__ scales, int n, int k,
    int r_pad, int n_modules, int aligned) {
    // xs: [LORA_TILE][LORA_CROW], then as: [r_pad][LORA_CROW]; once a chunk's mma are done, the
    // warps' sums (red: [4][LORA_TILE][cols + 1] f32, at most 16.6 KB) reuse the same bytes.
    bf16_t* const xs = lora_stage_smem;
    bf16_t* const as = lora_stage_smem + LORA_TILE * LORA_CROW;
    float* const red = reinterpret_cast<float*>(lora_stage_smem);
    __shared__ int last;
    pdl_wait();
    pdl_trigger();
    const int split = blockIdx.x, tile = blockIdx.y, mod = blockIdx.z;
    if (tile >= tiles[0]) return;
    const int slot = tiles[1 + 2 * tile], first = tiles[2 + 2 * tile];
    const int start = seg[slot] + first, len = min(seg[slot + 1] - seg[slot] - first, LORA_TILE);
    const int rank = min(ranks[slot], r_pad);
    if (len == 0 || rank <= 0) return;
    const int ntiles = (rank + 7) >> 3;
    const bf16_t* a = (mod == 0 ? a0 : mod == 1 ? a1 : a2) + (u64)slot * r_pad * k;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int R = n_modules * r_pad;
    const int cols = ntiles * 8, red_row = cols + 1;
#define LORA_RED(w, r, c) red[((w) * LORA_TILE + (r)) * red_row + (c)]
    // One block per chunk of LORA_KC (a split), or (grid x of 1) one block for every chunk in turn,
    // keeping each chunk's sum in registers: both add the chunks' sums in chunk order starting
    // from 0, so a token's result is the same bits either way (batch invariance across step sizes).
    const bool whole = gridDim.x == 1;
    const int chunk_end = whole ? (k + LORA_KC - 1) / LORA_KC : split + 1;
    float run[LORA_RUN];
#pragma unroll
    for (int j = 0; j < LORA_RUN; ++j) run[j] = 0.f;
    for (int chunk = whole ? 0 : split; chunk < chunk_end; ++chunk) {
        const int k0 = chunk * LORA_KC;
        // Stage: x's rows (zeros past the tile's tokens), then A's first `cols` rows; 16-byte pieces
        // past k are left alone (the k-steps there are skipped below).
        for (int e = threadIdx.x; e < (LORA_TILE + cols) * (LORA_KC / 8); e += blockDim.x) {
            const int row = e / (LORA_KC / 8), kk = k0 + (e % (LORA_KC / 8)) * 8;
            if (kk >= k) continue;
            const bool is_x = row < LORA_TILE, fill = !is_x || row < len;
            const bf16_t* src = is_x ? (fill ? x + (u64)order[start + row] * x_stride + kk : x) : a + (u64)(row - LORA_TILE) * k + kk;
            bf16_t* dst = xs + row * LORA_CROW + (kk - k0);  // as follows xs: row LORA_TILE is A's row 0
            if (aligned) {
                lora_cp16(dst, src, fill);
            } else {
#pragma unroll
                for (int w = 0; w < 4; ++w) reinterpret_cast<u32*>(dst)[w] = fill ? lora_ld2(src + 2 * w) : 0u;
            }
        }
        if (aligned) {
            lora_cp_commit();
            lora_cp_wait_all();
        }
        __syncthreads();
        const int k_begin = warp * (LORA_KC / 4);  // within the chunk
        float acc[8][4];
#pragma unroll
        for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
        for (int step = 0; step < LORA_KC / 4 / 16; ++step) {
            const int c = k_begin + step * 16 + q * 2;
            if (k0 + k_begin + step * 16 < k) {
                u32 af[4];
                af[0] = lora_ld2(xs + g * LORA_CROW + c);
                af[1] = lora_ld2(xs + (g + 8) * LORA_CROW + c);
                af[2] = lora_ld2(xs + g * LORA_CROW + c + 8);
                af[3] = lora_ld2(xs + (g + 8) * LORA_CROW + c + 8);
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    if (t < ntiles) {
                        const bf16_t* ar = as + (t * 8 + g) * LORA_CROW + c;
                        lora_mma(acc[t], af, lora_ld2(ar), lora_ld2(ar + 8));
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with the staged chunk that red overwrites
        // Accumulator (t): rows g and g + 8, rank columns t * 8 + 2q, +1.
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            if (t < ntiles) {
                LORA_RED(warp, g, t * 8 + 2 * q) = acc[t][0];
                LORA_RED(warp, g, t * 8 + 2 * q + 1) = acc[t][1];
                LORA_RED(warp, g + 8, t * 8 + 2 * q) = acc[t][2];
                LORA_RED(warp, g + 8, t * 8 + 2 * q + 1) = acc[t][3];
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < LORA_RUN; ++j) {
            const int e = threadIdx.x + j * 128;
            if (e < 16 * cols) {
                const int row = e / cols, col = e % cols;
                const float v = ((LORA_RED(0, row, col) + LORA_RED(1, row, col)) + LORA_RED(2, row, col)) + LORA_RED(3, row, col);
                if (whole) {
                    run[j] += v;
                } else if (row < len) {
                    t_part[((u64)split * n + order[start + row]) * R + mod * r_pad + col] = v;
                }
            }
        }
        __syncthreads();  // red is read before the next chunk is staged over it
    }
    const float scale = scales[slot];
    if (whole) {
        // The sums, from registers (laid out by 16 x cols) to red's first rows (by row, col) for the store.
#pragma unroll
        for (int j = 0; j < LORA_RUN; ++j) {
            const int e = threadIdx.x + j * 128;
            if (e < 16 * cols) LORA_RED(0, e / cols, e % cols) = run[j];
        }
        __syncthreads();
        for (int e = threadIdx.x; e < len * r_pad; e += blockDim.x) {
            const int row = e / r_pad, col = e % r_pad;
            const u64 at = (u64)order[start + row] * R + mod * r_pad + col;
            lora_store_t(t_hi, t_lo, at, col < rank ? LORA_RED(0, row, col) * scale : 0.f);
        }
        return;
    }
#undef LORA_RED
    // The last block of this (tile, module) reduces every split (threadFenceReduction's pattern).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(&counters[tile * 3 + mod], 1);
        last = done == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) counters[tile * 3 + mod] = 0;
    lora_sum_splits(t_hi, t_lo, t_part, order, start, len, n, R, mod, r_pad, rank, scale, gridDim.x, threadIdx.x, blockDim.x);
}

// Prefill-sized steps: lora_shrink_staged computes what lora_shrink_sgmv computes, bit for bit, with
// x and A staged in shared memory. One block of 4 warps takes 4 consecutive work tiles (64 tokens,
// mostly of one slot), so A is read from global memory once per 64 tokens instead of once per 16, and
// every global read is a 16-byte cp.async, in a ring of LORA_STAGES sub-ranges of 64 of the fan-in. Each
// warp computes its own tile's sums in the split kernel's order: per sub-range of 64 (4 mma k-steps
// from 0), ((p0 + p1) + p2) + p3 per chunk of 256, the chunks added in order from 0; steps past k
// are skipped exactly as there. Tiles of another slot in the same block get a second pass (tiles are
// sorted by slot). grid.z splits the chunks over blocks: each chunk's sum goes to t_part and the
// last block of the tile group adds them in chunk order, as the split kernel does; with grid.z = 1
// the sums stay in registers. grid: (ceil(max tiles / 4), n_modules, splits); block: 128; x, A and
// their row strides 16-byte aligned; chunks_per_block * gridDim.z covers ceil(k / 256).
#define LORA_SUB (LORA_KC / 4)      // fan-in per sub-range: a warp's share of a chunk in the split kernel
#define LORA_SROW (LORA_SUB + 8)    // shared row in bf16 (144 bytes: lanes g, q hit 32 distinct banks)
// Sub-ranges in the cp.async ring: two are in flight while the third is computed (with two, the
// block waited for each one's loads: 18 % of the DRAM bandwidth at 4096 tokens on an H100). Dynamic
// shared memory: LORA_STAGES * (4 * LORA_TILE + r_pad) rows of LORA_SROW (lora_staged_smem_bytes).
#define LORA_STAGES 3

// NT: 8-rank accumulator tiles a warp holds (r_pad / 8 at most); the r32 instance holds 4, so fewer
// registers and more blocks per SM for ranks up to 32.
template <int NT>
__device__ __forceinline__ void lora_shrink_staged_body(
    bf16_t* __restrict__ t_hi, bf16_t* __restrict__ t_lo, float* __restrict__ t_part, int* __restrict__ counters,
    const bf16_t* __restrict__ x, int x_stride, const bf16_t* __restrict__ a0, const bf16_t* __restrict__ a1,
    const bf16_t* __restrict__ a2, const int* __restrict__ order, const int* __restrict__ seg,
    const int* __restrict__ tiles, const int* __restrict__ ranks, const float* __restrict__ scales, int n, int k,
    int r_pad, int n_modules, int chunks_per_block) {
    // xs: [LORA_STAGES][4 * LORA_TILE][LORA_SROW], then as: [LORA_STAGES][r_pad][LORA_SROW].
    bf16_t* const xs = lora_stage_smem;
    bf16_t* const as = lora_stage_smem + LORA_STAGES * 4 * LORA_TILE * LORA_SROW;
#define LORA_XS(b, r, c) xs[((b) * 4 * LORA_TILE + (r)) * LORA_SROW + (c)]
#define LORA_AS(b, r, c) as[((b) * r_pad + (r)) * LORA_SROW + (c)]
    __shared__ int last;
    pdl_wait();
    pdl_trigger();
    const int mod = blockIdx.y, total = tiles[0], first_tile = blockIdx.x * 4;
    if (first_tile >= total) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int my_tile = first_tile + warp, last_tile = min(first_tile + 4, total) - 1;
    int my_slot = -1, start = 0, len = 0;
    if (my_tile < total) {
        my_slot = tiles[1 + 2 * my_tile];
        const int first = tiles[2 + 2 * my_tile];
        start = seg[my_slot] + first;
        len = min(seg[my_slot + 1] - seg[my_slot] - first, LORA_TILE);
    }
    const int R = n_modules * r_pad;
    const bool whole = gridDim.z == 1;
    const int chunks = (k + LORA_KC - 1) / LORA_KC;
    const int sub_begin = blockIdx.z * chunks_per_block * 4;
    const int sub_end = min(chunks, (int)(blockIdx.z + 1) * chunks_per_block) * 4;
    // This lane's share of staging its warp's 16 rows: row lane / 2, pieces (lane & 1) * 4 .. + 4.
    const int stage_row = lane >> 1, stage_piece = (lane & 1) * 4;
    for (int pass_slot = tiles[1 + 2 * first_tile];;) {
        const int rank = min(ranks[pass_slot], r_pad);
        const bool mine = my_slot == pass_slot && len > 0;
        if (rank > 0 && sub_begin < sub_end) {
            const int ntiles = min((rank + 7) >> 3, NT), cols = ntiles * 8;
            const bf16_t* a = (mod == 0 ? a0 : mod == 1 ? a1 : a2) + (u64)pass_slot * r_pad * k;
            const bool xfill = mine && stage_row < len;
            const bf16_t* xrow = xfill ? x + (u64)order[start + stage_row] * x_stride : x;
            auto stage = [&](int sub, int buf) {
                const int k0 = sub * LORA_SUB;
                if (k0 >= k) return;
                if (mine) {
#pragma unroll
                    for (int pc = 0; pc < 4; ++pc) {
                        const int kk = k0 + (stage_piece + pc) * 8;
                        if (kk < k) lora_cp16(&LORA_XS(buf, warp * LORA_TILE + stage_row, (stage_piece + pc) * 8), xrow + kk, xfill);
                    }
                }
                for (int e = threadIdx.x; e < cols * 8; e += blockDim.x) {
                    const int row = e >> 3, kk = k0 + (e & 7) * 8;
                    if (kk < k) lora_cp16(&LORA_AS(buf, row, (e & 7) * 8), a + (u64)row * k + kk, true);
                }
            };
            float run[NT][4], sum[NT][4];
#pragma unroll
            for (int t = 0; t < NT; ++t) run[t][0] = run[t][1] = run[t][2] = run[t][3] = 0.f;
            // The ring: LORA_STAGES - 1 sub-ranges staged ahead; one commit group per sub-range
            // (empty past the end), so that waiting for all but the newest LORA_STAGES - 2 groups
            // means this sub-range has landed.
            const int nsub = sub_end - sub_begin;
#pragma unroll
            for (int p = 0; p < LORA_STAGES - 1; ++p) {
                if (p < nsub) stage(sub_begin + p, p);
                lora_cp_commit();
            }
            for (int i = 0; i < nsub; ++i) {
                const int sub = sub_begin + i, buf = i % LORA_STAGES;
                lora_cp_wait_prev();  // wait_group 1 = LORA_STAGES - 2
                // Every thread's copies of this sub-range have landed, and every warp is done with
                // the buffer read in the previous iteration, which the next stage overwrites.
                __syncthreads();
                if (i + LORA_STAGES - 1 < nsub) stage(sub + LORA_STAGES - 1, (i + LORA_STAGES - 1) % LORA_STAGES);
                lora_cp_commit();
                if (mine) {
                    float acc[NT][4];
#pragma unroll
                    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
                    for (int step = 0; step < LORA_SUB / 16; ++step) {
                        if (sub * LORA_SUB + step * 16 < k) {
                            const int c = step * 16 + q * 2;
                            const bf16_t* r0 = &LORA_XS(buf, warp * LORA_TILE + g, c);
                            const bf16_t* r1 = &LORA_XS(buf, warp * LORA_TILE + g + 8, c);
                            u32 af[4];
                            af[0] = lora_ld2(r0);
                            af[1] = lora_ld2(r1);
                            af[2] = lora_ld2(r0 + 8);
                            af[3] = lora_ld2(r1 + 8);
#pragma unroll
                            for (int t = 0; t < NT; ++t) {
                                if (t < ntiles) {
                                    const bf16_t* ar = &LORA_AS(buf, t * 8 + g, c);
                                    lora_mma(acc[t], af, lora_ld2(ar), lora_ld2(ar + 8));
                                }
                            }
                        }
                    }
                    const int w = sub & 3;
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) sum[t][j] = w == 0 ? acc[t][j] : sum[t][j] + acc[t][j];
                    }
                    if (w == 3) {
#pragma unroll
                        for (int t = 0; t < NT; ++t) {
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                const int row = g + (j >> 1) * 8, col = t * 8 + 2 * q + (j & 1);
                                if (whole) {
                                    run[t][j] += sum[t][j];
                                } else if (t < ntiles && row < len) {
                                    t_part[((u64)(sub >> 2) * n + order[start + row]) * R + mod * r_pad + col] = sum[t][j];
                                }
                            }
                        }
                    }
                }
            }
            // Nothing in flight, and every warp done reading, before another pass stages again.
            lora_cp_wait_all();
            __syncthreads();
            if (mine && whole) {
                const float scale = scales[pass_slot];
#pragma unroll
                for (int t = 0; t < NT; ++t) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int row = g + (j >> 1) * 8, col = t * 8 + 2 * q + (j & 1);
                        if (t < ntiles && row < len) {
                            lora_store_t(t_hi, t_lo, (u64)order[start + row] * R + mod * r_pad + col, col < rank ? run[t][j] * scale : 0.f);
                        }
                    }
                }
                // Columns past the rank tiles up to r_pad are zeros, as the split kernel writes them.
                for (int e = lane; e < LORA_TILE * (r_pad - cols); e += 32) {
                    const int row = e / (r_pad - cols), col = cols + e % (r_pad - cols);
                    if (row < len) lora_store_t(t_hi, t_lo, (u64)order[start + row] * R + mod * r_pad + col, 0.f);
                }
            }
        }
        // The next slot among this block's tiles (sorted by slot), if any.
        int next = -1;
        for (int tt = first_tile; tt <= last_tile && next < 0; ++tt) {
            if (tiles[1 + 2 * tt] > pass_slot) next = tiles[1 + 2 * tt];
        }
        if (next < 0) break;
        pass_slot = next;
    }
    if (whole) return;
    // The last block of this tile group and module adds every chunk's sum in chunk order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(&counters[blockIdx.x * 3 + mod], 1);
        last = done == (int)gridDim.z - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) counters[blockIdx.x * 3 + mod] = 0;
    if (len == 0) return;
    const int rank = min(ranks[my_slot], r_pad);
    if (rank <= 0) return;
    const float scale = scales[my_slot];
    lora_sum_splits(t_hi, t_lo, t_part, order, start, len, n, R, mod, r_pad, rank, scale, chunks, lane, 32);
}
#define LORA_STAGED_PARAMS                                                                                       \
    bf16_t *__restrict__ t_hi, bf16_t *__restrict__ t_lo, float *__restrict__ t_part, int *__restrict__ counters, \
        const bf16_t *__restrict__ x, int x_stride, const bf16_t *__restrict__ a0, const bf16_t *__restrict__ a1,  \
        const bf16_t *__restrict__ a2, const int *__restrict__ order, const int *__restrict__ seg,                 \
        const int *__restrict__ tiles, const int *__restrict__ ranks, const float *__restrict__ scales, int n, int k, \
        int r_pad, int n_modules, int chunks_per_block
#define LORA_STAGED_ARGS \
    t_hi, t_lo, t_part, counters, x, x_stride, a0, a1, a2, order, seg, tiles, ranks, scales, n, k, r_pad, n_modules, chunks_per_block
extern "C" __global__ void __launch_bounds__(128) lora_shrink_staged(LORA_STAGED_PARAMS) {
    lora_shrink_staged_body<LORA_MAX_R / 8>(LORA_STAGED_ARGS);
}
// r_pad <= 32 (ranks up to 32): the same sums with half the accumulator tiles held.
extern "C" __global__ void __launch_bounds__(128) lora_shrink_staged_r32(LORA_STAGED_PARAMS) {
    lora_shrink_staged_body<4>(LORA_STAGED_ARGS);
}
#undef LORA_STAGED_ARGS
#undef LORA_STAGED_PARAMS
#undef LORA_XS
#undef LORA_AS

// Decode-sized steps without a reduction across blocks: lora_shrink_ranks computes what
// lora_shrink_sgmv computes, bit for bit, with one block per (8-rank column tile, work tile, module)
// walking the whole fan-in. Its LORA_RK_WARPS warps take the 256-wide chunks in turn (warp w: chunks
// w, w + LORA_RK_WARPS, ...), each chunk as the split kernel's four warps do it (four 64-wide
// sub-ranges of four k-steps each, from 0, then ((p0 + p1) + p2) + p3), into shared memory; then the
// chunks are added in order from 0, scaled and stored. No partial sums in global memory, no
// counter, no last block: the split kernel's chain after its mma (store, fence, atomic, re-read)
// is gone, and each block reads only its 8 rows of A. Column tiles at or past the slot's rank write
// zeros, as the split kernel does past the rank. grid: (r_pad / 8, max tiles, n_modules); block:
// 32 * LORA_RK_WARPS; ceil(k / 256) <= LORA_RK_MAX_CHUNKS.
#define LORA_RK_WARPS 16
#define LORA_RK_MAX_CHUNKS 64

extern "C" __global__ void __launch_bounds__(LORA_RK_WARPS * 32) lora_shrink_ranks(
    bf16_t* __restrict__ t_hi, bf16_t* __restrict__ t_lo, const bf16_t* __restrict__ x, int x_stride,
    const bf16_t* __restrict__ a0, const bf16_t* __restrict__ a1, const bf16_t* __restrict__ a2,
    const int* __restrict__ order, const int* __restrict__ seg, const int* __restrict__ tiles,
    const int* __restrict__ ranks, const float* __restrict__ scales, int k, int r_pad, int n_modules) {
    __shared__ float sums[LORA_RK_MAX_CHUNKS][LORA_TILE][8];
    pdl_wait();
    pdl_trigger();
    const int col0 = blockIdx.x * 8, tile = blockIdx.y, mod = blockIdx.z;
    if (tile >= tiles[0]) return;
    const int slot = tiles[1 + 2 * tile], first = tiles[2 + 2 * tile];
    const int start = seg[slot] + first, len = min(seg[slot + 1] - seg[slot] - first, LORA_TILE);
    const int rank = min(ranks[slot], r_pad);
    if (len == 0 || rank <= 0) return;
    const u64 out0 = (u64)mod * r_pad + col0;  // this tile's first column of t
    const int R = n_modules * r_pad;
    if (col0 >= rank) {
        for (int e = threadIdx.x; e < len * 8; e += blockDim.x) {
            lora_store_t(t_hi, t_lo, (u64)order[start + (e >> 3)] * R + out0 + (e & 7), 0.f);
        }
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const bf16_t* a = (mod == 0 ? a0 : mod == 1 ? a1 : a2) + ((u64)slot * r_pad + col0 + g) * k;
    // Rows past the tile's tokens read a valid row (the tile's first) and feed zeros, and steps past
    // k a valid column, so that every load is unconditional and a half chunk's 48 go out before its
    // first mma (with the split kernel's guarded loads, each k-step waited for its own).
    const bool has0 = g < len, has1 = g + 8 < len;
    const bf16_t* x0 = x + (u64)order[start + (has0 ? g : 0)] * x_stride;
    const bf16_t* x1 = x + (u64)order[start + (has1 ? g + 8 : 0)] * x_stride;
    const int chunks = (k + LORA_KC - 1) / LORA_KC;
    for (int chunk = warp; chunk < chunks; chunk += LORA_RK_WARPS) {
        float sum[4], acc[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // two sub-ranges of four k-steps each
            u32 xf[8][4], af[8][2];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int c = min(chunk * LORA_KC + (half * 8 + i) * 16, k - 16) + q * 2;
                xf[i][0] = lora_ld2(x0 + c);
                xf[i][1] = lora_ld2(x1 + c);
                xf[i][2] = lora_ld2(x0 + c + 8);
                xf[i][3] = lora_ld2(x1 + c + 8);
                af[i][0] = lora_ld2(a + c);
                af[i][1] = lora_ld2(a + c + 8);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int st = half * 8 + i, sub = st >> 2;
                if ((st & 3) == 0) acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
                if (chunk * LORA_KC + st * 16 < k) {
                    const u32 xa[4] = {has0 ? xf[i][0] : 0u, has1 ? xf[i][1] : 0u, has0 ? xf[i][2] : 0u, has1 ? xf[i][3] : 0u};
                    lora_mma(acc, xa, af[i][0], af[i][1]);
                }
                if ((st & 3) == 3) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) sum[j] = sub == 0 ? acc[j] : sum[j] + acc[j];
                }
            }
        }
        // Accumulator: rows g and g + 8, columns 2q, 2q + 1 of the tile.
        sums[chunk][g][2 * q] = sum[0];
        sums[chunk][g][2 * q + 1] = sum[1];
        sums[chunk][g + 8][2 * q] = sum[2];
        sums[chunk][g + 8][2 * q + 1] = sum[3];
    }
    __syncthreads();
    if (threadIdx.x < LORA_TILE * 8) {
        const int row = threadIdx.x >> 3, col = threadIdx.x & 7;
        if (row < len) {
            float v = 0.f;
            for (int c = 0; c < chunks; ++c) v += sums[c][row][col];
            v *= scales[slot];
            lora_store_t(t_hi, t_lo, (u64)order[start + row] * R + out0 + col, col0 + col < rank ? v : 0.f);
        }
    }
}

// Row stride of the expand kernels' staged sums, in floats: 8 more than the columns, so that the
// float2 stores of an mma accumulator (rows g, columns 2q) from half a warp hit 32 distinct banks.
#define LORA_STAGE_PAD 8
// An accumulator pair (columns c, c + 1 of rows g and g + 8) into staged sums `stride` floats apart.
__device__ __forceinline__ void lora_stage_acc(float* staged, int stride, int g, int c, const float (&acc)[4]) {
    *reinterpret_cast<float2*>(staged + g * stride + c) = make_float2(acc[0], acc[1]);
    *reinterpret_cast<float2*>(staged + (g + 8) * stride + c) = make_float2(acc[2], acc[3]);
}
// Eight staged sums from `p` (16-byte aligned) as two 16-byte reads. The 8 lanes of a quarter warp
// read 8 such runs 32 bytes apart: lanes with bit 2 set read their second half first, so that each
// of the two reads covers 32 distinct banks (scalar reads were the kernels' L1 bottleneck: 82 % of
// L1 throughput at 20 % of DRAM's, ncu on an H200).
__device__ __forceinline__ void lora_load8_staged(const float* p, float (&v)[8]) {
    const int sw = threadIdx.x & 4;
    const float4 a = *reinterpret_cast<const float4*>(p + sw);
    const float4 b = *reinterpret_cast<const float4*>(p + 4 - sw);
    const float4 lo = sw ? b : a, hi = sw ? a : b;
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// The expand kernels' copy of t for one tile: rows 0..rows-1 are the tokens order[start ..], zeros
// after; columns c0 .. c0 + w of t_hi and t_lo (w a multiple of 8), in rows `stride` bf16 apart
// (stride = w + 8: the mma fragment reads of a warp, rows g and 4-byte columns q, hit distinct
// banks). One 16-byte load per thread and chunk: read from global memory as 4-byte fragments, t was
// the kernels' L1 bottleneck (8 lines per warp load, re-read by every column block).
#define LORA_TS_MAX (2 * LORA_MAX_R + 8)
__device__ __forceinline__ void lora_stage_t(bf16_t* ts_hi, bf16_t* ts_lo, int stride, const bf16_t* __restrict__ t_hi,
                                             const bf16_t* __restrict__ t_lo, const int* __restrict__ order, int start,
                                             int rows, int R, int c0, int w) {
    const int per_row = w >> 3, per_half = LORA_TILE * per_row;
    for (int e = threadIdx.x; e < 2 * per_half; e += blockDim.x) {
        const int lo = e >= per_half, r = (e - lo * per_half) / per_row, c = ((e - lo * per_half) % per_row) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows) v = *reinterpret_cast<const uint4*>((lo ? t_lo : t_hi) + (u64)order[start + r] * R + c0 + c);
        *reinterpret_cast<uint4*>((lo ? ts_lo : ts_hi) + r * stride + c) = v;
    }
}

// A warp's B fragments of one slot's stack `b` ([out, r_pad]): 4 column tiles of 8 from o_base, up to
// KS rank steps of 16; zeros past `ksteps` and past `out`.
template <int KS>
__device__ __forceinline__ void lora_load_b(u32 (&bf)[4][KS][2], const bf16_t* __restrict__ b, int o_base, int out,
                                            int r_pad, int ksteps, int g, int q) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const int o = o_base + nt * 8 + g;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const bf16_t* br = b + (u64)o * r_pad + ks * 16 + q * 2;
            const bool ok = o < out && ks < ksteps;
            bf[nt][ks][0] = ok ? lora_ld2(br) : 0u;
            bf[nt][ks][1] = ok ? lora_ld2(br + 8) : 0u;
        }
    }
}

// A warp's sums of one tile: acc[nt] = (t_hi + t_lo) · B over the first `ksteps` rank steps, t from
// the tile's shared copy (rows g and g + 8, columns c0 + 16 ks + 2q; see lora_stage_t).
template <int KS>
__device__ __forceinline__ void lora_tile_mma(float (&acc)[4][4], const u32 (&bf)[4][KS][2], const bf16_t* ts_hi,
                                              const bf16_t* ts_lo, int stride, int c0, int ksteps, int g, int q) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        if (ks < ksteps) {
            const int c = c0 + ks * 16 + q * 2;
            const bf16_t *h0 = ts_hi + g * stride + c, *h1 = h0 + 8 * stride;
            const bf16_t *l0 = ts_lo + g * stride + c, *l1 = l0 + 8 * stride;
            const u32 hi[4] = {lora_ld2(h0), lora_ld2(h1), lora_ld2(h0 + 8), lora_ld2(h1 + 8)};
            const u32 lo[4] = {lora_ld2(l0), lora_ld2(l1), lora_ld2(l0 + 8), lora_ld2(l1 + 8)};
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                lora_mma(acc[nt], hi, bf[nt][ks][0], bf[nt][ks][1]);
                lora_mma(acc[nt], lo, bf[nt][ks][0], bf[nt][ks][1]);
            }
        }
    }
}

// y[i, col_m + o] += (t_hi + t_lo)[i, module m's ranks] · B_m[slot_i][o, :] for the tokens of each
// segment, rounded back to bf16. b_m: module m's B stack for this layer, [slots, out_m, r_pad] bf16;
// module m's columns start at col_m in rows `y_stride` apart. grid: (Σ_m ceil(out_m / 128),
// ceil(max tiles / tiles_per_block)); block: 128.
// With `overwrite`, y is a separate delta buffer instead: y[i, ..] = bf16(update) for every token with
// a slot (zeros for an empty slot's rank 0), nothing read; the kernel that consumes the base output
// adds it (LoraDelta in ops/lora.rs), so this launch can run beside the base projection.
// KS: the most 16-rank steps of B a thread holds (LORA_MAX_R / 16 = 4; 2 where r_pad <= 32, which
// keeps 16 fewer registers of B fragments).
template <int KS>
__device__ __forceinline__ void lora_expand_body(
    bf16_t* __restrict__ y, int y_stride, const bf16_t* __restrict__ t_hi, const bf16_t* __restrict__ t_lo,
    const bf16_t* __restrict__ b0, const bf16_t* __restrict__ b1, const bf16_t* __restrict__ b2, int out0, int out1,
    int out2, int col0, int col1, int col2, const int* __restrict__ order, const int* __restrict__ seg,
    const int* __restrict__ tiles, const int* __restrict__ ranks, int R, int r_pad, int tiles_per_block, int overwrite) {
    // A tile's sums, staged for the 16-byte read-modify-write of y (when rows and columns allow it).
    __shared__ __align__(16) float staged[LORA_TILE][LORA_EXPAND_COLS + LORA_STAGE_PAD];
    // The tile's t columns of this block's module (r_pad of them).
    __shared__ __align__(16) bf16_t ts_hi[LORA_TILE * (LORA_MAX_R + 8)], ts_lo[LORA_TILE * (LORA_MAX_R + 8)];
    int tile = blockIdx.x, mod = 0;
    const int tiles0 = (out0 + LORA_EXPAND_COLS - 1) / LORA_EXPAND_COLS;
    const int tiles1 = (out1 + LORA_EXPAND_COLS - 1) / LORA_EXPAND_COLS;
    if (tile >= tiles0) {
        tile -= tiles0;
        mod = 1;
        if (tile >= tiles1) {
            tile -= tiles1;
            mod = 2;
        }
    }
    const int out = mod == 0 ? out0 : mod == 1 ? out1 : out2;
    const int col = mod == 0 ? col0 : mod == 1 ? col1 : col2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int o_base = tile * LORA_EXPAND_COLS + warp * 32;
    // A warp past the module's last column computes nothing but still takes part in the barriers.
    const bool active = o_base < out;
    // 16-byte vectors of y: 8 columns at a time, coalesced along the row, instead of one 4-byte pair
    // per lane (which left half of each 32-byte sector unused). Block-uniform.
    const bool vec8 = ((col | y_stride | out) & 7) == 0 && (reinterpret_cast<unsigned long long>(y) & 15) == 0;
    // This warp's B fragments (4 column tiles × up to 4 rank steps) of the slot last loaded: a block
    // takes `tiles_per_block` consecutive work tiles, mostly of one slot, and reloads B only when the
    // slot changes. Each token's sum is the same whatever tiles share its block.
    u32 bf[4][KS][2];
    int loaded = -1, ksteps = 0;
    // The first work tile's B fragments load before pdl_wait(), while the kernel before this launch
    // (the base GEMV of a one-token step, PDL-chained) still runs: B and the segment tables are not
    // written by it (lora_group, which writes the tables, lets no later kernel start before it
    // completes); t and y are read only after the wait.
    if (blockIdx.y * tiles_per_block < tiles[0] && active) {
        const int wt = blockIdx.y * tiles_per_block;
        const int slot = tiles[1 + 2 * wt], first = tiles[2 + 2 * wt];
        const int len = min(seg[slot + 1] - seg[slot] - first, LORA_TILE);
        const int rank = max(min(ranks[slot], r_pad), 0);
        if (len > 0 && (rank > 0 || overwrite)) {
            ksteps = (rank + 15) >> 4;
            lora_load_b<KS>(bf, (mod == 0 ? b0 : mod == 1 ? b1 : b2) + (u64)slot * out * r_pad, o_base, out, r_pad, ksteps, g, q);
            loaded = slot;
        }
    }
    pdl_wait();
    pdl_trigger();
    for (int wt = blockIdx.y * tiles_per_block; wt < (int)(blockIdx.y + 1) * tiles_per_block && wt < tiles[0]; ++wt) {
        const int slot = tiles[1 + 2 * wt], first = tiles[2 + 2 * wt];
        const int start = seg[slot] + first, len = min(seg[slot + 1] - seg[slot] - first, LORA_TILE);
        const int rank = max(min(ranks[slot], r_pad), 0);
        if (len == 0 || (rank == 0 && !overwrite)) continue;
        if (slot != loaded && active) {
            ksteps = (rank + 15) >> 4;
            lora_load_b<KS>(bf, (mod == 0 ? b0 : mod == 1 ? b1 : b2) + (u64)slot * out * r_pad, o_base, out, r_pad, ksteps, g, q);
            loaded = slot;
        }
        for (int m0 = 0; m0 < len; m0 += 16) {
            // The 16-byte path loads its two vectors of y first, so that their latency overlaps the
            // loads of t and the mma below (each (token, column) belongs to one block: no race).
            uint4 y_pre[LORA_EXPAND_VECS];
            uint4* y_at[LORA_EXPAND_VECS];
#pragma unroll
            for (int j = 0; j < LORA_EXPAND_VECS; ++j) {
                const int v = threadIdx.x + j * 128;
                const int row = v / (LORA_EXPAND_COLS / 8), c8 = (v % (LORA_EXPAND_COLS / 8)) * 8;
                const int o = tile * LORA_EXPAND_COLS + c8;
                y_at[j] = vec8 && m0 + row < len && o < out ? reinterpret_cast<uint4*>(y + (u64)order[start + m0 + row] * y_stride + col + o) : nullptr;
                if (y_at[j] && !overwrite) y_pre[j] = *y_at[j];
            }
            const int ts_stride = r_pad + 8;
            lora_stage_t(ts_hi, ts_lo, ts_stride, t_hi, t_lo, order, start + m0, min(len - m0, LORA_TILE), R, mod * r_pad, r_pad);
            __syncthreads();
            float acc[4][4];
            lora_tile_mma<KS>(acc, bf, ts_hi, ts_lo, ts_stride, 0, ksteps, g, q);
            const int i0 = m0 + g < len ? order[start + m0 + g] : -1;
            const int i1 = m0 + g + 8 < len ? order[start + m0 + g + 8] : -1;
            if (vec8) {
                // Accumulator (nt): rows g and g + 8, columns nt * 8 + 2q, +1 of this warp's 32.
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const int c = warp * 32 + nt * 8 + 2 * q;
                    lora_stage_acc(&staged[0][0], LORA_EXPAND_COLS + LORA_STAGE_PAD, g, c, acc[nt]);
                }
                __syncthreads();
#pragma unroll
                for (int j = 0; j < LORA_EXPAND_VECS; ++j) {
                    if (!y_at[j]) continue;
                    const int v = threadIdx.x + j * 128;
                    const int row = v / (LORA_EXPAND_COLS / 8), c8 = (v % (LORA_EXPAND_COLS / 8)) * 8;
                    uint4 w = overwrite ? make_uint4(0u, 0u, 0u, 0u) : y_pre[j];
                    u32* h = reinterpret_cast<u32*>(&w);
                    float sums[8];
                    lora_load8_staged(&staged[row][c8], sums);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        // Overwrite: 0 + sum is the sum exactly, rounded once.
                        const float lo = bf2f((bf16_t)(h[e] & 0xffffu)) + sums[2 * e];
                        const float hi = bf2f((bf16_t)(h[e] >> 16)) + sums[2 * e + 1];
                        h[e] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
                    }
                    *y_at[j] = w;
                }
                __syncthreads();
                continue;
            }
            // Accumulator (nt): rows g (token i0) and g + 8 (token i1), columns nt * 8 + 2q, +1: one
            // 4-byte read-modify-write per pair where the pair is aligned and whole.
            const bool pairs = ((col | y_stride | out) & 1) == 0;
#pragma unroll
            for (int nt = 0; nt < 4 && active; ++nt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = h == 0 ? i0 : i1;
                    const int o = o_base + nt * 8 + 2 * q;
                    if (i < 0 || o >= out) continue;
                    bf16_t* yp = y + (u64)i * y_stride + col + o;
                    if (pairs) {
                        u32* p = reinterpret_cast<u32*>(yp);
                        const u32 old = overwrite ? 0u : *p;
                        const float lo = bf2f((bf16_t)(old & 0xffffu)) + acc[nt][2 * h];
                        const float hi = bf2f((bf16_t)(old >> 16)) + acc[nt][2 * h + 1];
                        *p = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
                    } else {
                        yp[0] = f2bf((overwrite ? 0.f : bf2f(yp[0])) + acc[nt][2 * h]);
                        if (o + 1 < out) yp[1] = f2bf((overwrite ? 0.f : bf2f(yp[1])) + acc[nt][2 * h + 1]);
                    }
                }
            }
            // Every warp done with this tile's t before the next one is staged.
            __syncthreads();
        }
    }
}

#define LORA_EXPAND_PARAMS                                                                                          \
    bf16_t *__restrict__ y, int y_stride, const bf16_t *__restrict__ t_hi, const bf16_t *__restrict__ t_lo,       \
        const bf16_t *__restrict__ b0, const bf16_t *__restrict__ b1, const bf16_t *__restrict__ b2, int out0,     \
        int out1, int out2, int col0, int col1, int col2, const int *__restrict__ order,                          \
        const int *__restrict__ seg, const int *__restrict__ tiles, const int *__restrict__ ranks, int R, int r_pad, \
        int tiles_per_block, int overwrite
#define LORA_EXPAND_ARGS \
    y, y_stride, t_hi, t_lo, b0, b1, b2, out0, out1, out2, col0, col1, col2, order, seg, tiles, ranks, R, r_pad, tiles_per_block, overwrite
extern "C" __global__ void __launch_bounds__(128) lora_expand_sgmv(LORA_EXPAND_PARAMS) {
    lora_expand_body<LORA_MAX_R / 16>(LORA_EXPAND_ARGS);
}
// r_pad <= 32 (ranks up to 32): the same sums with half the B fragments held.
extern "C" __global__ void __launch_bounds__(128) lora_expand_sgmv_r32(LORA_EXPAND_PARAMS) {
    lora_expand_body<2>(LORA_EXPAND_ARGS);
}
#undef LORA_EXPAND_ARGS
#undef LORA_EXPAND_PARAMS

// Large steps over bf16 weights: SwiGLU of the gate|up projection with its LoRA update, for the
// tokens that have a slot: h[i, j] = silu(g + d_g) · (u + d_u) with g = y[i, j], u = y[i, inter + j]
// and d_m = bf16((t_hi + t_lo)[i, module m's ranks] · B_m[slot_i][j, :]), the update buffer's value
// (lora_expand_body with `overwrite`) and silu_mul's arithmetic: the same bits as that path
// (lora_expand_to, then silu_mul adding the buffer), without an update buffer as large as y and
// without writing y back (gate|up's in-place expand was the largest of a prefill step's LoRA
// launches: 1,094 of 2,611 µs per layer at 16,384 tokens on an H200). silu_mul skips these rows
// (its skip_slots). Tiles of an empty slot (rank 0) are written too, with no update. grid:
// (inter / 64, ceil(max tiles / tiles_per_block)); block: 128, warps 0-1 the block's 64 gate
// columns, warps 2-3 the same 64 up columns. inter % 64 == 0; y and h 16-byte aligned.
#define LORA_SWIGLU_COLS 64
template <int KS>
__device__ __forceinline__ void lora_expand_swiglu_body(
    bf16_t* __restrict__ h, const bf16_t* __restrict__ y, int inter, const bf16_t* __restrict__ t_hi,
    const bf16_t* __restrict__ t_lo, const bf16_t* __restrict__ b_gate, const bf16_t* __restrict__ b_up,
    const int* __restrict__ order, const int* __restrict__ seg, const int* __restrict__ tiles,
    const int* __restrict__ ranks, int R, int r_pad, int tiles_per_block) {
    // Each tile's sums: gate in columns 0-63, up in 64-127.
    __shared__ __align__(16) float staged[LORA_TILE][2 * LORA_SWIGLU_COLS + LORA_STAGE_PAD];
    // The tile's t columns of both modules (gate's r_pad, then up's).
    __shared__ __align__(16) bf16_t ts_hi[LORA_TILE * LORA_TS_MAX], ts_lo[LORA_TILE * LORA_TS_MAX];
    pdl_wait();
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int mod = warp >> 1;  // 0: gate, 1: up
    const int j0 = blockIdx.x * LORA_SWIGLU_COLS;
    const int o_base = j0 + (warp & 1) * 32;  // this warp's 32 columns of its module
    const u64 y_stride = 2 * (u64)inter;
    // This thread's 8 outputs of a tile: row threadIdx.x / 8, columns j0 + (threadIdx.x % 8) * 8.
    const int my_row = threadIdx.x >> 3, my_c8 = (threadIdx.x & 7) * 8;
    u32 bf[4][KS][2];
    int loaded = -1, ksteps = 0;
    for (int wt = blockIdx.y * tiles_per_block; wt < (int)(blockIdx.y + 1) * tiles_per_block && wt < tiles[0]; ++wt) {
        const int slot = tiles[1 + 2 * wt], first = tiles[2 + 2 * wt];
        const int start = seg[slot] + first, len = min(seg[slot + 1] - seg[slot] - first, LORA_TILE);
        const int rank = max(min(ranks[slot], r_pad), 0);
        if (len <= 0) continue;
        if (slot != loaded) {
            ksteps = (rank + 15) >> 4;
            lora_load_b<KS>(bf, (mod == 0 ? b_gate : b_up) + (u64)slot * inter * r_pad, o_base, inter, r_pad, ksteps, g, q);
            loaded = slot;
        }
        for (int m0 = 0; m0 < len; m0 += 16) {
            // This thread's gate and up vectors, loaded first so that their latency overlaps the
            // loads of t and the mma.
            const bool mine = m0 + my_row < len;
            const u64 my_token = mine ? (u64)order[start + m0 + my_row] : 0;
            uint4 g_pre = make_uint4(0u, 0u, 0u, 0u), u_pre = g_pre;
            if (mine) {
                const bf16_t* yr = y + my_token * y_stride + j0 + my_c8;
                g_pre = *reinterpret_cast<const uint4*>(yr);
                u_pre = *reinterpret_cast<const uint4*>(yr + inter);
            }
            const int ts_stride = 2 * r_pad + 8;
            lora_stage_t(ts_hi, ts_lo, ts_stride, t_hi, t_lo, order, start + m0, min(len - m0, LORA_TILE), R, 0, 2 * r_pad);
            __syncthreads();
            float acc[4][4];
            lora_tile_mma<KS>(acc, bf, ts_hi, ts_lo, ts_stride, mod * r_pad, ksteps, g, q);
            // Accumulator (nt): rows g and g + 8, columns nt * 8 + 2q, +1 of this warp's 32.
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                lora_stage_acc(&staged[0][0], 2 * LORA_SWIGLU_COLS + LORA_STAGE_PAD, g, warp * 32 + nt * 8 + 2 * q, acc[nt]);
            }
            __syncthreads();
            if (mine) {
                float gv[8], uv[8], dg[8], du[8];
                bf16x8_to_f32(g_pre, gv);
                bf16x8_to_f32(u_pre, uv);
                lora_load8_staged(&staged[my_row][my_c8], dg);
                lora_load8_staged(&staged[my_row][LORA_SWIGLU_COLS + my_c8], du);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    // The update buffer's value (0 + sum, rounded once), added as silu_mul adds it.
                    gv[e] += bf2f(f2bf(0.f + dg[e]));
                    uv[e] += bf2f(f2bf(0.f + du[e]));
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) gv[e] = gv[e] / (1.f + __expf(-gv[e])) * uv[e];
                st8_bf16(h + my_token * inter + j0 + my_c8, gv);
            }
            __syncthreads();
        }
    }
}

#define LORA_SWIGLU_PARAMS                                                                                          \
    bf16_t *__restrict__ h, const bf16_t *__restrict__ y, int inter, const bf16_t *__restrict__ t_hi,             \
        const bf16_t *__restrict__ t_lo, const bf16_t *__restrict__ b_gate, const bf16_t *__restrict__ b_up,       \
        const int *__restrict__ order, const int *__restrict__ seg, const int *__restrict__ tiles,                \
        const int *__restrict__ ranks, int R, int r_pad, int tiles_per_block
#define LORA_SWIGLU_ARGS h, y, inter, t_hi, t_lo, b_gate, b_up, order, seg, tiles, ranks, R, r_pad, tiles_per_block
extern "C" __global__ void __launch_bounds__(128) lora_expand_swiglu(LORA_SWIGLU_PARAMS) {
    lora_expand_swiglu_body<LORA_MAX_R / 16>(LORA_SWIGLU_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) lora_expand_swiglu_r32(LORA_SWIGLU_PARAMS) {
    lora_expand_swiglu_body<2>(LORA_SWIGLU_ARGS);
}
#undef LORA_SWIGLU_ARGS
#undef LORA_SWIGLU_PARAMS

// Decode-sized steps through cuBLAS (cuda/lora.rs, DenseShrink): one GEMM of the step's tokens
// against every slot's A of the group, u = x · [A_0; ...; A_{M-1}]ᵀ in f32, u [n, M * num_slots *
// r_pad] with module m, slot s, rank j at column (m * num_slots + s) * r_pad + j. This kernel keeps
// each token's own slot: t[i, m * r_pad + j] = scale · u[i, (m * num_slots + slot_i) * r_pad + j] as
// bf16 hi + lo, zeros past the slot's rank, as the shrink kernels store it for the expand. Tokens
// without a slot are left alone (no work tile reads them). grid-stride over n * M * r_pad.
extern "C" __global__ void lora_pick_t(bf16_t* __restrict__ t_hi, bf16_t* __restrict__ t_lo, const float* __restrict__ u,
                                       const int* __restrict__ slots, const int* __restrict__ ranks,
                                       const float* __restrict__ scales, int n, int n_modules, int num_slots, int r_pad) {
    pdl_wait();
    pdl_trigger();
    const int R = n_modules * r_pad;
    const u64 u_row = (u64)R * num_slots;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < (u64)n * R; e += (u64)gridDim.x * blockDim.x) {
        const int i = (int)(e / R), c = (int)(e % R), m = c / r_pad, j = c % r_pad;
        const int slot = slots[i];
        if (slot < 0) continue;
        const float v = j < ranks[slot] ? __ldcg(u + i * u_row + (u64)(m * num_slots + slot) * r_pad + j) * scales[slot] : 0.f;
        lora_store_t(t_hi, t_lo, e, v);
    }
}

#else

extern "C" __global__ void lora_shrink_sgmv(bf16_t*, bf16_t*, float*, int*, const bf16_t*, int, const bf16_t*,
                                            const bf16_t*, const bf16_t*, const int*, const int*, const int*,
                                            const int*, const float*, int, int, int, int, int) {}
extern "C" __global__ void lora_expand_sgmv(bf16_t*, int, const bf16_t*, const bf16_t*, const bf16_t*, const bf16_t*,
                                            const bf16_t*, int, int, int, int, int, int, const int*, const int*,
                                            const int*, const int*, int, int, int, int) {}
extern "C" __global__ void lora_expand_sgmv_r32(bf16_t*, int, const bf16_t*, const bf16_t*, const bf16_t*, const bf16_t*,
                                                const bf16_t*, int, int, int, int, int, int, const int*, const int*,
                                                const int*, const int*, int, int, int, int) {}
extern "C" __global__ void lora_expand_swiglu(bf16_t*, const bf16_t*, int, const bf16_t*, const bf16_t*,
                                              const bf16_t*, const bf16_t*, const int*, const int*, const int*,
                                              const int*, int, int, int) {}
extern "C" __global__ void lora_expand_swiglu_r32(bf16_t*, const bf16_t*, int, const bf16_t*, const bf16_t*,
                                                  const bf16_t*, const bf16_t*, const int*, const int*, const int*,
                                                  const int*, int, int, int) {}
extern "C" __global__ void lora_shrink_ranks(bf16_t*, bf16_t*, const bf16_t*, int, const bf16_t*, const bf16_t*,
                                             const bf16_t*, const int*, const int*, const int*, const int*,
                                             const float*, int, int, int) {}
extern "C" __global__ void lora_shrink_staged(bf16_t*, bf16_t*, float*, int*, const bf16_t*, int, const bf16_t*,
                                              const bf16_t*, const bf16_t*, const int*, const int*, const int*,
                                              const int*, const float*, int, int, int, int, int) {}
extern "C" __global__ void lora_shrink_staged_r32(bf16_t*, bf16_t*, float*, int*, const bf16_t*, int, const bf16_t*,
                                                  const bf16_t*, const bf16_t*, const int*, const int*, const int*,
                                                  const int*, const float*, int, int, int, int, int) {}

extern "C" __global__ void lora_pick_t(bf16_t*, bf16_t*, const float*, const int*, const int*, const float*, int, int,
                                       int, int) {}

#endif

// The o and down groups' LoRA inside the step's own launches (docs/lora-fusion-plan.md): the base
// GEMM's weight carries every slot's A rows after its own, so one GEMM writes y = [x · Wᵀ | x · Aᵀ]
// (row stride y_stride = hidden + slots · r_pad; slot s's u = x · A_sᵀ at columns hidden + s · r_pad),
// and this kernel, the residual add + RMSNorm that consumes y, adds the expand on the way:
//   residual[i] += y[i, :hidden] + bf16(scale_s · u_i · B_sᵀ)     (s: token i's slot; none: no update)
//   out[i] = bf16(residual[i] * rsqrt(mean(residual[i]^2) + eps) * weight)
// No launch and no side stream of its own: the graph's fork/join per group is what LoRA cost
// (docs/benchmarks.md, sessions 28-29).
//
// grid (NORM_LORA_CLUSTER, lora_tiles + ceil(n / 16)) in clusters of NORM_LORA_CLUSTER blocks along x;
// block NORM_LORA_WARPS warps. A cluster takes one work tile: up to 16 tokens of one slot (lora_group's
// tiles, y < lora_tiles) or up to 16 consecutive tokens without a slot (the rest); its blocks split the
// row's columns, so that each reads 1/NORM_LORA_CLUSTER of the slot's B once for the whole tile
// (mma m16n8k16 with the tile's u as the A operand), and they add their rows' partial sums of
// squares through distributed shared memory before normalizing. A token's result depends only on
// its own row, in a fixed order (batch invariance), though not with add_rmsnorm's bits.
// hidden % (8 · NORM_LORA_CLUSTER) == 0, hidden / (8 · NORM_LORA_CLUSTER) <= NORM_LORA_WARPS · NORM_LORA_MAXJ.
#define NORM_LORA_CLUSTER 8
#define NORM_LORA_WARPS 8
#define NORM_LORA_MAXJ 8

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

__device__ __forceinline__ void norm_lora_cluster_sync() {
    asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

// `p` (this block's shared memory) in the block of cluster rank `rank`.
__device__ __forceinline__ float norm_lora_remote(const float* p, unsigned rank) {
    unsigned local, remote;
    asm volatile("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }\n" : "=r"(local) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// A fused LoRA consumer's tile (add_rmsnorm_lora, silu_mul_lora): blockIdx.y below lora_tiles is
// lora_group's work tile y (up to 16 tokens of one slot), from there on the 16 consecutive tokens
// (y - lora_tiles) · 16 ... that have no slot. Fills tok[16] (-1: no token there) and slot (-1 for
// the tokens without one); false: nothing to do, which the whole block (and cluster) agrees on.
__device__ __forceinline__ bool fused_lora_tile(int* tok, int& slot, const int* slots, const int* order, const int* seg,
                                                const int* tiles, int n, int lora_tiles) {
    const int ty = blockIdx.y;
    if (ty < lora_tiles) {
        if (ty >= tiles[0]) return false;
        slot = tiles[1 + 2 * ty];
        const int first = tiles[2 + 2 * ty], start = seg[slot] + first;
        const int rows = min(seg[slot + 1] - seg[slot] - first, LORA_TILE);
        if (threadIdx.x < LORA_TILE) tok[threadIdx.x] = threadIdx.x < rows ? order[start + threadIdx.x] : -1;
        __syncthreads();
        return true;
    }
    const int i = (ty - lora_tiles) * LORA_TILE + (int)threadIdx.x;
    const bool mine = threadIdx.x < LORA_TILE && i < n && slots[i] < 0;
    if (threadIdx.x < LORA_TILE) tok[threadIdx.x] = mine ? i : -1;
    return __syncthreads_or(mine);
}

// How a fused consumer reads its GEMM's output (a compile-time choice, so that every load is
// issued before the first use: a runtime branch around each load made them wait in turn, and the
// 8-bit norm took twice the bf16 one's time). FY_BF16: final bf16 values. Over 8-bit weights whose
// GEMM left its scales (Cuda::linear_w8_deferred): FY_BF16_SCALED, raw bf16 values (e4m3), or
// FY_I32_SCALED, an int8 GEMM's int32 sums at y_i32 (same stride); each times dxs[token] ·
// dws[column], u's columns' scales being the A rows' own.
#define FY_BF16 0
#define FY_BF16_SCALED 1
#define FY_I32_SCALED 2

// A pair of raw values as loaded: bf16 bits or int32 sums (the unused one optimized away).
struct FusedRaw2 {
    u32 b;
    int2 i;
};

template <int YM>
__device__ __forceinline__ FusedRaw2 fused_ld2(const bf16_t* row, const int* row_i32, int col, bool on) {
    FusedRaw2 r;
    if (YM == FY_I32_SCALED) r.i = on ? *reinterpret_cast<const int2*>(row_i32 + col) : make_int2(0, 0);
    else r.b = on ? lora_ld2(row + col) : 0u;
    return r;
}

// The pair's values in f32: as they are (FY_BF16), or times sx · w.
template <int YM>
__device__ __forceinline__ float2 fused_val2(FusedRaw2 r, float sx, float2 w) {
    float2 v = YM == FY_I32_SCALED ? make_float2((float)r.i.x, (float)r.i.y)
                                   : make_float2(__uint_as_float(r.b << 16), __uint_as_float(r.b & 0xffff0000u));
    if (YM != FY_BF16) {
        v.x *= sx * w.x;
        v.y *= sx * w.y;
    }
    return v;
}

// A tile's u for one k step, the mma's A operand (rows g and g + 8 of the tile, columns c, c + 1
// and c + 8, c + 9 of the slot's ranks): loaded together, then (scaled modes) times the tokens' and
// the A rows' scales and rounded to bf16. u0/u1 (ui0/ui1): the rows' u, null where the tile has no
// token.
template <int YM>
__device__ __forceinline__ void fused_u_frag(u32 (&a)[4], const bf16_t* u0, const bf16_t* u1, const int* ui0, const int* ui1,
                                             int c, float sx0, float sx1, const float* uws) {
    const bool on0 = YM == FY_I32_SCALED ? ui0 != nullptr : u0 != nullptr;
    const bool on1 = YM == FY_I32_SCALED ? ui1 != nullptr : u1 != nullptr;
    const FusedRaw2 r[4] = {fused_ld2<YM>(u0, ui0, c, on0), fused_ld2<YM>(u1, ui1, c, on1), fused_ld2<YM>(u0, ui0, c + 8, on0),
                            fused_ld2<YM>(u1, ui1, c + 8, on1)};
    if (YM == FY_BF16) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = r[e].b;
        return;
    }
    const float2 w0 = uws ? *reinterpret_cast<const float2*>(uws + c) : make_float2(0.f, 0.f);
    const float2 w1 = uws ? *reinterpret_cast<const float2*>(uws + c + 8) : make_float2(0.f, 0.f);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 v = fused_val2<YM>(r[e], (e & 1) ? sx1 : sx0, e < 2 ? w0 : w1);
        a[e] = (u32)f2bf(v.x) | ((u32)f2bf(v.y) << 16);
    }
}

// add_rmsnorm_lora, and over 8-bit weights (W8) add_rmsnorm_lora_quant_{e4m3,i8}[_scaled]: the same
// with y (and u) an 8-bit GEMM's output, read as YM says (FY_*), and the normalized row's codes
// written to qo and its scale to qs (quant8.cu's add_rmsnorm_quant: scale = max |v| / Q of the f32 values, codes encode(v / scale)),
// the scale reduced over the cluster as the sum of squares is. dxs may be qs: each token's scale is
// read before the first cluster barrier and written after the second.
template <bool W8, int FMT, int YM>
__device__ __forceinline__ void add_rmsnorm_lora_impl(
    float* __restrict__ residual, const bf16_t* __restrict__ y, int y_stride, const bf16_t* __restrict__ b,
    const float* __restrict__ weight, bf16_t* __restrict__ out, int hidden, float eps,
    const int* __restrict__ slots, const int* __restrict__ order, const int* __restrict__ seg,
    const int* __restrict__ tiles, const int* __restrict__ ranks, const float* __restrict__ scales, int n,
    int lora_tiles, int r_pad, const float* dxs, const float* __restrict__ dws, const int* __restrict__ y_i32,
    unsigned char* __restrict__ qo, float* qs) {
    __shared__ int tok[LORA_TILE];
    __shared__ float wsum[NORM_LORA_WARPS][LORA_TILE];
    __shared__ float part[LORA_TILE];
    __shared__ float inv[LORA_TILE];
    __shared__ float pmax[LORA_TILE];
    __shared__ float qscale[LORA_TILE];
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    // The tile's tokens. The tables were written by lora_group at the step's start, not by the kernel
    // before this one, so they are read before pdl_wait(). The whole cluster decides alike (same
    // blockIdx.y), so a cluster leaves before any barrier or not at all.
    int slot = -1;
    if (!fused_lora_tile(tok, slot, slots, order, seg, tiles, n, lora_tiles)) return;
    const int t0 = tok[g], t1 = tok[g + 8];
    const int cw = hidden / NORM_LORA_CLUSTER, ntiles = cw >> 3;
    const int c_block = (int)blockIdx.x * cw;
    const int rank = slot >= 0 ? ranks[slot] : 0;
    const int ksteps = min((rank + 15) >> 4, LORA_MAX_R / 16);
    const float scale = slot >= 0 ? scales[slot] : 0.f;
    pdl_wait();
    // The tokens' scales, before any block of the cluster may overwrite them (dxs may be qs).
    const float sx0 = YM != FY_BF16 && t0 >= 0 ? dxs[t0] : 1.f, sx1 = YM != FY_BF16 && t1 >= 0 ? dxs[t1] : 1.f;
    // Every load this thread needs is issued before the first is used: one round trip, not one per
    // column tile (the loop that mixed loads, mma and stores waited on each in turn: 3-4x the time).
    // Column tile j = warp + NORM_LORA_WARPS * i; rows g ([i][0]) and g + 8 ([i][1]), columns 2q and
    // 2q + 1 of the tile (the mma accumulator's layout).
    float2 x[NORM_LORA_MAXJ][2];
    FusedRaw2 yr[NORM_LORA_MAXJ][2];
    float2 wsv[NORM_LORA_MAXJ];
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
        const int j = warp + NORM_LORA_WARPS * i;
        const int c = c_block + 8 * j + 2 * q;
        if (YM != FY_BF16) wsv[i] = j < ntiles ? *reinterpret_cast<const float2*>(dws + c) : make_float2(0.f, 0.f);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = h ? t1 : t0;
            const bool on = j < ntiles && t >= 0;
            x[i][h] = on ? *reinterpret_cast<const float2*>(residual + (u64)t * hidden + c) : make_float2(0.f, 0.f);
            const u64 row = (u64)max(t, 0) * y_stride;
            yr[i][h] = fused_ld2<YM>(y + row, YM == FY_I32_SCALED ? y_i32 + row : nullptr, c, on);
        }
    }
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // residual + base output now; the update after the products (the order add_rmsnorm adds in).
            const float2 yv = fused_val2<YM>(yr[i][h], h ? sx1 : sx0, YM != FY_BF16 ? wsv[i] : make_float2(1.f, 1.f));
            x[i][h].x += yv.x;
            x[i][h].y += yv.y;
        }
    }
    float acc[NORM_LORA_MAXJ][4];
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    if (ksteps > 0) {
        const int u_col = hidden + slot * r_pad;
        const bf16_t* u0 = t0 >= 0 ? y + (u64)t0 * y_stride + u_col : nullptr;
        const bf16_t* u1 = t1 >= 0 ? y + (u64)t1 * y_stride + u_col : nullptr;
        const int* ui0 = YM == FY_I32_SCALED && t0 >= 0 ? y_i32 + (u64)t0 * y_stride + u_col : nullptr;
        const int* ui1 = YM == FY_I32_SCALED && t1 >= 0 ? y_i32 + (u64)t1 * y_stride + u_col : nullptr;
        const float* uws = YM != FY_BF16 ? dws + u_col : nullptr;
        const bf16_t* bs = b + (u64)slot * hidden * r_pad + 2 * q;
#pragma unroll
        for (int k = 0; k < LORA_MAX_R / 16; ++k) {
            if (k >= ksteps) break;
            // The tile's u (the mma's A operand: rows g and g + 8) and this step's B fragments of
            // every column tile, loaded together, then the products.
            const int c = 16 * k + 2 * q;
            u32 a[4];
            fused_u_frag<YM>(a, u0, u1, ui0, ui1, c, sx0, sx1, uws);
            u32 bf[NORM_LORA_MAXJ][2];
#pragma unroll
            for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
                const int j = warp + NORM_LORA_WARPS * i;
                const bf16_t* brow = bs + (u64)(c_block + 8 * j + g) * r_pad + 16 * k;
                bf[i][0] = j < ntiles ? lora_ld2(brow) : 0u;
                bf[i][1] = j < ntiles ? lora_ld2(brow + 8) : 0u;
            }
#pragma unroll
            for (int i = 0; i < NORM_LORA_MAXJ; ++i)
                if (warp + NORM_LORA_WARPS * i < ntiles) lora_mma(acc[i], a, bf[i][0], bf[i][1]);
        }
    }
    float ss0 = 0.f, ss1 = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
        const int j = warp + NORM_LORA_WARPS * i;
        const int c = c_block + 8 * j + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = h ? t1 : t0;
            if (j >= ntiles || t < 0) continue;
            float2 v = x[i][h];
            if (slot >= 0) {
                v.x += bf2f(f2bf(scale * acc[i][2 * h]));
                v.y += bf2f(f2bf(scale * acc[i][2 * h + 1]));
            }
            *reinterpret_cast<float2*>(residual + (u64)t * hidden + c) = v;
            x[i][h] = v;
            if (h) ss1 += v.x * v.x + v.y * v.y;
            else ss0 += v.x * v.x + v.y * v.y;
        }
    }
    ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1);
    ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
    ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1);
    ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
    if (q == 0) {
        wsum[warp][g] = ss0;
        wsum[warp][g + 8] = ss1;
    }
    __syncthreads();
    if (threadIdx.x < LORA_TILE) {
        float s = 0.f;
        for (int w = 0; w < NORM_LORA_WARPS; ++w) s += wsum[w][threadIdx.x];
        part[threadIdx.x] = s;
    }
    // Every block's partial sums written before any block reads them ...
    norm_lora_cluster_sync();
    if (threadIdx.x < LORA_TILE) {
        float s = 0.f;
        for (unsigned r = 0; r < NORM_LORA_CLUSTER; ++r) s += norm_lora_remote(&part[threadIdx.x], r);
        inv[threadIdx.x] = rsqrtf(s / (float)hidden + eps);
    }
    // ... and read before any block leaves (its shared memory goes with it); inv is then visible.
    norm_lora_cluster_sync();
    const float i0 = inv[g], i1 = inv[g + 8];
    // The norm's weights, all loaded before the first store (as above).
    float2 wv[NORM_LORA_MAXJ];
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
        const int j = warp + NORM_LORA_WARPS * i;
        wv[i] = j < ntiles ? *reinterpret_cast<const float2*>(weight + c_block + 8 * j + 2 * q) : make_float2(0.f, 0.f);
    }
    float m0 = 0.f, m1 = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
        const int j = warp + NORM_LORA_WARPS * i;
        if (j >= ntiles) continue;
        const int c = c_block + 8 * j + 2 * q;
        const float2 w = wv[i];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = h ? t1 : t0;
            if (t < 0) continue;
            const float s = h ? i1 : i0;
            const float2 o = make_float2(x[i][h].x * s * w.x, x[i][h].y * s * w.y);
            if (out) *reinterpret_cast<u32*>(out + (u64)t * hidden + c) = (u32)f2bf(o.x) | ((u32)f2bf(o.y) << 16);
            if (W8) {
                x[i][h] = o;  // kept for the codes
                const float m = fmaxf(fabsf(o.x), fabsf(o.y));
                if (h) m1 = fmaxf(m1, m);
                else m0 = fmaxf(m0, m);
            }
        }
    }
    if (!W8) return;
    // The rows' max |v|: over the quad, the block's warps, then the cluster (as the sums above).
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
    if (q == 0) {
        wsum[warp][g] = m0;
        wsum[warp][g + 8] = m1;
    }
    __syncthreads();
    if (threadIdx.x < LORA_TILE) {
        float m = 0.f;
        for (int w = 0; w < NORM_LORA_WARPS; ++w) m = fmaxf(m, wsum[w][threadIdx.x]);
        pmax[threadIdx.x] = m;
    }
    norm_lora_cluster_sync();
    if (threadIdx.x < LORA_TILE) {
        float m = 0.f;
        for (unsigned r = 0; r < NORM_LORA_CLUSTER; ++r) m = fmaxf(m, norm_lora_remote(&pmax[threadIdx.x], r));
        const float sc = q8_scale<FMT>(m);
        qscale[threadIdx.x] = sc;
        const int t = tok[threadIdx.x];
        if (blockIdx.x == 0 && t >= 0) qs[t] = sc;
    }
    __syncthreads();
    const float qs0 = qscale[g], qs1 = qscale[g + 8];
#pragma unroll
    for (int i = 0; i < NORM_LORA_MAXJ; ++i) {
        const int j = warp + NORM_LORA_WARPS * i;
        if (j >= ntiles) continue;
        const int c = c_block + 8 * j + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = h ? t1 : t0;
            const float sc = h ? qs1 : qs0;
            if (t < 0) continue;
            const u32 lo = sc > 0.f ? q8_encode<FMT>(x[i][h].x / sc) : 0u, hi = sc > 0.f ? q8_encode<FMT>(x[i][h].y / sc) : 0u;
            *reinterpret_cast<unsigned short*>(qo + (u64)t * hidden + c) = (unsigned short)(lo | (hi << 8));
        }
    }
    // Every block's maxima read before any block leaves.
    norm_lora_cluster_sync();
}

#define ADD_RMSNORM_LORA_ARGS                                                                                           \
    float *__restrict__ residual, const bf16_t *__restrict__ y, int y_stride, const bf16_t *__restrict__ b,             \
        const float *__restrict__ weight, bf16_t *__restrict__ out, int hidden, float eps, const int *__restrict__ slots, \
        const int *__restrict__ order, const int *__restrict__ seg, const int *__restrict__ tiles,                       \
        const int *__restrict__ ranks, const float *__restrict__ scales, int n, int lora_tiles, int r_pad
#define ADD_RMSNORM_LORA_PASS residual, y, y_stride, b, weight, out, hidden, eps, slots, order, seg, tiles, ranks, scales, n, lora_tiles, r_pad
#define ADD_RMSNORM_LORA_QUANT_ARGS \
    ADD_RMSNORM_LORA_ARGS, const float *dxs, const float *__restrict__ dws, const int *__restrict__ y_i32, unsigned char *__restrict__ qo, float *qs

// Two blocks per SM (at most 128 registers): at batch 256 a step has ~20 tiles of 8 blocks.
extern "C" __global__ void __launch_bounds__(NORM_LORA_WARPS * 32, 2) add_rmsnorm_lora(ADD_RMSNORM_LORA_ARGS) {
    add_rmsnorm_lora_impl<false, Q8_E4M3, FY_BF16>(ADD_RMSNORM_LORA_PASS, nullptr, nullptr, nullptr, nullptr, nullptr);
}
// A final y (our GEMV's output), or the scales left: e4m3's raw bf16 output, int8's int32 sums.
// Loading the norm's weights and B before pdl_wait() (one block per SM for the registers) measured
// 0.812 / 0.827 / 0.768 × base at batch 16 / 64 / 256 against 0.787 / 0.834 / 0.801 without
// (docs/benchmarks.md, session 37), so they load after it, as in add_rmsnorm_lora.
extern "C" __global__ void __launch_bounds__(NORM_LORA_WARPS * 32, 2) add_rmsnorm_lora_quant_e4m3(ADD_RMSNORM_LORA_QUANT_ARGS) {
    add_rmsnorm_lora_impl<true, Q8_E4M3, FY_BF16>(ADD_RMSNORM_LORA_PASS, dxs, dws, y_i32, qo, qs);
}
extern "C" __global__ void __launch_bounds__(NORM_LORA_WARPS * 32, 2) add_rmsnorm_lora_quant_i8(ADD_RMSNORM_LORA_QUANT_ARGS) {
    add_rmsnorm_lora_impl<true, Q8_I8, FY_BF16>(ADD_RMSNORM_LORA_PASS, dxs, dws, y_i32, qo, qs);
}
extern "C" __global__ void __launch_bounds__(NORM_LORA_WARPS * 32, 2) add_rmsnorm_lora_quant_e4m3_scaled(ADD_RMSNORM_LORA_QUANT_ARGS) {
    add_rmsnorm_lora_impl<true, Q8_E4M3, FY_BF16_SCALED>(ADD_RMSNORM_LORA_PASS, dxs, dws, y_i32, qo, qs);
}
extern "C" __global__ void __launch_bounds__(NORM_LORA_WARPS * 32, 2) add_rmsnorm_lora_quant_i8_scaled(ADD_RMSNORM_LORA_QUANT_ARGS) {
    add_rmsnorm_lora_impl<true, Q8_I8, FY_I32_SCALED>(ADD_RMSNORM_LORA_PASS, dxs, dws, y_i32, qo, qs);
}

// The gate|up group's LoRA the same way (no side stream): the gate|up GEMM's weight carries every
// slot's A rows of gate, then of up, after its own 2·inter rows, so y = [gate | up | u_gate | u_up]
// (row stride y_stride >= 2·inter + 2·slots·r_pad; slot s's u_gate at 2·inter + s·r_pad, its u_up
// slots·r_pad further), and this SwiGLU adds each token's updates before the product:
//   out[i, c] = silu(gate + bf16(scale_s · u_gate · B_gate,sᵀ)) · (up + bf16(scale_s · u_up · B_up,sᵀ))
// (tokens without a slot: silu_mul's plain product, the same expression and bits). Elementwise, so
// no cluster: grid (inter / SWIGLU_LORA_COLS, ceil(lora_tiles / tpb) + ceil(n / 16)), 4 warps of
// SWIGLU_LORA_NT column tiles of 8, gate's and up's at the same columns in one thread's registers.
//
// B is what makes this kernel cost: two modules of inter columns, where o's and down's expands read
// one of hidden. So a block holds its columns' slice of B in registers and takes `tpb` consecutive
// work tiles (the host picks tpb from the tokens per slot): a slot's tiles are consecutive in the
// table, so B is read once per slot and block rather than once per tile, and is loaded before
// pdl_wait() (a weight, not the GEMM's output) while the GEMM ends. Tiles without a slot (after the
// LoRA tiles) stay one per block. MAXK: k steps of 16 ranks the registers hold (r_pad <= 16 · MAXK).
#define SWIGLU_LORA_NT 4
#define SWIGLU_LORA_COLS (4 * 8 * SWIGLU_LORA_NT)
#define SWIGLU_LORA_MAX_TPB 8  // tpb · LORA_TILE <= the block's 128 threads

template <int MAXK>
__device__ __forceinline__ void silu_mul_lora_load_b(u32 (&bg)[MAXK][SWIGLU_LORA_NT][2], u32 (&bu)[MAXK][SWIGLU_LORA_NT][2],
                                                     const bf16_t* __restrict__ b_gate, const bf16_t* __restrict__ b_up,
                                                     int slot, int ksteps, int inter, int r_pad, int c_warp, int g, int q) {
    const u64 b_off = (u64)max(slot, 0) * inter * r_pad + 2 * q;
#pragma unroll
    for (int k = 0; k < MAXK; ++k) {
#pragma unroll
        for (int nt = 0; nt < SWIGLU_LORA_NT; ++nt) {
            const bool on = k < ksteps;
            const u64 row = b_off + (u64)(c_warp + 8 * nt + g) * r_pad + 16 * k;
            bg[k][nt][0] = on ? lora_ld2(b_gate + row) : 0u;
            bg[k][nt][1] = on ? lora_ld2(b_gate + row + 8) : 0u;
            bu[k][nt][0] = on ? lora_ld2(b_up + row) : 0u;
            bu[k][nt][1] = on ? lora_ld2(b_up + row + 8) : 0u;
        }
    }
}

template <int MAXK>
__device__ __forceinline__ void silu_mul_lora_impl(
    bf16_t* __restrict__ out, const bf16_t* __restrict__ y, int y_stride, int inter, const bf16_t* __restrict__ b_gate,
    const bf16_t* __restrict__ b_up, const int* __restrict__ slots, const int* __restrict__ order,
    const int* __restrict__ seg, const int* __restrict__ tiles, const int* __restrict__ ranks,
    const float* __restrict__ scales, int n, int lora_tiles, int r_pad, int num_slots, int tpb) {
    __shared__ int tok[SWIGLU_LORA_MAX_TPB][LORA_TILE];
    __shared__ int tile_slot[SWIGLU_LORA_MAX_TPB];
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    // This block's tiles (the tables were written by lora_group at the step's start, so they are
    // read before pdl_wait(), as in fused_lora_tile).
    const int lora_blocks = (lora_tiles + tpb - 1) / tpb, ty = blockIdx.y;
    int count;
    if (ty < lora_blocks) {
        const int first = ty * tpb;
        count = min(tpb, tiles[0] - first);
        if (count <= 0) return;
        const int e = threadIdx.x / LORA_TILE, r = threadIdx.x % LORA_TILE;
        if (e < count) {
            const int entry = first + e, slot = tiles[1 + 2 * entry], from = tiles[2 + 2 * entry];
            const int rows = min(seg[slot + 1] - seg[slot] - from, LORA_TILE);
            tok[e][r] = r < rows ? order[seg[slot] + from + r] : -1;
            if (r == 0) tile_slot[e] = slot;
        }
        __syncthreads();
    } else {
        const int i = (ty - lora_blocks) * LORA_TILE + (int)threadIdx.x;
        const bool mine = threadIdx.x < LORA_TILE && i < n && slots[i] < 0;
        if (threadIdx.x < LORA_TILE) tok[0][threadIdx.x] = mine ? i : -1;
        if (threadIdx.x == 0) tile_slot[0] = -1;
        count = 1;
        if (!__syncthreads_or(mine)) return;
    }
    const int c_warp = blockIdx.x * SWIGLU_LORA_COLS + warp * 8 * SWIGLU_LORA_NT;
    int slot = tile_slot[0];
    int ksteps = slot >= 0 ? min((ranks[slot] + 15) >> 4, MAXK) : 0;
    float scale = slot >= 0 ? scales[slot] : 0.f;
    u32 bg[MAXK][SWIGLU_LORA_NT][2], bu[MAXK][SWIGLU_LORA_NT][2];
    silu_mul_lora_load_b<MAXK>(bg, bu, b_gate, b_up, slot, ksteps, inter, r_pad, c_warp, g, q);
    pdl_wait();
    for (int e = 0; e < count; ++e) {
        if (tile_slot[e] != slot) {
            // The block's group of tiles reaches into the next slot's (B loaded so far is the first's).
            slot = tile_slot[e];
            ksteps = slot >= 0 ? min((ranks[slot] + 15) >> 4, MAXK) : 0;
            scale = slot >= 0 ? scales[slot] : 0.f;
            silu_mul_lora_load_b<MAXK>(bg, bu, b_gate, b_up, slot, ksteps, inter, r_pad, c_warp, g, q);
        }
        const int t0 = tok[e][g], t1 = tok[e][g + 8];
        // Gate and up of rows g and g + 8, columns 2q, 2q + 1 of each of this warp's column tiles,
        // and the tile's u (the mma's A operand) for every k step, all loaded before the first use.
        u32 gb[SWIGLU_LORA_NT][2], ub[SWIGLU_LORA_NT][2];
#pragma unroll
        for (int nt = 0; nt < SWIGLU_LORA_NT; ++nt) {
            const int c = c_warp + 8 * nt + 2 * q;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int t = h ? t1 : t0;
                gb[nt][h] = t >= 0 ? lora_ld2(y + (u64)t * y_stride + c) : 0u;
                ub[nt][h] = t >= 0 ? lora_ld2(y + (u64)t * y_stride + inter + c) : 0u;
            }
        }
        u32 a_g[MAXK][4], a_u[MAXK][4];
        {
            const u64 ug = 2 * (u64)inter + (u64)max(slot, 0) * r_pad, uu = ug + (u64)num_slots * r_pad;
            const bf16_t* r0 = t0 >= 0 ? y + (u64)t0 * y_stride : nullptr;
            const bf16_t* r1 = t1 >= 0 ? y + (u64)t1 * y_stride : nullptr;
#pragma unroll
            for (int k = 0; k < MAXK; ++k) {
                const bool on = k < ksteps;
                const int c = 16 * k + 2 * q;
                a_g[k][0] = on && r0 ? lora_ld2(r0 + ug + c) : 0u;
                a_g[k][1] = on && r1 ? lora_ld2(r1 + ug + c) : 0u;
                a_g[k][2] = on && r0 ? lora_ld2(r0 + ug + c + 8) : 0u;
                a_g[k][3] = on && r1 ? lora_ld2(r1 + ug + c + 8) : 0u;
                a_u[k][0] = on && r0 ? lora_ld2(r0 + uu + c) : 0u;
                a_u[k][1] = on && r1 ? lora_ld2(r1 + uu + c) : 0u;
                a_u[k][2] = on && r0 ? lora_ld2(r0 + uu + c + 8) : 0u;
                a_u[k][3] = on && r1 ? lora_ld2(r1 + uu + c + 8) : 0u;
            }
        }
        float ag[SWIGLU_LORA_NT][4], au[SWIGLU_LORA_NT][4];
#pragma unroll
        for (int nt = 0; nt < SWIGLU_LORA_NT; ++nt) ag[nt][0] = ag[nt][1] = ag[nt][2] = ag[nt][3] = au[nt][0] = au[nt][1] = au[nt][2] = au[nt][3] = 0.f;
#pragma unroll
        for (int k = 0; k < MAXK; ++k) {
            if (k >= ksteps) break;
#pragma unroll
            for (int nt = 0; nt < SWIGLU_LORA_NT; ++nt) {
                lora_mma(ag[nt], a_g[k], bg[k][nt][0], bg[k][nt][1]);
                lora_mma(au[nt], a_u[k], bu[k][nt][0], bu[k][nt][1]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < SWIGLU_LORA_NT; ++nt) {
            const int c = c_warp + 8 * nt + 2 * q;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int t = h ? t1 : t0;
                if (t < 0) continue;
                float gv[2] = {__uint_as_float(gb[nt][h] << 16), __uint_as_float(gb[nt][h] & 0xffff0000u)};
                float uv[2] = {__uint_as_float(ub[nt][h] << 16), __uint_as_float(ub[nt][h] & 0xffff0000u)};
                if (slot >= 0) {
#pragma unroll
                    for (int e2 = 0; e2 < 2; ++e2) {
                        gv[e2] += bf2f(f2bf(scale * ag[nt][2 * h + e2]));
                        uv[e2] += bf2f(f2bf(scale * au[nt][2 * h + e2]));
                    }
                }
#pragma unroll
                for (int e2 = 0; e2 < 2; ++e2) gv[e2] = gv[e2] / (1.f + __expf(-gv[e2])) * uv[e2];
                *reinterpret_cast<u32*>(out + (u64)t * inter + c) = (u32)f2bf(gv[0]) | ((u32)f2bf(gv[1]) << 16);
            }
        }
    }
}

#define SILU_MUL_LORA_ARGS                                                                                             \
    bf16_t *__restrict__ out, const bf16_t *__restrict__ y, int y_stride, int inter, const bf16_t *__restrict__ b_gate,  \
        const bf16_t *__restrict__ b_up, const int *__restrict__ slots, const int *__restrict__ order,                   \
        const int *__restrict__ seg, const int *__restrict__ tiles, const int *__restrict__ ranks,                       \
        const float *__restrict__ scales, int n, int lora_tiles, int r_pad, int num_slots, int tpb
#define SILU_MUL_LORA_PASS out, y, y_stride, inter, b_gate, b_up, slots, order, seg, tiles, ranks, scales, n, lora_tiles, r_pad, num_slots, tpb

// Ranks up to 64 (4 k steps of B in registers) and, with half the registers, up to 32.
extern "C" __global__ void __launch_bounds__(128) silu_mul_lora(SILU_MUL_LORA_ARGS) {
    silu_mul_lora_impl<LORA_MAX_R / 16>(SILU_MUL_LORA_PASS);
}
extern "C" __global__ void __launch_bounds__(128) silu_mul_lora_r32(SILU_MUL_LORA_ARGS) {
    silu_mul_lora_impl<2>(SILU_MUL_LORA_PASS);
}

// q|k|v's LoRA the same way (no side stream): the q|k|v GEMM's weight carries every slot's A rows of
// q, then of k, then of v after its own width = (hq + 2·hkv)·d rows, so y = [q | k | v | u_q | u_k | u_v]
// (row stride y_stride >= width + 3·slots·r_pad; module m's slot s's u at width + (m·slots + s)·r_pad),
// and this RoPE + KV write (a bf16 cache, no rotation: rope_kv_write's plain case) adds each token's
// update the way rope_kv_write adds the side stream's:
//   x[c] = y[c] (+ bias[c]) + bf16(scale_s · u_m · B_m,sᵀ)[c - first column of m]
// then rotates q and k heads (rotate-half) and stores q into q_out, k and v into the caches.
// Tokens without a slot get no update (in the same launch). grid (hq + 2·hkv, lora_tiles +
// ceil(n / 16)); block ROPE_LORA_WARPS warps: a block takes one head of one tile, so each reads the
// head's slice of B once for the tile (mma m16n8k16, the tile's u as the A operand). Warp w takes the
// column-tile pairs (j, j + d/16) for j = w + ROPE_LORA_WARPS·i: the accumulator's columns 2q, 2q + 1
// of tile j are the first halves of RoPE pairs whose second halves are the same columns of tile
// j + d/16, so each thread rotates its own values. d % (16 · ROPE_LORA_WARPS) == 0, d <= 128.
#define ROPE_LORA_WARPS 4
#define ROPE_LORA_MAXI 2

// rope_kv_write_lora, and rope_kv_write_lora_{scaled,sums}: the same over an 8-bit q|k|v GEMM's
// output whose scales it left, read as YM says (FY_BF16_SCALED, FY_I32_SCALED).
template <int YM>
__device__ __forceinline__ void rope_kv_write_lora_impl(
    const bf16_t* __restrict__ y, int y_stride, const float* __restrict__ bias, const int* __restrict__ positions,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const int* __restrict__ cache_slots,
    bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int hq, int hkv, int d,
    int block_size, const bf16_t* __restrict__ b_q, const bf16_t* __restrict__ b_k, const bf16_t* __restrict__ b_v,
    const int* __restrict__ slots, const int* __restrict__ order, const int* __restrict__ seg,
    const int* __restrict__ tiles, const int* __restrict__ ranks, const float* __restrict__ scales, int n,
    int lora_tiles, int r_pad, int num_slots, const float* __restrict__ dxs, const float* __restrict__ dws,
    const int* __restrict__ y_i32) {
    __shared__ int tok[LORA_TILE];
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int slot = -1;
    if (!fused_lora_tile(tok, slot, slots, order, seg, tiles, n, lora_tiles)) return;
    const int t0 = tok[g], t1 = tok[g + 8];
    const int head = blockIdx.x;
    // The head's module (q, k or v), its place there, and the module's B stack.
    const int m = head < hq ? 0 : (head < hq + hkv ? 1 : 2);
    const int head_in_m = head - (m == 0 ? 0 : (m == 1 ? hq : hq + hkv));
    const int fan_out = (m == 0 ? hq : hkv) * d;
    const bf16_t* b = m == 0 ? b_q : (m == 1 ? b_k : b_v);
    const int half = d >> 1, npair = (d >> 4) / ROPE_LORA_WARPS;
    const int width = (hq + 2 * hkv) * d;
    const int rank = slot >= 0 ? ranks[slot] : 0;
    const int ksteps = min((rank + 15) >> 4, LORA_MAX_R / 16);
    const float scale = slot >= 0 ? scales[slot] : 0.f;
    // The head's slice of B for every k step of the slot's rank, before pdl_wait(): a weight, not
    // the GEMM's output, so its loads are in flight while the GEMM ends.
    u32 bl[LORA_MAX_R / 16][ROPE_LORA_MAXI][2], bh[LORA_MAX_R / 16][ROPE_LORA_MAXI][2];
    {
        const bf16_t* bs = b + ((u64)max(slot, 0) * fan_out + (u64)head_in_m * d + g) * r_pad + 2 * q;
#pragma unroll
        for (int k = 0; k < LORA_MAX_R / 16; ++k) {
#pragma unroll
            for (int i = 0; i < ROPE_LORA_MAXI; ++i) {
                const bool on = k < ksteps && i < npair;
                const bf16_t* row = bs + (u64)(8 * (warp + ROPE_LORA_WARPS * i)) * r_pad + 16 * k;
                const bf16_t* row_hi = row + (u64)half * r_pad;
                bl[k][i][0] = on ? lora_ld2(row) : 0u;
                bl[k][i][1] = on ? lora_ld2(row + 8) : 0u;
                bh[k][i][0] = on ? lora_ld2(row_hi) : 0u;
                bh[k][i][1] = on ? lora_ld2(row_hi + 8) : 0u;
            }
        }
    }
    pdl_wait();
    // Every load issued before the first use (add_rmsnorm_lora's lesson): the pair's two halves of
    // rows g and g + 8, their positions' cos and sin, the bias.
    int pos[2];
    float sx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int t = h ? t1 : t0;
        pos[h] = t >= 0 ? positions[t] : 0;
        sx[h] = YM != FY_BF16 && t >= 0 ? dxs[t] : 1.f;
    }
    // The pairs as loaded, and (scaled modes) their columns' scales.
    FusedRaw2 ylo[ROPE_LORA_MAXI][2], yhi[ROPE_LORA_MAXI][2];
    float2 wlo[ROPE_LORA_MAXI], whi[ROPE_LORA_MAXI];
    float2 cs[ROPE_LORA_MAXI][2], sn[ROPE_LORA_MAXI][2], blo[ROPE_LORA_MAXI], bhi[ROPE_LORA_MAXI];
#pragma unroll
    for (int i = 0; i < ROPE_LORA_MAXI; ++i) {
        const bool on_i = i < npair;
        const int c = 8 * (warp + ROPE_LORA_WARPS * i) + 2 * q;
        const int col = head * d + c;
        blo[i] = bias && on_i ? *reinterpret_cast<const float2*>(bias + col) : make_float2(0.f, 0.f);
        bhi[i] = bias && on_i ? *reinterpret_cast<const float2*>(bias + col + half) : make_float2(0.f, 0.f);
        if (YM != FY_BF16) {
            wlo[i] = on_i ? *reinterpret_cast<const float2*>(dws + col) : make_float2(0.f, 0.f);
            whi[i] = on_i ? *reinterpret_cast<const float2*>(dws + col + half) : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = h ? t1 : t0;
            const bool on = on_i && t >= 0;
            const u64 row = (u64)max(t, 0) * y_stride;
            const int* row_i32 = YM == FY_I32_SCALED ? y_i32 + row : nullptr;
            ylo[i][h] = fused_ld2<YM>(y + row, row_i32, col, on);
            yhi[i][h] = fused_ld2<YM>(y + row, row_i32, col + half, on);
            const bool rot = on && m < 2;
            cs[i][h] = rot ? *reinterpret_cast<const float2*>(cos_t + (u64)pos[h] * half + c) : make_float2(1.f, 1.f);
            sn[i][h] = rot ? *reinterpret_cast<const float2*>(sin_t + (u64)pos[h] * half + c) : make_float2(0.f, 0.f);
        }
    }
    float alo[ROPE_LORA_MAXI][4], ahi[ROPE_LORA_MAXI][4];
#pragma unroll
    for (int i = 0; i < ROPE_LORA_MAXI; ++i) alo[i][0] = alo[i][1] = alo[i][2] = alo[i][3] = ahi[i][0] = ahi[i][1] = ahi[i][2] = ahi[i][3] = 0.f;
    if (ksteps > 0) {
        const u64 u_col = (u64)width + (u64)(m * num_slots + slot) * r_pad;
        const bf16_t* u0 = t0 >= 0 ? y + (u64)t0 * y_stride + u_col : nullptr;
        const bf16_t* u1 = t1 >= 0 ? y + (u64)t1 * y_stride + u_col : nullptr;
        const int* ui0 = YM == FY_I32_SCALED && t0 >= 0 ? y_i32 + (u64)t0 * y_stride + u_col : nullptr;
        const int* ui1 = YM == FY_I32_SCALED && t1 >= 0 ? y_i32 + (u64)t1 * y_stride + u_col : nullptr;
        const float* uws = YM != FY_BF16 ? dws + u_col : nullptr;
        // The tile's u (the mma's A operand) for every k step, loaded together, then the products.
        u32 a[LORA_MAX_R / 16][4];
#pragma unroll
        for (int k = 0; k < LORA_MAX_R / 16; ++k) {
            const bool on = k < ksteps;
            const int c = 16 * k + 2 * q;
            fused_u_frag<YM>(a[k], on ? u0 : nullptr, on ? u1 : nullptr, on ? ui0 : nullptr, on ? ui1 : nullptr, c, sx[0], sx[1], on ? uws : nullptr);
        }
#pragma unroll
        for (int k = 0; k < LORA_MAX_R / 16; ++k) {
            if (k >= ksteps) break;
#pragma unroll
            for (int i = 0; i < ROPE_LORA_MAXI; ++i) {
                if (i >= npair) continue;
                lora_mma(alo[i], a[k], bl[k][i][0], bl[k][i][1]);
                lora_mma(ahi[i], a[k], bh[k][i][0], bh[k][i][1]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int t = h ? t1 : t0;
        if (t < 0) continue;
        const int cslot = cache_slots[t];
        const u64 blk = (u64)(cslot / block_size), off = (u64)(cslot % block_size);
        bf16_t* dst = m == 0 ? q_out + (u64)t * hq * d + (u64)head * d
                             : (m == 1 ? k_cache : v_cache) + ((blk * hkv + head_in_m) * block_size + off) * d;
#pragma unroll
        for (int i = 0; i < ROPE_LORA_MAXI; ++i) {
            if (i >= npair) continue;
            const int c = 8 * (warp + ROPE_LORA_WARPS * i) + 2 * q;
            const float2 v0 = fused_val2<YM>(ylo[i][h], sx[h], YM != FY_BF16 ? wlo[i] : make_float2(1.f, 1.f));
            const float2 v1 = fused_val2<YM>(yhi[i][h], sx[h], YM != FY_BF16 ? whi[i] : make_float2(1.f, 1.f));
            float x0[2] = {v0.x, v0.y};
            float x1[2] = {v1.x, v1.y};
            const float bl2[2] = {blo[i].x, blo[i].y}, bh2[2] = {bhi[i].x, bhi[i].y};
            const float c2[2] = {cs[i][h].x, cs[i][h].y}, s2[2] = {sn[i][h].x, sn[i][h].y};
            float o0[2], o1[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                // The order rope_kv_write adds in: output, bias, update.
                if (bias) {
                    x0[e] += bl2[e];
                    x1[e] += bh2[e];
                }
                if (slot >= 0) {
                    x0[e] += bf2f(f2bf(scale * alo[i][2 * h + e]));
                    x1[e] += bf2f(f2bf(scale * ahi[i][2 * h + e]));
                }
                if (m < 2) {
                    o0[e] = x0[e] * c2[e] - x1[e] * s2[e];
                    o1[e] = x1[e] * c2[e] + x0[e] * s2[e];
                } else {
                    o0[e] = x0[e];
                    o1[e] = x1[e];
                }
            }
            *reinterpret_cast<u32*>(dst + c) = (u32)f2bf(o0[0]) | ((u32)f2bf(o0[1]) << 16);
            *reinterpret_cast<u32*>(dst + c + half) = (u32)f2bf(o1[0]) | ((u32)f2bf(o1[1]) << 16);
        }
    }
}

#define ROPE_KV_WRITE_LORA_ARGS                                                                                          \
    const bf16_t *__restrict__ y, int y_stride, const float *__restrict__ bias, const int *__restrict__ positions,      \
        const float *__restrict__ cos_t, const float *__restrict__ sin_t, const int *__restrict__ cache_slots,         \
        bf16_t *__restrict__ q_out, bf16_t *__restrict__ k_cache, bf16_t *__restrict__ v_cache, int hq, int hkv, int d, \
        int block_size, const bf16_t *__restrict__ b_q, const bf16_t *__restrict__ b_k, const bf16_t *__restrict__ b_v, \
        const int *__restrict__ slots, const int *__restrict__ order, const int *__restrict__ seg,                     \
        const int *__restrict__ tiles, const int *__restrict__ ranks, const float *__restrict__ scales, int n,         \
        int lora_tiles, int r_pad, int num_slots
#define ROPE_KV_WRITE_LORA_PASS                                                                                       \
    y, y_stride, bias, positions, cos_t, sin_t, cache_slots, q_out, k_cache, v_cache, hq, hkv, d, block_size, b_q, b_k, \
        b_v, slots, order, seg, tiles, ranks, scales, n, lora_tiles, r_pad, num_slots

extern "C" __global__ void __launch_bounds__(ROPE_LORA_WARPS * 32) rope_kv_write_lora(ROPE_KV_WRITE_LORA_ARGS) {
    rope_kv_write_lora_impl<FY_BF16>(ROPE_KV_WRITE_LORA_PASS, nullptr, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(ROPE_LORA_WARPS * 32) rope_kv_write_lora_scaled(
    ROPE_KV_WRITE_LORA_ARGS, const float* __restrict__ dxs, const float* __restrict__ dws, const int* __restrict__ y_i32) {
    rope_kv_write_lora_impl<FY_BF16_SCALED>(ROPE_KV_WRITE_LORA_PASS, dxs, dws, y_i32);
}
extern "C" __global__ void __launch_bounds__(ROPE_LORA_WARPS * 32) rope_kv_write_lora_sums(
    ROPE_KV_WRITE_LORA_ARGS, const float* __restrict__ dxs, const float* __restrict__ dws, const int* __restrict__ y_i32) {
    rope_kv_write_lora_impl<FY_I32_SCALED>(ROPE_KV_WRITE_LORA_PASS, dxs, dws, y_i32);
}

#else

extern "C" __global__ void add_rmsnorm_lora(float*, const bf16_t*, int, const bf16_t*, const float*, bf16_t*, int, float,
                                            const int*, const int*, const int*, const int*, const int*, const float*,
                                            int, int, int) {}
extern "C" __global__ void add_rmsnorm_lora_quant_e4m3(float*, const bf16_t*, int, const bf16_t*, const float*, bf16_t*, int,
                                                       float, const int*, const int*, const int*, const int*, const int*,
                                                       const float*, int, int, int, const float*, const float*, const int*,
                                                       unsigned char*, float*) {}
extern "C" __global__ void add_rmsnorm_lora_quant_i8(float*, const bf16_t*, int, const bf16_t*, const float*, bf16_t*, int,
                                                     float, const int*, const int*, const int*, const int*, const int*,
                                                     const float*, int, int, int, const float*, const float*, const int*,
                                                     unsigned char*, float*) {}
extern "C" __global__ void add_rmsnorm_lora_quant_e4m3_scaled(float*, const bf16_t*, int, const bf16_t*, const float*, bf16_t*,
                                                              int, float, const int*, const int*, const int*, const int*,
                                                              const int*, const float*, int, int, int, const float*,
                                                              const float*, const int*, unsigned char*, float*) {}
extern "C" __global__ void add_rmsnorm_lora_quant_i8_scaled(float*, const bf16_t*, int, const bf16_t*, const float*, bf16_t*,
                                                            int, float, const int*, const int*, const int*, const int*,
                                                            const int*, const float*, int, int, int, const float*,
                                                            const float*, const int*, unsigned char*, float*) {}
extern "C" __global__ void silu_mul_lora(bf16_t*, const bf16_t*, int, int, const bf16_t*, const bf16_t*, const int*,
                                         const int*, const int*, const int*, const int*, const float*, int, int, int, int, int) {}
extern "C" __global__ void silu_mul_lora_r32(bf16_t*, const bf16_t*, int, int, const bf16_t*, const bf16_t*, const int*,
                                             const int*, const int*, const int*, const int*, const float*, int, int, int, int,
                                             int) {}
extern "C" __global__ void rope_kv_write_lora(const bf16_t*, int, const float*, const int*, const float*, const float*,
                                              const int*, bf16_t*, bf16_t*, bf16_t*, int, int, int, int, const bf16_t*,
                                              const bf16_t*, const bf16_t*, const int*, const int*, const int*,
                                              const int*, const int*, const float*, int, int, int, int) {}
extern "C" __global__ void rope_kv_write_lora_scaled(const bf16_t*, int, const float*, const int*, const float*,
                                                     const float*, const int*, bf16_t*, bf16_t*, bf16_t*, int, int, int, int,
                                                     const bf16_t*, const bf16_t*, const bf16_t*, const int*, const int*,
                                                     const int*, const int*, const int*, const float*, int, int, int, int,
                                                     const float*, const float*, const int*) {}
extern "C" __global__ void rope_kv_write_lora_sums(const bf16_t*, int, const float*, const int*, const float*,
                                                   const float*, const int*, bf16_t*, bf16_t*, bf16_t*, int, int, int, int,
                                                   const bf16_t*, const bf16_t*, const bf16_t*, const int*, const int*,
                                                   const int*, const int*, const int*, const float*, int, int, int, int,
                                                   const float*, const float*, const int*) {}

#endif
