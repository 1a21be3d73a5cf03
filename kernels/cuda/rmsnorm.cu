// RMSNorm fused with the residual add.
//   residual[r] += delta[r] (+ lora_d[r]) (when not null; the residual stream stays f32; lora_d is the
//                                       LoRA update of the projection that wrote delta, for tokens
//                                       whose lora_slots entry is >= 0)
//   out[i] = bf16(residual[src] * rsqrt(mean(residual[src]^2) + eps) * weight)
// src = rows ? rows[i] : i, which lets the final norm run only on the rows whose logits are wanted
// (the other rows' residuals are left as they were). dws not null: delta is an 8-bit GEMM's unscaled
// output, each value times dxs[src] · dws[j] (quant8.cu's scale_outer, fused); delta_i32 not null:
// the delta is that GEMM's int32 sums there instead (int8). grid: one block per output row, the row
// in registers (common.cuh's row chunks): hidden % 8 == 0.
extern "C" __global__ void __launch_bounds__(1024) add_rmsnorm(float* __restrict__ residual, const bf16_t* __restrict__ delta,
                                                              const float* __restrict__ weight, bf16_t* __restrict__ out,
                                                              const int* __restrict__ rows, int hidden, float eps,
                                                              const bf16_t* __restrict__ lora_d, const int* __restrict__ lora_slots,
                                                              const float* __restrict__ dxs, const float* __restrict__ dws,
                                                              const int* __restrict__ delta_i32) {
    __shared__ float scratch[33];
    pdl_trigger();  // the GEMV after this may start streaming its weights now
    const u64 i = blockIdx.x;
    const u64 src = rows ? (u64)rows[i] : i;
    const int chunks = hidden >> 3;
    float* x = residual + src * hidden;
    const bf16_t* d = delta ? delta + src * hidden : nullptr;
    const int* di = delta_i32 ? delta_i32 + src * hidden : nullptr;
    const bf16_t* ld = lora_delta_row(lora_d, lora_slots, src, hidden);
    const float sx = dws ? dxs[src] : 1.f;
    float v[ROW_MAXC][8];
    const float ss = residual_add_row(x, d, di, ld, sx, dws, chunks, v);
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    bf16_t* o = out + i * hidden;
#pragma unroll
    for (int r = 0; r < ROW_MAXC; ++r) {
        const int c = threadIdx.x + r * blockDim.x;
        if (c < chunks) {
            float w[8];
            ld8_f32(weight + 8 * c, w);
#pragma unroll
            for (int t = 0; t < 8; ++t) v[r][t] = v[r][t] * inv * w[t];
            st8_bf16(o + 8 * c, v[r]);
        }
    }
}
