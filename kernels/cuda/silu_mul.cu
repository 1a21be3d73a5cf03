// SwiGLU activation: out[r, j] = silu(gate[r, j]) * up[r, j], with gate_up = [n, 2*I] from the fused
// gate/up projection (gate in the first I columns), plus its LoRA update lora_d (same layout) where
// not null and the row's lora_slots entry is >= 0. Rows whose skip_slots entry is >= 0 (where not
// null) are left alone: lora_expand_swiglu writes them with their LoRA update. Grid-stride over
// chunks of 8 values (I % 8 == 0, n * I / 8 < 2^32): 16-byte loads and stores, 32-bit index maths.
extern "C" __global__ void silu_mul(bf16_t* __restrict__ out, const bf16_t* __restrict__ gate_up, u64 n,
                                    int inter, const bf16_t* __restrict__ lora_d, const int* __restrict__ lora_slots,
                                    const int* __restrict__ skip_slots) {
    pdl_trigger();
    const u32 per_row = (u32)inter >> 3;
    const u32 total = (u32)n * per_row;
    for (u32 e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const u32 r = e / per_row, c = e - r * per_row;
        if (skip_slots && skip_slots[r] >= 0) continue;
        const bf16_t* g = gate_up + (u64)r * 2 * inter + 8 * c;
        float gv[8], uv[8];
        ld8_bf16(g, gv);
        ld8_bf16(g + inter, uv);
        if (const bf16_t* ld = lora_delta_row(lora_d, lora_slots, r, 2 * (u64)inter)) {
            add8_bf16(ld + 8 * c, gv);
            add8_bf16(ld + inter + 8 * c, uv);
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) gv[t] = gv[t] / (1.f + __expf(-gv[t])) * uv[t];
        st8_bf16(out + (u64)r * inter + 8 * c, gv);
    }
}
