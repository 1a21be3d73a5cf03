// Block-wide argmax: every thread brings its own (value, index) candidate; every thread gets the
// block's largest value and its lowest index (NaN never wins; index 0x7fffffff when nothing was
// seen). blockDim.x a multiple of 32, at most 1024.
__device__ __forceinline__ void block_argmax(float& best, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) { sv[0] = best; si[0] = bi; }
    }
    __syncthreads();
    best = sv[0];
    bi = si[0];
    __syncthreads();  // sv/si may be reused by the next call
}

// Greedy sampling: the index of each row's largest logit (the lowest index on ties, NaN never wins).
// grid: one block per row; blockDim.x a multiple of 32 (at most 1024).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, u32* __restrict__ out) {
    const float* row = logits + (u64)blockIdx.x * vocab;
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float v = row[j];
        if (v > best) { best = v; bi = j; }  // strided visit in increasing j keeps the lowest index
    }
    block_argmax(best, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = (bi == 0x7fffffff) ? 0u : (u32)bi;
}
