//! encoder.cu: the kernels of a BERT-family encoder over a ragged batch (f32 activations). They live
//! apart from [`super::Kernels`] (the decoder's), loaded from the same module by the encoder alone.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig};

use super::{as_i32, as_u32, cfg, DPtr, Launch};
use crate::{KernelError, Result};

/// Queries per attention block (`ENC_ATTN_QT` in encoder.cu): the host cuts each sequence into
/// tiles of this many queries.
pub const ENC_ATTN_QUERY_TILE: usize = 16;
/// The largest head dimension the attention kernel holds (`ENC_ATTN_DMAX`).
pub const ENC_ATTN_MAX_HEAD_DIM: usize = 128;
/// Queries per warp of the tensor-core attention (the mma's 16 rows): a block of `w` warps takes
/// tiles of `16 w` queries ([`attention_tiles_of`]).
pub const ENC_ATTN_MMA_QUERIES_PER_WARP: usize = 16;
/// Warps per block of the tensor-core attention it is built for: 4 (64 queries sharing each K/V
/// tile) for long sequences, 1 for short ones.
pub const ENC_ATTN_MMA_WARPS: [usize; 2] = [1, 4];
/// The head dimensions the tensor-core attention is built for (`enc_attention_mma_d*`).
pub const ENC_ATTN_MMA_HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// Threads per block of the row kernels (LayerNorms): one block per token.
const ROW_THREADS: u32 = 128;

/// The activation after a GEMM (`ENC_ACT_*` in encoder.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderActivation {
    None = 0,
    GeluErf = 1,
    GeluTanh = 2,
    Relu = 3,
}

/// A pooling of a sequence's hidden states (`ENC_POOL_*` in encoder.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderPooling {
    /// The first token's state.
    Cls = 0,
    /// The largest value of each column.
    Max = 1,
    /// The mean over the tokens.
    Mean = 2,
    /// The sum over the tokens divided by the square root of their count.
    MeanSqrtLen = 3,
    /// The last token's state.
    LastToken = 4,
}

/// The LayerNorm parameters of one norm: device addresses of `h` f32 weights and biases.
#[derive(Debug, Clone, Copy)]
pub struct NormParams {
    pub gamma: DPtr,
    pub beta: DPtr,
    pub eps: f32,
}

/// The embedding tables: device addresses of f32 `[vocab, h]`, `[positions, h]`, `[types, h]`.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingTables {
    pub word: DPtr,
    pub position: DPtr,
    pub token_type: DPtr,
}

pub struct EncoderKernels {
    embed_layernorm: CudaFunction,
    add_bias_layernorm: CudaFunction,
    bias_act: CudaFunction,
    attention: CudaFunction,
    /// The tensor-core attention per warps a block ([`ENC_ATTN_MMA_WARPS`]) and head dimension
    /// ([`ENC_ATTN_MMA_HEAD_DIMS`]).
    attention_mma: [[CudaFunction; 3]; 2],
    f32_to_bf16: CudaFunction,
    pool: CudaFunction,
    num_sms: u32,
}

impl EncoderKernels {
    pub fn load(module: &Arc<CudaModule>, num_sms: u32) -> Result<Self> {
        let f = |name: &str| module.load_function(name);
        Ok(EncoderKernels {
            embed_layernorm: f("enc_embed_layernorm")?,
            add_bias_layernorm: f("enc_add_bias_layernorm")?,
            bias_act: f("enc_bias_act")?,
            attention: f("enc_attention")?,
            attention_mma: [
                [f("enc_attention_mma_w1_d32")?, f("enc_attention_mma_w1_d64")?, f("enc_attention_mma_w1_d128")?],
                [f("enc_attention_mma_w4_d32")?, f("enc_attention_mma_w4_d64")?, f("enc_attention_mma_w4_d128")?],
            ],
            f32_to_bf16: f("f32_to_bf16")?,
            pool: f("enc_pool")?,
            num_sms: num_sms.max(1),
        })
    }

    fn grid(&self, n: usize) -> u32 {
        n.div_ceil(256).clamp(1, self.num_sms as usize * 8) as u32
    }

    /// `x[t] = LayerNorm(word[id] + position[pos] + token_type[type])` for `n` tokens, with `meta`
    /// three i32 per token (id, type, position; positions already offset as the model says); `xb`
    /// (0 for none) gets x as bf16 too (the next bf16 GEMM's input).
    ///
    /// # Safety
    /// x: n·h f32; meta: 3n i32 with every index inside its table; the tables and norm as described;
    /// xb: 0 or n·h bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn embed_layernorm(&self, s: &CudaStream, x: DPtr, meta: DPtr, tables: EmbeddingTables, norm: NormParams, n: usize, h: usize, xb: DPtr) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let h_i = as_i32(h, "hidden size")?;
        Launch::new(&self.embed_layernorm)
            .arg(&x)
            .arg(&meta)
            .arg(&tables.word)
            .arg(&tables.position)
            .arg(&tables.token_type)
            .arg(&norm.gamma)
            .arg(&norm.beta)
            .arg(&h_i)
            .arg(&norm.eps)
            .arg(&xb)
            .launch(s, cfg(as_u32(n, "tokens")?, ROW_THREADS), false)
    }

    /// `x = LayerNorm(x + y + bias)` per row of `h`, for `n` rows; `xb` (0 for none) gets x as
    /// bf16 too.
    ///
    /// # Safety
    /// x, y: n·h f32; bias and the norm's vectors: h f32; xb: 0 or n·h bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_bias_layernorm(&self, s: &CudaStream, x: DPtr, y: DPtr, bias: DPtr, norm: NormParams, n: usize, h: usize, xb: DPtr) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let h_i = as_i32(h, "hidden size")?;
        Launch::new(&self.add_bias_layernorm)
            .arg(&x)
            .arg(&y)
            .arg(&bias)
            .arg(&norm.gamma)
            .arg(&norm.beta)
            .arg(&h_i)
            .arg(&norm.eps)
            .arg(&xb)
            .launch(s, cfg(as_u32(n, "tokens")?, ROW_THREADS), false)
    }

    /// `y[r, c] = act(y[r, c] + bias[c])` for `n` rows of `cols`; with `yb` (not 0) the result goes
    /// there as bf16 instead, and y is left as it was.
    ///
    /// # Safety
    /// y: n·cols f32; bias: cols f32; yb: 0 or n·cols bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bias_act(&self, s: &CudaStream, y: DPtr, bias: DPtr, n: usize, cols: usize, act: EncoderActivation, yb: DPtr) -> Result<()> {
        if n == 0 || cols == 0 {
            return Ok(());
        }
        let (n64, cols_i, act_i) = (n as u64, as_i32(cols, "columns")?, act as i32);
        Launch::new(&self.bias_act)
            .arg(&y)
            .arg(&bias)
            .arg(&n64)
            .arg(&cols_i)
            .arg(&act_i)
            .arg(&yb)
            .launch(s, cfg(self.grid(n * cols), 256), false)
    }

    /// Bidirectional attention of every sequence over itself: `ctx[t, head] = softmax(q·kᵀ·scale)·v`
    /// over the keys of `t`'s sequence. `tiles` holds three i32 per tile (the sequence's first token,
    /// its length, the tile's first query; see [`attention_tiles`]).
    ///
    /// # Safety
    /// qkv: n·3h f32 (q | k | v per row); ctx: n·h f32; tiles: 3·num_tiles i32 describing sequences
    /// inside the n tokens.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention(&self, s: &CudaStream, ctx: DPtr, qkv: DPtr, tiles: DPtr, num_tiles: usize, heads: usize, head_dim: usize) -> Result<()> {
        if num_tiles == 0 {
            return Ok(());
        }
        if head_dim == 0 || head_dim > ENC_ATTN_MAX_HEAD_DIM {
            return Err(KernelError::Unsupported(format!("encoder attention: head dimension {head_dim} (at most {ENC_ATTN_MAX_HEAD_DIM})")));
        }
        let h_i = as_i32(heads * head_dim, "hidden size")?;
        let d_i = head_dim as i32;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let config = LaunchConfig { grid_dim: (as_u32(num_tiles, "attention tiles")?, as_u32(heads, "heads")?, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        Launch::new(&self.attention).arg(&ctx).arg(&qkv).arg(&tiles).arg(&h_i).arg(&d_i).arg(&scale).launch(s, config, false)
    }

    /// [`Self::attention`] on the tensor cores: Q, K, V and the probabilities rounded to bf16, f32
    /// accumulation and softmax, `warps` warps a block (one of [`ENC_ATTN_MMA_WARPS`]), `tiles` cut
    /// by [`attention_tiles_of`] with `16 · warps` queries. Needs sm_80 or later (the kernel is
    /// empty below) and a head dimension in [`ENC_ATTN_MMA_HEAD_DIMS`]. With `ctx_bf16` (not 0)
    /// the output goes there as bf16 instead of to `ctx`.
    ///
    /// # Safety
    /// As [`Self::attention`]; ctx_bf16: 0 or n·h bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_mma(&self, s: &CudaStream, ctx: DPtr, qkv: DPtr, tiles: DPtr, num_tiles: usize, heads: usize, head_dim: usize, warps: usize, ctx_bf16: DPtr) -> Result<()> {
        if num_tiles == 0 {
            return Ok(());
        }
        let Some(i) = ENC_ATTN_MMA_HEAD_DIMS.iter().position(|&d| d == head_dim) else {
            return Err(KernelError::Unsupported(format!("encoder tensor-core attention: head dimension {head_dim} (one of {ENC_ATTN_MMA_HEAD_DIMS:?})")));
        };
        let Some(w) = ENC_ATTN_MMA_WARPS.iter().position(|&x| x == warps) else {
            return Err(KernelError::Unsupported(format!("encoder tensor-core attention: {warps} warps a block (one of {ENC_ATTN_MMA_WARPS:?})")));
        };
        let h_i = as_i32(heads * head_dim, "hidden size")?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let config = LaunchConfig { grid_dim: (as_u32(num_tiles, "attention tiles")?, as_u32(heads, "heads")?, 1), block_dim: (32 * warps as u32, 1, 1), shared_mem_bytes: 0 };
        Launch::new(&self.attention_mma[w][i]).arg(&ctx).arg(&qkv).arg(&tiles).arg(&h_i).arg(&scale).arg(&ctx_bf16).launch(s, config, false)
    }

    /// Each sequence's rows of `x` (`offsets[s]..offsets[s + 1]`, at least one each) pooled as each
    /// of `modes` (i32 [`EncoderPooling`] codes) says: `out[s, m, 0..h]`. Means summed in f64.
    ///
    /// # Safety
    /// x: offsets[num_seqs]·h f32; offsets: num_seqs + 1 increasing i32; modes: num_modes i32 codes;
    /// out: num_seqs·num_modes·h f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn pool(&self, s: &CudaStream, out: DPtr, x: DPtr, offsets: DPtr, num_seqs: usize, modes: DPtr, num_modes: usize, h: usize) -> Result<()> {
        if num_seqs == 0 || num_modes == 0 {
            return Ok(());
        }
        let (modes_i, h_i) = (as_i32(num_modes, "pooling modes")?, as_i32(h, "hidden size")?);
        let config = LaunchConfig { grid_dim: (as_u32(num_seqs, "sequences")?, as_u32(h.div_ceil(128), "hidden size")?, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        Launch::new(&self.pool).arg(&out).arg(&x).arg(&offsets).arg(&modes).arg(&modes_i).arg(&h_i).launch(s, config, false)
    }

    /// `out = bf16(input)` for `n` values (round to nearest even).
    ///
    /// # Safety
    /// out: n bf16; input: n f32.
    pub unsafe fn f32_to_bf16(&self, s: &CudaStream, out: DPtr, input: DPtr, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        Launch::new(&self.f32_to_bf16).arg(&out).arg(&input).arg(&n64).launch(s, cfg(self.grid(n), 256), false)
    }
}

/// The attention tiles of sequences given by their lengths (in batch order, packed back to back):
/// three i32 per tile of up to [`ENC_ATTN_QUERY_TILE`] queries (the sequence's first token, its
/// length, the tile's first query).
pub fn attention_tiles(lengths: impl IntoIterator<Item = usize>) -> Result<Vec<i32>> {
    attention_tiles_of(lengths, ENC_ATTN_QUERY_TILE)
}

/// [`attention_tiles`] with tiles of `tile` queries (the tensor-core kernel's: 16 per warp).
pub fn attention_tiles_of(lengths: impl IntoIterator<Item = usize>, tile: usize) -> Result<Vec<i32>> {
    if tile == 0 {
        return Err(KernelError::Unsupported("encoder attention tiles of 0 queries".into()));
    }
    let mut tiles = Vec::new();
    let mut start = 0usize;
    for len in lengths {
        let (s, l) = (as_i32(start, "token offset")?, as_i32(len, "sequence length")?);
        for q0 in (0..len).step_by(tile) {
            tiles.extend_from_slice(&[s, l, q0 as i32]);
        }
        start += len;
    }
    Ok(tiles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_every_query_once_and_stay_in_their_sequence() {
        let lengths = [1usize, 16, 17, 40];
        let tiles = attention_tiles(lengths).unwrap();
        let mut covered = vec![0u32; lengths.iter().sum()];
        for t in tiles.chunks(3) {
            let (start, len, q0) = (t[0] as usize, t[1] as usize, t[2] as usize);
            for q in q0..(q0 + ENC_ATTN_QUERY_TILE).min(len) {
                covered[start + q] += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "{covered:?}");
        assert_eq!(tiles.len() / 3, 1 + 1 + 2 + 3);
    }

    #[test]
    fn mma_tiles_cover_every_query_once() {
        let lengths = [1usize, 64, 65, 200];
        let tiles = attention_tiles_of(lengths, 64).unwrap();
        let mut covered = vec![0u32; lengths.iter().sum()];
        for t in tiles.chunks(3) {
            let (start, len, q0) = (t[0] as usize, t[1] as usize, t[2] as usize);
            for q in q0..(q0 + 64).min(len) {
                covered[start + q] += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "{covered:?}");
        assert_eq!(tiles.len() / 3, 1 + 1 + 2 + 4);
        assert!(attention_tiles_of(lengths, 0).is_err());
    }
}
