// SwiGLU activation: out[r, j] = silu(gate[r, j]) * up[r, j], with gate_up = [n, 2*I] from the fused
// gate/up projection (gate in the first I columns), plus its LoRA update lora_d (same layout) where
// not null and the row's lora_slots entry is >= 0. grid-stride over n*I elements.
extern "C" __global__ void silu_mul(bf16_t* __restrict__ out, const bf16_t* __restrict__ gate_up, u64 n,
                                    int inter, const bf16_t* __restrict__ lora_d, const int* __restrict__ lora_slots) {
    pdl_trigger();
    const u64 total = n * (u64)inter;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / inter, j = e % inter;
        float g = bf2f(gate_up[r * 2 * inter + j]);
        float u = bf2f(gate_up[r * 2 * inter + inter + j]);
        if (const bf16_t* ld = lora_delta_row(lora_d, lora_slots, r, 2 * (u64)inter)) {
            g += bf2f(ld[j]);
            u += bf2f(ld[inter + j]);
        }
        out[e] = f2bf(g / (1.f + __expf(-g)) * u);
    }
}
