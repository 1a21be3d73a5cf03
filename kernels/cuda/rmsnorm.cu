// RMSNorm fused with the residual add.
//   residual[r] += delta[r] (+ lora_d[r]) (when not null; the residual stream stays f32; lora_d is the
//                                       LoRA update of the projection that wrote delta, for tokens
//                                       whose lora_slots entry is >= 0)
//   out[i] = bf16(residual[src] * rsqrt(mean(residual[src]^2) + eps) * weight)
// src = rows ? rows[i] : i, which lets the final norm run only on the rows whose logits are wanted
// (the other rows' residuals are left as they were). grid: one block per output row.
extern "C" __global__ void add_rmsnorm(float* __restrict__ residual, const bf16_t* __restrict__ delta,
                                       const float* __restrict__ weight, bf16_t* __restrict__ out,
                                       const int* __restrict__ rows, int hidden, float eps,
                                       const bf16_t* __restrict__ lora_d, const int* __restrict__ lora_slots) {
    __shared__ float scratch[33];
    pdl_trigger();  // the GEMV after this may start streaming its weights now
    const u64 i = blockIdx.x;
    const u64 src = rows ? (u64)rows[i] : i;
    float* x = residual + src * hidden;
    float ss = 0.f;
    const bf16_t* ld = lora_delta_row(lora_d, lora_slots, src, hidden);
    if (delta || ld) {
        const bf16_t* d = delta ? delta + src * hidden : nullptr;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            float v = x[j];
            if (d) v += bf2f(d[j]);
            if (ld) v += bf2f(ld[j]);
            x[j] = v;
            ss += v * v;
        }
    } else {
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            float v = x[j];
            ss += v * v;
        }
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    bf16_t* o = out + i * hidden;
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed.
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) o[j] = f2bf(x[j] * inv * weight[j]);
}
