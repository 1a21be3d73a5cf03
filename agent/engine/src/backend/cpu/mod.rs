//! The CPU reference backend: f32 compute (weights may stay quantized and are dequantized to the
//! same f32 values inside the matmul), paged KV cache in host memory, rayon for threads.

pub mod attention;
mod attention_int8;
pub mod calibrate;
pub mod encoder;
pub mod hadamard;
pub mod int8;
pub mod kv_cache;
pub mod lora;
pub mod matmul;
#[cfg(target_arch = "x86_64")]
mod matmul_avx2;
mod matmul_w8a8;
pub mod ops;
pub mod simd;
pub mod tp;
mod vmath;

use attention::TokenCtx;
use kv_cache::{KvCache, KvFormat};
use matmul::matmul;
use ops::Rope;
use simd::Isa;

use crate::backend::{kv_block_bytes, Backend, KvCacheShape, Logits, StepBatch};
use crate::config::ModelConfig;
use self::lora::{CpuLora, Rows, RowsMut};
use crate::lora::{LoraAdapter, TargetModule};
use crate::model::gptq::{LayerInputs, LinearInput};
use crate::model::{Matrix, ModelWeights};
use crate::{EngineError, Result};

/// A pool of `threads` CPU threads (`0`: every available core) named `{name}-{i}`, and its size.
fn thread_pool(threads: usize, name: &'static str) -> Result<(std::sync::Arc<rayon::ThreadPool>, usize)> {
    let threads = if threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{name}-{i}"))
        .build()
        .map_err(|e| {
            EngineError::Backend(format!("cannot start {threads} CPU threads: {e}"))
        })?;
    Ok((std::sync::Arc::new(pool), threads))
}

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
    /// The block of the online rotation of down_proj's input (`ModelWeights::down_input_hadamard`).
    down_input_hadamard: Option<usize>,
    /// `--quantization-gptq`: the second moment of every linear layer's input, summed over the
    /// steps run while it is set (`record_linear_inputs`).
    linear_inputs: Option<Vec<LayerInputs>>,
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
        let (pool, threads) = thread_pool(threads, "peregrine-cpu")?;
        CpuBackend::with_pool(weights, kv, pool, threads)
    }

    /// A backend computing on `pool` (of `threads` threads), which it may share with others (the
    /// ranks of the fake tensor parallelism take turns on one pool).
    fn with_pool(weights: ModelWeights, kv: KvCacheShape, pool: std::sync::Arc<rayon::ThreadPool>, threads: usize) -> Result<CpuBackend> {
        weights
            .validate()
            .map_err(|m| EngineError::Backend(format!("weights do not match the config: {m}")))?;
        let config = weights.config.clone();
        let down_input_hadamard = weights.down_input_hadamard;
        if let Some(b) = down_input_hadamard.filter(|&b| !b.is_power_of_two() || !config.intermediate_size.is_multiple_of(b)) {
            return Err(EngineError::Backend(format!("down_proj's input rotation in blocks of {b} does not tile {} channels", config.intermediate_size)));
        }
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
            down_input_hadamard,
            linear_inputs: None,
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
        kv_block_bytes(config, block_size, 4 * config.head_dim)
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
        check_step(batch, self.config.vocab_size, self.kv.shape, self.lora.is_some())
    }

    fn forward_inner(&mut self, batch: &StepBatch) -> Logits {
        let h = self.trunk(batch);
        let rows = logit_rows(batch);
        let normed = self.final_norm(&h, &rows);
        let mut data = vec![0f32; rows.len() * self.config.vocab_size];
        self.lm_head_into(&normed, rows.len(), &mut data);
        Logits {
            vocab: self.config.vocab_size,
            data,
        }
    }

    /// The final norm's output for every token of `batch` (`tokens × hidden_size`, row-major): the
    /// hidden states a decoder model's embeddings are pooled from (last-token pooling). The batch's
    /// K/V are written to the cache as for a forward.
    pub fn final_hidden_states(&mut self, batch: &StepBatch) -> Result<Vec<f32>> {
        self.check_batch(batch)?;
        if self.lora.is_some() {
            return Err(EngineError::Backend("final hidden states are for the base model only (no LoRA)".into()));
        }
        let pool = std::sync::Arc::clone(&self.pool);
        let h = pool.install(|| self.trunk(batch));
        let mut normed = vec![0f32; h.len()];
        ops::rms_norm(&h, &self.norm, self.config.rms_norm_eps, &mut normed);
        Ok(normed)
    }

    /// From now on, sums `x·xᵀ` of every linear layer's inputs over the tokens of each step (the
    /// calibration GPTQ needs); `take_linear_inputs` returns the sums and stops.
    pub fn record_linear_inputs(&mut self) {
        let c = &self.config;
        self.linear_inputs = Some((0..self.layers.len()).map(|_| LayerInputs::new(c)).collect());
    }

    /// The sums since `record_linear_inputs` (layer by layer), or `None` if it was not called.
    pub fn take_linear_inputs(&mut self) -> Option<Vec<LayerInputs>> {
        self.linear_inputs.take()
    }

    /// Embedding and every decoder layer: the residual stream of each token before the final norm.
    fn trunk(&mut self, batch: &StepBatch) -> Vec<f32> {
        let (hidden, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        let n = batch.tokens.len();
        let ctx = token_ctx(batch);
        let mut h = vec![0f32; n * hidden];
        for (row, &t) in h.chunks_exact_mut(hidden).zip(&batch.tokens) {
            self.embed.row_into(t as usize, row);
        }
        let mut xn = vec![0f32; n * hidden];
        let mut s = Scratch::new(&self.config, n, self.rope.half());
        for li in 0..self.layers.len() {
            ops::rms_norm(&h, &self.layers[li].attn_norm, eps, &mut xn);
            self.attention_block(li, &xn, &ctx, &mut s);
            add_into(&mut h, &s.proj);
            ops::rms_norm(&h, &self.layers[li].mlp_norm, eps, &mut xn);
            self.mlp_block(li, &xn, &mut s);
            add_into(&mut h, &s.proj);
        }
        h
    }

    /// The attention half of layer `li` on its normalized input `xn`: q/k/v (with LoRA, bias and
    /// RoPE), K and V written to the cache, attention, o_proj (with LoRA) into `s.proj`. Under
    /// tensor parallelism this backend holds one rank's heads and `s.proj` is its partial sum.
    fn attention_block(&mut self, li: usize, xn: &[f32], ctx: &[TokenCtx<'_>], s: &mut Scratch) {
        let c = &self.config;
        let n = ctx.len();
        let (hidden, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let qkv_dim = q_dim + 2 * kv_dim;
        let isa = self.isa;
        record(&mut self.linear_inputs, li, LinearInput::Attention, xn, n);
        let layer = &self.layers[li];
        matmul(isa, xn, n, &layer.qkv, &mut s.qkv);
        if let Some(lora) = &self.lora {
            // q, k and v sit side by side in each fused qkv row.
            for (m, off) in [(TargetModule::Q, 0), (TargetModule::K, q_dim), (TargetModule::V, q_dim + kv_dim)] {
                let x = Rows { data: xn, stride: hidden, offset: 0 };
                lora.apply(li, m, x, RowsMut { data: &mut s.qkv, stride: qkv_dim, offset: off });
            }
        }
        for (row, tc) in s.qkv.chunks_exact_mut(qkv_dim).zip(ctx) {
            if let Some(b) = &layer.qkv_bias {
                for (x, &bb) in row.iter_mut().zip(b) {
                    *x += bb;
                }
            }
            let (q, rest) = row.split_at_mut(q_dim);
            let (k, v) = rest.split_at_mut(kv_dim);
            self.rope.apply(q, tc.pos as u32, &mut s.cos, &mut s.sin);
            self.rope.apply(k, tc.pos as u32, &mut s.cos, &mut s.sin);
            if self.kv.format.hadamard {
                hadamard::rotate_heads(q, c.head_dim);
                hadamard::rotate_heads(k, c.head_dim);
            }
            if self.kv.format.hadamard_v {
                hadamard::rotate_heads(v, c.head_dim);
            }
            attention::write_kv(&mut self.kv, li, tc.block_table, tc.pos, k, v);
        }
        attention::attention(isa, &self.kv, li, c.num_attention_heads, &s.qkv, qkv_dim, ctx, &mut s.attn);
        if self.kv.format.hadamard_v {
            // The output is H times the unrotated one: rotate it back.
            hadamard::rotate_heads(&mut s.attn, c.head_dim);
        }
        record(&mut self.linear_inputs, li, LinearInput::Output, &s.attn, n);
        let layer = &self.layers[li];
        matmul(isa, &s.attn, n, &layer.o, &mut s.proj);
        if let Some(lora) = &self.lora {
            let x = Rows { data: &s.attn, stride: q_dim, offset: 0 };
            lora.apply(li, TargetModule::O, x, RowsMut { data: &mut s.proj, stride: hidden, offset: 0 });
        }
    }

    /// The MLP half of layer `li` on its normalized input `xn`: gate/up (with LoRA), SwiGLU, down
    /// (with LoRA) into `s.proj` (one rank's partial sum under tensor parallelism).
    fn mlp_block(&mut self, li: usize, xn: &[f32], s: &mut Scratch) {
        let (hidden, inter) = (self.config.hidden_size, self.config.intermediate_size);
        let n = xn.len() / hidden.max(1);
        let isa = self.isa;
        record(&mut self.linear_inputs, li, LinearInput::Mlp, xn, n);
        let layer = &self.layers[li];
        matmul(isa, xn, n, &layer.gate_up, &mut s.gu);
        if let Some(lora) = &self.lora {
            for (m, off) in [(TargetModule::Gate, 0), (TargetModule::Up, inter)] {
                let x = Rows { data: xn, stride: hidden, offset: 0 };
                lora.apply(li, m, x, RowsMut { data: &mut s.gu, stride: 2 * inter, offset: off });
            }
        }
        ops::swiglu(&s.gu, inter, &mut s.act);
        if let Some(block) = self.down_input_hadamard {
            // down_proj (and its adapter's A) hold the rotation's inverse (model::rotate).
            hadamard::rotate_heads(&mut s.act, block);
        }
        record(&mut self.linear_inputs, li, LinearInput::Down, &s.act, n);
        let layer = &self.layers[li];
        matmul(isa, &s.act, n, &layer.down, &mut s.proj);
        if let Some(lora) = &self.lora {
            let x = Rows { data: &s.act, stride: inter, offset: 0 };
            lora.apply(li, TargetModule::Down, x, RowsMut { data: &mut s.proj, stride: hidden, offset: 0 });
        }
    }

    /// The final norm of the hidden rows `rows` (the rows that want logits), back to back.
    fn final_norm(&self, h: &[f32], rows: &[usize]) -> Vec<f32> {
        let hidden = self.config.hidden_size;
        let mut last = vec![0f32; rows.len() * hidden];
        for (dst, &r) in last.chunks_exact_mut(hidden).zip(rows) {
            dst.copy_from_slice(&h[r * hidden..(r + 1) * hidden]);
        }
        let mut normed = vec![0f32; last.len()];
        ops::rms_norm(&last, &self.norm, self.config.rms_norm_eps, &mut normed);
        normed
    }

    /// Logits of `rows` normalized hidden rows over this backend's vocabulary (a rank's slice of it
    /// under tensor parallelism).
    fn lm_head_into(&self, normed: &[f32], rows: usize, out: &mut [f32]) {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        matmul(self.isa, normed, rows, head, out);
    }
}

/// Per-step work buffers of one backend (one rank), sized by its model shape for `n` tokens.
struct Scratch {
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Scratch {
    fn new(c: &ModelConfig, n: usize, rope_half: usize) -> Scratch {
        let (q_dim, kv_dim, inter) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        Scratch {
            qkv: vec![0f32; n * (q_dim + 2 * kv_dim)],
            attn: vec![0f32; n * q_dim],
            proj: vec![0f32; n * c.hidden_size],
            gu: vec![0f32; n * 2 * inter],
            act: vec![0f32; n * inter],
            cos: vec![0f32; rope_half],
            sin: vec![0f32; rope_half],
        }
    }
}

/// Per-token context for attention, in batch order.
fn token_ctx(batch: &StepBatch) -> Vec<TokenCtx<'_>> {
    let mut ctx = Vec::with_capacity(batch.tokens.len());
    for s in &batch.seqs {
        for j in 0..s.len {
            ctx.push(TokenCtx {
                pos: s.context_len + j,
                block_table: &s.block_table,
            });
        }
    }
    ctx
}

/// The batch rows whose logits the step returns: the last token of each sequence that wants them.
fn logit_rows(batch: &StepBatch) -> Vec<usize> {
    batch
        .seqs
        .iter()
        .filter(|s| s.wants_logits)
        .map(|s| s.start + s.len - 1)
        .collect()
}

/// Rejects a batch that would index outside a KV cache of `kv` or a vocabulary of `vocab`, or that
/// names a LoRA slot where LoRA is off.
fn check_step(batch: &StepBatch, vocab: usize, kv: KvCacheShape, lora_enabled: bool) -> Result<()> {
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
        .find(|&&t| t as usize >= vocab)
    {
        return bad(format!(
            "token id {t} is outside the vocabulary ({})",
            vocab
        ));
    }
    let bs = kv.block_size;
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
            .find(|&&b| b as usize >= kv.num_blocks)
        {
            return bad(format!(
                "sequence {i}: block {b} is outside the pool of {}",
                kv.num_blocks
            ));
        }
    }
    if next != n {
        return bad(format!("sequences cover {next} of {n} tokens"));
    }
    if !lora_enabled {
        self::lora::reject_lora_slots(batch)?;
    }
    Ok(())
}

/// Adds `x` (the input rows of one linear layer) to the recorded sums, when recording.
fn record(linear_inputs: &mut Option<Vec<LayerInputs>>, li: usize, site: LinearInput, x: &[f32], n: usize) {
    if let Some(layers) = linear_inputs {
        layers[li].site_mut(site).add(x, n);
    }
}

fn add_into(h: &mut [f32], x: &[f32]) {
    for (a, b) in h.iter_mut().zip(x) {
        *a += b;
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
        let mut out = [0.0; 2];
        KvElem::Fp8E4m3.round_head(&[1000.0, -1000.0], &mut out);
        assert_eq!(out, [448.0, -448.0], "saturates as the CUDA cache does");
        KvElem::Bf16.round_head(&[1.0 + 1.0 / 512.0, 3.0], &mut out);
        assert_eq!(out, [1.0, 3.0]);
    }
}
