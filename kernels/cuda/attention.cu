// Paged attention for a flat batch: decode tokens and prefill chunks alike.
//
// Token t belongs to sequence token_seq[t], sits at position positions[t] and attends causally to the
// positions 0..=positions[t] of its sequence, read through that sequence's block table (K/V of the
// step's own tokens were written by rope_kv_write before this runs). One block per (token, KV head)
// serves the whole GQA group of query heads, so each K/V row is read once for the group. The warps of
// the block take keys round-robin, each keeping an online softmax (running max, sum, accumulator) per
// query head; the warps' partial results are merged through shared memory at the end.
//
// q: [n, Hq*D] bf16; caches: [blocks, Hkv, block_size, D] bf16; block_tables: [seqs, max_blocks] i32;
// out: [n, Hq*D] bf16. scale = 1/sqrt(D).
//
// Split along the sequence (gridDim.z = splits > 1, for decode batches too small to fill the GPU):
// split z takes keys [z*chunk, min(ctx, (z+1)*chunk)), chunk = max(ceil(ctx / splits), 64), and writes its
// unnormalized partial result (max, sum, accumulator) to `part_*`; attention_combine merges them.
#define ATTN_WARPS 4
#define ATTN_MAX_GROUP 8
// Fewest keys a split takes: a short context leaves the launch's later splits empty (they only
// write an empty partial) rather than cutting it into slivers that each pay a block's fixed costs.
// Batch-1 decode on an H100 at contexts 128-256: 16 slivers 167.4-168.0 tokens/s, 2-4 splits
// 169.8-170.4 (docs/benchmarks.md).
#define ATTN_MIN_SPLIT_KEYS 64

template <int D>
__device__ __forceinline__ void load_row(const bf16_t* p, float (&v)[D / 32]) {
    if constexpr (D == 128) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        v[0] = __uint_as_float(raw.x << 16); v[1] = __uint_as_float(raw.x & 0xffff0000u);
        v[2] = __uint_as_float(raw.y << 16); v[3] = __uint_as_float(raw.y & 0xffff0000u);
    } else if constexpr (D == 64) {
        const u32 raw = *reinterpret_cast<const u32*>(p);
        v[0] = __uint_as_float(raw << 16); v[1] = __uint_as_float(raw & 0xffff0000u);
    } else {
#pragma unroll
        for (int e = 0; e < D / 32; ++e) v[e] = bf2f(p[e]);
    }
}

// What one block of an attention launch covers: token t = blockIdx.x (of sequence token_seq[t],
// attending to positions 0..=positions[t]), KV head blockIdx.y, and of those keys the range
// [begin, end) of split blockIdx.z (chunk = ceil(ctx / splits), at least ATTN_MIN_SPLIT_KEYS).
struct AttnBlock {
    int t, kvh, group, splits, split, begin, end;
    const int* bt;  // the sequence's block table row
};

// `align`: split starts are multiples of it (the fp8 tensor-core kernel copies 16 keys at a time).
__device__ __forceinline__ AttnBlock attention_block(const int* __restrict__ block_tables, int max_blocks,
                                                     const int* __restrict__ token_seq,
                                                     const int* __restrict__ positions, int hq, int hkv,
                                                     int align = 1) {
    AttnBlock b;
    b.t = blockIdx.x;
    b.kvh = blockIdx.y;
    b.group = hq / hkv;
    const int ctx = positions[b.t] + 1;
    b.splits = gridDim.z;
    b.split = blockIdx.z;
    const int chunk = (max((ctx + b.splits - 1) / b.splits, ATTN_MIN_SPLIT_KEYS) + align - 1) / align * align;
    b.begin = b.split * chunk;
    b.end = min(ctx, b.begin + chunk);
    b.bt = block_tables + (u64)token_seq[b.t] * max_blocks;
    return b;
}

// The second half of attention_merge_warps (below), also used by kernels that store their warps'
// states themselves: starts with a barrier, then merges sm_m/sm_l/sm_acc ([warp][head of the
// group][dim]) and writes the block's output rows, or the split's unnormalized partials.
template <int D>
__device__ __forceinline__ void attention_merge_write(
    float (*sm_m)[ATTN_MAX_GROUP], float (*sm_l)[ATTN_MAX_GROUP], float (*sm_acc)[ATTN_MAX_GROUP][D], int group, int t,
    int kvh, int hq, int splits, int split, bf16_t* __restrict__ out, float* __restrict__ part_ml,
    float* __restrict__ part_acc, const AttnOutQuant& aq) {
    __syncthreads();
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float sum = 0.f, o = 0.f;
        if (mx != NEG_INF) {  // a split past the end of a short sequence saw no key at all
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                // A warp that saw no key has m = -inf and l = 0: its factor is exp2(-inf) = 0.
                const float f = exp2f(sm_m[w][g] - mx);
                sum += sm_l[w][g] * f;
                o += sm_acc[w][g][d] * f;
            }
        }
        const int head = kvh * group + g;
        if (splits == 1) {
            out[(u64)t * hq * D + (u64)head * D + d] = f2bf(o / sum);
        } else {
            const u64 pi = ((u64)t * hq + head) * splits + split;
            part_acc[pi * D + d] = o;
            if (d == 0) { part_ml[2 * pi] = mx; part_ml[2 * pi + 1] = sum; }
        }
    }
    // hkv blocks write a token's row; attention_combine quantizes split ones.
    if (splits == 1) attn_out_rows_written(aq, out, hq * D, t, 1);
}

// The end of the CUDA-core attention kernels: each warp's online-softmax state (running max m, sum l,
// accumulator acc; lanes hold D/32 dims each) merged through shared memory, then the block's output
// rows written, or the split's unnormalized partials. Starts with a barrier, so a kernel may reuse
// the bytes of sm_acc for something else during its key loop.
template <int D>
__device__ __forceinline__ void attention_merge_warps(
    const float (&m)[ATTN_MAX_GROUP], const float (&l)[ATTN_MAX_GROUP], const float (&acc)[ATTN_MAX_GROUP][D / 32],
    float (*sm_m)[ATTN_MAX_GROUP], float (*sm_l)[ATTN_MAX_GROUP], float (*sm_acc)[ATTN_MAX_GROUP][D], int group,
    int t, int kvh, int hq, int splits, int split, bf16_t* __restrict__ out, float* __restrict__ part_ml,
    float* __restrict__ part_acc, const AttnOutQuant& aq) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
        if (g < group) {
            if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
#pragma unroll
            for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
        }
    }
    attention_merge_write<D>(sm_m, sm_l, sm_acc, group, t, kvh, hq, splits, split, out, part_ml, part_acc, aq);
}

template <int D>
__device__ __forceinline__ void paged_attention_impl(
    bf16_t* __restrict__ out, const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int hq, int hkv, int block_size,
    float scale, const AttnOutQuant& aq, float* __restrict__ part_ml, float* __restrict__ part_acc) {
    constexpr int E = D / 32;  // elements of a head row per lane
    __shared__ float sm_m[ATTN_WARPS][ATTN_MAX_GROUP];
    __shared__ float sm_l[ATTN_WARPS][ATTN_MAX_GROUP];
    __shared__ float sm_acc[ATTN_WARPS][ATTN_MAX_GROUP][D];

    if (gridDim.z == 1) pdl_trigger();  // unsplit: this kernel is the one before the o GEMV
    const AttnBlock ab = attention_block(block_tables, max_blocks, token_seq, positions, hq, hkv);
    const int t = ab.t, kvh = ab.kvh, group = ab.group, splits = ab.splits, split = ab.split;
    const int begin = ab.begin, end = ab.end;
    const int* bt = ab.bt;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2

    float qv[ATTN_MAX_GROUP][E], acc[ATTN_MAX_GROUP][E], m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) { acc[g][e] = 0.f; qv[g][e] = 0.f; }
        if (g < group) {
            load_row<D>(q + (u64)t * hq * D + (u64)(kvh * group + g) * D + lane * E, qv[g]);
#pragma unroll
            for (int e = 0; e < E; ++e) qv[g][e] *= qscale;
        }
    }

    // The first 32 block ids of this split's range, one per lane, so the key loop does not wait on a
    // dependent block-table load for each key (p is warp-uniform, so the shuffle is safe).
    const int first_blk = begin / block_size;
    const int nblk = (end > begin) ? (end - 1) / block_size - first_blk + 1 : 0;
    const int bt_lane = (lane < nblk) ? bt[first_blk + lane] : 0;
    // Two keys per iteration, both loaded before either is used: more memory requests in flight.
    for (int p0 = begin + warp; p0 < end; p0 += 2 * ATTN_WARPS) {
        float kv2[2][E], vv2[2][E];
        const int np = (p0 + ATTN_WARPS < end) ? 2 : 1;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (j < np) {
                const int p = p0 + j * ATTN_WARPS;
                const int bi = p / block_size - first_blk;
                const int b = __shfl_sync(0xffffffffu, bt_lane, bi & 31);
                const u64 blk = (u64)(bi < 32 ? b : bt[p / block_size]);
                const u64 row = ((blk * hkv + kvh) * block_size + (p % block_size)) * D + lane * E;
                load_row<D>(k_cache + row, kv2[j]);
                load_row<D>(v_cache + row, vv2[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
        if (j >= np) break;
        const float* kv = kv2[j];
        const float* vv = vv2[j];
#pragma unroll
        for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
            if (g < group) {
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) s += qv[g][e] * kv[e];
                s = warp_sum(s);
                const float mn = fmaxf(m[g], s);
                const float corr = exp2f(m[g] - mn);
                const float w = exp2f(s - mn);
                l[g] = l[g] * corr + w;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + w * vv[e];
                m[g] = mn;
            }
        }
        }
    }

    attention_merge_warps<D>(m, l, acc, sm_m, sm_l, sm_acc, group, t, kvh, hq, splits, split, out, part_ml, part_acc, aq);
}

// Merges the splits of each (token, query head): grid (n, hq), blockDim.x = D; then, where `aq` asks
// for it, the block that completes a token's row quantizes it.
extern "C" __global__ void attention_combine(bf16_t* __restrict__ out, const float* __restrict__ part_ml,
                                             const float* __restrict__ part_acc, int hq, int splits, int d,
                                             AttnOutQuant aq) {
    pdl_trigger();
    const u64 th = (u64)blockIdx.x * hq + blockIdx.y;
    const int i = threadIdx.x;
    float mx = NEG_INF;
    for (int z = 0; z < splits; ++z) mx = fmaxf(mx, part_ml[2 * (th * splits + z)]);
    float sum = 0.f, o = 0.f;
    for (int z = 0; z < splits; ++z) {
        const float m = part_ml[2 * (th * splits + z)];
        if (m == NEG_INF) continue;
        const float f = exp2f(m - mx);
        sum += part_ml[2 * (th * splits + z) + 1] * f;
        o += part_acc[(th * splits + z) * d + i] * f;
    }
    if (i < d) out[th * d + i] = f2bf(o / sum);
    attn_out_rows_written(aq, out, hq * d, blockIdx.x, 1);
}

// The exported entry points: NAME_d64 / NAME_d128 with the launch signature both kernels share.
#define ATTENTION_KERNEL(NAME, IMPL, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) NAME##_d##D(                         \
        bf16_t* out, const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,                     \
        const int* block_tables, int max_blocks, const int* token_seq, const int* positions, int hq,    \
        int hkv, int block_size, float scale, AttnOutQuant aq, float* part_ml, float* part_acc) {                        \
        IMPL<D>(out, q, k_cache, v_cache, block_tables, max_blocks, token_seq, positions, hq, hkv,       \
                block_size, scale, aq, part_ml, part_acc);                                                  \
    }
ATTENTION_KERNEL(paged_attention, paged_attention_impl, 64)
ATTENTION_KERNEL(paged_attention, paged_attention_impl, 128)
