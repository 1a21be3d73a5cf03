// RoPE (rotate-half, as transformers' Llama) fused with the paged KV-cache write.
// qkv: [n, (Hq + 2*Hkv) * D] bf16, the fused q/k/v projection of each token (+ bias when not null, f32).
// cos_t/sin_t: [max_pos, D/2] f32 tables (Llama-3 frequency scaling already applied on the host).
// slots[t] = block * block_size + offset of token t's position; caches: [blocks, Hkv, block_size, D].
// Writes the rotated q to q_out [n, Hq*D] and the rotated k and plain v into the caches.
// grid: one block per token.
extern "C" __global__ void rope_kv_write(const bf16_t* __restrict__ qkv, const float* __restrict__ bias,
                                         const int* __restrict__ positions, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, const int* __restrict__ slots,
                                         bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_cache,
                                         bf16_t* __restrict__ v_cache, int hq, int hkv, int d,
                                         int block_size) {
    const u64 t = blockIdx.x;
    const int half = d >> 1;
    const int width = (hq + 2 * hkv) * d;
    const bf16_t* row = qkv + t * width;
    const int pos = positions[t];
    const float* c = cos_t + (u64)pos * half;
    const float* s = sin_t + (u64)pos * half;
    const int slot = slots[t];
    const u64 blk = (u64)(slot / block_size), off = (u64)(slot % block_size);
    // q and k heads: one thread per rotated pair.
    const int pairs = (hq + hkv) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int h = p / half, i = p % half;
        const int c0 = h * d + i, c1 = c0 + half;
        float x0 = bf2f(row[c0]), x1 = bf2f(row[c1]);
        if (bias) { x0 += bias[c0]; x1 += bias[c1]; }
        const float y0 = x0 * c[i] - x1 * s[i];
        const float y1 = x1 * c[i] + x0 * s[i];
        if (h < hq) {
            q_out[t * (u64)(hq * d) + c0] = f2bf(y0);
            q_out[t * (u64)(hq * d) + c1] = f2bf(y1);
        } else {
            const u64 base = ((blk * hkv + (h - hq)) * block_size + off) * d;
            k_cache[base + i] = f2bf(y0);
            k_cache[base + i + half] = f2bf(y1);
        }
    }
    // v heads: copied as they are.
    const int vstart = (hq + hkv) * d;
    for (int e = threadIdx.x; e < hkv * d; e += blockDim.x) {
        const int h = e / d, i = e % d;
        float x = bf2f(row[vstart + e]);
        if (bias) x += bias[vstart + e];
        v_cache[((blk * hkv + h) * block_size + off) * d + i] = f2bf(x);
    }
}
