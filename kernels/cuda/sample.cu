// Sampling on the GPU: temperature, top-k, top-p and min-p over one f32 logits row per block, so only
// the chosen token ids cross to the host.
//
// Each row's candidates are the tokens whose weight w = exp((logit - max) / T) reaches a threshold:
// top-k, top-p and min-p each keep "every token at least this probable", so their intersection is
// the largest of their thresholds. Thresholds are found by radix selection on the bits of w (a
// positive float's bits order like its value): four passes of 8-bit digits, each a histogram of
// counts (top-k) or of probability mass (top-p) over the candidates that share the digits so far.
// Like the CPU sampler, top-p applies to what top-k kept and min-p compares with the most probable
// token (w = 1). Ties at a threshold are all kept (as HF/vLLM do for top-k).
//
// The draw: the host passes u in [0, 1) from the request's own seeded RNG (one draw per token, as on
// the CPU), and the kernel returns the first token, in id order, at which the running sum of the
// candidates' weights exceeds u times their total (inverse CDF). Each thread sums a contiguous run of
// ids and the runs are combined by a fixed-order scan, so the result depends only on the row and u.
//
// params: SAMPLE_PARAMS floats per row: temperature (< 1e-5: greedy), top_k (0: off), top_p (1: off),
// min_p (0: off), u. grid: one block per row; blockDim.x == SAMPLE_THREADS.

#define SAMPLE_THREADS 1024
#define SAMPLE_PARAMS 5
#define SAMPLE_GREEDY_T 1e-5f

__device__ __forceinline__ float sample_weight(float logit, float mx, float inv_t) {
    // -inf logits (and NaNs) give 0 or NaN: neither passes a `w > 0` test.
    return expf((logit - mx) * inv_t);
}

// Largest key K such that the sum over candidates with key >= K (and key >= floor_key) of 1
// (count_mode) or of w reaches `target`. Every thread returns the same K.
__device__ u32 sample_radix_threshold(const float* __restrict__ row, int vocab, float mx, float inv_t,
                                      u32 floor_key, bool count_mode, float target, float* hist,
                                      float* s_target, int* s_bucket) {
    u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.f;
        __syncthreads();
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float w = sample_weight(row[j], mx, inv_t);
            const u32 key = __float_as_uint(w);
            if (w > 0.f && key >= floor_key && (key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 255u], count_mode ? 1.f : w);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // From the most probable digit down: the digit at which the running sum reaches target.
            float cum = 0.f;
            int b = 255;
            for (; b > 0; --b) {
                if (cum + hist[b] >= target) break;
                cum += hist[b];
            }
            *s_target = target - cum;
            *s_bucket = b;
        }
        __syncthreads();
        target = *s_target;
        prefix |= ((u32)*s_bucket) << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// Exclusive prefix sum over the block in thread order (fixed order: deterministic). Every thread gets
// its exclusive prefix; `*total` gets the sum of all.
__device__ float sample_block_exclusive_scan(float v, float* warp_sums, float* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        float ws = lane < nwarps ? warp_sums[lane] : 0.f;
        float wincl = ws;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(0xffffffffu, wincl, o);
            if (lane >= o) wincl += n;
        }
        if (lane < nwarps) warp_sums[lane] = wincl - ws;  // exclusive prefix of each warp
        if (lane == 31) *total = wincl;
    }
    __syncthreads();
    const float r = warp_sums[warp] + incl - v;
    __syncthreads();
    return r;
}

extern "C" __global__ void sample_rows(const float* __restrict__ logits, int vocab,
                                       const float* __restrict__ params, u32* __restrict__ out) {
    __shared__ float hist[256];
    __shared__ float scratch[33];
    __shared__ float s_target, s_total;
    __shared__ int s_bucket, s_choice;
    const float* row = logits + (u64)blockIdx.x * vocab;
    const float* p = params + (u64)blockIdx.x * SAMPLE_PARAMS;
    const float temperature = p[0], top_p = p[2], min_p = p[3], u = p[4];
    const int top_k = (int)p[1];

    // Pass 1: the largest logit and its lowest index (the greedy choice, and the fallback draw).
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float v = row[j];
        if (v > best) { best = v; bi = j; }
    }
    block_argmax(best, bi);
    const float mx = best;
    const int argmax = bi == 0x7fffffff ? 0 : bi;
    if (temperature < SAMPLE_GREEDY_T || !(mx > NEG_INF)) {
        if (threadIdx.x == 0) out[blockIdx.x] = (u32)argmax;
        return;
    }
    const float inv_t = 1.f / temperature;

    // Thresholds (as float bits of w; 0 keeps every token with w > 0).
    u32 thr = 0;
    if (top_k > 0 && top_k < vocab) {
        thr = sample_radix_threshold(row, vocab, mx, inv_t, 0u, true, (float)top_k, hist, &s_target, &s_bucket);
    }
    if (top_p < 1.f) {
        float kept = 0.f;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float w = sample_weight(row[j], mx, inv_t);
            if (w > 0.f && __float_as_uint(w) >= thr) kept += w;
        }
        kept = block_sum(kept, scratch);
        const u32 tp = sample_radix_threshold(row, vocab, mx, inv_t, thr, false, top_p * kept, hist, &s_target, &s_bucket);
        thr = max(thr, tp);
    }
    if (min_p > 0.f) thr = max(thr, __float_as_uint(min_p));  // the top token has w = 1

    // The draw: each thread owns a contiguous run of ids.
    const int run = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = min(vocab, (int)threadIdx.x * run), hi = min(vocab, lo + run);
    float mine = 0.f;
    for (int j = lo; j < hi; ++j) {
        const float w = sample_weight(row[j], mx, inv_t);
        if (w > 0.f && __float_as_uint(w) >= thr) mine += w;
    }
    if (threadIdx.x == 0) s_choice = 0x7fffffff;
    const float before = sample_block_exclusive_scan(mine, scratch, &s_total);
    const float target = u * s_total;
    if (mine > 0.f && before <= target && target < before + mine) {
        float cum = before;
        int pick = -1, last = -1;
        for (int j = lo; j < hi; ++j) {
            const float w = sample_weight(row[j], mx, inv_t);
            if (w > 0.f && __float_as_uint(w) >= thr) {
                last = j;
                cum += w;
                if (cum > target) { pick = j; break; }
            }
        }
        // Rounding may leave the target just past this run's sum: its last candidate then. Two runs
        // may both claim the target under rounding: the lower id wins, so the result is fixed.
        atomicMin(&s_choice, pick >= 0 ? pick : last);
    }
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = (u32)(s_choice != 0x7fffffff ? s_choice : argmax);
}
