//! The CPU reference backend: f32 compute (weights may stay quantized and are dequantized to the
//! same f32 values inside the matmul), paged KV cache in host memory, rayon for threads.

pub mod attention;
pub mod encoder;
pub mod hadamard;
pub mod kv_cache;
pub mod lora;
pub mod matmul;
#[cfg(target_arch = "x86_64")]
mod matmul_avx2;
mod matmul_w8a8;
pub mod ops;
pub mod simd;

use attention::TokenCtx;
use kv_cache::{KvCache, KvFormat};
use matmul::matmul;
use ops::Rope;
use simd::Isa;

use crate::backend::{kv_block_bytes, Backend, KvCacheShape, Logits, StepBatch};
use crate::config::ModelConfig;
use self::lora::{CpuLora, Rows, RowsMut};
use crate::lora::{LoraAdapter, TargetModule};
use crate::model::{Matrix, ModelWeights};
use crate::{EngineError, Result};

/// One decoder layer with q/k/v and gate/up fused into single matrices (one pass over the input
/// each; every output element is still its own dot product, so results are unchanged).
struct CpuLayer {
    attn_norm: Vec<f32>,
    qkv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    o: Matrix,
    mlp_norm: Vec<f32>,
    gate_up: Matrix,
    down: Matrix,
}

pub struct CpuBackend {
    config: ModelConfig,
    embed: Matrix,
    lm_head: Option<Matrix>,
    norm: Vec<f32>,
    layers: Vec<CpuLayer>,
    rope: Rope,
    kv: KvCache,
    pool: std::sync::Arc<rayon::ThreadPool>,
    threads: usize,
    isa: Isa,
    /// LoRA slots and the step's segment table, once `enable_lora` was called.
    lora: Option<CpuLora>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("isa", &self.isa)
            .field("kv", &self.kv.shape)
            .finish()
    }
}

fn fuse(parts: &[&Matrix], what: &str) -> Result<Matrix> {
    Matrix::concat_rows(parts)
        .ok_or_else(|| EngineError::Backend(format!("cannot fuse {what}: widths differ")))
}

impl CpuBackend {
    /// `threads == 0` uses every available core.
    pub fn new(weights: ModelWeights, kv: KvCacheShape, threads: usize) -> Result<CpuBackend> {
        weights
            .validate()
            .map_err(|m| EngineError::Backend(format!("weights do not match the config: {m}")))?;
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("peregrine-cpu-{i}"))
            .build()
            .map_err(|e| {
                EngineError::Backend(format!("cannot start {threads} CPU threads: {e}"))
            })?;
        let pool = std::sync::Arc::new(pool);
        let config = weights.config.clone();
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in weights.layers {
            let qkv_bias = if l.q_bias.is_some() || l.k_bias.is_some() || l.v_bias.is_some() {
                let mut b = l.q_bias.unwrap_or_else(|| vec![0.0; config.q_dim()]);
                b.extend(l.k_bias.unwrap_or_else(|| vec![0.0; config.kv_dim()]));
                b.extend(l.v_bias.unwrap_or_else(|| vec![0.0; config.kv_dim()]));
                Some(b)
            } else {
                None
            };
            layers.push(CpuLayer {
                attn_norm: l.input_layernorm,
                qkv: fuse(&[&l.q_proj, &l.k_proj, &l.v_proj], "q/k/v")?,
                qkv_bias,
                o: l.o_proj,
                mlp_norm: l.post_attention_layernorm,
                gate_up: fuse(&[&l.gate_proj, &l.up_proj], "gate/up")?,
                down: l.down_proj,
            });
        }
        let kv = KvCache::new(
            kv,
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
        )?;
        Ok(CpuBackend {
            rope: Rope::new(&config),
            config,
            embed: weights.embed_tokens,
            lm_head: weights.lm_head,
            norm: weights.norm,
            layers,
            kv,
            pool,
            threads,
            isa: Isa::detect(),
            lora: None,
        })
    }

    /// Stores K and V as `format` says from now on (rounded to bf16/e4m3, Hadamard-rotated q and k):
    /// to measure what a GPU cache type costs with the CPU's arithmetic. Set it before the first
    /// step; values cached before keep the old format. Errors for a rotation the head size cannot have.
    pub fn set_kv_format(&mut self, format: KvFormat) -> Result<()> {
        if (format.hadamard || format.hadamard_v) && !hadamard::supports(self.config.head_dim) {
            return Err(EngineError::InvalidRequest(format!(
                "Hadamard rotation needs a power-of-two head dimension, this model's is {}",
                self.config.head_dim
            )));
        }
        self.kv.format = format;
        Ok(())
    }

    pub fn kv_format(&self) -> KvFormat {
        self.kv.format
    }

    /// Bytes one KV block of `block_size` tokens takes in this backend (f32 K and V, every layer).
    pub fn kv_bytes_per_block(config: &ModelConfig, block_size: usize) -> usize {
        kv_block_bytes(config, block_size, 4)
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Switches kernels (to test or time the fallbacks); errors if this CPU cannot run `isa`.
    pub fn set_isa(&mut self, isa: Isa) -> Result<()> {
        if !Isa::available().contains(&isa) {
            return Err(EngineError::Backend(format!(
                "this CPU cannot run {} kernels",
                isa.name()
            )));
        }
        self.isa = isa;
        Ok(())
    }

    /// Rejects a batch that would index outside the cache or the vocabulary.
    fn check_batch(&self, batch: &StepBatch) -> Result<()> {
        let bad = |m: String| Err(EngineError::Backend(format!("invalid step batch: {m}")));
        let n = batch.tokens.len();
        if batch.positions.len() != n {
            return bad(format!(
                "{} tokens but {} positions",
                n,
                batch.positions.len()
            ));
        }
        if let Some(&t) = batch
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return bad(format!(
                "token id {t} is outside the vocabulary ({})",
                self.config.vocab_size
            ));
        }
        let bs = self.kv.shape.block_size;
        let mut next = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.start != next || s.len == 0 {
                return bad(format!(
                    "sequence {i} starts at {} with {} tokens; expected start {next}",
                    s.start, s.len
                ));
            }
            next = s.start + s.len;
            if next > n {
                return bad(format!("sequence {i} runs past the {n} tokens"));
            }
            for j in 0..s.len {
                if batch.positions[s.start + j] as usize != s.context_len + j {
                    return bad(format!(
                        "sequence {i}: token {j} has position {}, expected {}",
                        batch.positions[s.start + j],
                        s.context_len + j
                    ));
                }
            }
            let needed = (s.context_len + s.len).div_ceil(bs);
            if s.block_table.len() < needed {
                return bad(format!(
                    "sequence {i} needs {needed} blocks, block table has {}",
                    s.block_table.len()
                ));
            }
            if let Some(&b) = s.block_table[..needed]
                .iter()
                .find(|&&b| b as usize >= self.kv.shape.num_blocks)
            {
                return bad(format!(
                    "sequence {i}: block {b} is outside the pool of {}",
                    self.kv.shape.num_blocks
                ));
            }
        }
        if next != n {
            return bad(format!("sequences cover {next} of {n} tokens"));
        }
        if self.lora.is_none() {
            self::lora::reject_lora_slots(batch)?;
        }
        Ok(())
    }

    fn forward_inner(&mut self, batch: &StepBatch) -> Logits {
        let c = &self.config;
        let n = batch.tokens.len();
        let (hidden, q_dim, kv_dim, inter) =
            (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let qkv_dim = q_dim + 2 * kv_dim;
        let isa = self.isa;
        let eps = c.rms_norm_eps;
        let n_heads = c.num_attention_heads;

        // Per-token context for attention.
        let mut ctx: Vec<TokenCtx<'_>> = Vec::with_capacity(n);
        for s in &batch.seqs {
            for j in 0..s.len {
                ctx.push(TokenCtx {
                    pos: s.context_len + j,
                    block_table: &s.block_table,
                });
            }
        }

        let mut h = vec![0f32; n * hidden];
        for (row, &t) in h.chunks_exact_mut(hidden).zip(&batch.tokens) {
            self.embed.row_into(t as usize, row);
        }
        let mut xn = vec![0f32; n * hidden];
        let mut qkv = vec![0f32; n * qkv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * hidden];
        let mut gu = vec![0f32; n * 2 * inter];
        let mut act = vec![0f32; n * inter];
        let (mut cos, mut sin) = (vec![0f32; self.rope.half()], vec![0f32; self.rope.half()]);

        for (li, layer) in self.layers.iter().enumerate() {
            ops::rms_norm(&h, &layer.attn_norm, eps, &mut xn);
            matmul(isa, &xn, n, &layer.qkv, &mut qkv);
            if let Some(lora) = &self.lora {
                // q, k and v sit side by side in each fused qkv row.
                for (m, off) in [(TargetModule::Q, 0), (TargetModule::K, q_dim), (TargetModule::V, q_dim + kv_dim)] {
                    let x = Rows { data: &xn, stride: hidden, offset: 0 };
                    lora.apply(li, m, x, RowsMut { data: &mut qkv, stride: qkv_dim, offset: off });
                }
            }
            for (row, tc) in qkv.chunks_exact_mut(qkv_dim).zip(&ctx) {
                if let Some(b) = &layer.qkv_bias {
                    for (x, &bb) in row.iter_mut().zip(b) {
                        *x += bb;
                    }
                }
                let (q, rest) = row.split_at_mut(q_dim);
                let (k, v) = rest.split_at_mut(kv_dim);
                self.rope.apply(q, tc.pos as u32, &mut cos, &mut sin);
                self.rope.apply(k, tc.pos as u32, &mut cos, &mut sin);
                if self.kv.format.hadamard {
                    hadamard::rotate_heads(q, c.head_dim);
                    hadamard::rotate_heads(k, c.head_dim);
                }
                if self.kv.format.hadamard_v {
                    hadamard::rotate_heads(v, c.head_dim);
                }
                attention::write_kv(&mut self.kv, li, tc.block_table, tc.pos, k, v);
            }
            attention::attention(isa, &self.kv, li, n_heads, &qkv, qkv_dim, &ctx, &mut attn);
            if self.kv.format.hadamard_v {
                // The output is H times the unrotated one: rotate it back.
                hadamard::rotate_heads(&mut attn, c.head_dim);
            }
            matmul(isa, &attn, n, &layer.o, &mut proj);
            if let Some(lora) = &self.lora {
                let x = Rows { data: &attn, stride: q_dim, offset: 0 };
                lora.apply(li, TargetModule::O, x, RowsMut { data: &mut proj, stride: hidden, offset: 0 });
            }
            for (a, b) in h.iter_mut().zip(&proj) {
                *a += b;
            }
            ops::rms_norm(&h, &layer.mlp_norm, eps, &mut xn);
            matmul(isa, &xn, n, &layer.gate_up, &mut gu);
            if let Some(lora) = &self.lora {
                for (m, off) in [(TargetModule::Gate, 0), (TargetModule::Up, inter)] {
                    let x = Rows { data: &xn, stride: hidden, offset: 0 };
                    lora.apply(li, m, x, RowsMut { data: &mut gu, stride: 2 * inter, offset: off });
                }
            }
            ops::swiglu(&gu, inter, &mut act);
            matmul(isa, &act, n, &layer.down, &mut proj);
            if let Some(lora) = &self.lora {
                let x = Rows { data: &act, stride: inter, offset: 0 };
                lora.apply(li, TargetModule::Down, x, RowsMut { data: &mut proj, stride: hidden, offset: 0 });
            }
            for (a, b) in h.iter_mut().zip(&proj) {
                *a += b;
            }
        }

        // LM head only for the rows that want logits.
        let rows: Vec<usize> = batch
            .seqs
            .iter()
            .filter(|s| s.wants_logits)
            .map(|s| s.start + s.len - 1)
            .collect();
        let mut last = vec![0f32; rows.len() * hidden];
        for (dst, &r) in last.chunks_exact_mut(hidden).zip(&rows) {
            dst.copy_from_slice(&h[r * hidden..(r + 1) * hidden]);
        }
        let mut normed = vec![0f32; last.len()];
        ops::rms_norm(&last, &self.norm, eps, &mut normed);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut data = vec![0f32; rows.len() * c.vocab_size];
        matmul(isa, &normed, rows.len(), head, &mut data);
        Logits {
            vocab: c.vocab_size,
            data,
        }
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_shape(&self) -> KvCacheShape {
        self.kv.shape
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        self.check_batch(batch)?;
        if let Some(lora) = &mut self.lora {
            lora.begin_step(batch)?;
        }
        if batch.tokens.is_empty() {
            return Ok(Logits {
                vocab: self.config.vocab_size,
                data: Vec::new(),
            });
        }
        // A clone of the handle, so that `forward_inner` can borrow `self` mutably inside the pool.
        let pool = std::sync::Arc::clone(&self.pool);
        Ok(pool.install(|| self.forward_inner(batch)))
    }

    fn name(&self) -> String {
        format!("cpu({} threads, {})", self.threads, self.isa.name())
    }

    fn enable_lora(&mut self, max_loras: usize, max_rank: usize) -> Result<()> {
        self.lora = Some(CpuLora::new(&self.config, max_loras, max_rank));
        Ok(())
    }

    fn set_lora_slot(&mut self, slot: u32, adapter: &LoraAdapter) -> Result<()> {
        match &mut self.lora {
            Some(lora) => lora.set_slot(slot, adapter),
            None => Err(EngineError::Backend("set_lora_slot before enable_lora".into())),
        }
    }
}

#[cfg(test)]
mod kv_format_tests {
    use super::kv_cache::{KvElem, KvFormat};
    use super::*;
    use crate::lora::test_support::tiny_config;
    use crate::model::dummy::dummy_weights;
    use crate::plan::SeqChunk;

    /// Logits of every position of `tokens`, fed one step per token through the cache.
    fn run(format: KvFormat, tokens: &[u32]) -> Vec<f32> {
        let config = tiny_config();
        let mut b = CpuBackend::new(dummy_weights(&config, 7), KvCacheShape { num_blocks: 4, block_size: 4 }, 1).unwrap();
        b.set_kv_format(format).unwrap();
        let mut out = Vec::new();
        for (pos, &t) in tokens.iter().enumerate() {
            let batch = StepBatch {
                tokens: vec![t],
                positions: vec![pos as u32],
                seqs: vec![SeqChunk { start: 0, len: 1, context_len: pos, block_table: vec![0, 1, 2, 3], wants_logits: true, lora_slot: None }],
            };
            out.extend(b.forward(&batch).unwrap().data);
        }
        out
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    const TOKENS: [u32; 11] = [3, 17, 42, 99, 5, 64, 3, 12, 77, 8, 50];

    #[test]
    fn hadamard_rotated_attention_equals_unrotated_in_f32() {
        let plain = run(KvFormat::F32, &TOKENS);
        let scale = plain.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (hadamard, hadamard_v) in [(true, false), (false, true), (true, true)] {
            let rotated = run(KvFormat { hadamard, hadamard_v, ..KvFormat::F32 }, &TOKENS);
            let d = max_diff(&plain, &rotated);
            assert!(d <= 1e-5 * scale.max(1.0), "q/k {hadamard}, v {hadamard_v}: {d} (logits up to {scale})");
        }
    }

    #[test]
    fn rounded_caches_change_the_logits_by_their_precision() {
        let exact = run(KvFormat::F32, &TOKENS);
        let bf16 = run(KvFormat::both(KvElem::Bf16, false), &TOKENS);
        let fp8 = run(KvFormat::both(KvElem::Fp8E4m3, false), &TOKENS);
        let fp8_h = run(KvFormat::both(KvElem::Fp8E4m3, true), &TOKENS);
        let (d_bf16, d_fp8, d_fp8_h) = (max_diff(&exact, &bf16), max_diff(&exact, &fp8), max_diff(&exact, &fp8_h));
        assert!(d_bf16 > 0.0 && d_fp8 > d_bf16, "bf16 {d_bf16}, fp8 {d_fp8}");
        // The rotation changes which values are rounded, so the fp8 results differ.
        assert!(d_fp8_h > 0.0 && max_diff(&fp8, &fp8_h) > 0.0);
    }

    #[test]
    fn a_rotation_needs_a_power_of_two_head_dim() {
        let mut config = tiny_config();
        config.head_dim = 6;
        config.num_attention_heads = 4;
        let mut b = CpuBackend::new(dummy_weights(&config, 7), KvCacheShape { num_blocks: 2, block_size: 4 }, 1).unwrap();
        let e = b.set_kv_format(KvFormat { hadamard: true, ..KvFormat::F32 }).unwrap_err().to_string();
        assert!(e.contains("power-of-two"), "{e}");
        assert_eq!(KvElem::Fp8E4m3.round(1000.0), 448.0, "saturates as the CUDA cache does");
        assert_eq!(KvElem::Bf16.round(1.0 + 1.0 / 512.0), 1.0);
    }
}
