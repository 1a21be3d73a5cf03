// Row-wise 8-bit W8A8 for decode-sized steps, the GPU side of `--quantization fp8|int8` (issue 17).
// e4m3 needs sm_89+ (conversions); the kernels compile everywhere and are never launched below that.
//
// (The per-token quantizers, quant_rows_{e4m3,i8}, are in quant8.cu: codes and scales bit-identical
//   to the CPU's `rowquant::quantize_activations`, IEEE division on both sides.)
// gemv_e4m3_m{M}, gemv_i8_m{M}: y[m, n] = (Σ_k xq[i, k] · wq[j, k]) · xs[i] · ws[j], the token scale,
//   then the row scale, as the CPU's matmul_w8a8 epilogue. e4m3: each code pair converted e4m3x2 ->
//   f16x2 (exact) -> f32, products of two e4m3 values are exact in f32, sums in f32 in this kernel's
//   own order (so results match the CPU to f32 rounding, not bit for bit). int8: dp4a, exact s32
//   sums. k % 16 == 0 and 16-byte aligned rows; m <= 16.
#define GEMV8_WARPS 8
#define GEMV8_UNROLL 8

// f16x2 -> two floats (low half first), exactly.
__device__ __forceinline__ float2 f16x2_to_float2(u32 v) {
    float lo, hi;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
    return make_float2(lo, hi);
}

// Σ of 16 products of int8 codes, exact (4 dp4a).
__device__ __forceinline__ int dot16_i8(const uint4 a, const uint4 b) {
    int s = __dp4a((int)a.x, (int)b.x, 0);
    s = __dp4a((int)a.y, (int)b.y, s);
    s = __dp4a((int)a.z, (int)b.z, s);
    return __dp4a((int)a.w, (int)b.w, s);
}

// 16 e4m3 codes as f32 values (exact), low byte first.
struct E4m3x16 {
    float v[16];
};
__device__ __forceinline__ E4m3x16 decode16_e4m3(const uint4 a) {
    const u32 av[4] = {a.x, a.y, a.z, a.w};
    E4m3x16 r;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 h2[2];
        e4m3x4_to_f16x2x2(av[i], h2[0], h2[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 f = f16x2_to_float2(h2[h]);
            r.v[4 * i + 2 * h] = f.x;
            r.v[4 * i + 2 * h + 1] = f.y;
        }
    }
    return r;
}

// Σ of the 16 products of a decoded weight chunk and 16 activation codes, in a fixed order (the
// weight chunk is decoded once and shared by the m tokens).
__device__ __forceinline__ float dot16_e4m3_decoded(const E4m3x16& w, const uint4 b) {
    const u32 bv[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 h2[2];
        e4m3x4_to_f16x2x2(bv[i], h2[0], h2[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 fb = f16x2_to_float2(h2[h]);
            s = fmaf(w.v[4 * i + 2 * h], fb.x, s);
            s = fmaf(w.v[4 * i + 2 * h + 1], fb.y, s);
        }
    }
    return s;
}

// The accumulator of a format: f32 for e4m3 products (exact in f32), s32 for int8 (exact sums).
// `W` is a weight chunk as the dot product wants it: decoded once per chunk for e4m3 (the conversions,
// not the loads, bound the e4m3 GEMV at m = 8..16 when each token re-decoded the weights), the raw
// codes for int8 (dp4a reads them as they are).
template <int FMT>
struct Gemv8Acc {
    typedef float T;
    typedef E4m3x16 W;
    static __device__ __forceinline__ W prepare(const uint4 a) { return decode16_e4m3(a); }
    static __device__ __forceinline__ float dot(const W& a, const uint4 b) { return dot16_e4m3_decoded(a, b); }
    static __device__ __forceinline__ float warp_total(float v) { return warp_sum(v); }
    static __device__ __forceinline__ float to_bits(float v) { return v; }
    static __device__ __forceinline__ float from_bits(float v) { return v; }
};
template <>
struct Gemv8Acc<Q8_I8> {
    typedef int T;
    typedef uint4 W;
    static __device__ __forceinline__ W prepare(const uint4 a) { return a; }
    static __device__ __forceinline__ int dot(const W& a, const uint4 b) { return dot16_i8(a, b); }
    static __device__ __forceinline__ int warp_total(int v) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
    static __device__ __forceinline__ float to_bits(int v) { return __int_as_float(v); }
    static __device__ __forceinline__ int from_bits(float v) { return __float_as_int(v); }
};

// As gemv.cu's bf16 GEMV: `wpr` warps share a tile of ROWS weight rows, each warp a contiguous share of
// k, GEMV8_UNROLL 16-byte weight loads in flight per lane (GEMV8_UNROLL / ROWS per row; the first ones
// issued before pdl_wait(): the weights do not depend on the kernel before), activation codes through
// the read-only cache; the warps of a tile add their partial sums in a fixed order. Epilogue:
// (Σ) · xs[i] · ws[row]. ROWS > 1 (the m = 8 and 16 variants): each activation load (and, for e4m3,
// its decode) serves ROWS weight rows; with one row per warp the m activation rows were re-read from
// L1 for every weight row (n·m·k bytes per call against n·k of weights), which made m = 8..16 slower
// than the bf16 GEMV. Each output is still one row's chunks in the same order: results do not depend
// on ROWS.
template <int FMT, int MAXM, int ROWS>
__device__ __forceinline__ void gemv8_impl(void* __restrict__ y, int y_f32, const unsigned char* __restrict__ xq,
                                           const float* __restrict__ xs, const unsigned char* __restrict__ w,
                                           const float* __restrict__ ws, int m, int n, int k, int wpr) {
    typedef Gemv8Acc<FMT> A;
    typedef typename A::T T;
    constexpr int UNROLL = GEMV8_UNROLL / ROWS;
    __shared__ float partial[GEMV8_WARPS][ROWS][MAXM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles_per_block = GEMV8_WARPS / wpr;
    const int row0 = (blockIdx.x * tiles_per_block + warp / wpr) * ROWS;
    const int part = warp % wpr;
    const int chunks = k >> 4;  // 16 codes per 16-byte chunk
    const int per = (chunks + wpr - 1) / wpr;
    const int cbeg = part * per, cend = min(chunks, cbeg + per);
    T acc[ROWS][MAXM];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int i = 0; i < MAXM; ++i) acc[r][i] = 0;
    const bool live = row0 < n;
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = reinterpret_cast<const uint4*>(w + (u64)min(row0 + r, n - 1) * k);
    uint4 wv[ROWS][UNROLL];
    int c = cbeg + lane;
    pdl_trigger();
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int cu = c + 32 * u;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[r][u] = (live && cu < cend) ? __ldcs(wr[r] + cu) : make_uint4(0u, 0u, 0u, 0u);  // streamed once
    }
    pdl_wait();
    if (live) {
        for (; c < cend; c += 32 * UNROLL) {
            if (c != cbeg + lane) {
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int cu = c + 32 * u;
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) wv[r][u] = cu < cend ? __ldcs(wr[r] + cu) : make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int cu = c + 32 * u;
                if (cu < cend) {
                    typename A::W wd[ROWS];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) wd[r] = A::prepare(wv[r][u]);
#pragma unroll
                    for (int i = 0; i < MAXM; ++i) {
                        if (i < m) {
                            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xq + (u64)i * k) + cu);
#pragma unroll
                            for (int r = 0; r < ROWS; ++r) acc[r][i] += A::dot(wd[r], xv);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int i = 0; i < MAXM; ++i) {
            const T s = A::warp_total(acc[r][i]);
            if (lane == 0) partial[warp][r][i] = A::to_bits(s);
        }
    __syncthreads();
    if (part == 0 && lane < m) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int row = row0 + r;
            if (row < n) {
                T s = 0;
                for (int p = 0; p < wpr; ++p) s += A::from_bits(partial[warp + p][r][lane]);
                const float v = (float)s * xs[lane] * ws[row];
                if (y_f32) reinterpret_cast<float*>(y)[(u64)lane * n + row] = v;
                else reinterpret_cast<bf16_t*>(y)[(u64)lane * n + row] = f2bf(v);
            }
        }
    }
}

#define GEMV8(NAME, FMT, M, ROWS)                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV8_WARPS * 32)                                        \
        NAME##_m##M(void* y, int y_f32, const unsigned char* xq, const float* xs, const unsigned char* w,  \
                    const float* ws, int m, int n, int k, int wpr) {                                      \
        gemv8_impl<FMT, M, ROWS>(y, y_f32, xq, xs, w, ws, m, n, k, wpr);                                  \
    }
// One token with ROWS weight rows per warp tile (`PEREGRINE_GEMV8_M1_ROWS`): each activation chunk
// is loaded and decoded once for ROWS rows instead of once per row.
#define GEMV8_M1(NAME, FMT, ROWS)                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV8_WARPS * 32)                                        \
        NAME##_m1r##ROWS(void* y, int y_f32, const unsigned char* xq, const float* xs, const unsigned char* w, \
                         const float* ws, int m, int n, int k, int wpr) {                                 \
        gemv8_impl<FMT, 1, ROWS>(y, y_f32, xq, xs, w, ws, m, n, k, wpr);                                  \
    }
GEMV8_M1(gemv_e4m3, Q8_E4M3, 2)
GEMV8_M1(gemv_e4m3, Q8_E4M3, 4)
GEMV8_M1(gemv_i8, Q8_I8, 2)
GEMV8_M1(gemv_i8, Q8_I8, 4)
// Weight rows per warp tile: keep in step with `gemv8_rows` in kernels/src/ops/gemv_fp8.rs.
GEMV8(gemv_e4m3, Q8_E4M3, 1, 1)
GEMV8(gemv_e4m3, Q8_E4M3, 2, 1)
GEMV8(gemv_e4m3, Q8_E4M3, 4, 1)
GEMV8(gemv_e4m3, Q8_E4M3, 8, 2)
GEMV8(gemv_e4m3, Q8_E4M3, 16, 2)
GEMV8(gemv_i8, Q8_I8, 1, 1)
GEMV8(gemv_i8, Q8_I8, 2, 1)
GEMV8(gemv_i8, Q8_I8, 4, 1)
GEMV8(gemv_i8, Q8_I8, 8, 2)
GEMV8(gemv_i8, Q8_I8, 16, 2)
