//! A BERT-family encoder on the CPU over a ragged batch (`plan::RaggedBatch`): embeddings (word +
//! absolute position + token type, LayerNorm), then per layer fused q/k/v, bidirectional attention
//! restricted to each sequence, output projection + residual + LayerNorm, GELU feed-forward +
//! residual + LayerNorm (post-LN, as BERT). f32 throughout, on a private rayon pool; or, with
//! `--quantization int8` ([`CpuEncoder::with_quantization`]), the four linears of each layer (q/k/v,
//! attention output, feed-forward up and down) in int8 (`super::int8`: row-wise weights, activations
//! quantized per token by the step that produces them) and, where the CPU has AVX-512 VNNI, the
//! attention's two products too (`super::attention_int8`); embeddings, LayerNorm, softmax, GELU and
//! the residual stream stay f32. The int8 path fuses the feed-forward up projection with the GELU
//! and the next quantization (`int8::gemm_then_quantize`), so a block of rows is finished in cache.
//!
//! The projections are large GEMMs (all tokens of the batch at once: the point of token-level
//! batching), so they run on the `gemm` crate's cache-blocked kernels rather than the decoder's
//! dot-product tiles, which stream the whole activation matrix once per 16 weight rows. Attention and
//! the per-row ops read only their own sequence; a sequence's result may differ from its result alone
//! only by the GEMM's summation order (float32 rounding, far below the 1e-5 the tests allow).

use rayon::prelude::*;

use super::attention_int8;
use super::int8::{self, Int8Linear, Kernel, QuantRows};
use super::simd::Isa;
use super::vmath;
use crate::backend::EncoderBackend;
use crate::encoder::config::{Activation, EncoderConfig};
use crate::encoder::weights::{EncoderWeights, LayerNorm, Linear};
use crate::model::rowquant::RowFormat;
use crate::plan::RaggedBatch;
use crate::{EngineError, Result};

struct Layer {
    /// `[q; k; v]` rows fused: one pass over the input.
    qkv: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

/// A layer whose four linears are int8 (`--quantization int8`).
struct Int8Layer {
    qkv: Int8Linear,
    attn_out: Int8Linear,
    attn_norm: LayerNorm,
    intermediate: Int8Linear,
    output: Int8Linear,
    output_norm: LayerNorm,
}

enum Layers {
    F32(Vec<Layer>),
    Int8(Vec<Int8Layer>, Kernel),
}

pub struct CpuEncoder {
    config: EncoderConfig,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    embeddings_norm: LayerNorm,
    layers: Layers,
    pool: std::sync::Arc<rayon::ThreadPool>,
    threads: usize,
    isa: Isa,
    /// The int8 path's attention in int8 too (`super::attention_int8`): set with int8 where the
    /// CPU has AVX-512 VNNI, the ISA is not capped below AVX-512 and the head size is 32 or 64.
    int8_attention: bool,
    /// The int8 path's activations, one set per chunk in flight, reused by every forward.
    scratch: Vec<Scratch>,
}

impl std::fmt::Debug for CpuEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuEncoder").field("threads", &self.threads).field("isa", &self.isa).finish()
    }
}

impl CpuEncoder {
    /// `threads == 0` uses every available core. The classifier head (if any) stays with the caller.
    pub fn new(config: EncoderConfig, weights: EncoderWeights, threads: usize) -> Result<CpuEncoder> {
        Self::with_quantization(config, weights, threads, None)
    }

    /// As [`CpuEncoder::new`]; `Some(RowFormat::Int8)` quantizes each layer's linears to int8 (W8A8,
    /// one scale per weight row and per token). FP8 has no CPU encoder kernel and is refused.
    pub fn with_quantization(
        config: EncoderConfig,
        weights: EncoderWeights,
        threads: usize,
        quantization: Option<RowFormat>,
    ) -> Result<CpuEncoder> {
        if let Some(f) = quantization.filter(|&f| f != RowFormat::Int8) {
            return Err(EngineError::Unsupported(format!(
                "--quantization {} on an encoder: the CPU encoder has int8 kernels only",
                f.name()
            )));
        }
        let (pool, threads) = super::thread_pool(threads, "peregrine-enc")?;
        let isa = Isa::detect();
        let layers = Layers::F32(
            weights
                .layers
                .into_iter()
                .map(|l| Layer {
                    qkv: l.fused_qkv(),
                    attn_out: l.attn_out,
                    attn_norm: l.attn_norm,
                    intermediate: l.intermediate,
                    output: l.output,
                    output_norm: l.output_norm,
                })
                .collect(),
        );
        let mut encoder = CpuEncoder {
            config,
            word: weights.word_embeddings,
            position: weights.position_embeddings,
            token_type: weights.token_type_embeddings,
            embeddings_norm: weights.embeddings_norm,
            layers,
            pool,
            threads,
            isa,
            int8_attention: false,
            scratch: Vec::new(),
        };
        if quantization.is_some() {
            encoder.quantize_int8()?;
        }
        Ok(encoder)
    }

    /// Replaces the f32 layers by int8 ones, smoothed ([`Int8Linear::quantize_smoothed`]) by the
    /// activation ranges of one f32 forward over fixed calibration inputs: 4 sequences of 128
    /// pseudo-random ids from the upper part of the vocabulary (away from special and unused ids;
    /// the outlier columns smoothing is for are the model's, whatever the text).
    fn quantize_int8(&mut self) -> Result<()> {
        let Layers::F32(layers) = &self.layers else {
            return Ok(());
        };
        let c = &self.config;
        let len = 128.min(c.max_tokens_per_sequence());
        let (lo, span) = (c.vocab_size / 4, (c.vocab_size - c.vocab_size / 4).max(1) as u64);
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut batch = RaggedBatch::new();
        for _ in 0..4 {
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    (lo as u64 + (state >> 33) % span) as u32
                })
                .collect();
            batch.push(&ids, &vec![0; len]);
        }
        c.check_batch(&batch)?;
        let n = batch.num_tokens();
        let mut seen: Vec<[Vec<f32>; 4]> = Vec::with_capacity(layers.len());
        let mut x = vec![0f32; n * c.hidden_size];
        let mut scratch = Scratch::new(n * c.hidden_size);
        self.pool.install(|| {
            self.embed(&batch, &mut x);
            for l in layers {
                let mut m = Default::default();
                self.layer(l, &batch, &mut x, &mut scratch, Some(&mut m));
                seen.push(m);
            }
        });
        let mut out = Vec::with_capacity(layers.len());
        for (i, (l, m)) in layers.iter().zip(&seen).enumerate() {
            let q = |lin: &Linear, m: &[f32], name: &str| Int8Linear::quantize_smoothed(lin, m, &format!("encoder.layer.{i}.{name}"));
            out.push(Int8Layer {
                qkv: q(&l.qkv, &m[0], "attention.self.{query,key,value}")?,
                attn_out: q(&l.attn_out, &m[1], "attention.output.dense")?,
                attn_norm: l.attn_norm.clone(),
                intermediate: q(&l.intermediate, &m[2], "intermediate.dense")?,
                output: q(&l.output, &m[3], "output.dense")?,
                output_norm: l.output_norm.clone(),
            });
        }
        self.layers = Layers::Int8(out, Kernel::detect(self.isa));
        self.int8_attention = self.isa == Isa::Avx512 && attention_int8::available(c.head_dim());
        Ok(())
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// One parallel pass over every token of the batch (a region per sequence cost 64 wake-ups
    /// and joins for 64 short requests); each token's position is its index in its sequence.
    fn embed(&self, batch: &RaggedBatch, x: &mut [f32]) {
        let h = self.config.hidden_size;
        let eps = self.config.layer_norm_eps;
        let mut positions = Vec::with_capacity(batch.num_tokens());
        for s in 0..batch.num_seqs() {
            positions.extend(0..batch.range(s).len());
        }
        x.par_chunks_mut(h).zip(positions.par_iter()).enumerate().for_each(|(t, (row, &i))| {
            let (id, ty) = (batch.ids[t] as usize, batch.type_ids[t] as usize);
            let pos = self.config.position_offset + i;
            let w = &self.word[id * h..(id + 1) * h];
            let p = &self.position[pos * h..(pos + 1) * h];
            let tt = &self.token_type[ty * h..(ty + 1) * h];
            for j in 0..h {
                row[j] = w[j] + p[j] + tt[j];
            }
            layer_norm(row, &self.embeddings_norm, eps);
        });
    }

    /// The int8 layers over the batch in chunks of whole sequences, each chunk through every
    /// layer before the next step of another chunk touches its rows: its activations stay in
    /// cache between the steps that make and read them. Chunks run in parallel (one task each,
    /// with its own [`Scratch`] from `spare`), and a chunk's steps split further over the pool
    /// only when a thread is idle to steal them: with one parallel region per step, a forward of 64
    /// short requests synchronized both threads ~50 times, and a thread waiting to be woken is
    /// a thread not computing. A chunk holds at most [`INT8_CHUNK_TOKENS`] tokens (or one longer
    /// sequence) and about 1/threads of the batch, so that short batches still give every
    /// thread a chunk. Results do not change: a sequence's int8 result does not depend on its batch.
    fn int8_chunks(&self, layers: &[Int8Layer], kernel: Kernel, batch: &RaggedBatch, x: &mut [f32], spare: &std::sync::Mutex<Vec<Scratch>>) {
        let h = self.config.hidden_size;
        let target = batch.num_tokens().div_ceil(self.threads.max(1)).clamp(1, INT8_CHUNK_TOKENS);
        let mut chunks = Vec::new();
        let mut rest = x;
        let mut s = 0;
        while s < batch.num_seqs() {
            let start = batch.range(s).start;
            let mut chunk = RaggedBatch::new();
            while s < batch.num_seqs() && (chunk.num_seqs() == 0 || batch.range(s).end - start <= target) {
                let r = batch.range(s);
                chunk.push(&batch.ids[r.clone()], &batch.type_ids[r]);
                s += 1;
            }
            let (xs, tail) = rest.split_at_mut(chunk.num_tokens() * h);
            rest = tail;
            chunks.push((chunk, xs));
        }
        let take = || spare.lock().ok().and_then(|mut v| v.pop()).unwrap_or_default();
        let give = |scratch: Scratch| {
            if let Ok(mut v) = spare.lock() {
                v.push(scratch);
            }
        };
        let parallel = chunks.len() > 1;
        let run = |(chunk, xs): (RaggedBatch, &mut [f32])| {
            let mut scratch = take();
            // The embeddings' output, quantized for the first layer's q/k/v.
            if let Some(first) = layers.first() {
                scratch.xq.quantize_all(kernel, xs, h, &first.qkv.smooth);
            }
            scratch.ctx.resize(chunk.num_tokens() * h, 0.0);
            for (i, l) in layers.iter().enumerate() {
                self.layer_int8(l, layers.get(i + 1), kernel, &chunk, xs, &mut scratch, parallel);
            }
            give(scratch);
        };
        if chunks.len() == 1 {
            chunks.into_iter().for_each(run);
        } else {
            chunks.into_par_iter().with_max_len(1).for_each(run);
        }
    }

    /// [`CpuEncoder::layer`] with int8 linears. On entry `xq` holds `x` quantized for this layer's
    /// q/k/v; on exit, for `next`'s (if any). Each activation is quantized (and smoothed for the
    /// linear that reads it) where it is made: the LayerNorms' and the GELU's rows while they are in
    /// cache; the attention context in a pass of its own, because its heads are written by separate
    /// tasks and a token's scale needs the whole row.
    /// `parallel`: other chunks run beside this one (so its steps need not split to keep every
    /// thread busy).
    #[allow(clippy::too_many_arguments)]
    fn layer_int8(&self, l: &Int8Layer, next: Option<&Int8Layer>, kernel: Kernel, batch: &RaggedBatch, x: &mut [f32], s: &mut Scratch, parallel: bool) {
        let c = &self.config;
        let (h, n) = (c.hidden_size, batch.num_tokens());
        let eps = c.layer_norm_eps;
        int8::gemm(kernel, &s.xq, n, &l.qkv, &mut s.qkv);
        self.attention(batch, &s.qkv, &mut s.ctx, self.int8_attention);
        s.ctxq.quantize_all(kernel, &s.ctx, h, &l.attn_out.smooth);
        int8::gemm(kernel, &s.ctxq, n, &l.attn_out, &mut s.proj);
        residual_norm_int8(x, &s.proj, &l.attn_norm, h, eps, self.isa, kernel, Some((&mut s.xq, &l.intermediate.smooth)));
        let (act, isa) = (c.activation, self.isa);
        if n >= FUSE_FROM_TOKENS || parallel {
            int8::gemm_then_quantize(kernel, &s.xq, n, &l.intermediate, &mut s.inter, |row| activate(act, isa, row), &l.output.smooth, &mut s.interq);
        } else {
            // Too few token blocks to keep every thread busy: split the GEMM over row groups too.
            int8::gemm(kernel, &s.xq, n, &l.intermediate, &mut s.inter);
            s.interq.reset(n, c.intermediate_size);
            let smooth = &l.output.smooth;
            s.inter.par_chunks_mut(c.intermediate_size).zip(s.interq.rows_mut()).for_each_init(Vec::new, |tmp, (row, (codes, scale))| {
                activate(act, isa, row);
                *scale = int8::quantize_input(kernel, row, smooth, tmp, codes);
            });
        }
        int8::gemm(kernel, &s.interq, n, &l.output, &mut s.proj);
        residual_norm_int8(x, &s.proj, &l.output_norm, h, eps, self.isa, kernel, next.map(|nl| (&mut s.xq, nl.qkv.smooth.as_slice())));
    }

    /// One f32 layer. `seen` (calibration for int8): each of the four linears' input columns' max
    /// |x| (q/k/v, attention output, up, down), recorded on the way.
    fn layer(&self, l: &Layer, batch: &RaggedBatch, x: &mut [f32], s: &mut Scratch, mut seen: Option<&mut [Vec<f32>; 4]>) {
        let c = &self.config;
        let (h, n) = (c.hidden_size, batch.num_tokens());
        let eps = c.layer_norm_eps;
        let mut record = |i: usize, v: &[f32], width: usize| {
            if let Some(m) = seen.as_deref_mut() {
                m[i] = column_max(v, width);
            }
        };
        record(0, x, h);
        linear(self.isa, x, n, &l.qkv, &mut s.qkv);
        self.attention(batch, &s.qkv, &mut s.ctx, false);
        record(1, &s.ctx, h);
        linear(self.isa, &s.ctx, n, &l.attn_out, &mut s.proj);
        residual_norm(x, &s.proj, &l.attn_norm, h, eps);
        record(2, x, h);
        linear(self.isa, x, n, &l.intermediate, &mut s.inter);
        let (act, isa) = (c.activation, self.isa);
        s.inter.par_chunks_mut(c.intermediate_size).for_each(|row| activate(act, isa, row));
        record(3, &s.inter, c.intermediate_size);
        linear(self.isa, &s.inter, n, &l.output, &mut s.proj);
        residual_norm(x, &s.proj, &l.output_norm, h, eps);
    }

    /// Each token's query attends to every key of its own sequence (no causal mask, no padding).
    /// One task per (sequence, head), on the pool: `S = Q·Kᵀ·scale` and `ctx = softmax(S)·V` as two
    /// small GEMMs over strided views of the fused `qkv` rows, so each key and value row is loaded
    /// once per block of queries rather than once per query (the scalar loop this replaced did the
    /// latter and was the encoder's bottleneck from 128 tokens up). A task reads only its own
    /// sequence, so a sequence's context does not depend on what else is in the batch.
    ///
    /// `quantized` (the int8 path, where the CPU has AVX-512 VNNI): each task in int8 instead
    /// (`super::attention_int8`), its softmax fused between the two products.
    fn attention(&self, batch: &RaggedBatch, qkv: &[f32], ctx: &mut [f32], quantized: bool) {
        let c = &self.config;
        let (h, heads, d) = (c.hidden_size, c.num_attention_heads, c.head_dim());
        let scale = 1.0 / (d as f32).sqrt();
        assert!(qkv.len() == batch.num_tokens() * 3 * h && ctx.len() == batch.num_tokens() * h, "attention: shapes");
        // Short sequences in the int8 path: one task for all heads of a sequence (a (sequence,
        // head) task at 16 tokens is ~1 µs of work, 768 of them a layer for 64 requests).
        let tasks: Vec<(usize, usize, usize, usize)> = (0..batch.num_seqs())
            .flat_map(|s| {
                let range = batch.range(s);
                let group = if quantized && range.len() < SEQ_TASK_BELOW { heads } else { 1 };
                (0..heads).step_by(group).map(move |head| (range.start, range.len(), head, (head + group).min(heads)))
            })
            .collect();
        let out = SharedOut(ctx.as_mut_ptr());
        if quantized {
            thread_local! {
                /// Each pool thread's attention buffers, kept across tasks and forwards (no
                /// allocation or page faults per task: 768 tasks a layer for 64 short sequences).
                static BUFFERS: std::cell::RefCell<(attention_int8::Scratch, Vec<f32>)> = Default::default();
            }
            tasks.into_par_iter().for_each(|(start, len, first, end)| {
                BUFFERS.with_borrow_mut(|(scratch, local)| {
                    local.resize(len * d, 0.0);
                    for head in first..end {
                        let view = attention_int8::HeadView { stride: 3 * h, q: head * d, k: h + head * d, v: 2 * h + head * d, d };
                        attention_int8::head(&qkv[start * 3 * h..(start + len) * 3 * h], len, view, scale, scratch, local);
                        for (i, row) in local[..len * d].chunks_exact(d).enumerate() {
                            // SAFETY: as below: this task's (rows, columns) block of ctx only.
                            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.at((start + i) * h + head * d), d) };
                        }
                    }
                })
            });
            return;
        }
        let isa = self.isa;
        tasks.into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, (start, len, head, _)| {
            scores.clear();
            scores.resize(len * len, 0.0);
            let q = qkv[start * 3 * h + head * d..].as_ptr();
            let k = qkv[start * 3 * h + h + head * d..].as_ptr();
            let v = qkv[start * 3 * h + 2 * h + head * d..].as_ptr();
            let stride = 3 * h as isize;
            // SAFETY: rows start..start+len of qkv hold len × 3h floats (asserted above); Q, K and V
            // of `head` are d columns at offsets head·d, h + head·d and 2h + head·d of each row, so
            // every read stays inside them. `scores` holds len × len.
            unsafe {
                // scores[i, j] = scale · Σ_e Q[i, e] · K[j, e]: rhs is Kᵀ (d × len), column j = K's row j.
                gemm::gemm(
                    len, len, d,
                    scores.as_mut_ptr(), 1, len as isize,
                    false,
                    q, 1, stride,
                    k, stride, 1,
                    0.0, scale,
                    false, false, false,
                    gemm::Parallelism::None,
                );
            }
            scores.chunks_mut(len).for_each(|row| vmath::softmax(isa, row));
            // SAFETY: ctx has num_tokens × h floats (asserted above). This task writes only rows
            // start..start+len, columns head·d..(head+1)·d, and no two tasks share a (sequence, head),
            // so the writes are disjoint; ctx outlives the parallel loop, which joins before returning.
            unsafe {
                let dst = out.at(start * h + head * d);
                gemm::gemm(
                    len, d, len,
                    dst, 1, h as isize,
                    false,
                    scores.as_ptr(), 1, len as isize,
                    v, 1, stride,
                    0.0, 1.0,
                    false, false, false,
                    gemm::Parallelism::None,
                );
            }
        });
    }
}

/// The context buffer's base pointer, shared by the attention tasks, which write disjoint blocks.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: see `attention`: every task writes its own (rows, columns) block of the buffer.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// A method, not a field read, so closures capture the whole (Send) wrapper, not the raw pointer.
    ///
    /// # Safety
    /// `offset` must lie inside the buffer.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller keeps `offset` inside the buffer.
        unsafe { self.0.add(offset) }
    }
}

impl Scratch {
    fn new(ctx_len: usize) -> Scratch {
        Scratch {
            qkv: Vec::new(),
            ctx: vec![0f32; ctx_len],
            proj: Vec::new(),
            inter: Vec::new(),
            xq: QuantRows::default(),
            ctxq: QuantRows::default(),
            interq: QuantRows::default(),
        }
    }
}

/// Activations of one forward, sized for its token count. The int8 path keeps one between
/// forwards ([`CpuEncoder`]'s `scratch`): fresh buffers cost page faults and zeroing on every batch.
#[derive(Default)]
struct Scratch {
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    proj: Vec<f32>,
    inter: Vec<f32>,
    /// Int8 only: the hidden state, the attention context and the GELU output, quantized per token.
    xq: QuantRows,
    ctxq: QuantRows,
    interq: QuantRows,
}

/// The int8 path runs a batch's sequences in chunks of at most this many tokens (or one longer
/// sequence), each chunk through every layer ([`CpuEncoder::int8_chunks`]; smaller where the
/// batch has fewer than threads × this). 1024 did better than 512 and 2048 when chunks ran one
/// after the other (docs/benchmarks.md, session 11).
const INT8_CHUNK_TOKENS: usize = 1024;

/// From this many tokens the int8 path fuses the feed-forward up projection with the GELU and the
/// quantization (`int8::gemm_then_quantize`, whose tasks are 48-token blocks: one 16-token request
/// would be a single task, on one thread, where the unfused GEMM splits over row groups as well),
/// and at any size when chunks run in parallel (each thread has a chunk of its own).
const FUSE_FROM_TOKENS: usize = 384;

/// Int8 attention on sequences shorter than this runs one task per sequence (all heads), longer
/// ones one task per (sequence, head).
const SEQ_TASK_BELOW: usize = 64;

/// From this many tokens in a batch the projections run on `gemm` (see `linear`).
const GEMM_FROM_TOKENS: usize = 256;

fn linear(isa: Isa, x: &[f32], n: usize, l: &Linear, out: &mut Vec<f32>) {
    let (rows, k) = (l.weight.rows, l.weight.cols);
    out.resize(n * rows, 0.0);
    let w = match &l.weight.data {
        crate::model::MatrixData::F32(w) if n >= GEMM_FROM_TOKENS => w.as_slice(),
        // Up to a few hundred tokens, the decoder's tile kernel (each weight row read once and
        // dotted with every token): `gemm` packs the whole weight matrix on every call, which for a
        // short batch costs more than the products (one 16-token request took 3.3x as long through
        // it, one of 128 tokens 1.14x; docs/benchmarks.md). Weights not held as f32 go there too.
        _ => {
            super::matmul::matmul(isa, x, n, &l.weight, out);
            add_bias(out, &l.bias, rows);
            return;
        }
    };
    assert!(x.len() == n * k && w.len() == rows * k, "linear: shapes");
    // out[t, r] = Σ_j x[t, j] · W[r, j]: dst n × rows row-major, lhs x (n × k row-major), rhs Wᵀ
    // (k × rows, column r is W's row r).
    // SAFETY: the pointers cover n·rows, n·k and rows·k elements with the strides given (checked above).
    unsafe {
        gemm::gemm(
            n,
            rows,
            k,
            out.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        );
    }
    add_bias(out, &l.bias, rows);
}

fn add_bias(out: &mut [f32], bias: &[f32], rows: usize) {
    out.par_chunks_mut(rows).for_each(|row| {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    });
}

/// `x = LayerNorm(x + y)` per row.
fn residual_norm(x: &mut [f32], y: &[f32], norm: &LayerNorm, h: usize, eps: f32) {
    x.par_chunks_mut(h).zip(y.par_chunks(h)).for_each(|(xr, yr)| {
        for (a, &b) in xr.iter_mut().zip(yr) {
            *a += b;
        }
        layer_norm(xr, norm, eps);
    });
}

/// [`residual_norm`] in f32 ([`vmath::residual_layer_norm`]), each row then quantized into `xq`
/// (when given; smoothed by its slice) while it is in cache.
#[allow(clippy::too_many_arguments)]
fn residual_norm_int8(x: &mut [f32], y: &[f32], norm: &LayerNorm, h: usize, eps: f32, isa: Isa, kernel: Kernel, xq: Option<(&mut QuantRows, &[f32])>) {
    let Some((xq, smooth)) = xq else {
        x.par_chunks_mut(h).zip(y.par_chunks(h)).for_each(|(xr, yr)| vmath::residual_layer_norm(isa, xr, yr, &norm.weight, &norm.bias, eps));
        return;
    };
    xq.reset(x.len() / h, h);
    x.par_chunks_mut(h).zip(y.par_chunks(h)).zip(xq.rows_mut()).for_each_init(Vec::new, |tmp, ((xr, yr), (codes, scale))| {
        vmath::residual_layer_norm(isa, xr, yr, &norm.weight, &norm.bias, eps);
        *scale = int8::quantize_input(kernel, xr, smooth, tmp, codes);
    });
}

/// Max |v| of each column of the rows of `x` (`width` wide).
fn column_max(x: &[f32], width: usize) -> Vec<f32> {
    let mut m = vec![0f32; width];
    for row in x.chunks_exact(width) {
        for (m, &v) in m.iter_mut().zip(row) {
            *m = m.max(v.abs());
        }
    }
    m
}

/// LayerNorm of one row in place; mean and variance (biased, as torch) summed in f64.
fn layer_norm(row: &mut [f32], norm: &LayerNorm, eps: f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = row.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for ((v, &w), &b) in row.iter_mut().zip(&norm.weight).zip(&norm.bias) {
        *v = ((*v as f64 - mean) * inv) as f32 * w + b;
    }
}

fn activate(act: Activation, isa: Isa, row: &mut [f32]) {
    match act {
        Activation::GeluErf => vmath::gelu_erf(isa, row),
        Activation::GeluTanh => row.iter_mut().for_each(|v| {
            let x = *v;
            let inner = (2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            *v = 0.5 * x * (1.0 + inner.tanh());
        }),
        Activation::Relu => row.iter_mut().for_each(|v| *v = v.max(0.0)),
    }
}

impl EncoderBackend for CpuEncoder {
    fn forward(&mut self, batch: &RaggedBatch) -> Result<Vec<f32>> {
        let c = &self.config;
        c.check_batch(batch)?;
        let n = batch.num_tokens();
        let mut x = vec![0f32; n * c.hidden_size];
        if let Layers::Int8(layers, kernel) = &self.layers {
            let mut spare = std::sync::Mutex::new(std::mem::take(&mut self.scratch));
            self.pool.install(|| {
                self.embed(batch, &mut x);
                self.int8_chunks(layers, *kernel, batch, &mut x, &spare);
            });
            self.scratch = std::mem::take(spare.get_mut().unwrap_or_else(|e| e.into_inner()));
            return Ok(x);
        }
        let mut scratch = Scratch::new(n * c.hidden_size);
        self.pool.install(|| {
            self.embed(batch, &mut x);
            if let Layers::F32(layers) = &self.layers {
                for l in layers {
                    self.layer(l, batch, &mut x, &mut scratch, None);
                }
            }
        });
        Ok(x)
    }

    fn name(&self) -> String {
        match &self.layers {
            Layers::F32(_) => format!("cpu-encoder ({} threads, {})", self.threads, self.isa.name()),
            Layers::Int8(_, kernel) => format!("cpu-encoder ({} threads, {}, {} linears)", self.threads, self.isa.name(), kernel.name()),
        }
    }
}
