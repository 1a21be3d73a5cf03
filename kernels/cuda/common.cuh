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
