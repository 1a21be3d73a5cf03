// Multi-LoRA on the GPU: after a base projection y = x · Wᵀ, each token adds its own adapter's update
// y += scale · (x · Aᵀ) · Bᵀ, read from slot stacks (every slot padded to the same rank r_max with
// zeros, so a smaller rank or an untargeted module contributes exactly 0).
//
// One slot index per token (-1: base model), so a batch may mix adapters in any order; each token's
// update is computed on its own in a fixed order, whatever else is in the batch (batch invariance).
// Correct first: the shrink reads A once per token; grouping tokens by adapter (SGMV) is the speed-up
// left for later.

// t[i, r] = x[i, :] · A[slot_i][r, :] for tokens with a slot. A stack: [slots, r_max, k] bf16;
// x rows `x_stride` apart; t: [n, r_max] f32.
// grid: (n, ceil(r_max / 8)); block: 256 threads, one warp per rank row.
extern "C" __global__ void lora_shrink(float* __restrict__ t, const bf16_t* __restrict__ x, int x_stride,
                                       const bf16_t* __restrict__ a_stack, const int* __restrict__ slots,
                                       int k, int r_max) {
    const int i = blockIdx.x;
    const int slot = slots[i];
    const int r = blockIdx.y * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (slot < 0 || r >= r_max) return;
    const bf16_t* xr = x + (u64)i * x_stride;
    const bf16_t* ar = a_stack + ((u64)slot * r_max + r) * k;
    float acc = 0.f;
    for (int j = lane; j < k; j += 32) acc += bf2f(xr[j]) * bf2f(ar[j]);
    acc = warp_sum(acc);
    if (lane == 0) t[(u64)i * r_max + r] = acc;
}

// y[i, o] += scale[slot_i] · t[i, :] · B[slot_i][o, :] for tokens with a slot, rounded back to bf16.
// B stack: [slots, out, r_max] bf16; y rows `y_stride` apart (y may point into a fused output, e.g.
// the k columns of [q | k | v]). grid-stride over n * out.
extern "C" __global__ void lora_expand(bf16_t* __restrict__ y, int y_stride, const float* __restrict__ t,
                                       const bf16_t* __restrict__ b_stack, const float* __restrict__ scales,
                                       const int* __restrict__ slots, u64 n, int out, int r_max) {
    const u64 total = n * (u64)out;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e / out;
        const int o = (int)(e % out);
        const int slot = slots[i];
        if (slot < 0) continue;
        const bf16_t* br = b_stack + ((u64)slot * out + o) * r_max;
        const float* tr = t + i * r_max;
        float acc = 0.f;
        for (int r = 0; r < r_max; ++r) acc += tr[r] * bf2f(br[r]);
        bf16_t* yp = y + i * (u64)y_stride + o;
        *yp = f2bf(bf2f(*yp) + scales[slot] * acc);
    }
}
