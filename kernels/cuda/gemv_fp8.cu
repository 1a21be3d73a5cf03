// Row-wise FP8 (W8A8) for decode-sized steps, the GPU side of `--quantization fp8` (issue 17).
// sm_89+ (e4m3 conversions); the kernels compile everywhere and are never launched below that.
//
// quant_rows_e4m3: one block per token row: amax over the row (bf16 in), scale = amax / 448 (0 for a
//   zero row), codes = e4m3(x / scale) rounded to nearest even and saturating: exactly the CPU's
//   `rowquant::quantize_activations` on the same values (IEEE division on both sides), so codes and
//   scales are bit-identical to the CPU path's.
// gemv_e4m3_m{M}: y[m, n] = (Σ_k xq[i, k] · wq[j, k]) · xs[i] · ws[j], the token scale, then the row
//   scale, as the CPU's matmul_w8a8 epilogue. One warp per weight row, 16 codes per 16-byte load,
//   each pair converted e4m3x2 -> f16x2 (exact) -> f32; products of two e4m3 values are exact in f32;
//   the sum runs in f32 in this kernel's own order (so results match the CPU to f32 rounding, not
//   bit for bit). k % 16 == 0 and 16-byte aligned rows.
// A first, simple version for correctness and a first figure: one warp per row, no split of k
// across warps and no PDL yet (gemv.cu's bf16 kernel has both).
#define GEMV8_WARPS 8

// f16x2 -> two floats (low half first), exactly.
__device__ __forceinline__ float2 f16x2_to_float2(u32 v) {
    float lo, hi;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
    return make_float2(lo, hi);
}

// Σ of 16 products of e4m3 codes (a: 16 codes, b: 16 codes), in a fixed order.
__device__ __forceinline__ float dot16_e4m3(const uint4 a, const uint4 b) {
    const u32 av[4] = {a.x, a.y, a.z, a.w};
    const u32 bv[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 fa = f16x2_to_float2(e4m3x2_to_f16x2(av[i] >> (16 * h)));
            const float2 fb = f16x2_to_float2(e4m3x2_to_f16x2(bv[i] >> (16 * h)));
            s = fmaf(fa.x, fb.x, s);
            s = fmaf(fa.y, fb.y, s);
        }
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(256) quant_rows_e4m3(unsigned char* __restrict__ q, float* __restrict__ scales,
                                                                 const bf16_t* __restrict__ x, int k) {
    __shared__ float red[32];
    const int row = blockIdx.x;
    const bf16_t* xr = x + (u64)row * k;
    float m = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(bf2f(xr[i])));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        v = warp_max(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float amax = red[0];
    const float scale = amax > 0.f ? amax / 448.f : 0.f;
    if (threadIdx.x == 0) scales[row] = scale;
    unsigned char* qr = q + (u64)row * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) qr[i] = scale > 0.f ? f2e4m3(bf2f(xr[i]) / scale) : (unsigned char)0;
}

template <int MAXM>
__device__ __forceinline__ void gemv_e4m3_impl(void* __restrict__ y, int y_f32, const unsigned char* __restrict__ xq,
                                               const float* __restrict__ xs, const unsigned char* __restrict__ w,
                                               const float* __restrict__ ws, int m, int n, int k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * GEMV8_WARPS + warp;
    if (row >= n) return;  // whole warps leave; no block-wide barrier below
    const int chunks = k >> 4;  // 16 codes per 16-byte chunk
    const uint4* wr = reinterpret_cast<const uint4*>(w + (u64)row * k);
    float acc[MAXM];
#pragma unroll
    for (int i = 0; i < MAXM; ++i) acc[i] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        const uint4 wv = __ldcs(wr + c);  // streamed once
#pragma unroll
        for (int i = 0; i < MAXM; ++i) {
            if (i < m) acc[i] += dot16_e4m3(wv, __ldg(reinterpret_cast<const uint4*>(xq + (u64)i * k) + c));
        }
    }
#pragma unroll
    for (int i = 0; i < MAXM; ++i) {
        const float s = warp_sum(acc[i]);
        if (lane == 0 && i < m) {
            const float v = s * xs[i] * ws[row];
            if (y_f32) reinterpret_cast<float*>(y)[(u64)i * n + row] = v;
            else reinterpret_cast<bf16_t*>(y)[(u64)i * n + row] = f2bf(v);
        }
    }
}

#define GEMV_E4M3(M)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV8_WARPS * 32)                                        \
        gemv_e4m3_m##M(void* y, int y_f32, const unsigned char* xq, const float* xs, const unsigned char* w, \
                       const float* ws, int m, int n, int k) {                                            \
        gemv_e4m3_impl<M>(y, y_f32, xq, xs, w, ws, m, n, k);                                              \
    }
GEMV_E4M3(1)
GEMV_E4M3(2)
GEMV_E4M3(4)
GEMV_E4M3(8)
