// SwiGLU activation: out[r, j] = silu(gate[r, j]) * up[r, j], with gate_up = [n, 2*I] from the fused
// gate/up projection (gate in the first I columns). grid-stride over n*I elements.
extern "C" __global__ void silu_mul(bf16_t* __restrict__ out, const bf16_t* __restrict__ gate_up, u64 n,
                                    int inter) {
    pdl_trigger();
    const u64 total = n * (u64)inter;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / inter, j = e % inter;
        const float g = bf2f(gate_up[r * 2 * inter + j]);
        const float u = bf2f(gate_up[r * 2 * inter + inter + j]);
        out[e] = f2bf(g / (1.f + __expf(-g)) * u);
    }
}
