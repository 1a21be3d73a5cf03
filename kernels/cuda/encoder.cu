// BERT-family encoder kernels over a ragged batch (every sequence's tokens concatenated, no padding),
// f32 activations throughout: the embedding sum + LayerNorm, bias + activation after a GEMM, the
// residual add + bias + LayerNorm of a post-LN block, and bidirectional attention restricted to each
// sequence (varlen: per-tile sequence offsets instead of a padded batch and a mask tensor).

#define ENC_ACT_NONE 0
#define ENC_ACT_GELU_ERF 1
#define ENC_ACT_GELU_TANH 2
#define ENC_ACT_RELU 3

// LayerNorm of one row that this block's threads have just written (thread t wrote elements t,
// t + blockDim.x, ...; it reads back only those, so no barrier is needed before the first pass).
// Two passes: the mean, then the centred variance (biased, as torch), both summed in f32 over the block.
// out_bf16 (may be null): the normalized row also as bf16, the next bf16 GEMM's input.
__device__ __forceinline__ void enc_layernorm_row(float* __restrict__ row, const float* __restrict__ gamma,
                                                  const float* __restrict__ beta, int h, float eps,
                                                  float* scratch /* >= 33 floats */, bf16_t* __restrict__ out_bf16) {
    float s = 0.f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) s += row[j];
    const float mean = block_sum(s, scratch) / (float)h;
    float v = 0.f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        const float c = row[j] - mean;
        v += c * c;
    }
    const float inv = rsqrtf(block_sum(v, scratch) / (float)h + eps);
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        const float v = (row[j] - mean) * inv * gamma[j] + beta[j];
        row[j] = v;
        if (out_bf16) out_bf16[j] = f2bf(v);
    }
}

// x[t] = LayerNorm(word[ids[t]] + position[positions[t]] + token_type[types[t]]); one block per token.
// meta holds three i32 per token: id, token type, position (the model's offset already applied).
// xb (may be null): x as bf16 too.
extern "C" __global__ void enc_embed_layernorm(float* __restrict__ x, const int* __restrict__ meta,
                                               const float* __restrict__ word, const float* __restrict__ position,
                                               const float* __restrict__ token_type,
                                               const float* __restrict__ gamma, const float* __restrict__ beta,
                                               int h, float eps, bf16_t* __restrict__ xb) {
    __shared__ float scratch[33];
    const u64 t = blockIdx.x;
    const int* m = meta + 3 * t;
    const float* w = word + (u64)m[0] * h;
    const float* tt = token_type + (u64)m[1] * h;
    const float* p = position + (u64)m[2] * h;
    float* row = x + t * h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) row[j] = w[j] + p[j] + tt[j];
    enc_layernorm_row(row, gamma, beta, h, eps, scratch, xb ? xb + t * h : nullptr);
}

// x[t] = LayerNorm(x[t] + y[t] + bias): a post-LN block's residual after its output projection
// (the projection's bias folded in here). One block per token. xb (may be null): x as bf16 too.
extern "C" __global__ void enc_add_bias_layernorm(float* __restrict__ x, const float* __restrict__ y,
                                                  const float* __restrict__ bias, const float* __restrict__ gamma,
                                                  const float* __restrict__ beta, int h, float eps,
                                                  bf16_t* __restrict__ xb) {
    __shared__ float scratch[33];
    const u64 t = blockIdx.x;
    float* row = x + t * h;
    const float* yr = y + t * h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) row[j] = row[j] + yr[j] + bias[j];
    enc_layernorm_row(row, gamma, beta, h, eps, scratch, xb ? xb + t * h : nullptr);
}

// y[r, c] = act(y[r, c] + bias[c]) over n rows of `cols`; grid-stride. With yb (not null) the
// result goes there as bf16 instead (the next bf16 GEMM's input), y is left as it was.
extern "C" __global__ void enc_bias_act(float* __restrict__ y, const float* __restrict__ bias, u64 n, int cols,
                                        int act, bf16_t* __restrict__ yb) {
    const u64 total = n * (u64)cols;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        float v = y[e] + bias[e % cols];
        if (act == ENC_ACT_GELU_ERF) {
            v = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
        } else if (act == ENC_ACT_GELU_TANH) {
            const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
            v = 0.5f * v * (1.f + tanhf(inner));
        } else if (act == ENC_ACT_RELU) {
            v = fmaxf(v, 0.f);
        }
        if (yb) yb[e] = f2bf(v);
        else y[e] = v;
    }
}

// Pooling of each sequence's hidden states, on the device so that only the pooled vectors go to the
// host: out[s, m, c] for sequence s (rows offsets[s]..offsets[s + 1] of x, at least one), mode
// modes[m] (ENC_POOL_*), column c; block (s, column block), one thread per column. Means are summed
// in f64, as the host's pooling (encoder::sentence::pool) does, so the f32 encoder gives its bits.
#define ENC_POOL_CLS 0
#define ENC_POOL_MAX 1
#define ENC_POOL_MEAN 2
#define ENC_POOL_MEAN_SQRT_LEN 3
#define ENC_POOL_LAST 4
extern "C" __global__ void enc_pool(float* __restrict__ out, const float* __restrict__ x, const int* __restrict__ offsets,
                                    const int* __restrict__ modes, int num_modes, int h) {
    const int s = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= h) return;
    const int b = offsets[s], e = offsets[s + 1];
    const int n = e - b;
    for (int m = 0; m < num_modes; ++m) {
        const int mode = modes[m];
        float r;
        if (mode == ENC_POOL_CLS) {
            r = x[(u64)b * h + c];
        } else if (mode == ENC_POOL_LAST) {
            r = x[(u64)(e - 1) * h + c];
        } else if (mode == ENC_POOL_MAX) {
            r = x[(u64)b * h + c];
            for (int t = b + 1; t < e; ++t) r = fmaxf(r, x[(u64)t * h + c]);
        } else {
            double sum = 0.0;
            for (int t = b; t < e; ++t) sum += (double)x[(u64)t * h + c];
            r = (float)(sum / (mode == ENC_POOL_MEAN ? (double)n : sqrt((double)n)));
        }
        out[((u64)s * num_modes + m) * h + c] = r;
    }
}

// Varlen bidirectional attention. qkv: [n, 3h] rows (q | k | v, head-major inside each), ctx: [n, h].
// Block (tile, head): tiles[3 * tile] = the sequence's first token, its length, the tile's first query
// (a tile is ENC_ATTN_QT queries of one sequence). Each of the 4 warps owns 4 queries of the tile; keys
// and values stream through shared memory in chunks of 32, lane j scoring key j, with an online
// softmax (running max and sum) in f32 and exact expf. Each query reads only its own sequence's keys,
// so a sequence's result does not depend on the rest of the batch. Needs head_dim <= 128.
#define ENC_ATTN_QT 16
#define ENC_ATTN_KC 32
#define ENC_ATTN_DMAX 128
#define ENC_ATTN_WARPS 4
extern "C" __global__ void __launch_bounds__(ENC_ATTN_WARPS * 32)
enc_attention(float* __restrict__ ctx, const float* __restrict__ qkv, const int* __restrict__ tiles, int h, int d,
              float scale) {
    __shared__ float qs[ENC_ATTN_QT][ENC_ATTN_DMAX];
    __shared__ float ks[ENC_ATTN_KC][ENC_ATTN_DMAX + 1];  // +1: lane j reads row j without bank conflicts
    __shared__ float vs[ENC_ATTN_KC][ENC_ATTN_DMAX];
    const int start = tiles[3 * blockIdx.x], len = tiles[3 * blockIdx.x + 1], q0 = tiles[3 * blockIdx.x + 2];
    const int head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nq = min(ENC_ATTN_QT, len - q0);
    const u64 stride = 3 * (u64)h;
    const float* base = qkv + (u64)start * stride + (u64)head * d;

    for (int i = threadIdx.x; i < ENC_ATTN_QT * d; i += blockDim.x) {
        const int qi = i / d, e = i % d;
        qs[qi][e] = qi < nq ? base[(u64)(q0 + qi) * stride + e] : 0.f;
    }
    const int per_warp = ENC_ATTN_QT / ENC_ATTN_WARPS;
    float m[ENC_ATTN_QT / ENC_ATTN_WARPS], l[ENC_ATTN_QT / ENC_ATTN_WARPS];
    float acc[ENC_ATTN_QT / ENC_ATTN_WARPS][ENC_ATTN_DMAX / 32];
#pragma unroll
    for (int a = 0; a < per_warp; a++) {
        m[a] = NEG_INF;
        l[a] = 0.f;
#pragma unroll
        for (int r = 0; r < ENC_ATTN_DMAX / 32; r++) acc[a][r] = 0.f;
    }
    for (int c0 = 0; c0 < len; c0 += ENC_ATTN_KC) {
        const int nk = min(ENC_ATTN_KC, len - c0);
        __syncthreads();  // the previous chunk is consumed (and, the first time, qs is written)
        for (int i = threadIdx.x; i < ENC_ATTN_KC * d; i += blockDim.x) {
            const int j = i / d, e = i % d;
            const bool in = j < nk;
            const float* row = base + (u64)(c0 + j) * stride;
            ks[j][e] = in ? row[h + e] : 0.f;
            vs[j][e] = in ? row[2 * h + e] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < per_warp; a++) {
            const int qi = warp + ENC_ATTN_WARPS * a;
            if (qi >= nq) continue;  // uniform across the warp
            float s = NEG_INF;
            if (lane < nk) {
                float dot = 0.f;
                for (int e = 0; e < d; e++) dot += qs[qi][e] * ks[lane][e];
                s = dot * scale;
            }
            const float new_m = fmaxf(m[a], warp_max(s));  // finite: nk >= 1
            const float corr = expf(m[a] - new_m);         // 0 on the first chunk (m = -inf)
            const float p = lane < nk ? expf(s - new_m) : 0.f;
            l[a] = l[a] * corr + warp_sum(p);
            m[a] = new_m;
#pragma unroll
            for (int r = 0; r < ENC_ATTN_DMAX / 32; r++) acc[a][r] *= corr;
            for (int j = 0; j < nk; j++) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int r = 0; r < ENC_ATTN_DMAX / 32; r++) {
                    const int e = lane + 32 * r;
                    if (e < d) acc[a][r] += pj * vs[j][e];
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < per_warp; a++) {
        const int qi = warp + ENC_ATTN_WARPS * a;
        if (qi >= nq) continue;
        const float inv = 1.f / l[a];
        float* out = ctx + (u64)(start + q0 + qi) * h + (u64)head * d;
#pragma unroll
        for (int r = 0; r < ENC_ATTN_DMAX / 32; r++) {
            const int e = lane + 32 * r;
            if (e < d) out[e] = acc[a][r] * inv;
        }
    }
}

// Varlen bidirectional attention on the tensor cores (the bf16-GEMM encoder's): the same contract as
// enc_attention (qkv [n, 3h] f32 rows, ctx [n, h] f32, tiles of one sequence's queries), with tiles of
// 16 queries per warp as the rows of mma.sync m16n8k16 (bf16 in, f32 accumulate), W warps a block:
// W = 4 (64 queries; the warps share each K/V tile) for long sequences, W = 1 for short ones, whose
// 64-query tiles would be mostly empty rows. Keys and values of 64 keys at a time are read as f32, rounded to bf16 into shared memory (rows
// padded as attention_mma.cu's, so ldmatrix hits distinct banks; keys past the sequence are zeros, so
// p = 0 never meets a NaN), and go through attention_mma.cu's steps: S = Q Kᵀ, the online softmax in
// f32 (base 2), O += P V with P rounded to bf16. Q, K, V and P in bf16 are the error of this kernel
// (about 3 significant digits, as torch's fp16/bf16 SDPA); the f32 encoder keeps enc_attention.
// Each query reads only its own sequence's keys, so a sequence's result does not depend on the batch.
// With ctx_bf16 (not null) the output goes there as bf16 instead (the output projection's input).
#define ENC_MMA_KT 64
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
template <int D>
struct EncMmaGeom {
    static constexpr int K_ROW = (D + MMA_PAD) * 2;  // bytes per shared-memory row of K and of V
    static constexpr int V_ROW = K_ROW;
};

template <int D>
__device__ __forceinline__ void enc_attention_mma_impl(float* __restrict__ ctx, const float* __restrict__ qkv,
                                                       const int* __restrict__ tiles, int h, float scale,
                                                       bf16_t* __restrict__ ctx_bf16) {
    // blockDim.x = 32 W; the tile's first query is q0, warp w takes queries q0 + 16 w ..
    typedef EncMmaGeom<D> G;
    constexpr int KSTEPS = D / 16, NT = D / 8, SN = ENC_MMA_KT / 8;
    __shared__ __align__(16) unsigned char ks[ENC_MMA_KT * G::K_ROW];
    __shared__ __align__(16) unsigned char vs[ENC_MMA_KT * G::V_ROW];
    const int start = tiles[3 * blockIdx.x], len = tiles[3 * blockIdx.x + 1], q0 = tiles[3 * blockIdx.x + 2];
    const int head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane & 3;
    const u64 stride = 3 * (u64)h;
    const float* base = qkv + (u64)start * stride + (u64)head * D;
    // This thread's two query rows (positions in the sequence) of its warp's 16.
    const int r_lo = q0 + warp * 16 + (lane >> 2), r_hi = r_lo + 8;
    const bool a_lo = r_lo < len, a_hi = r_hi < len;
    const bool warp_active = q0 + warp * 16 < len;  // uniform: some row of the warp is a query
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2

    u32 qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        const int c = kk * 16 + quad * 2;
        const float2 z = make_float2(0.f, 0.f);
        const float* lo = base + (u64)r_lo * stride + c;
        const float* hi = base + (u64)r_hi * stride + c;
        const float2 l0 = a_lo ? *reinterpret_cast<const float2*>(lo) : z, l8 = a_lo ? *reinterpret_cast<const float2*>(lo + 8) : z;
        const float2 h0 = a_hi ? *reinterpret_cast<const float2*>(hi) : z, h8 = a_hi ? *reinterpret_cast<const float2*>(hi + 8) : z;
        qa[kk][0] = pack_bf16x2(l0.x, l0.y);
        qa[kk][1] = pack_bf16x2(h0.x, h0.y);
        qa[kk][2] = pack_bf16x2(l8.x, l8.y);
        qa[kk][3] = pack_bf16x2(h8.x, h8.y);
    }
    float o[NT][4];
#pragma unroll
    for (int x = 0; x < NT; ++x) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    const int lim_lo = a_lo ? len : 0, lim_hi = a_hi ? len : 0;

    for (int kt0 = 0; kt0 < len; kt0 += ENC_MMA_KT) {
        // Keys of this tile in groups of 16 (the mma's k): groups wholly past the sequence are
        // neither loaded nor multiplied (a 16-token sequence uses one group of four).
        const int groups = min(ENC_MMA_KT, len - kt0 + 15) / 16;
        __syncthreads();  // every warp is done with the previous tile
        for (int i = threadIdx.x; i < groups * 16 * (D / 4); i += blockDim.x) {
            const int r = i / (D / 4), c = (i % (D / 4)) * 4;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
            if (kt0 + r < len) {
                const float* row = base + (u64)(kt0 + r) * stride + c;
                kv = *reinterpret_cast<const float4*>(row + h);
                vv = *reinterpret_cast<const float4*>(row + 2 * h);
            }
            *reinterpret_cast<uint2*>(ks + r * G::K_ROW + c * 2) = make_uint2(pack_bf16x2(kv.x, kv.y), pack_bf16x2(kv.z, kv.w));
            *reinterpret_cast<uint2*>(vs + r * G::V_ROW + c * 2) = make_uint2(pack_bf16x2(vv.x, vv.y), pack_bf16x2(vv.z, vv.w));
        }
        __syncthreads();
        if (warp_active) {
            float s[SN][4];
#pragma unroll
            for (int j = 0; j < SN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int k16 = 0; k16 < SN / 2; ++k16)
                if (k16 < groups) mma_qk16<D, false, G>(s[2 * k16], s[2 * k16 + 1], qa, ks, k16 * 16, lane);
            // Scores of skipped groups stay 0 and are masked (key >= len) like any key past the end.
            mma_softmax_step<SN, NT, false>(s, o, m_lo, m_hi, l_lo, l_hi, kt0 + quad * 2, lim_lo, lim_hi, qscale);
#pragma unroll
            for (int k16 = 0; k16 < SN / 2; ++k16)
                if (k16 < groups) mma_pv16<D, false, G>(o, s[2 * k16], s[2 * k16 + 1], vs, k16 * 16, lane);
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
    const float inv_lo = a_lo ? 1.f / l_lo : 0.f, inv_hi = a_hi ? 1.f / l_hi : 0.f;  // an active row saw its own key
    const u64 off_lo = (u64)(start + r_lo) * h + (u64)head * D, off_hi = (u64)(start + r_hi) * h + (u64)head * D;
#pragma unroll
    for (int x = 0; x < NT; ++x) {
        const int d = x * 8 + quad * 2;
        if (ctx_bf16) {  // the output projection's bf16 input, straight
            if (a_lo) *reinterpret_cast<u32*>(ctx_bf16 + off_lo + d) = pack_bf16x2(o[x][0] * inv_lo, o[x][1] * inv_lo);
            if (a_hi) *reinterpret_cast<u32*>(ctx_bf16 + off_hi + d) = pack_bf16x2(o[x][2] * inv_hi, o[x][3] * inv_hi);
        } else {
            if (a_lo) *reinterpret_cast<float2*>(ctx + off_lo + d) = make_float2(o[x][0] * inv_lo, o[x][1] * inv_lo);
            if (a_hi) *reinterpret_cast<float2*>(ctx + off_hi + d) = make_float2(o[x][2] * inv_hi, o[x][3] * inv_hi);
        }
    }
}
#else
template <int D>
__device__ void enc_attention_mma_impl(float*, const float*, const int*, int, float, bf16_t*) {}
#endif

#define ENC_ATTENTION_MMA_KERNEL(W, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * W) enc_attention_mma_w##W##_d##D(                     \
        float* ctx, const float* qkv, const int* tiles, int h, float scale, bf16_t* ctx_bf16) {              \
        enc_attention_mma_impl<D>(ctx, qkv, tiles, h, scale, ctx_bf16);                                      \
    }
ENC_ATTENTION_MMA_KERNEL(1, 32)
ENC_ATTENTION_MMA_KERNEL(1, 64)
ENC_ATTENTION_MMA_KERNEL(1, 128)
ENC_ATTENTION_MMA_KERNEL(4, 32)
ENC_ATTENTION_MMA_KERNEL(4, 64)
ENC_ATTENTION_MMA_KERNEL(4, 128)
