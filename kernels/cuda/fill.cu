// Device-side initialisation, so dummy weights for big models never cross PCIe.
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// out[i] = uniform(-scale, scale), a pure function of (seed, i).
extern "C" __global__ void fill_uniform_bf16(bf16_t* __restrict__ out, u64 n, u64 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = splitmix64(seed ^ splitmix64(i));
        const float u = (float)(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        out[i] = f2bf((2.f * u - 1.f) * scale);
    }
}

extern "C" __global__ void fill_f32(float* __restrict__ out, u64 n, float value) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = value;
}

// Host f32 → device bf16 happens on the device: upload f32, convert here (round to nearest even).
extern "C" __global__ void f32_to_bf16(bf16_t* __restrict__ out, const float* __restrict__ in, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f2bf(in[i]);
}
