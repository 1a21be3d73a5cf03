// Paged attention, key-tiled: the same contract as attention.cu's paged_attention (one block per
// (token, KV head[, split]), the GQA group served together, partials for splits), but each warp takes
// 32 keys at a time with one key per lane for q·k (a lane reads its key's whole row: no cross-lane
// reduction per key), one softmax update per tile, then lanes over head dims for p·V (coalesced V
// rows, probabilities from shared memory). Per key this costs a fraction of the instructions of the
// key-per-warp kernel, which matters once contexts are long and batches large (decode with thousands
// of cached tokens per sequence, prefill chunks). A warp first copies its tile of K rows into shared
// memory with coalesced 16-byte loads (16 lanes per row), so the per-lane row reads of q·k hit shared
// memory, not 32 scattered cache lines per load instruction; rows are padded by 16 bytes so the eight
// lanes of a quarter-warp read eight different bank groups.
#define ATTN_TILE 32
#define ATTN_KROW_PAD 8  // bf16 elements (16 bytes) after each K row in shared memory

template <int D>
__device__ __forceinline__ void paged_attention_tiled_impl(
    bf16_t* __restrict__ out, const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int hq, int hkv, int block_size,
    float scale, const AttnOutQuant& aq, float* __restrict__ part_ml, float* __restrict__ part_acc) {
    constexpr int E = D / 32;  // head dims per lane in p·V
    constexpr int KROW = D + ATTN_KROW_PAD;
    __shared__ __align__(16) float q_s[ATTN_MAX_GROUP][D];
    __shared__ float p_s[ATTN_WARPS][ATTN_MAX_GROUP][ATTN_TILE];
    __shared__ float sm_m[ATTN_WARPS][ATTN_MAX_GROUP];
    __shared__ float sm_l[ATTN_WARPS][ATTN_MAX_GROUP];
    // The K tiles during the key loop; the warps' partial accumulators after it (same bytes).
    constexpr int K_TILE_BYTES = ATTN_WARPS * ATTN_TILE * KROW * 2;
    constexpr int ACC_BYTES = ATTN_WARPS * ATTN_MAX_GROUP * D * 4;
    __shared__ __align__(16) unsigned char scratch[K_TILE_BYTES > ACC_BYTES ? K_TILE_BYTES : ACC_BYTES];
    bf16_t* k_s = reinterpret_cast<bf16_t*>(scratch) + (threadIdx.x >> 5) * ATTN_TILE * KROW;
    float (*sm_acc)[ATTN_MAX_GROUP][D] = reinterpret_cast<float (*)[ATTN_MAX_GROUP][D]>(scratch);

    if (gridDim.z == 1) pdl_trigger();
    const AttnBlock ab = attention_block(block_tables, max_blocks, token_seq, positions, hq, hkv);
    const int t = ab.t, kvh = ab.kvh, group = ab.group, splits = ab.splits, split = ab.split;
    const int begin = ab.begin, end = ab.end;
    const int* bt = ab.bt;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2

    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        q_s[g][d] = bf2f(q[(u64)t * hq * D + (u64)(kvh * group + g) * D + d]) * qscale;
    }
    __syncthreads();

    float acc[ATTN_MAX_GROUP][E], m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    }

    for (int p0 = begin + warp * ATTN_TILE; p0 < end; p0 += ATTN_WARPS * ATTN_TILE) {
        const int p = p0 + lane;
        const bool valid = p < end;
        const u64 blk = valid ? (u64)bt[p / block_size] : 0;
        const u64 row = valid ? ((blk * hkv + kvh) * block_size + (p % block_size)) * D : 0;

        // The tile's K rows into shared memory: D/8 lanes per row, 16 bytes each, coalesced.
        constexpr int CHUNKS = D / 8;             // 16-byte chunks per row
        constexpr int ROWS_PER_PASS = 32 / CHUNKS;
        const int nk = min(ATTN_TILE, end - p0);
#pragma unroll
        for (int r0 = 0; r0 < ATTN_TILE; r0 += ROWS_PER_PASS) {
            const int r = r0 + lane / CHUNKS, c = lane % CHUNKS;
            const u64 rr = __shfl_sync(0xffffffffu, row, r);
            if (r < nk) {
                *reinterpret_cast<uint4*>(k_s + r * KROW + c * 8) = *reinterpret_cast<const uint4*>(k_cache + rr + c * 8);
            }
        }
        __syncwarp();

        // q·k for this lane's key, every head of the group.
        float s[ATTN_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < ATTN_MAX_GROUP; ++g) s[g] = 0.f;
        if (valid) {
            const uint4* kr = reinterpret_cast<const uint4*>(k_s + lane * KROW);
#pragma unroll
            for (int c = 0; c < D / 8; ++c) {
                const uint4 raw = kr[c];
                const u32 w4[4] = {raw.x, raw.y, raw.z, raw.w};
                float kf[8];
#pragma unroll
                for (int h = 0; h < 4; ++h) {
                    kf[2 * h] = __uint_as_float(w4[h] << 16);
                    kf[2 * h + 1] = __uint_as_float(w4[h] & 0xffff0000u);
                }
#pragma unroll
                for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
                    if (g < group) {
                        const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][c * 8]);
                        const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][c * 8 + 4]);
                        s[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                                qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                    }
                }
            }
        }
        // One online-softmax update per tile and head.
#pragma unroll
        for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
            if (g < group) {
                const float sv = valid ? s[g] : NEG_INF;
                const float mn = fmaxf(m[g], warp_max(sv));
                const float corr = exp2f(m[g] - mn);  // m = -inf before the first key: 0
                const float w = valid ? exp2f(sv - mn) : 0.f;
                l[g] = l[g] * corr + warp_sum(w);
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] *= corr;
                m[g] = mn;
                p_s[warp][g][lane] = w;
            }
        }
        __syncwarp();
        // p·V: lanes over head dims, keys of the tile in turn.
        const int nv = min(ATTN_TILE, end - p0);
        auto pv = [&](int j) {
            const u64 rj = __shfl_sync(0xffffffffu, row, j);
            float vv[E];
            load_row<D>(v_cache + rj + lane * E, vv);
#pragma unroll
            for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
                if (g < group) {
                    const float pj = p_s[warp][g][j];
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[g][e] += pj * vv[e];
                }
            }
        };
        if (nv == ATTN_TILE) {
            // Unrolled so several V rows are in flight at once (the loads do not depend on each other).
#pragma unroll 8
            for (int j = 0; j < ATTN_TILE; ++j) pv(j);
        } else {
            for (int j = 0; j < nv; ++j) pv(j);
        }
        __syncwarp();
    }

    // (the merge starts with a barrier: every warp is done with its K tile before the accumulators
    // take the same bytes)
    attention_merge_warps<D>(m, l, acc, sm_m, sm_l, sm_acc, group, t, kvh, hq, splits, split, out, part_ml, part_acc, aq);
}

ATTENTION_KERNEL(paged_attention_tiled, paged_attention_tiled_impl, 64)
ATTENTION_KERNEL(paged_attention_tiled, paged_attention_tiled_impl, 128)
