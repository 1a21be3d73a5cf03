// Embedding gather: the residual stream (f32) starts as the rows of the bf16 table.
// grid: one block per token.
extern "C" __global__ void embedding_gather(float* __restrict__ out, const bf16_t* __restrict__ table,
                                            const u32* __restrict__ ids, int hidden) {
    const u64 row = blockIdx.x;
    const bf16_t* src = table + (u64)ids[row] * hidden;
    float* dst = out + row * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = bf2f(src[j]);
}
