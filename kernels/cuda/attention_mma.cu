// Paged attention on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate), flash-attention
// style: the same inputs and outputs as attention.cu's paged_attention, but one block computes a tile
// of query rows (16 or 64) against K/V tiles of 64 keys that stream into shared memory with cp.async,
// two stages deep, so the next tile's bytes are in flight while the current one is computed.
//
// Two kernels share the tile pipeline and the mma steps. Rows are (token, query head) pairs of KV
// head blockIdx.y.
// - paged_attention_mma (decode): attention.cu's one-token block and launch shape; the token's GQA
//   group fills rows 0..group-1 of a 16-row tile (4 of 16 for Llama's group of 4: the tensor cores
//   have room to spare, the K/V bytes are what counts, and they are read once per group). The four
//   warps split each K/V tile (16 keys each), keep their own online softmax (running max m, sum l,
//   accumulator O as mma fragments) and are merged by attention.cu's attention_merge_write, which
//   also writes the partials of splits along the sequence for attention_combine.
// - paged_attention_mma_rows (prefill chunks): 64 rows, the tq = 64 / group consecutive tokens from
//   t_begin + blockIdx.x * tq (row r: token r / group, head r % group), each warp owning 16 rows
//   against all 64 keys of every tile (flash-attention 2's layout), so a K/V tile read from L2 serves
//   64 rows, a warp skips the tiles its causal mask hides, and no merge is needed. Tokens of one
//   sequence are contiguous in the flat batch; a block whose tokens span sequences runs the key loop
//   once per sequence with the other rows masked.
//
// The prefill kernel also comes in an fp8 flavour (F8 = true: `--kv-cache-dtype fp8`; fp8 decode has
// its own kernel, attention_mma_f8.cu, with the keys as the mma's rows), for a KV cache of
// e4m3 bytes (scale 1, as vLLM's uncalibrated fp8 cache): K as [blocks, Hkv, block_size, D] and V
// transposed within each block, [blocks, Hkv, D, block_size], so that 16 keys of one dimension are 16
// contiguous bytes. Tiles land in shared memory as bytes (half the traffic of bf16) and become the
// B fragments of f16 mma.sync through ldmatrix with no transposition: a 32-bit ldmatrix element is 4
// fp8 values, converted pairwise (cvt e4m3x2 -> f16x2, sm_89+). That gives each lane dims (keys)
// 4q..4q+3 where the mma wants k = 2q, 2q+1 and 2q+8, 2q+9; the k index is a sum, so its order is
// free: Q's A fragments are loaded with the same permutation (dims 4q+j as k 2q+j, 4q+2+j as k
// 2q+8+j), and the score columns are assigned keys so that a lane's probabilities are exactly the
// keys its V fragment holds (column 2q+e of n-tile t of 16 keys = key 4q+2t+e). Q and P are f16 in
// this path (f16 has the finer mantissa; |Q| is clamped to f16's range).
// The fp8 flavour also reads an int8 cache with per-head scales (`--kv-cache-dtype int8*`: the same
// layout, bytes and scales; I8 only changes how four bytes become f16, kv8x4_to_f16x2x2).
#define MMA_WARPS 4
#define MMA_KT 64      // keys per tile (the decode kernel's warps take 16 each)
// MMA_WARPS must equal attention.cu's ATTN_WARPS: the decode kernel uses its merge.
#define MMA_STAGES 2     // pipeline depth (fp8 prefill: MMA_F8_STAGES)
#define MMA_F8_STAGES 3  // fp8 prefill: an fp8 tile is half the bytes, one more in flight
#define MMA_PAD 8      // bf16 elements after each shared-memory row: ldmatrix rows land in distinct banks
#define MMA_F8_PAD 16  // bytes after each fp8 shared-memory row (K rows: D + 16, V^T rows: 64 + 16)

typedef unsigned char fp8_t;

// Element type of the KV cache: bf16, or e4m3 bytes.
template <bool F8> struct KvElem { typedef bf16_t T; };
template <> struct KvElem<true> { typedef fp8_t T; };

// Tiles of KT_ keys, STAGES_ deep; shared-memory geometry of one pipeline stage in bytes: the K tile,
// then the V tile.
// SC (a scaled fp8 cache, see attention_mma_f8.cu's header): KT k scales and KT v scales (f32) after
// the V tile.
template <int D, bool F8, int KT_, int STAGES_, bool SC = false> struct MmaGeom {
    static constexpr int KT = KT_;
    static constexpr int STAGES = STAGES_;
    static constexpr int K_ROW = F8 ? D + MMA_F8_PAD : (D + MMA_PAD) * 2;
    static constexpr int K_TILE = KT * K_ROW;
    static constexpr int V_ROW = F8 ? KT + MMA_F8_PAD : (D + MMA_PAD) * 2;  // fp8: a row per dim
    static constexpr int V_TILE = F8 ? D * V_ROW : KT * V_ROW;
    static constexpr int SCALES = K_TILE + V_TILE;
    static constexpr int STAGE = SCALES + (SC ? 2 * KT * 4 : 0);
};
template <int D, bool F8> using MmaDecodeGeom = MmaGeom<D, F8, MMA_KT, MMA_STAGES>;
template <int D, bool F8, bool SC = false> using MmaRowsGeom = MmaGeom<D, F8, MMA_KT, F8 ? MMA_F8_STAGES : MMA_STAGES, SC>;

// What a scaled cache's probabilities are multiplied by besides the v scale, so that p * s stays in
// f16's normal range for small scales (undone through l; the fp8 decode kernel uses it too).
#define MMA_VSC_BIAS 256.f

// fp8 K tiles: the shared-memory row of key r of a tile. Within each 16 keys, the keys of score
// n-tile 0 (4q + e: 0, 1, 4, 5, 8, 9, 12, 13) come first and those of n-tile 1 (4q + 2 + e) next, so
// each ldmatrix reads 8 consecutive rows (distinct banks at the padded stride).
__device__ __forceinline__ int mma_f8_key_row(int r) {
    const int k = r & 15;
    return (r & ~15) | ((k & 2) << 2) | ((k >> 2) << 1) | (k & 1);
}

// mma.sync on bf16 and cp.async need sm_80; older targets get empty kernels the host never launches.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronously; `bytes` = 0 writes zeros (keys past the end: their V rows
// must be zeros, not stale memory, because p = 0 times NaN is NaN).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col); fragments as in the PTX ISA's m16n8k16 layout. mma_bf16 for
// the bf16 path, mma_f16 for the fp8 path (its operands are converted to f16).
#define MMA_M16N8K16(NAME, T)                                                                           \
    __device__ __forceinline__ void NAME(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {            \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
                     "{%8,%9}, {%0,%1,%2,%3};\n"                                                         \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                   \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                   \
    }
MMA_M16N8K16(mma_bf16, "bf16")
MMA_M16N8K16(mma_f16, "f16")

// Two floats as bf16x2 (low half first), rounded to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
}

// Two floats as f16x2 (low half first), rounded to nearest even; clamped to f16's finite range.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    lo = fminf(fmaxf(lo, -65504.f), 65504.f);
    hi = fminf(fmaxf(hi, -65504.f), 65504.f);
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// bf16x2 -> f16x2 (Q of the fp8 path).
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 v) {
    return pack_f16x2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

// Two e4m3 values (low byte first) -> f16x2, exactly. sm_89+; the fp8 kernels exist only there.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v) {
#if __CUDA_ARCH__ >= 890
    u32 r;
    const unsigned short h = (unsigned short)(v & 0xffffu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
    return r;
#else
    return 0u * v;
#endif
}

// Four e4m3 values (low byte first) -> two f16x2 (values 0, 1 and 2, 3), exactly. Naming the 32-bit
// register's halves lets ptxas convert the high half in place instead of shifting it down first.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(u32 v, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(v));
#else
    lo = hi = 0u * v;
#endif
}

// Four int8 codes (low byte first) -> two f16x2 (values 0, 1 and 2, 3), exactly: code + 128 becomes
// the low byte of an f16 whose exponent makes its unit 1 (0x64xx = 1024 + xx), and 1152 is subtracted.
__device__ __forceinline__ void i8x4_to_f16x2x2(u32 v, u32& lo, u32& hi) {
    const u32 b = v ^ 0x80808080u;
    const u32 bias = 0x64806480u;  // 1152, 1152 as f16x2
    lo = __byte_perm(b, 0x64646464u, 0x4140);
    hi = __byte_perm(b, 0x64646464u, 0x4342);
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(lo), "r"(bias));
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(hi), "r"(bias));
}

// Four codes of an 8-bit cache -> two f16x2: int8 (I8, `--kv-cache-dtype int8*`) or e4m3.
template <bool I8>
__device__ __forceinline__ void kv8x4_to_f16x2x2(u32 v, u32& lo, u32& hi) {
    if constexpr (I8) i8x4_to_f16x2x2(v, lo, hi);
    else e4m3x4_to_f16x2x2(v, lo, hi);
}

// 2^x for x <= 0 (softmax weights): the approximate unit, subnormal results flushed to zero, without
// exp2f's rescaling around the subnormal range.
__device__ __forceinline__ float exp2_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// This thread's rows lo and hi of Q as A fragments (raw bf16 pairs: the softmax scale is applied to
// the f32 scores); zeros for rows that are not active.
template <int D>
__device__ __forceinline__ void mma_load_q(u32 (&qa)[D / 16][4], const bf16_t* q_lo, const bf16_t* q_hi, bool a_lo,
                                           bool a_hi, int quad) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk * 16 + quad * 2;
        qa[kk][0] = a_lo ? *reinterpret_cast<const u32*>(q_lo + c) : 0u;
        qa[kk][1] = a_hi ? *reinterpret_cast<const u32*>(q_hi + c) : 0u;
        qa[kk][2] = a_lo ? *reinterpret_cast<const u32*>(q_lo + c + 8) : 0u;
        qa[kk][3] = a_hi ? *reinterpret_cast<const u32*>(q_hi + c + 8) : 0u;
    }
}

// The fp8 path's Q fragments (f16): k index 2q + j of k-step kk is dim 16 kk + 4q + j, and 2q + 8 + j
// is dim 16 kk + 4q + 2 + j (the order in which ldmatrix hands a lane its fp8 K values).
template <int D>
__device__ __forceinline__ void mma_load_q_f16(u32 (&qa)[D / 16][4], const bf16_t* q_lo, const bf16_t* q_hi, bool a_lo,
                                               bool a_hi, int quad) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk * 16 + quad * 4;
        const uint2 lo = a_lo ? *reinterpret_cast<const uint2*>(q_lo + c) : make_uint2(0u, 0u);
        const uint2 hi = a_hi ? *reinterpret_cast<const uint2*>(q_hi + c) : make_uint2(0u, 0u);
        qa[kk][0] = bf16x2_to_f16x2(lo.x);
        qa[kk][1] = bf16x2_to_f16x2(hi.x);
        qa[kk][2] = bf16x2_to_f16x2(lo.y);
        qa[kk][3] = bf16x2_to_f16x2(hi.y);
    }
}

// Q fragments of either path.
template <int D, bool F8>
__device__ __forceinline__ void mma_load_q_any(u32 (&qa)[D / 16][4], const bf16_t* q_lo, const bf16_t* q_hi, bool a_lo,
                                               bool a_hi, int quad) {
    if constexpr (F8) mma_load_q_f16<D>(qa, q_lo, q_hi, a_lo, a_hi, quad);
    else mma_load_q<D>(qa, q_lo, q_hi, a_lo, a_hi, quad);
}

// One online-softmax step over SN score n-tiles (8 keys each) of this thread's rows lo and hi: keys
// at or past a row's limit are masked, the scores scaled to base 2, the running max m, this lane's
// share of the sum l (the quad is summed at the end) and the accumulator o rescaled, and the scores
// replaced by their probabilities. key0: the key of s[0][0] in this lane (bf16: key0 + 8j + e for
// s[j][e]; fp8: key0 + 16 (j / 2) + 2 (j % 2) + e, see the header); a row's scores sit in the four
// lanes of a quad.
template <int SN, int NT, bool F8 = false>
__device__ __forceinline__ void mma_softmax_step(float (&s)[SN][4], float (&o)[NT][4], float& m_lo, float& m_hi,
                                                 float& l_lo, float& l_hi, int key0, int lim_lo, int lim_hi,
                                                 float qscale) {
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
    for (int j = 0; j < SN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int key = F8 ? key0 + 16 * (j >> 1) + 2 * (j & 1) + e : key0 + j * 8 + e;
            s[j][e] = key < lim_lo ? s[j][e] * qscale : NEG_INF;
            s[j][2 + e] = key < lim_hi ? s[j][2 + e] * qscale : NEG_INF;
            mx_lo = fmaxf(mx_lo, s[j][e]);
            mx_hi = fmaxf(mx_hi, s[j][2 + e]);
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
    }
    const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
    // A row with no key yet keeps m = -inf: nothing to rescale, every p is 0.
    const float corr_lo = (mn_lo == NEG_INF) ? 1.f : exp2f(m_lo - mn_lo);
    const float corr_hi = (mn_hi == NEG_INF) ? 1.f : exp2f(m_hi - mn_hi);
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int j = 0; j < SN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[j][e] = (mn_lo == NEG_INF) ? 0.f : exp2f(s[j][e] - mn_lo);
            s[j][2 + e] = (mn_hi == NEG_INF) ? 0.f : exp2f(s[j][2 + e] - mn_hi);
            sum_lo += s[j][e];
            sum_hi += s[j][2 + e];
        }
    }
    l_lo = l_lo * corr_lo + sum_lo;
    l_hi = l_hi * corr_hi + sum_hi;
    m_lo = mn_lo;
    m_hi = mn_hi;
#pragma unroll
    for (int x = 0; x < NT; ++x) {
        o[x][0] *= corr_lo; o[x][1] *= corr_lo;
        o[x][2] *= corr_hi; o[x][3] *= corr_hi;
    }
}

// Cache block and slot of key p. Block sizes are powers of two in practice (16 by default), where a
// shift and a mask replace the division (tens of instructions per copy in the fp8 tile loader).
__device__ __forceinline__ void kv_locate(int p, int block_size, int& blk, int& slot) {
    if ((block_size & (block_size - 1)) == 0) {
        blk = p >> (__ffs(block_size) - 1);
        slot = p & (block_size - 1);
    } else {
        blk = p / block_size;
        slot = p - blk * block_size;
    }
}

// Issues the copies of the K and V rows of keys [kt0, kt0 + KT) (zeros past `end`) of KV head
// `kvh` into pipeline stage `stage` of `tiles` (bytes: [stage][K tile | V tile], MmaGeom G).
// bf16: both tiles [KT][D + MMA_PAD]. fp8: K [KT][D + MMA_F8_PAD] in mma_f8_key_row order, V^T
// [D][KT + MMA_F8_PAD], copied 16 keys of a dimension at a time (block_size % 16 == 0, so 16
// keys never straddle a cache block; the bytes past `end` are zero-filled).
template <int D, bool F8, class G, bool SC = false>
__device__ __forceinline__ void mma_load_tile(unsigned char* tiles, int stage, int kt0, int end, const int* __restrict__ bt,
                                              int block_size, int hkv, int kvh,
                                              const typename KvElem<F8>::T* __restrict__ k_cache,
                                              const typename KvElem<F8>::T* __restrict__ v_cache) {
    unsigned char* ks = tiles + stage * G::STAGE;
    unsigned char* vs = ks + G::K_TILE;
    if constexpr (!F8) {
        constexpr int CH = D / 8;  // 16-byte chunks of a row
        constexpr int ROWS_PER_PASS = MMA_WARPS * 32 / CH, PASSES = G::KT / ROWS_PER_PASS;
        const int c = threadIdx.x % CH;
#pragma unroll
        for (int j = 0; j < PASSES; ++j) {
            const int r = threadIdx.x / CH + j * ROWS_PER_PASS;
            const int p = kt0 + r;
            const bool valid = p < end;
            int blk = 0, slot = 0;
            kv_locate(p, block_size, blk, slot);
            const u64 off = valid ? (((u64)bt[blk] * hkv + kvh) * block_size + slot) * D + c * 8 : 0;
            cp_async16(smem_addr(ks + r * G::K_ROW + c * 16), k_cache + off, valid ? 16 : 0);
            cp_async16(smem_addr(vs + r * G::V_ROW + c * 16), v_cache + off, valid ? 16 : 0);
        }
    } else {
        // Pass j copies, for one 16-key chunk of the tile, 16 bytes of a K row and 16 keys of a V^T
        // row; the K and V halves of a pass share the chunk, so its block-table entry is read once.
        constexpr int CH = D / 16;  // 16-byte chunks of a K row
        constexpr int PASSES = G::KT * D / 16 / (MMA_WARPS * 32);
#pragma unroll
        for (int j = 0; j < PASSES; ++j) {
            const int i = threadIdx.x + j * MMA_WARPS * 32;
            const int chunk = i / D, w = i % D;  // w: a V^T row (dim), or key w / CH's K bytes w % CH
            const int p0 = kt0 + chunk * 16;     // a multiple of 16: the chunk lies in one cache block
            const int bytes = min(max(end - p0, 0), 16);
            int blk = 0, slot = 0;
            kv_locate(p0, block_size, blk, slot);
            const u64 head = bytes > 0 ? (u64)bt[blk] * hkv + kvh : 0;  // (block, KV head) of the chunk
            const u64 hb = head * block_size * (SC ? D + 4 : D);       // its first byte (SC: + scales)
            const int kr = w / CH, c = w % CH;
            const bool kvalid = kr < bytes;
            const u64 koff = kvalid ? hb + (u64)(slot + kr) * D + c * 16 : 0;
            cp_async16(smem_addr(ks + (chunk * 16 + mma_f8_key_row(kr)) * G::K_ROW + c * 16), k_cache + koff, kvalid ? 16 : 0);
            const u64 voff = bytes > 0 ? hb + (u64)w * block_size + slot : 0;
            cp_async16(smem_addr(vs + w * G::V_ROW + chunk * 16), v_cache + voff, bytes);
        }
        if constexpr (SC) {
            // Threads 0..KT/2-1: 4 keys' k scales (tid < KT/4) or v scales each, in tile key order.
            constexpr int SPIECES = G::KT / 4;
            if ((int)threadIdx.x < 2 * SPIECES) {
                const int piece = (int)threadIdx.x % SPIECES, is_v = (int)threadIdx.x / SPIECES;
                const int p = kt0 + piece * 4;
                const int bytes = min(max(end - p, 0), 4) * 4;
                int blk = 0, slot = 0;
                kv_locate(p, block_size, blk, slot);
                const u64 at = bytes > 0 ? ((u64)bt[blk] * hkv + kvh) * block_size * (D + 4) + (u64)block_size * D + (u64)slot * 4 : 0;
                cp_async16(smem_addr(ks + G::SCALES + (is_v * G::KT + piece * 4) * 4), (is_v ? v_cache : k_cache) + at, bytes);
            }
        }
    }
}

// S = Q K^T for the 16 keys at rows key0.. of the K tile `ks`: s0 holds keys 0..7, s1 keys 8..15
// (fp8: the keys of n-tiles 0 and 1 in the header's order, rows key0.. in mma_f8_key_row order).
template <int D, bool F8, class G, bool I8 = false>
__device__ __forceinline__ void mma_qk16(float (&s0)[4], float (&s1)[4], const u32 (&qa)[D / 16][4],
                                         const unsigned char* ks, int key0, int lane) {
    const int mi = lane >> 3;  // the 8x8 matrix whose row address this lane supplies
    if constexpr (!F8) {
        const unsigned char* base = ks + (key0 + (mi >> 1) * 8 + (lane & 7)) * G::K_ROW + (mi & 1) * 16;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(smem_addr(base + kk * 32), b0, b1, b2, b3);
            mma_bf16(s0, qa[kk], b0, b1);
            mma_bf16(s1, qa[kk], b2, b3);
        }
    } else {
        // An 8x8 b16 matrix is 8 keys x 16 fp8 dims (one k-step of one n-tile): matrix mi covers
        // n-tile mi >> 1 and k-step 2 kk + (mi & 1).
        const unsigned char* base = ks + (key0 + (mi >> 1) * 8 + (lane & 7)) * G::K_ROW + (mi & 1) * 16;
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) {
            u32 r0, r1, r2, r3;
            ldmatrix_x4(smem_addr(base + kk * 32), r0, r1, r2, r3);
            u32 b[4][2];
            kv8x4_to_f16x2x2<I8>(r0, b[0][0], b[0][1]);
            kv8x4_to_f16x2x2<I8>(r1, b[1][0], b[1][1]);
            kv8x4_to_f16x2x2<I8>(r2, b[2][0], b[2][1]);
            kv8x4_to_f16x2x2<I8>(r3, b[3][0], b[3][1]);
            mma_f16(s0, qa[2 * kk], b[0][0], b[0][1]);
            mma_f16(s0, qa[2 * kk + 1], b[1][0], b[1][1]);
            mma_f16(s1, qa[2 * kk], b[2][0], b[2][1]);
            mma_f16(s1, qa[2 * kk + 1], b[3][0], b[3][1]);
        }
    }
}

// O += P V for the 16 keys at key0.. of the V tile `vs`; p0/p1 are their probabilities (the score
// fragments of mma_qk16, which packed to 16 bits are the A layout of the next mma). bf16: V rows
// through transposing loads. fp8: V^T rows (a dimension's keys) through plain loads, matrix i of a
// load = the 8 dims of n-tile 4 dd + i.
template <int D, bool F8, class G, bool I8 = false>
__device__ __forceinline__ void mma_pv16(float (&o)[D / 8][4], const float (&p0)[4], const float (&p1)[4],
                                         const unsigned char* vs, int key0, int lane) {
    const int mi = lane >> 3;
    if constexpr (!F8) {
        const u32 pa[4] = {pack_bf16x2(p0[0], p0[1]), pack_bf16x2(p0[2], p0[3]), pack_bf16x2(p1[0], p1[1]),
                           pack_bf16x2(p1[2], p1[3])};
        const unsigned char* base = vs + (key0 + (mi & 1) * 8 + (lane & 7)) * G::V_ROW + (mi >> 1) * 16;
#pragma unroll
        for (int dd = 0; dd < D / 16; ++dd) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(smem_addr(base + dd * 32), b0, b1, b2, b3);
            mma_bf16(o[2 * dd], pa, b0, b1);
            mma_bf16(o[2 * dd + 1], pa, b2, b3);
        }
    } else {
        const u32 pa[4] = {pack_f16x2(p0[0], p0[1]), pack_f16x2(p0[2], p0[3]), pack_f16x2(p1[0], p1[1]),
                           pack_f16x2(p1[2], p1[3])};
        const unsigned char* base = vs + (mi * 8 + (lane & 7)) * G::V_ROW + key0;
#pragma unroll
        for (int dd = 0; dd < D / 32; ++dd) {
            u32 r[4];
            ldmatrix_x4(smem_addr(base + dd * 32 * G::V_ROW), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 b0, b1;
                kv8x4_to_f16x2x2<I8>(r[i], b0, b1);
                mma_f16(o[4 * dd + i], pa, b0, b1);
            }
        }
    }
}

// The end of the segment that starts at token sb (< t1): the tokens of one sequence.
__device__ __forceinline__ int mma_segment_end(const int* __restrict__ token_seq, int sb, int t1) {
    const int seq = token_seq[sb];
    int se = sb + 1;
    while (se < t1 && token_seq[se] == seq) ++se;
    return se;
}

// Decode: the one-token block of attention.cu's contract (attention_block: token blockIdx.x, KV head
// blockIdx.y, the keys of split blockIdx.z). Its `group` query heads are rows 0..group-1 of the
// 16-row mma tile (rows 8..15 stay empty: group <= 8). The warps split every tile, 16 keys each, and
// are merged by attention_merge_write like the CUDA-core kernels' warps.
// (An fp8 cache has its own decode kernel, attention_mma_f8.cu.)
template <int D>
__device__ __forceinline__ void paged_attention_mma_impl(
    bf16_t* __restrict__ out, const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int hq, int hkv, int block_size,
    float scale, const AttnOutQuant& aq, float* __restrict__ part_ml, float* __restrict__ part_acc) {
    typedef MmaDecodeGeom<D, false> G;
    constexpr int KW = G::KT / MMA_WARPS;  // keys of a tile per warp (16): one or more mma steps of 16
    constexpr int NT = D / 8;  // mma n-tiles of p·V
    extern __shared__ __align__(16) unsigned char mma_smem[];
    unsigned char* tiles = mma_smem;  // [stage][K tile | V tile]
    // After the key loop the same bytes hold the warps' accumulators.
    float (*sm_acc)[ATTN_MAX_GROUP][D] = reinterpret_cast<float (*)[ATTN_MAX_GROUP][D]>(mma_smem);
    __shared__ float sm_m[ATTN_WARPS][ATTN_MAX_GROUP], sm_l[ATTN_WARPS][ATTN_MAX_GROUP];

    if (gridDim.z == 1) pdl_trigger();
    const AttnBlock ab = attention_block(block_tables, max_blocks, token_seq, positions, hq, hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane & 3;
    const int r = lane >> 2;  // this thread's row (its second fragment row, r + 8, is always empty)
    const bool active = r < ab.group;
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2

    u32 qa[D / 16][4];
    const bf16_t* q_row = q + ((u64)ab.t * hq + ab.kvh * ab.group + r) * D;
    mma_load_q<D>(qa, q_row, q_row, active, false, quad);

    float o[NT][4];
#pragma unroll
    for (int x = 0; x < NT; ++x) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    // Every key of the split's range precedes the token; empty rows see none.
    const int lim = active ? ab.end : ab.begin;

    const int ntiles = (ab.end > ab.begin) ? (ab.end - ab.begin + G::KT - 1) / G::KT : 0;
    // STAGES - 1 tiles in flight before the first is used; one copy group per tile (empty past the end).
#pragma unroll
    for (int st = 0; st < G::STAGES - 1; ++st) {
        if (st < ntiles) mma_load_tile<D, false, G>(tiles, st, ab.begin + st * G::KT, ab.end, ab.bt, block_size, hkv, ab.kvh, k_cache, v_cache);
        cp_async_commit();
    }
    for (int it = 0; it < ntiles; ++it) {
        const int next = it + G::STAGES - 1;
        if (next < ntiles)
            mma_load_tile<D, false, G>(tiles, next % G::STAGES, ab.begin + next * G::KT, ab.end, ab.bt, block_size, hkv, ab.kvh,
                                    k_cache, v_cache);
        cp_async_commit();
        cp_async_wait<G::STAGES - 1>();  // every group but the STAGES - 1 newest: tile `it` has landed
        __syncthreads();

        const unsigned char* ks = tiles + (it % G::STAGES) * G::STAGE;
        const unsigned char* vs = ks + G::K_TILE;
        const int kw = warp * KW;  // this warp's keys of the tile, 16 per mma step
        float s[KW / 8][4];
#pragma unroll
        for (int j = 0; j < KW / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int g = 0; g < KW / 16; ++g) mma_qk16<D, false, G>(s[2 * g], s[2 * g + 1], qa, ks, kw + 16 * g, lane);
        mma_softmax_step<KW / 8, NT>(s, o, m_lo, m_hi, l_lo, l_hi, ab.begin + it * G::KT + kw + quad * 2, lim,
                                         ab.begin, qscale);
#pragma unroll
        for (int g = 0; g < KW / 16; ++g) mma_pv16<D, false, G>(o, s[2 * g], s[2 * g + 1], vs, kw + 16 * g, lane);
        __syncthreads();  // the stage is overwritten by the copy issued next iteration
    }
    cp_async_wait<0>();

    // Full row sums over the quad; then each warp's (m, l, O) into shared memory for the merge.
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
    __syncthreads();  // every warp is done with the tiles before sm_acc takes their bytes
    if (active) {
        if (quad == 0) { sm_m[warp][r] = m_lo; sm_l[warp][r] = l_lo; }
#pragma unroll
        for (int x = 0; x < NT; ++x) {
            sm_acc[warp][r][x * 8 + quad * 2] = o[x][0];
            sm_acc[warp][r][x * 8 + quad * 2 + 1] = o[x][1];
        }
    }
    attention_merge_write<D>(sm_m, sm_l, sm_acc, ab.group, ab.t, ab.kvh, hq, ab.splits, ab.split, out, part_ml, part_acc, aq);
}

// Prefill chunks: 64 rows per block, 16 per warp, every warp against all 64 keys of each tile.
template <int D, bool F8, bool SC = false, bool I8 = false>
__device__ __forceinline__ void paged_attention_mma_rows_impl(
    bf16_t* __restrict__ out, const bf16_t* __restrict__ q, const typename KvElem<F8>::T* __restrict__ k_cache,
    const typename KvElem<F8>::T* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int hq, int hkv, int block_size,
    float scale, const AttnOutQuant& aq, int t_begin, int n, int tq) {
    static_assert(F8 || !SC, "only an fp8 cache is scaled");
    static_assert(SC || !I8, "an int8 cache is always scaled");
    typedef MmaRowsGeom<D, F8, SC> G;
    constexpr int KSTEPS = D / 16;  // mma k-steps of q·k
    constexpr int NT = D / 8;       // mma n-tiles of p·V
    constexpr int SN = MMA_KT / 8;  // score n-tiles per tile (8 keys each)
    extern __shared__ __align__(16) unsigned char mma_smem[];
    unsigned char* tiles = mma_smem;

    pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = blockIdx.y, group = hq / hkv;
    const int t0 = t_begin + blockIdx.x * tq, t1 = min(n, t0 + tq);
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2
    // This thread's two rows of the block (lo and hi of its warp's 16).
    const int quad = lane & 3;
    const int r_lo = warp * 16 + (lane >> 2), r_hi = r_lo + 8;

    for (int sb = t0; sb < t1;) {
        const int se = mma_segment_end(token_seq, sb, t1);
        const int* bt = block_tables + (u64)token_seq[sb] * max_blocks;
        const int end = positions[se - 1] + 1;  // keys [0, end) serve every token of the segment

        auto row_token = [&](int r) { return t0 + r / group; };
        auto row_active = [&](int r) {
            const int t = row_token(r);
            return r < tq * group && t >= sb && t < se;
        };
        const bool a_lo = row_active(r_lo), a_hi = row_active(r_hi);
        const int lim_lo = a_lo ? positions[row_token(r_lo)] + 1 : 0;
        const int lim_hi = a_hi ? positions[row_token(r_hi)] + 1 : 0;
        // The warp's last needed key: tiles past it are loaded for the other warps only.
        int warp_lim = max(lim_lo, lim_hi);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) warp_lim = max(warp_lim, __shfl_xor_sync(0xffffffffu, warp_lim, off));

        u32 qa[KSTEPS][4];
        mma_load_q_any<D, F8>(qa, q + ((u64)row_token(r_lo) * hq + kvh * group + r_lo % group) * D,
                              q + ((u64)row_token(r_hi) * hq + kvh * group + r_hi % group) * D, a_lo, a_hi, quad);

        float o[NT][4];
#pragma unroll
        for (int x = 0; x < NT; ++x) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.f;
        float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

        const int ntiles = (end + MMA_KT - 1) / MMA_KT;
#pragma unroll
        for (int st = 0; st < G::STAGES - 1; ++st) {
            if (st < ntiles) mma_load_tile<D, F8, G, SC>(tiles, st, st * MMA_KT, end, bt, block_size, hkv, kvh, k_cache, v_cache);
            cp_async_commit();
        }
        for (int it = 0; it < ntiles; ++it) {
            const int next = it + G::STAGES - 1;
            if (next < ntiles)
                mma_load_tile<D, F8, G, SC>(tiles, next % G::STAGES, next * MMA_KT, end, bt, block_size, hkv, kvh, k_cache, v_cache);
            cp_async_commit();
            cp_async_wait<G::STAGES - 1>();
            __syncthreads();

            const int kt0 = it * MMA_KT;
            if (kt0 < warp_lim) {  // warp-uniform: some key of the tile is visible to some row of the warp
                const unsigned char* ks = tiles + (it % G::STAGES) * G::STAGE;
                const unsigned char* vs = ks + G::K_TILE;

                // S = Q K^T over the tile's 64 keys: score n-tile j holds keys 8j..8j+7.
                float s[SN][4];
#pragma unroll
                for (int j = 0; j < SN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
                for (int k16 = 0; k16 < SN / 2; ++k16) mma_qk16<D, F8, G, I8>(s[2 * k16], s[2 * k16 + 1], qa, ks, k16 * 16, lane);

                // SC: score n-tile j's column 2 quad + e is tile key 4 quad + 16 (j / 2) + 2 (j % 2) + e
                // (the header's order); times its k scale before the softmax, its probability times
                // its v scale (and MMA_VSC_BIAS) after it.
                const float* ksc = reinterpret_cast<const float*>(ks + G::SCALES);
                const float* vsc = ksc + G::KT;
                if constexpr (SC) {
#pragma unroll
                    for (int j = 0; j < SN; ++j) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float k = ksc[quad * 4 + 16 * (j >> 1) + 2 * (j & 1) + e];
                            s[j][e] *= k;
                            s[j][2 + e] *= k;
                        }
                    }
                }
                mma_softmax_step<SN, NT, F8>(s, o, m_lo, m_hi, l_lo, l_hi, kt0 + quad * (F8 ? 4 : 2), lim_lo, lim_hi, qscale);
                if constexpr (SC) {
#pragma unroll
                    for (int j = 0; j < SN; ++j) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float v = vsc[quad * 4 + 16 * (j >> 1) + 2 * (j & 1) + e] * MMA_VSC_BIAS;
                            s[j][e] *= v;
                            s[j][2 + e] *= v;
                        }
                    }
                }

                // O += P V, 16 keys per k-step.
#pragma unroll
                for (int k16 = 0; k16 < SN / 2; ++k16) mma_pv16<D, F8, G, I8>(o, s[2 * k16], s[2 * k16 + 1], vs, k16 * 16, lane);
            }
            __syncthreads();  // the stage is overwritten by the copy issued next iteration
        }
        cp_async_wait<0>();

        // Each row is whole in its warp: sum l over the quad and write the normalized rows.
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
            l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
        }
        bf16_t* o_lo = out + ((u64)row_token(r_lo) * hq + kvh * group + r_lo % group) * D;
        bf16_t* o_hi = out + ((u64)row_token(r_hi) * hq + kvh * group + r_hi % group) * D;
        // An active row saw at least its own key. SC: O carries MMA_VSC_BIAS.
        const float inv_lo = 1.f / (SC ? l_lo * MMA_VSC_BIAS : l_lo), inv_hi = 1.f / (SC ? l_hi * MMA_VSC_BIAS : l_hi);
#pragma unroll
        for (int x = 0; x < NT; ++x) {
            const int d = x * 8 + quad * 2;
            if (a_lo) *reinterpret_cast<u32*>(o_lo + d) = pack_bf16x2(o[x][0] * inv_lo, o[x][1] * inv_lo);
            if (a_hi) *reinterpret_cast<u32*>(o_hi + d) = pack_bf16x2(o[x][2] * inv_hi, o[x][3] * inv_hi);
        }
        __syncthreads();  // the next segment's first copy reuses stage 0
        sb = se;
    }
    // hkv blocks write each token's row.
    attn_out_rows_written(aq, out, hq * D, t0, t1 - t0);
}

#else
// Empty bodies for targets without mma.sync on bf16: the host never launches these.
template <int D>
__device__ void paged_attention_mma_impl(bf16_t*, const bf16_t*, const bf16_t*, const bf16_t*, const int*, int, const int*,
                                         const int*, int, int, int, float, const AttnOutQuant&, float*, float*) {}
template <int D, bool F8, bool SC = false, bool I8 = false>
__device__ void paged_attention_mma_rows_impl(bf16_t*, const bf16_t*, const typename KvElem<F8>::T*,
                                              const typename KvElem<F8>::T*, const int*, int, const int*, const int*, int,
                                              int, int, float, const AttnOutQuant&, int, int, int) {}
#endif

// Decode: attention.cu's signature and launch shape (plus dynamic shared memory).
#define ATTENTION_MMA_KERNEL(NAME, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) NAME##_d##D(                               \
        bf16_t* out, const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, const int* block_tables,   \
        int max_blocks, const int* token_seq, const int* positions, int hq, int hkv, int block_size,          \
        float scale, AttnOutQuant aq, float* part_ml, float* part_acc) {                                                       \
        paged_attention_mma_impl<D>(out, q, k_cache, v_cache, block_tables, max_blocks, token_seq, positions,  \
                                    hq, hkv, block_size, scale, aq, part_ml, part_acc);                           \
    }
ATTENTION_MMA_KERNEL(paged_attention_mma, 64)
ATTENTION_MMA_KERNEL(paged_attention_mma, 128)

// Prefill: the block's first token is t_begin + blockIdx.x * tq, tokens past n are not computed.
#define ATTENTION_MMA_ROWS_KERNEL(NAME, D, F8, KV, SC, I8)                                                    \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) NAME##_d##D(                               \
        bf16_t* out, const bf16_t* q, const KV* k_cache, const KV* v_cache, const int* block_tables,           \
        int max_blocks, const int* token_seq, const int* positions, int hq, int hkv, int block_size,          \
        float scale, AttnOutQuant aq, int t_begin, int n, int tq) {                                                            \
        paged_attention_mma_rows_impl<D, F8, SC, I8>(out, q, k_cache, v_cache, block_tables, max_blocks, token_seq,    \
                                             positions, hq, hkv, block_size, scale, aq, t_begin, n, tq);          \
    }
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows, 64, false, bf16_t, false, false)
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows, 128, false, bf16_t, false, false)

// The fp8 kernels need sm_89's e4m3 conversions.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows_f8, 64, true, fp8_t, false, false)
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows_f8, 128, true, fp8_t, false, false)
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows_f8s, 64, true, fp8_t, true, false)
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows_f8s, 128, true, fp8_t, true, false)
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows_i8s, 64, true, fp8_t, true, true)
ATTENTION_MMA_ROWS_KERNEL(paged_attention_mma_rows_i8s, 128, true, fp8_t, true, true)
#else
// Below sm_89 the fp8 entry points exist (the host loads every name) with empty bodies.
#define ATTENTION_MMA_F8_STUB(NAME) extern "C" __global__ void NAME(bf16_t*, const bf16_t*, const fp8_t*, \
    const fp8_t*, const int*, int, const int*, const int*, int, int, int, float, AttnOutQuant, int, int, int) {}
ATTENTION_MMA_F8_STUB(paged_attention_mma_rows_f8_d64)
ATTENTION_MMA_F8_STUB(paged_attention_mma_rows_f8_d128)
ATTENTION_MMA_F8_STUB(paged_attention_mma_rows_f8s_d64)
ATTENTION_MMA_F8_STUB(paged_attention_mma_rows_f8s_d128)
ATTENTION_MMA_F8_STUB(paged_attention_mma_rows_i8s_d64)
ATTENTION_MMA_F8_STUB(paged_attention_mma_rows_i8s_d128)
#endif

