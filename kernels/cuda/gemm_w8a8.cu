// Row-wise 8-bit GEMM on tensor cores for steps larger than the 8-bit GEMV takes (prefill):
//   y[i, j] = (Σ_k xq[i, k] · wq[j, k]) · xs[i] · ws[j]
// xq: m × k activation codes with one scale per token (xs), wq: n × k weight codes with one scale per
// output row (ws), both row-major (k contiguous), y bf16 or f32. The token scale, then the row scale,
// in the epilogue: the order of the CPU's matmul_w8a8 and the GEMV.
//
// gemm_w8a8_e4m3: mma.sync m16n8k32 e4m3 x e4m3 -> f32 (sm_89+). gemm_w8a8_i8: m16n8k32 s8 x s8 -> s32
// (sm_80+; exact integer sums, converted to f32 once in the epilogue).
//
// A simple tiled kernel (correct first; not yet tuned): 64 × 64 output tiles, 4 warps of 32 × 32,
// k in steps of 64 bytes, both tiles streamed into shared memory with cp.async, two stages deep,
// fragments loaded with ldmatrix.
// Rows of a tile past m or n and k past the end load as zeros (cp.async's zero fill), so any m and
// n are fine; k must be a multiple of 16 and the rows 16-byte aligned. A row's result depends on
// that row and the weights alone (the k order is fixed), so it does not depend on the batch.
// Both A (activations, row) and B (weights, "col" = k contiguous per output) fragments are four
// consecutive k bytes per 32-bit register: PTX's m16n8k32 layout for 8-bit types.

// Output tiles are T × T (T = 64, or 32 for small grids: decode-sized m with n = 4096 would leave
// most SMs idle with 64 × 64 tiles); 4 warps of T/2 × T/2 each.
#define G8_BK 64
// Row pitch in shared memory: 64 bytes + 16 of padding, so the 8 rows a fragment load touches fall
// into 8 different bank quads.
#define G8_PITCH 80

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

template <int FMT>
__device__ __forceinline__ void mma8(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma8<Q8_E4M3>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The int8 variant accumulates in s32, carried in the float registers' bits (int 0 is float 0.f).
template <>
__device__ __forceinline__ void mma8<Q8_I8>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    int d0 = __float_as_int(d[0]), d1 = __float_as_int(d[1]), d2 = __float_as_int(d[2]), d3 = __float_as_int(d[3]);
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    d[0] = __int_as_float(d0);
    d[1] = __int_as_float(d1);
    d[2] = __int_as_float(d2);
    d[3] = __int_as_float(d3);
}

// One 64-row × 64-byte tile of a row-major code matrix with `rows` rows, from column k0, into
// shared memory (rows and chunks past the end as zeros). 128 threads, T / 32 16-byte chunks each.
template <int T>
__device__ __forceinline__ void g8_load_tile(unsigned char* smem, const unsigned char* __restrict__ src, int row0, int rows,
                                             int k0, int k) {
#pragma unroll
    for (int i = 0; i < T / 32; ++i) {
        const int c = threadIdx.x + i * 128;
        const int r = c >> 2, col = (c & 3) * 16;
        const bool valid = row0 + r < rows && k0 + col < k;
        const unsigned char* p = valid ? src + (u64)(row0 + r) * k + k0 + col : src;
        cp_async16(smem_addr(smem + r * G8_PITCH + col), p, valid ? 16 : 0);
    }
}

template <int FMT, int T>
__device__ __forceinline__ void gemm_w8a8_impl(void* __restrict__ y, int y_f32, const unsigned char* __restrict__ xq,
                                               const float* __restrict__ xs, const unsigned char* __restrict__ w,
                                               const float* __restrict__ ws, int m, int n, int k) {
    constexpr int MT = T / 32, NT = T / 16;  // m16 and n8 tiles per warp
    __shared__ __align__(16) unsigned char a_s[2][T * G8_PITCH];
    __shared__ __align__(16) unsigned char b_s[2][T * G8_PITCH];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * (T / 2), wn = (warp & 1) * (T / 2);
    const int m0 = blockIdx.y * T, n0 = blockIdx.x * T;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;  // also int 0 for the int8 variant
    const int tiles = (k + G8_BK - 1) / G8_BK;
    g8_load_tile<T>(a_s[0], xq, m0, m, 0, k);
    g8_load_tile<T>(b_s[0], w, n0, n, 0, k);
    cp_async_commit();
    for (int kt = 0; kt < tiles; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < tiles) {
            g8_load_tile<T>(a_s[buf ^ 1], xq, m0, m, (kt + 1) * G8_BK, k);
            g8_load_tile<T>(b_s[buf ^ 1], w, n0, n, (kt + 1) * G8_BK, k);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const unsigned char* as = a_s[buf];
        const unsigned char* bs = b_s[buf];
#pragma unroll
        for (int ks = 0; ks < G8_BK; ks += 32) {
            // ldmatrix (8 × 8 b16 = 8 rows × 16 bytes per matrix) hands each lane the 4 bytes at row
            // lane / 4, bytes 4 · (lane % 4): the 8-bit A/B fragment layout. A: matrices (rows 0-7 | 8-15)
            // × (bytes 0-15 | 16-31) = a0..a3; B: (bytes 0-15 | 16-31) × (n tile j | j + 1).
            u32 a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                ldmatrix_x4(smem_addr(as + (wm + i * 16 + (lane & 15)) * G8_PITCH + ks + (lane >> 4) * 16), a[i][0], a[i][1],
                            a[i][2], a[i][3]);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(smem_addr(bs + (wn + j * 8 + ((lane >> 4) << 3) + (lane & 7)) * G8_PITCH + ks + ((lane >> 3) & 1) * 16),
                            b0, b1, b2, b3);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma8<FMT>(acc[i][j], a[i], b0, b1);
                    mma8<FMT>(acc[i][j + 1], a[i], b2, b3);
                }
            }
        }
        __syncthreads();  // the next iteration's loads overwrite the other buffer only
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm + i * 16 + g + h * 8;
            if (row >= m) continue;
            const float sx = xs[row];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n0 + wn + j * 8 + t * 2 + e;
                    if (col >= n) continue;
                    const float raw = acc[i][j][h * 2 + e];
                    const float sum = FMT == Q8_I8 ? (float)__float_as_int(raw) : raw;
                    const float v = sum * sx * ws[col];
                    if (y_f32) reinterpret_cast<float*>(y)[(u64)row * n + col] = v;
                    else reinterpret_cast<bf16_t*>(y)[(u64)row * n + col] = f2bf(v);
                }
            }
        }
    }
}

#endif

// The kernels exist on every target; below their architecture (e4m3: sm_89, int8: sm_80) they are
// empty and the host never launches them. Suffix _t32: 32 × 32 tiles.
#define GEMM_W8A8(NAME, BODY, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                                    \
        NAME(void* y, int y_f32, const unsigned char* xq, const float* xs, const unsigned char* w,        \
             const float* ws, int m, int n, int k) {                                                     \
        BODY(T)                                                                                          \
    }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define GEMM_W8A8_BODY_e4m3(T) gemm_w8a8_impl<Q8_E4M3, T>(y, y_f32, xq, xs, w, ws, m, n, k);
#else
#define GEMM_W8A8_BODY_e4m3(T)
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GEMM_W8A8_BODY_i8(T) gemm_w8a8_impl<Q8_I8, T>(y, y_f32, xq, xs, w, ws, m, n, k);
#else
#define GEMM_W8A8_BODY_i8(T)
#endif
GEMM_W8A8(gemm_w8a8_e4m3, GEMM_W8A8_BODY_e4m3, 64)
GEMM_W8A8(gemm_w8a8_i8, GEMM_W8A8_BODY_i8, 64)
GEMM_W8A8(gemm_w8a8_e4m3_t32, GEMM_W8A8_BODY_e4m3, 32)
GEMM_W8A8(gemm_w8a8_i8_t32, GEMM_W8A8_BODY_i8, 32)
