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
__device__ __forceinline__ void enc_layernorm_row(float* __restrict__ row, const float* __restrict__ gamma,
                                                  const float* __restrict__ beta, int h, float eps,
                                                  float* scratch /* >= 33 floats */) {
    float s = 0.f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) s += row[j];
    const float mean = block_sum(s, scratch) / (float)h;
    float v = 0.f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        const float c = row[j] - mean;
        v += c * c;
    }
    const float inv = rsqrtf(block_sum(v, scratch) / (float)h + eps);
    for (int j = threadIdx.x; j < h; j += blockDim.x) row[j] = (row[j] - mean) * inv * gamma[j] + beta[j];
}

// x[t] = LayerNorm(word[ids[t]] + position[positions[t]] + token_type[types[t]]); one block per token.
// meta holds three i32 per token: id, token type, position (the model's offset already applied).
extern "C" __global__ void enc_embed_layernorm(float* __restrict__ x, const int* __restrict__ meta,
                                               const float* __restrict__ word, const float* __restrict__ position,
                                               const float* __restrict__ token_type,
                                               const float* __restrict__ gamma, const float* __restrict__ beta,
                                               int h, float eps) {
    __shared__ float scratch[33];
    const u64 t = blockIdx.x;
    const int* m = meta + 3 * t;
    const float* w = word + (u64)m[0] * h;
    const float* tt = token_type + (u64)m[1] * h;
    const float* p = position + (u64)m[2] * h;
    float* row = x + t * h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) row[j] = w[j] + p[j] + tt[j];
    enc_layernorm_row(row, gamma, beta, h, eps, scratch);
}

// x[t] = LayerNorm(x[t] + y[t] + bias): a post-LN block's residual after its output projection
// (the projection's bias folded in here). One block per token.
extern "C" __global__ void enc_add_bias_layernorm(float* __restrict__ x, const float* __restrict__ y,
                                                  const float* __restrict__ bias, const float* __restrict__ gamma,
                                                  const float* __restrict__ beta, int h, float eps) {
    __shared__ float scratch[33];
    const u64 t = blockIdx.x;
    float* row = x + t * h;
    const float* yr = y + t * h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) row[j] = row[j] + yr[j] + bias[j];
    enc_layernorm_row(row, gamma, beta, h, eps, scratch);
}

// y[r, c] = act(y[r, c] + bias[c]) over n rows of `cols`; grid-stride.
extern "C" __global__ void enc_bias_act(float* __restrict__ y, const float* __restrict__ bias, u64 n, int cols,
                                        int act) {
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
        y[e] = v;
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
