// Constrained decoding on the GPU: per-row allowed-token bitmasks and sparse logit biases applied to
// the logits in place, before sampling, on the rows that have them only (the other rows are not read).
//
// The host packs one step's constraints into one u32 buffer, so a step makes one upload (see
// ops/token_mask.rs, TokenConstraints): a header of TOKEN_MASK_HEADER words per constrained row (its
// logits row; the word offset of its bitmask in the buffer, 0xffffffff for none; the [begin, end)
// word offsets of its (token, f32 bias bits) pairs), then the masks, then the pairs. A mask holds
// ceil(vocab / 32) words, bit (t & 31) of word (t >> 5) set where token t is allowed (llguidance's
// layout); a token not allowed gets -inf. The biases are added after the mask by one thread, in the
// order given, so each sum is the host sampler's (left to right; -inf + bias stays -inf). A row has at
// most the engine's MAX_LOGIT_BIAS (1024) biases, so the serial loop is short.
// grid: one block per constrained row; any blockDim.x.

#define TOKEN_MASK_HEADER 4
#define TOKEN_MASK_NONE 0xffffffffu

extern "C" __global__ void apply_token_constraints(float* __restrict__ logits, int vocab, const u32* __restrict__ packed) {
    const u32* h = packed + (u64)blockIdx.x * TOKEN_MASK_HEADER;
    float* row = logits + (u64)h[0] * (u64)vocab;
    const u32 mask_at = h[1], bias_begin = h[2], bias_end = h[3];
    if (mask_at != TOKEN_MASK_NONE) {
        const u32* mask = packed + mask_at;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            if (!((mask[j >> 5] >> (j & 31)) & 1u)) row[j] = NEG_INF;
        }
    }
    if (bias_begin == bias_end) return;  // the same for every thread of the block
    __syncthreads();  // the masked logits are visible to thread 0
    if (threadIdx.x == 0) {
        for (u32 i = bias_begin; i + 1 < bias_end; i += 2) {
            const u32 t = packed[i];
            if (t < (u32)vocab) row[t] += __uint_as_float(packed[i + 1]);
        }
    }
}
