// Decode attention over an fp8 KV cache with the keys as the mma's rows: S^T = K Q^T, O^T = V^T P^T.
//
// attention_mma.cu's decode kernel puts a token's query heads in the rows of a 16-row mma tile; a
// Llama group of 4 fills 4 of them, and its accumulator (16 rows x head dim) holds 64 floats a thread
// for D = 128. Under the fp8 kernel's four blocks per SM that spilled (ncu, 200 x 1500 keys: 128
// registers, 1.57 M spill requests, issue-bound at 2.4 instructions a cycle, 46 % of DRAM peak).
// Here the keys are the 16 rows (M) and the group the 8 columns (N, half used for a group of 4): a
// key costs half the mma steps, the accumulator O^T (dims x heads) is 32 floats, and K and V^T tiles
// are A operands read with plain ldmatrix (K rows in mma_f8_key_row order, V^T rows of keys; the
// stage layout is F8SwzGeom's). Scores go from their accumulator
// layout to the B layout of P^T with one movmatrix (a register transpose) per 8 keys.
//
// k-order: a 32-bit ldmatrix element holds 4 fp8 values (dims, or keys) 4q..4q+3 of lane q of a quad;
// converted pairwise they are k = 2q, 2q+1 and 2q+8, 2q+9 of the mma, so Q^T (B of S^T) is loaded in
// that order, and row i of S^T is the key the loader stored at row i: key 4(i/2) + i%2 for i < 8 and
// that plus 2 for rows 8..15 (mma_f8_key_row). After the transpose, lane q holds the probabilities of
// keys 4q, 4q+1 (k = 2q, 2q+1) and 4q+2, 4q+3 (k = 2q+8, 2q+9): the keys its V^T fragment holds.
//
// An int8 cache (I8, `--kv-cache-dtype int8*`, always scaled) is read the same way; only the
// conversion of four codes to f16 differs (attention_mma.cu's kv8x4_to_f16x2x2).
//
// The scaled cache (SC, `--kv-cache-dtype fp8-scaled*`, rope_kv.cu's rope_kv_write_fp8s): each
// (block, KV head) chunk is block_size * (D + 4) bytes, the codes then one f32 scale per key for K and
// for V. The scales of a tile's keys are copied into the stage after V^T; a key's score is multiplied
// by its k scale, and its probability by its v scale times attention_mma.cu's MMA_VSC_BIAS (p * s in
// f16's normal range for small scales; the sums l carry the same factor) before the P·V mma.
//
// Each of the 4 warps takes KW keys of every KW * 4-key tile with its own online softmax per head
// (rescaling its accumulator only when a running max grew) and the warps are merged by attention.cu's
// attention_merge_write, which also writes the partials of splits for attention_combine.

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890

// Transposes the 8x8 b16 matrix a warp holds in ldmatrix fragment layout (lane 4g + q: row g,
// columns 2q, 2q + 1).
__device__ __forceinline__ u32 movmatrix_trans(u32 v) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

// Two floats in [0, 1] (probabilities) as f16x2, low half first.
__device__ __forceinline__ u32 prob_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The A fragment of 16 rows x 16 k from two ldmatrix registers of fp8 values: `lo` holds row g's
// values 4q..4q+3, `hi` row g + 8's (see the header for the k order).
// I8: the values are int8 codes (an int8 cache), else e4m3.
template <bool I8>
__device__ __forceinline__ void f8_a_fragment(u32 (&a)[4], u32 lo, u32 hi) {
    kv8x4_to_f16x2x2<I8>(lo, a[0], a[2]);
    kv8x4_to_f16x2x2<I8>(hi, a[1], a[3]);
}

// The decode kernel's stage: K [KT keys][D] bytes (rows in mma_f8_key_row order) then V^T [D][KT]
// bytes, unpadded; 16-byte chunks are XOR-swizzled within each 128-byte line (f8_swz) so that the 8
// rows an ldmatrix reads land in distinct banks. 16 KB a 64-key stage instead of attention_mma.cu's
// padded 19.5 KB: three stages fit four blocks per SM.
template <int D, int KT_, int STAGES_, bool SC = false> struct F8SwzGeom {
    static constexpr int KT = KT_;
    static constexpr int STAGES = STAGES_;
    static constexpr int K_TILE = KT * D;
    static constexpr int SCALES = K_TILE + D * KT;  // SC: KT k scales then KT v scales (f32)
    static constexpr int STAGE = SCALES + (SC ? 2 * KT * 4 : 0);
};

// Byte offset of 16-byte chunk c of row r in a tile of `row_bytes`-byte rows (a multiple of 16 that
// divides 128, or a multiple of 128): the chunk's place within its 128-byte line XORed with the
// line's index mod 8. Eight consecutive rows at one chunk then cover all 32 banks (for 64-byte rows:
// two rows per line, the second's chunks offset by 4, lines differing in their low three bits).
__device__ __forceinline__ int f8_swz(int r, int c, int row_bytes) {
    const int lin = r * row_bytes + c * 16;
    return (lin & ~0x70) | ((((lin >> 4) & 7) ^ ((lin >> 7) & 7)) << 4);
}

// The decode kernel's tile copies, in the F8SwzGeom layout, with this thread's share of every tile fixed once: pass j
// copies 16 bytes of a K row and 16 keys of a V^T row of one 16-key chunk, the two sharing the
// chunk's block-table entry, which is read a tile ahead (its load latency hidden behind a tile's
// compute). The generic loader spent ~70 instructions a pass on this (ptxas for sm_90), as many as
// the tile's mma work.
template <int D, class G, bool SC = false>
struct F8TileCopies {
    static constexpr int PASSES = G::KT * D / 16 / (MMA_WARPS * 32);
    // SC: threads 0..KT/2-1 copy the scales, 16 bytes (4 keys) each: piece tid % (KT/4) of K's
    // (tid < KT/4) or V's; s_entry is the block-table entry of the piece's 16-key chunk.
    static constexpr int SPIECES = G::KT / 4;
    int s_entry;
    static constexpr int CH = D / 16;  // 16-byte pieces of a K row
    int chunk16[PASSES], kr[PASSES];   // first key of the pass's chunk in the tile; its K row in the chunk
    u32 k_src[PASSES], v_src[PASSES];  // bytes from the chunk's (block, head) base: K row kr piece c; V^T row w
    u32 k_dst[PASSES], v_dst[PASSES];  // bytes from the stage's start
    int entry[PASSES];                 // block-table entries of the next tile to copy
    int shift;                         // log2(block size): an fp8 cache's blocks are powers of two

    __device__ __forceinline__ F8TileCopies(int block_size) {
        shift = __ffs(block_size) - 1;
#pragma unroll
        for (int j = 0; j < PASSES; ++j) {
            const int i = threadIdx.x + j * MMA_WARPS * 32;
            const int chunk = i / D, w = i % D;
            chunk16[j] = chunk * 16;
            kr[j] = w / CH;
            k_src[j] = (u32)(kr[j] * D + (w % CH) * 16);
            v_src[j] = (u32)(w * block_size);
            k_dst[j] = (u32)f8_swz(chunk * 16 + mma_f8_key_row(kr[j]), w % CH, D);
            v_dst[j] = (u32)(G::K_TILE + f8_swz(w, chunk, G::KT));
        }
    }


    // Reads the block-table entries of the tile at key kt0 (0 past `end`: nothing is copied there).
    __device__ __forceinline__ void fetch(const int* __restrict__ bt, int kt0, int end) {
#pragma unroll
        for (int j = 0; j < PASSES; ++j) {
            const int p0 = kt0 + chunk16[j];
            entry[j] = p0 < end ? bt[p0 >> shift] : 0;
        }
        if constexpr (SC) {
            if ((int)threadIdx.x < 2 * SPIECES) {
                const int p0 = kt0 + (((int)threadIdx.x % SPIECES) & ~3) * 4;
                s_entry = p0 < end ? bt[p0 >> shift] : 0;
            }
        }
    }

    // Issues the copies of the tile at key kt0 (the one `fetch` read) into `stage`; zeros past `end`.
    __device__ __forceinline__ void issue(unsigned char* stage, const fp8_t* __restrict__ k_cache, const fp8_t* __restrict__ v_cache,
                                          int kt0, int end, int block_size, int hkv, int kvh, u64 block_bytes) const {
        const u32 base = smem_addr(stage);
#pragma unroll
        for (int j = 0; j < PASSES; ++j) {
            const int p0 = kt0 + chunk16[j];
            const int rem = end - p0;
            const int slot = p0 & (block_size - 1);
            const u64 head = (u64)(entry[j] * hkv + kvh) * block_bytes;  // the chunk's (block, KV head)
            cp_async16(base + k_dst[j], k_cache + head + (u32)slot * D + k_src[j], kr[j] < rem ? 16 : 0);
            cp_async16(base + v_dst[j], v_cache + head + slot + v_src[j], min(max(rem, 0), 16));
        }
        if constexpr (SC) {
            if ((int)threadIdx.x < 2 * SPIECES) {
                const int piece = (int)threadIdx.x % SPIECES, is_v = (int)threadIdx.x / SPIECES;
                const int p = kt0 + piece * 4;  // 4 keys, within one cache block (slots are multiples of 4)
                const int slot = p & (block_size - 1);
                const u64 head = (u64)(s_entry * hkv + kvh) * block_bytes;
                const fp8_t* src = (is_v ? v_cache : k_cache) + head + (u64)block_size * D + (u32)slot * 4;
                cp_async16(base + G::SCALES + (is_v * G::KT + piece * 4) * 4, src, min(max(end - p, 0), 4) * 4);
            }
        }
    }
};

template <int D, int KW, int STAGES, bool SC, bool I8>
__device__ __forceinline__ void paged_attention_f8k_impl(
    bf16_t* __restrict__ out, const bf16_t* __restrict__ q, const fp8_t* __restrict__ k_cache,
    const fp8_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int hq, int hkv, int block_size,
    float scale, const AttnOutQuant& aq, float* __restrict__ part_ml, float* __restrict__ part_acc) {
    typedef F8SwzGeom<D, KW * MMA_WARPS, STAGES, SC> G;
    constexpr int KS = D / 16;   // k-steps of S^T (16 dims each) = m-tiles of O^T (16 dims each)
    constexpr int SG = KW / 16;  // this warp's 16-key groups of a tile
    extern __shared__ __align__(16) unsigned char mma_smem[];
    unsigned char* tiles = mma_smem;  // [stage][K tile | V^T tile]
    // After the key loop the same bytes hold the warps' accumulators.
    float (*sm_acc)[ATTN_MAX_GROUP][D] = reinterpret_cast<float (*)[ATTN_MAX_GROUP][D]>(mma_smem);
    __shared__ float sm_m[ATTN_WARPS][ATTN_MAX_GROUP], sm_l[ATTN_WARPS][ATTN_MAX_GROUP];

    if (gridDim.z == 1) pdl_trigger();
    // The V^T tiles are copied 16 keys at a time: splits start at multiples of 16.
    const AttnBlock ab = attention_block(block_tables, max_blocks, token_seq, positions, hq, hkv, 16);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, quad = lane & 3;
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2

    // Q^T as B fragments: column g is query head g of the group (zeros past it).
    u32 qb[KS][2];
    {
        const bool active = g < ab.group;
        const bf16_t* q_row = q + ((u64)ab.t * hq + ab.kvh * ab.group + g) * D;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const uint2 v = active ? *reinterpret_cast<const uint2*>(q_row + kk * 16 + quad * 4) : make_uint2(0u, 0u);
            qb[kk][0] = bf16x2_to_f16x2(v.x);
            qb[kk][1] = bf16x2_to_f16x2(v.y);
        }
    }

    // O^T fragments: o[mt][0..1] = dim 16 mt + g, heads 2q and 2q + 1; o[mt][2..3] = dim + 8.
    float o[KS][4];
#pragma unroll
    for (int x = 0; x < KS; ++x) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.f;
    // Running max and this lane's share of the sum, for heads 2q and 2q + 1.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    // Rows g and g + 8 of a 16-key group hold keys pg and pg + 2 (mma_f8_key_row's order).
    const int pg = 4 * (g >> 1) + (g & 1);
    // ldmatrix rows: K matrices (rows 0-7 | 8-15) x (16 dims | the next 16), so this lane's K row and
    // chunk; V^T matrices are 8 dims each, four consecutive, so this lane's dim.
    const int k_row = KW * warp + (lane & 7) + ((lane >> 3) & 1) * 8, k_chunk = lane >> 4;

    const int ntiles = (ab.end > ab.begin) ? (ab.end - ab.begin + G::KT - 1) / G::KT : 0;
    F8TileCopies<D, G, SC> copies(block_size);
    // One KV head of one cache block, K or V (SC: its scales too).
    const u64 block_bytes = (u64)block_size * (SC ? D + 4 : D);
    copies.fetch(ab.bt, ab.begin, ab.end);
    // STAGES - 1 tiles in flight before the first is used; one copy group per tile (empty past the end).
#pragma unroll
    for (int st = 0; st < G::STAGES - 1; ++st) {
        if (st < ntiles) {
            copies.issue(tiles + st * G::STAGE, k_cache, v_cache, ab.begin + st * G::KT, ab.end, block_size, hkv, ab.kvh, block_bytes);
            copies.fetch(ab.bt, ab.begin + (st + 1) * G::KT, ab.end);
        }
        cp_async_commit();
    }
    for (int it = 0; it < ntiles; ++it) {
        const int next = it + G::STAGES - 1;
        if (next < ntiles) {
            copies.issue(tiles + (next % G::STAGES) * G::STAGE, k_cache, v_cache, ab.begin + next * G::KT, ab.end, block_size, hkv,
                         ab.kvh, block_bytes);
            copies.fetch(ab.bt, ab.begin + (next + 1) * G::KT, ab.end);
        }
        cp_async_commit();
        cp_async_wait<G::STAGES - 1>();  // tile `it` has landed
        __syncthreads();

        const unsigned char* ks = tiles + (it % G::STAGES) * G::STAGE;
        const unsigned char* vs = ks + G::K_TILE;
        const int key_warp = ab.begin + it * G::KT + KW * warp;
        // SC: the tile's k and v scales; this lane's keys are tile keys KW warp + 16 sg + pg (+ 2).
        const float* ksc = reinterpret_cast<const float*>(ks + G::SCALES);
        const float* vsc = ksc + G::KT;

        // S^T for this warp's keys: s[sg][0..1] = key pg of group sg, heads 2q, 2q + 1; [2..3] key pg + 2.
        float s[SG][4];
#pragma unroll
        for (int sg = 0; sg < SG; ++sg) {
            s[sg][0] = s[sg][1] = s[sg][2] = s[sg][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 32; ++kk) {
                u32 r0, r1, r2, r3, a[4];
                ldmatrix_x4(smem_addr(ks + f8_swz(k_row + sg * 16, k_chunk + 2 * kk, D)), r0, r1, r2, r3);
                f8_a_fragment<I8>(a, r0, r1);
                mma_f16(s[sg], a, qb[2 * kk][0], qb[2 * kk][1]);
                f8_a_fragment<I8>(a, r2, r3);
                mma_f16(s[sg], a, qb[2 * kk + 1][0], qb[2 * kk + 1][1]);
            }
        }

        // Online softmax per head (column): keys past the end are masked; the max over the warp's
        // keys is reduced across the 8 lanes of a column (g).
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int sg = 0; sg < SG; ++sg) {
            const int key = key_warp + sg * 16 + pg;
            const bool v_lo = key < ab.end, v_hi = key + 2 < ab.end;
            const float q_lo = SC ? qscale * ksc[KW * warp + sg * 16 + pg] : qscale;
            const float q_hi = SC ? qscale * ksc[KW * warp + sg * 16 + pg + 2] : qscale;
            s[sg][0] = v_lo ? s[sg][0] * q_lo : NEG_INF;
            s[sg][1] = v_lo ? s[sg][1] * q_lo : NEG_INF;
            s[sg][2] = v_hi ? s[sg][2] * q_hi : NEG_INF;
            s[sg][3] = v_hi ? s[sg][3] * q_hi : NEG_INF;
            mx0 = fmaxf(mx0, fmaxf(s[sg][0], s[sg][2]));
            mx1 = fmaxf(mx1, fmaxf(s[sg][1], s[sg][3]));
        }
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        // Rescale only when some head's max grew (after the first tiles, rarely).
        if (__any_sync(0xffffffffu, mx0 != m0 || mx1 != m1)) {
            // A head with no key yet keeps m = -inf: nothing to rescale.
            const float c0 = (mx0 == NEG_INF) ? 1.f : exp2_ftz(m0 - mx0);
            const float c1 = (mx1 == NEG_INF) ? 1.f : exp2_ftz(m1 - mx1);
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int x = 0; x < KS; ++x) {
                o[x][0] *= c0; o[x][1] *= c1;
                o[x][2] *= c0; o[x][3] *= c1;
            }
            m0 = mx0;
            m1 = mx1;
        }
#pragma unroll
        for (int sg = 0; sg < SG; ++sg) {
            s[sg][0] = (m0 == NEG_INF) ? 0.f : exp2_ftz(s[sg][0] - m0);
            s[sg][1] = (m1 == NEG_INF) ? 0.f : exp2_ftz(s[sg][1] - m1);
            s[sg][2] = (m0 == NEG_INF) ? 0.f : exp2_ftz(s[sg][2] - m0);
            s[sg][3] = (m1 == NEG_INF) ? 0.f : exp2_ftz(s[sg][3] - m1);
            l0 += s[sg][0] + s[sg][2];
            l1 += s[sg][1] + s[sg][3];
        }

        // O^T += V^T P^T: P^T's B fragment is the score fragment transposed.
#pragma unroll
        for (int sg = 0; sg < SG; ++sg) {
            // SC: each probability times its key's v scale (and MMA_VSC_BIAS).
            const float v_lo = SC ? vsc[KW * warp + sg * 16 + pg] * MMA_VSC_BIAS : 1.f;
            const float v_hi = SC ? vsc[KW * warp + sg * 16 + pg + 2] * MMA_VSC_BIAS : 1.f;
            const u32 b0 = movmatrix_trans(prob_f16x2(s[sg][0] * v_lo, s[sg][1] * v_lo));  // keys 4q, 4q + 1
            const u32 b1 = movmatrix_trans(prob_f16x2(s[sg][2] * v_hi, s[sg][3] * v_hi));  // keys 4q + 2, 4q + 3
#pragma unroll
            for (int mp = 0; mp < D / 32; ++mp) {
                u32 r0, r1, r2, r3, a[4];
                ldmatrix_x4(smem_addr(vs + f8_swz(lane + mp * 32, (KW * warp) / 16 + sg, G::KT)), r0, r1, r2, r3);
                f8_a_fragment<I8>(a, r0, r1);
                mma_f16(o[2 * mp], a, b0, b1);
                f8_a_fragment<I8>(a, r2, r3);
                mma_f16(o[2 * mp + 1], a, b0, b1);
            }
        }
        __syncthreads();  // the stage is overwritten by the copy issued next iteration
    }
    cp_async_wait<0>();

    // Sums over the column's lanes; then each warp's (m, l, O) into shared memory for the merge.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    if constexpr (SC) {  // O carries MMA_VSC_BIAS: so does l, and O / l is the output
        l0 *= MMA_VSC_BIAS;
        l1 *= MMA_VSC_BIAS;
    }
    __syncthreads();  // every warp is done with the tiles before sm_acc takes their bytes
    const int h0 = 2 * quad, h1 = h0 + 1;
    if (g == 0) {
        if (h0 < ab.group) { sm_m[warp][h0] = m0; sm_l[warp][h0] = l0; }
        if (h1 < ab.group) { sm_m[warp][h1] = m1; sm_l[warp][h1] = l1; }
    }
#pragma unroll
    for (int x = 0; x < KS; ++x) {
        const int d = 16 * x + g;
        if (h0 < ab.group) { sm_acc[warp][h0][d] = o[x][0]; sm_acc[warp][h0][d + 8] = o[x][2]; }
        if (h1 < ab.group) { sm_acc[warp][h1][d] = o[x][1]; sm_acc[warp][h1][d + 8] = o[x][3]; }
    }
    attention_merge_write<D>(sm_m, sm_l, sm_acc, ab.group, ab.t, ab.kvh, hq, ab.splits, ab.split, out, part_ml, part_acc, aq);
}

// attention.cu's one-token signature and launch shape, plus dynamic shared memory (attention.rs's
// attention_mma_smem_bytes). Measured on an H100 (docs/benchmarks.md, session 15) with attention_mma.cu's
// padded stages against 32 keys per warp, three stages (then three blocks per SM), and five blocks
// per SM: 16 keys per warp, two stages, four blocks per SM (no spills at 128 registers) was best or
// within 2 % on every batched shape. Unpadded XOR-swizzled stages fit three at four blocks per SM:
// 3-4 % faster than two padded ones on every batched shape (session 16).
#define F8K_KW 16      // keys per warp per tile
#define F8K_STAGES 3
#define F8K_BLOCKS 4   // blocks per SM the registers are bounded for
#define ATTENTION_F8K_KERNEL(NAME, D, SC, I8)                                                                  \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, F8K_BLOCKS) NAME##_d##D(                  \
        bf16_t* out, const bf16_t* q, const fp8_t* k_cache, const fp8_t* v_cache, const int* block_tables,     \
        int max_blocks, const int* token_seq, const int* positions, int hq, int hkv, int block_size,          \
        float scale, AttnOutQuant aq, float* part_ml, float* part_acc) {                                                       \
        paged_attention_f8k_impl<D, F8K_KW, F8K_STAGES, SC, I8>(out, q, k_cache, v_cache, block_tables, max_blocks,   \
                                                        token_seq, positions, hq, hkv, block_size, scale,     \
                                                        aq, part_ml, part_acc);                                   \
    }
ATTENTION_F8K_KERNEL(paged_attention_mma_f8, 64, false, false)
ATTENTION_F8K_KERNEL(paged_attention_mma_f8, 128, false, false)
ATTENTION_F8K_KERNEL(paged_attention_mma_f8s, 64, true, false)
ATTENTION_F8K_KERNEL(paged_attention_mma_f8s, 128, true, false)
ATTENTION_F8K_KERNEL(paged_attention_mma_i8s, 64, true, true)
ATTENTION_F8K_KERNEL(paged_attention_mma_i8s, 128, true, true)
#else
// Below sm_89 the entry points exist (the host loads every name) with empty bodies.
extern "C" __global__ void paged_attention_mma_f8_d64(bf16_t*, const bf16_t*, const fp8_t*, const fp8_t*, const int*, int,
                                                      const int*, const int*, int, int, int, float, AttnOutQuant, float*, float*) {}
extern "C" __global__ void paged_attention_mma_f8_d128(bf16_t*, const bf16_t*, const fp8_t*, const fp8_t*, const int*, int,
                                                       const int*, const int*, int, int, int, float, AttnOutQuant, float*, float*) {}
extern "C" __global__ void paged_attention_mma_f8s_d64(bf16_t*, const bf16_t*, const fp8_t*, const fp8_t*, const int*, int,
                                                       const int*, const int*, int, int, int, float, AttnOutQuant, float*, float*) {}
extern "C" __global__ void paged_attention_mma_f8s_d128(bf16_t*, const bf16_t*, const fp8_t*, const fp8_t*, const int*, int,
                                                        const int*, const int*, int, int, int, float, AttnOutQuant, float*, float*) {}
extern "C" __global__ void paged_attention_mma_i8s_d64(bf16_t*, const bf16_t*, const fp8_t*, const fp8_t*, const int*, int,
                                                       const int*, const int*, int, int, int, float, AttnOutQuant, float*, float*) {}
extern "C" __global__ void paged_attention_mma_i8s_d128(bf16_t*, const bf16_t*, const fp8_t*, const fp8_t*, const int*, int,
                                                        const int*, const int*, int, int, int, float, AttnOutQuant, float*, float*) {}
#endif
