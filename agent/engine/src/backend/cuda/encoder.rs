//! A BERT-family encoder on the GPU over a ragged batch, the same plan as the CPU reference
//! (`backend::cpu::encoder`): embeddings (word, absolute position and token type summed, then
//! LayerNorm), then per layer the fused q/k/v GEMM, varlen bidirectional attention (each sequence over
//! itself, no padding, no mask tensor), the output projection with residual and LayerNorm, and the
//! GELU feed-forward with residual and LayerNorm (post-LN). Activations are f32; the GEMMs run on
//! cuBLAS, in f32 with TF32 off by default (within f32 rounding of the CPU, which the 1e-5 reference
//! tests need) or with bf16 weights and inputs and f32 accumulation ([`EncoderGemm::Bf16`], faster,
//! not held to the references; its attention runs on the tensor cores in bf16 too, where the GPU and
//! the head size allow). Pooling runs on the device (`forward_pooled`: only pooled vectors go to the
//! host); dense layers, normalisation and the classifier head stay on the host (`encoder::sentence`),
//! over the pooled vectors.

use peregrine_kernels::ops::{
    encoder_attention_tiles_of, EmbeddingTables, EncoderActivation, EncoderKernels, EncoderPooling, NormParams, ENC_ATTN_MAX_HEAD_DIM, ENC_ATTN_MMA_HEAD_DIMS,
    ENC_ATTN_MMA_QUERIES_PER_WARP, ENC_ATTN_QUERY_TILE,
};
use peregrine_kernels::{compile, Blas, DevBuf, Gpu, OutType};

use super::gpu_err;
use crate::backend::EncoderBackend;
use crate::encoder::config::{Activation, EncoderConfig};
use crate::encoder::sentence::PoolingMode;
use crate::encoder::weights::{EncoderWeights, LayerNorm, Linear};
use crate::plan::RaggedBatch;
use crate::{EngineError, Result};

/// How the encoder's GEMMs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderGemm {
    /// f32 weights and inputs, f32 compute (no TF32), f32 attention: the reference path, within
    /// 1e-5 of Sentence-Transformers.
    F32,
    /// bf16 weights, GEMM inputs in bf16, f32 accumulation and output; attention on the tensor
    /// cores: 2.0–2.6× torch fp16's model call (docs/benchmarks.md), cosine ≥ 0.99997 to the f32 path.
    Bf16,
}

impl EncoderGemm {
    /// The serving choice: bf16 (what TEI and vLLM serve in on a GPU, half precision), unless
    /// `PEREGRINE_ENCODER_GEMM=f32` asks for the reference path.
    pub fn from_env() -> EncoderGemm {
        match std::env::var("PEREGRINE_ENCODER_GEMM").as_deref() {
            Ok("f32") => EncoderGemm::F32,
            _ => EncoderGemm::Bf16,
        }
    }
}

/// A linear layer on the device: the weight `[rows, cols]` (f32, or bf16 bits) and its f32 bias.
struct DevLinear {
    weight: DevWeight,
    bias: DevBuf<f32>,
    rows: usize,
    cols: usize,
}

enum DevWeight {
    F32(DevBuf<f32>),
    Bf16(DevBuf<u16>),
}

/// Which attention kernel a forward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttentionKernel {
    /// `enc_attention`: CUDA cores, f32 throughout (the reference path's).
    F32,
    /// `enc_attention_mma_d*`: tensor cores, bf16 operands, f32 softmax and accumulation.
    TensorCores,
}

impl AttentionKernel {
    /// The tensor cores for bf16 GEMMs on sm_80+ with a head size they are built for, unless
    /// `PEREGRINE_ENCODER_ATTENTION=f32` asks for the CUDA-core kernel (for comparisons); f32 GEMMs
    /// always keep the f32 kernel (the 1e-5 references).
    fn choose(gemm: EncoderGemm, arch: (i32, i32), head_dim: usize) -> AttentionKernel {
        let forced_f32 = std::env::var("PEREGRINE_ENCODER_ATTENTION").is_ok_and(|v| v == "f32");
        if gemm == EncoderGemm::Bf16 && arch.0 >= 8 && ENC_ATTN_MMA_HEAD_DIMS.contains(&head_dim) && !forced_f32 {
            AttentionKernel::TensorCores
        } else {
            AttentionKernel::F32
        }
    }

    /// Warps a block for a batch of these sequence lengths (tensor cores only; the f32 kernel's
    /// are fixed): 4 (64 queries sharing each K/V tile) unless 64-query tiles would be more than
    /// half empty rows, as for sequences of 16 tokens; then 1.
    fn warps(self, lengths: &[usize]) -> usize {
        let tokens: usize = lengths.iter().sum();
        let padded: usize = lengths.iter().map(|l| l.div_ceil(64) * 64).sum();
        match self {
            AttentionKernel::TensorCores if padded > 2 * tokens => 1,
            _ => 4,
        }
    }

    /// Queries per tile of this kernel with `warps` warps a block.
    fn query_tile(self, warps: usize) -> usize {
        match self {
            AttentionKernel::F32 => ENC_ATTN_QUERY_TILE,
            AttentionKernel::TensorCores => ENC_ATTN_MMA_QUERIES_PER_WARP * warps,
        }
    }
}

/// The attention launch of one forward: its tiles and warps a block.
#[derive(Debug, Clone, Copy)]
struct AttentionLaunch {
    tiles: usize,
    warps: usize,
}

struct DevNorm {
    weight: DevBuf<f32>,
    bias: DevBuf<f32>,
}

struct DevLayer {
    /// `[q; k; v]` rows fused: one GEMM over the input.
    qkv: DevLinear,
    attn_out: DevLinear,
    attn_norm: DevNorm,
    intermediate: DevLinear,
    output: DevLinear,
    output_norm: DevNorm,
}

/// Activations of one forward, grown to the largest batch seen (bounded by the batcher's
/// `--max-num-batched-tokens`, or one sequence of at most the position table's length).
struct Scratch {
    tokens: usize,
    x: DevBuf<f32>,
    qkv: DevBuf<f32>,
    ctx: DevBuf<f32>,
    proj: DevBuf<f32>,
    inter: DevBuf<f32>,
    /// The GEMM input rounded to bf16 (bf16 GEMMs only; tokens × max(hidden, intermediate)).
    input_bf16: DevBuf<u16>,
}

pub struct CudaEncoder {
    config: EncoderConfig,
    gpu: Gpu,
    kernels: EncoderKernels,
    blas: Blas,
    gemm: EncoderGemm,
    attention: AttentionKernel,
    word: DevBuf<f32>,
    position: DevBuf<f32>,
    token_type: DevBuf<f32>,
    embeddings_norm: DevNorm,
    layers: Vec<DevLayer>,
    scratch: Option<Scratch>,
}

impl std::fmt::Debug for CudaEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEncoder").field("device", &self.gpu.ordinal).field("gemm", &self.gemm).finish()
    }
}

impl CudaEncoder {
    /// Uploads the weights to device `device` and compiles (or loads from the cache) the kernels.
    /// The classifier head (if any) stays with the caller, on the host.
    pub fn new(config: EncoderConfig, weights: EncoderWeights, device: usize, gemm: EncoderGemm) -> Result<CudaEncoder> {
        let d = config.head_dim();
        if d == 0 || d > ENC_ATTN_MAX_HEAD_DIM || d * config.num_attention_heads != config.hidden_size {
            return Err(EngineError::Backend(format!(
                "the CUDA encoder needs hidden_size = heads × head_dim with head_dim ≤ {ENC_ATTN_MAX_HEAD_DIM} (got {} = {} heads); use --device cpu",
                config.hidden_size, config.num_attention_heads
            )));
        }
        let gpu = Gpu::new(device).map_err(gpu_err)?;
        let module = compile::load_module(&gpu.ctx, gpu.arch).map_err(gpu_err)?;
        let sms = gpu
            .ctx
            .attribute(peregrine_kernels::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| EngineError::Backend(e.to_string()))?;
        let kernels = EncoderKernels::load(&module, sms.max(1) as u32).map_err(gpu_err)?;
        let blas = Blas::new(&gpu.stream).map_err(gpu_err)?;
        let upload = |v: &[f32]| gpu.upload(v).map_err(gpu_err);
        let norm = |n: &LayerNorm| -> Result<DevNorm> { Ok(DevNorm { weight: upload(&n.weight)?, bias: upload(&n.bias)? }) };
        let linear = |l: &Linear| -> Result<DevLinear> {
            let w = upload(&l.weight.to_f32())?;
            let weight = match gemm {
                EncoderGemm::F32 => DevWeight::F32(w),
                EncoderGemm::Bf16 => {
                    let out = gpu.alloc_zeros::<u16>(w.len()).map_err(gpu_err)?;
                    // SAFETY: both buffers hold w.len() elements on this stream.
                    unsafe { kernels.f32_to_bf16(&gpu.stream, out.ptr(), w.ptr(), w.len()).map_err(gpu_err)? };
                    // The f32 copy is freed when `w` drops; finish the conversion first.
                    gpu.synchronize().map_err(gpu_err)?;
                    DevWeight::Bf16(out)
                }
            };
            Ok(DevLinear { weight, bias: upload(&l.bias)?, rows: l.weight.rows, cols: l.weight.cols })
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            layers.push(DevLayer {
                qkv: linear(&l.fused_qkv())?,
                attn_out: linear(&l.attn_out)?,
                attn_norm: norm(&l.attn_norm)?,
                intermediate: linear(&l.intermediate)?,
                output: linear(&l.output)?,
                output_norm: norm(&l.output_norm)?,
            });
        }
        let attention = AttentionKernel::choose(gemm, gpu.arch, d);
        let encoder = CudaEncoder {
            attention,
            word: upload(&weights.word_embeddings)?,
            position: upload(&weights.position_embeddings)?,
            token_type: upload(&weights.token_type_embeddings)?,
            embeddings_norm: norm(&weights.embeddings_norm)?,
            layers,
            config,
            kernels,
            blas,
            gemm,
            scratch: None,
            gpu,
        };
        Ok(encoder)
    }

    fn ensure_scratch(&mut self, tokens: usize) -> Result<()> {
        if self.scratch.as_ref().is_some_and(|s| s.tokens >= tokens) {
            return Ok(());
        }
        let c = &self.config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let alloc = |len: usize| self.gpu.alloc_zeros::<f32>(len).map_err(gpu_err);
        // Drop the old buffers before allocating their larger successors.
        self.scratch = None;
        let bf16_len = if self.gemm == EncoderGemm::Bf16 { tokens * h.max(i) } else { 0 };
        self.scratch = Some(Scratch {
            tokens,
            x: alloc(tokens * h)?,
            qkv: alloc(tokens * 3 * h)?,
            ctx: alloc(tokens * h)?,
            proj: alloc(tokens * h)?,
            inter: alloc(tokens * i)?,
            input_bf16: self.gpu.alloc_zeros::<u16>(bf16_len).map_err(gpu_err)?,
        });
        Ok(())
    }

    /// `y[n, rows] = x[n, cols] · Wᵀ` (bias added by the caller's next kernel). For bf16 weights
    /// the input is `input_bf16`: `ready` when the kernel that produced x wrote its bf16 copy there
    /// already, else x is converted into it first.
    ///
    /// # Safety
    /// x: n·cols f32 and y: n·rows f32 on the device; `input_bf16` holds n·cols for bf16 GEMMs.
    unsafe fn gemm(&self, y: u64, x: u64, l: &DevLinear, n: usize, input_bf16: u64, ready: bool) -> Result<()> {
        // SAFETY: the caller's buffers have the shapes stated above; the weight is rows × cols.
        let r = unsafe {
            match &l.weight {
                DevWeight::F32(w) => self.blas.matmul_f32(y, x, w.ptr(), n, l.rows, l.cols, 0.0),
                DevWeight::Bf16(w) => {
                    if !ready {
                        self.kernels.f32_to_bf16(&self.gpu.stream, input_bf16, x, n * l.cols).map_err(gpu_err)?;
                    }
                    self.blas.matmul(y, OutType::F32, input_bf16, w.ptr(), n, l.rows, l.cols, 0.0)
                }
            }
        };
        r.map_err(gpu_err)
    }

    /// Uploads the batch's per-token (id, type, position) triples and attention tiles.
    fn upload_plan(&self, batch: &RaggedBatch) -> Result<(DevBuf<i32>, DevBuf<i32>, AttentionLaunch)> {
        let offset = self.config.position_offset;
        let mut meta = Vec::with_capacity(3 * batch.num_tokens());
        for s in 0..batch.num_seqs() {
            for (i, t) in batch.range(s).enumerate() {
                let as_i32 = |v: usize| i32::try_from(v).map_err(|_| EngineError::InvalidRequest(format!("encoder batch: index {v} too large")));
                meta.extend_from_slice(&[as_i32(batch.ids[t] as usize)?, as_i32(batch.type_ids[t] as usize)?, as_i32(offset + i)?]);
            }
        }
        let lengths: Vec<usize> = (0..batch.num_seqs()).map(|s| batch.range(s).len()).collect();
        let warps = self.attention.warps(&lengths);
        let tiles = encoder_attention_tiles_of(lengths, self.attention.query_tile(warps)).map_err(gpu_err)?;
        let launch = AttentionLaunch { tiles: tiles.len() / 3, warps };
        let meta = self.gpu.upload(&meta).map_err(gpu_err)?;
        let tiles = self.gpu.upload(&tiles).map_err(gpu_err)?;
        Ok((meta, tiles, launch))
    }

    fn run_layers(&self, batch: &RaggedBatch, meta: &DevBuf<i32>, tiles: &DevBuf<i32>, launch: AttentionLaunch) -> Result<()> {
        let num_tiles = launch.tiles;
        let c = &self.config;
        let (h, n) = (c.hidden_size, batch.num_tokens());
        let s = self.scratch.as_ref().ok_or_else(|| EngineError::Backend("encoder scratch missing".into()))?;
        let stream = &self.gpu.stream;
        let norm = |n: &DevNorm| NormParams { gamma: n.weight.ptr(), beta: n.bias.ptr(), eps: c.layer_norm_eps };
        let act = match c.activation {
            Activation::GeluErf => EncoderActivation::GeluErf,
            Activation::GeluTanh => EncoderActivation::GeluTanh,
            Activation::Relu => EncoderActivation::Relu,
        };
        let tables = EmbeddingTables { word: self.word.ptr(), position: self.position.ptr(), token_type: self.token_type.ptr() };
        let (x, qkv, ctx, proj, inter, xb) = (s.x.ptr(), s.qkv.ptr(), s.ctx.ptr(), s.proj.ptr(), s.inter.ptr(), s.input_bf16.ptr());
        let k = &self.kernels;
        // With bf16 GEMMs every GEMM input's bf16 copy is written by the kernel that produces it
        // (the LayerNorms, the tensor-core attention, the GELU) into the one `xb` buffer, each
        // consumed by the next GEMM before the next producer overwrites it (stream order).
        let bf16 = self.gemm == EncoderGemm::Bf16;
        let xbo = if bf16 { xb } else { 0 };
        // SAFETY: the scratch holds at least n tokens of every activation (ensure_scratch; xb
        // n·max(h, intermediate) bf16 with bf16 GEMMs); meta holds 3n indices inside their tables
        // (the batch was validated against the config); tiles describe sequences inside the n
        // tokens (attention_tiles over the batch's ranges).
        unsafe {
            k.embed_layernorm(stream, x, meta.ptr(), tables, norm(&self.embeddings_norm), n, h, xbo).map_err(gpu_err)?;
            for l in &self.layers {
                self.gemm(qkv, x, &l.qkv, n, xb, bf16)?;
                k.bias_act(stream, qkv, l.qkv.bias.ptr(), n, 3 * h, EncoderActivation::None, 0).map_err(gpu_err)?;
                let ctx_ready = match self.attention {
                    AttentionKernel::F32 => k.attention(stream, ctx, qkv, tiles.ptr(), num_tiles, c.num_attention_heads, c.head_dim()).map(|()| false),
                    AttentionKernel::TensorCores => k.attention_mma(stream, ctx, qkv, tiles.ptr(), num_tiles, c.num_attention_heads, c.head_dim(), launch.warps, xbo).map(|()| bf16),
                }
                .map_err(gpu_err)?;
                self.gemm(proj, ctx, &l.attn_out, n, xb, ctx_ready)?;
                k.add_bias_layernorm(stream, x, proj, l.attn_out.bias.ptr(), norm(&l.attn_norm), n, h, xbo).map_err(gpu_err)?;
                self.gemm(inter, x, &l.intermediate, n, xb, bf16)?;
                k.bias_act(stream, inter, l.intermediate.bias.ptr(), n, c.intermediate_size, act, xbo).map_err(gpu_err)?;
                self.gemm(proj, inter, &l.output, n, xb, bf16)?;
                k.add_bias_layernorm(stream, x, proj, l.output.bias.ptr(), norm(&l.output_norm), n, h, xbo).map_err(gpu_err)?;
            }
        }
        Ok(())
    }
}

impl CudaEncoder {
    /// Runs the layers over `batch`: the last hidden states are in the scratch's `x` after it
    /// (and the plan's buffers it returns must live until the stream has used them).
    fn run(&mut self, batch: &RaggedBatch) -> Result<(DevBuf<i32>, DevBuf<i32>)> {
        self.config.check_batch(batch)?;
        // The batching thread that calls this is not the one that made the context.
        self.gpu.ctx.bind_to_thread().map_err(|e| EngineError::Backend(e.to_string()))?;
        self.ensure_scratch(batch.num_tokens())?;
        let (meta, tiles, launch) = self.upload_plan(batch)?;
        self.run_layers(batch, &meta, &tiles, launch)?;
        Ok((meta, tiles))
    }

    /// Copies `len` f32 from the device to a new host vector and waits for the stream (the copy
    /// into pageable memory is staged; the plan's buffers are dropped by the caller next).
    fn download(&self, src: &DevBuf<f32>, len: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; len];
        let stream = &self.gpu.stream;
        stream.memcpy_dtoh(&src.slice().slice(0..len), &mut out).map_err(|e| EngineError::Backend(e.to_string()))?;
        self.gpu.synchronize().map_err(gpu_err)?;
        Ok(out)
    }
}

/// The pooling kernel's code of a Sentence-Transformers pooling mode.
fn device_pooling(mode: PoolingMode) -> EncoderPooling {
    match mode {
        PoolingMode::Cls => EncoderPooling::Cls,
        PoolingMode::Max => EncoderPooling::Max,
        PoolingMode::Mean => EncoderPooling::Mean,
        PoolingMode::MeanSqrtLen => EncoderPooling::MeanSqrtLen,
        PoolingMode::LastToken => EncoderPooling::LastToken,
    }
}

impl EncoderBackend for CudaEncoder {
    fn forward(&mut self, batch: &RaggedBatch) -> Result<Vec<f32>> {
        let n = batch.num_tokens();
        if n == 0 {
            self.config.check_batch(batch)?;
            return Ok(Vec::new());
        }
        let _plan = self.run(batch)?;
        let s = self.scratch.as_ref().ok_or_else(|| EngineError::Backend("encoder scratch missing".into()))?;
        self.download(&s.x, n * self.config.hidden_size)
    }

    /// Pools on the device: only `num_seqs × modes × hidden` values cross PCIe, not every token's.
    fn forward_pooled(&mut self, batch: &RaggedBatch, hidden: usize, modes: &[PoolingMode]) -> Result<Vec<f32>> {
        if hidden != self.config.hidden_size {
            return Err(EngineError::Backend(format!("pooling asked for width {hidden}, the encoder's is {}", self.config.hidden_size)));
        }
        let seqs = batch.num_seqs();
        if batch.num_tokens() == 0 || modes.is_empty() {
            self.config.check_batch(batch)?;
            return Ok(Vec::new());
        }
        // `run` refuses malformed batches first, empty sequences among them.
        let plan = self.run(batch)?;
        let offsets = batch.offsets.iter().map(|&o| i32::try_from(o).map_err(|_| EngineError::InvalidRequest(format!("encoder batch: offset {o} too large")))).collect::<Result<Vec<i32>>>()?;
        let codes: Vec<i32> = modes.iter().map(|&m| device_pooling(m) as i32).collect();
        let offsets = self.gpu.upload(&offsets).map_err(gpu_err)?;
        let codes = self.gpu.upload(&codes).map_err(gpu_err)?;
        let len = seqs * modes.len() * hidden;
        let out = self.gpu.alloc_zeros::<f32>(len).map_err(gpu_err)?;
        let s = self.scratch.as_ref().ok_or_else(|| EngineError::Backend("encoder scratch missing".into()))?;
        // SAFETY: x holds the batch's n·hidden states (run); offsets: seqs + 1 increasing values
        // ending at n, every sequence non-empty (check_batch in run); out: seqs·modes·hidden.
        unsafe { self.kernels.pool(&self.gpu.stream, out.ptr(), s.x.ptr(), offsets.ptr(), seqs, codes.ptr(), modes.len(), hidden).map_err(gpu_err)? };
        let pooled = self.download(&out, len)?;
        drop(plan);
        Ok(pooled)
    }

    fn name(&self) -> String {
        let gemm = match (self.gemm, self.attention) {
            (EncoderGemm::F32, _) => "f32",
            (EncoderGemm::Bf16, AttentionKernel::TensorCores) => "bf16 GEMMs and attention",
            (EncoderGemm::Bf16, AttentionKernel::F32) => "bf16 GEMMs, f32 attention",
        };
        format!("cuda-encoder (cuda:{} {}, {gemm})", self.gpu.ordinal, self.gpu.name)
    }
}
