// Shared helpers for every Peregrine kernel. NVRTC compiles all .cu files of this folder as one
// program with this header in front, so no include paths or CUDA headers are needed: bf16 is carried
// as its raw 16 bits and converted with integer arithmetic (round to nearest even, like torch).

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// NVRTC has no math.h, so no INFINITY macro.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch /* >= 33 floats */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = (threadIdx.x < nwarps) ? scratch[threadIdx.x] : 0.f;
    if (warp == 0) {
        t = warp_sum(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    float r = scratch[32];
    __syncthreads();  // scratch may be reused right after
    return r;
}

// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute may start while
// the previous kernel is still finishing; it must call pdl_wait() before reading anything that kernel
// wrote. A kernel that calls pdl_trigger() lets its dependent start early (the dependent still waits
// for this kernel's completion in pdl_wait()). Both are no-ops on older GPUs and normal launches.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Row `row` of a LoRA update that the expand wrote beside the base output (lora.cu, `overwrite`), for
// the kernel that consumes that output to add; null where no buffer was given or the row's token has
// no adapter (slot -1: the expand wrote nothing there).
__device__ __forceinline__ const bf16_t* lora_delta_row(const bf16_t* d, const int* slots, u64 row, u64 stride) {
    return d && slots[row] >= 0 ? d + row * stride : nullptr;
}

// Rows in registers (the one-block-per-row kernels: RMSNorm, SiLU·mul, the per-token quantizers).
// A row of L = 8·chunks values is split into 16-byte chunks of 8; thread t owns chunks t, t + T, ...
// (T = blockDim.x, at most ROW_MAXC of them, so L ≤ 8 · ROW_MAXC · T): every load of the row is
// issued at once, and a value read once stays in registers for the later passes (reduction, scale,
// codes). The scalar loops these replaced made each row a chain of dependent round trips to memory.
#define ROW_MAXC 4
// 8 bf16 values held in a 16-byte vector, as floats (exactly), low half of each word first.
__device__ __forceinline__ void bf16x8_to_f32(const uint4 r, float (&v)[8]) {
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        v[2 * t] = __uint_as_float(w[t] << 16);
        v[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
    }
}
__device__ __forceinline__ void ld8_bf16(const bf16_t* p, float (&v)[8]) {
    bf16x8_to_f32(*reinterpret_cast<const uint4*>(p), v);
}
__device__ __forceinline__ void st8_bf16(bf16_t* p, const float (&v)[8]) {
    u32 w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = (u32)f2bf(v[2 * t]) | ((u32)f2bf(v[2 * t + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void ld8_f32(const float* p, float (&v)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void st8_f32(float* p, const float (&v)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
// v[t] += bf16 p[t], one f32 addition each.
__device__ __forceinline__ void add8_bf16(const bf16_t* p, float (&v)[8]) {
    float d[8];
    ld8_bf16(p, d);
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] += d[t];
}

// v[t] += bf16 p[t] · (sx · sw[t]): a delta whose 8-bit GEMM left its token (sx) and row (sw) scales
// to the consumer (quant8.cu's scale_outer, fused), or v[t] += bf16 p[t] when sw is null.
__device__ __forceinline__ void add8_bf16_scaled(const bf16_t* p, float (&v)[8], float sx, const float* sw) {
    if (!sw) {
        add8_bf16(p, v);
        return;
    }
    float d[8], w[8];
    ld8_bf16(p, d);
    ld8_f32(sw, w);
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] += d[t] * (sx * w[t]);
}
// 8 int32 sums (an int8 GEMM's, its scales left to the consumer) as floats.
__device__ __forceinline__ void ld8_i32(const int* p, float (&v)[8]) {
    const int4 a = reinterpret_cast<const int4*>(p)[0], b = reinterpret_cast<const int4*>(p)[1];
    v[0] = (float)a.x, v[1] = (float)a.y, v[2] = (float)a.z, v[3] = (float)a.w;
    v[4] = (float)b.x, v[5] = (float)b.y, v[6] = (float)b.z, v[7] = (float)b.w;
}
// v[t] += float(p[t]) · (sx · sw[t]): int32 sums whose GEMM left its scales to the consumer.
__device__ __forceinline__ void add8_i32_scaled(const int* p, float (&v)[8], float sx, const float* sw) {
    float d[8], w[8];
    ld8_i32(p, d);
    ld8_f32(sw, w);
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] += d[t] * (sx * w[t]);
}
// 8 values of an 8-bit GEMM's output as its consumer reads them: bf16 `p`, or the int32 sums `pi`
// when that is not null, times sx · sw[t] when sw is not null (the scales it left; pi needs sw).
// Added to zeros rather than loaded and scaled in place: the in-place form spilled in silu_mul_quant
// at 1,024 threads (ptxas, sm_90).
__device__ __forceinline__ void ld8_delta_scaled(const bf16_t* p, const int* pi, float (&v)[8], float sx, const float* sw) {
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = 0.f;
    if (pi) add8_i32_scaled(pi, v, sx, sw);
    else add8_bf16_scaled(p, v, sx, sw);
}
// The residual add of a norm kernel: row x (f32) += d (bf16, times sx · dws[j] when dws is not null;
// or di, an int8 GEMM's int32 sums, times sx · dws[j]) + ld (the LoRA update, bf16), each null for
// none, written back when anything was added; the row in v (this thread's chunks), this thread's sum
// of squares returned.
__device__ __forceinline__ float residual_add_row(float* x, const bf16_t* d, const int* di, const bf16_t* ld, float sx,
                                                  const float* dws, int chunks, float (&v)[ROW_MAXC][8]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < ROW_MAXC; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) {
            ld8_f32(x + 8 * c, v[i]);
            if (di) add8_i32_scaled(di + 8 * c, v[i], sx, dws + 8 * c);
            else if (d) add8_bf16_scaled(d + 8 * c, v[i], sx, dws ? dws + 8 * c : nullptr);
            if (ld) add8_bf16(ld + 8 * c, v[i]);
            if (d || di || ld) st8_f32(x + 8 * c, v[i]);
#pragma unroll
            for (int t = 0; t < 8; ++t) ss += v[i][t] * v[i][t];
        }
    }
    return ss;
}
