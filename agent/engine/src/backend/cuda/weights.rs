//! Model weights on the GPU, in the layouts the forward pass wants: q/k/v fused into one
//! `[q_dim + 2 kv_dim, hidden]` matrix and gate/up into one `[2 I, hidden]` matrix, so each takes one
//! GEMM. Norm weights and biases stay f32 (tiny, read by the f32 parts of the kernels).
//!
//! The seven decoder linears are bf16, or with `--quantization fp8|int8` (or an FP8 checkpoint) 8-bit
//! codes with one f32 scale per output row ([`Linear::W8`]): the very codes and scales the CPU
//! backend computes with (`RowQuantMatrix`). Embedding, norms and LM head stay bf16/f32.

use half::bf16;
use peregrine_kernels::{Cuda, DevBuf, W8Format};

use super::gpu_err;
use crate::config::ModelConfig;
use crate::model::rowquant::{Activations, RowFormat, RowQuantMatrix};
use crate::model::{Matrix, MatrixData, ModelWeights};
use crate::{EngineError, Result};

/// One (possibly fused) linear layer's weight, `[out, in]` row-major.
pub enum Linear {
    Bf16(DevBuf<u16>),
    /// 8-bit codes (format in [`GpuWeights::w8`]) and one f32 scale per output row.
    W8 { codes: DevBuf<u8>, scales: DevBuf<f32> },
}

impl Linear {
    /// Whether this linear reads its input as bf16 (an 8-bit one reads the codes the kernel before
    /// it wrote beside the bf16 values).
    pub fn reads_bf16(&self) -> bool {
        matches!(self, Linear::Bf16(_))
    }

    pub fn bytes(&self) -> usize {
        match self {
            Linear::Bf16(w) => w.len() * 2,
            Linear::W8 { codes, scales } => codes.len() + scales.len() * 4,
        }
    }
}

pub struct LayerWeights {
    pub input_norm: DevBuf<f32>,
    pub qkv: Linear,
    pub qkv_bias: Option<DevBuf<f32>>,
    pub o: Linear,
    pub post_norm: DevBuf<f32>,
    pub gate_up: Linear,
    pub down: Linear,
}

pub struct GpuWeights {
    pub embed: DevBuf<u16>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DevBuf<f32>,
    /// None: tied to `embed`.
    pub lm_head: Option<DevBuf<u16>>,
    /// Some: every decoder linear is [`Linear::W8`] in this format (W8A8).
    pub w8: Option<W8Format>,
}

/// Where a weight's extra rows for LoRA start ([`GpuWeights::extend_rows_for_lora`]): the rows, bf16
/// or 8-bit codes, and for an 8-bit weight their row scales (0 otherwise). 0: no extra rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExtraRows {
    pub rows: u64,
    pub scales: u64,
}

/// The kernels' name for a row format.
pub fn w8_format(f: RowFormat) -> W8Format {
    match f {
        RowFormat::Fp8E4m3 => W8Format::E4m3,
        RowFormat::Int8 => W8Format::I8,
    }
}

impl GpuWeights {
    pub fn lm_head_ptr(&self) -> u64 {
        self.lm_head.as_ref().unwrap_or(&self.embed).ptr()
    }

    /// Rebuilds every layer's q|k|v, o, gate|up and down weights with `extra[i]` zero rows after the
    /// model's own `fan_out[i]` (`[fan_out + extra, in]`; an 8-bit weight's codes and its row scales
    /// alike), for LoRA's shrink to ride in their GEMMs (cuda/lora.rs, `FusedNorms`), and returns
    /// where each layer's extra rows start, `[q|k|v, o, gate|up, down]`. The first `fan_out` rows are
    /// the same matrix at the same row stride, so every base GEMM and GEMV reads them as before. One
    /// linear at a time: at most one is held twice; one with no extra rows is left as it is (its
    /// entry 0). None (nothing changed): the linears are neither all bf16 nor all 8-bit.
    /// A weight loaded with exactly those rows already after its own (`upload`'s and `random`'s
    /// `lora_rows`) is kept as it is: no rebuild, so nothing is freed and reallocated.
    pub fn extend_rows_for_lora(&mut self, cuda: &Cuda, fan_out: [usize; 4], fan_in: [usize; 4], extra: [usize; 4]) -> Result<Option<Vec<[ExtraRows; 4]>>> {
        let eight_bit = self.w8.is_some();
        if !self.layers.iter().all(|l| [&l.qkv, &l.o, &l.gate_up, &l.down].iter().all(|w| w.reads_bf16() != eight_bit)) {
            return Ok(None);
        }
        let stream = &cuda.gpu.stream;
        let copy_err = |e: peregrine_kernels::cudarc::driver::DriverError| gpu_err(e.into());
        let mut rows = Vec::with_capacity(self.layers.len());
        for layer in &mut self.layers {
            let mut at = [ExtraRows::default(); 4];
            for (i, linear) in [&mut layer.qkv, &mut layer.o, &mut layer.gate_up, &mut layer.down].into_iter().enumerate() {
                if extra[i] == 0 {
                    continue;
                }
                let (fan_in, fan_out) = (fan_in[i], fan_out[i]);
                match linear {
                    Linear::Bf16(old) => {
                        if old.len() == (fan_out + extra[i]) * fan_in {
                            // Loaded with its LoRA rows (zeros).
                            at[i].rows = old.ptr_at(fan_out * fan_in);
                            continue;
                        }
                        if fan_in * fan_out != old.len() {
                            return Err(EngineError::Backend("a projection's weight is not [fan-out, fan-in]".into()));
                        }
                        let mut wide = cuda.gpu.alloc_zeros::<u16>(old.len() + extra[i] * fan_in).map_err(gpu_err)?;
                        stream.memcpy_dtod(old.slice(), &mut wide.slice_mut().slice_mut(0..old.len())).map_err(copy_err)?;
                        at[i].rows = wide.ptr_at(old.len());
                        // The old buffer is freed in stream order, after the copy. Its block stays in the
                        // allocator's pool, and later allocations cut from it strand the rest (1.2 GiB on
                        // Llama-3.1-8B, docs/benchmarks.md session 31): hence `lora_rows` at load.
                        *linear = Linear::Bf16(wide);
                    }
                    Linear::W8 { codes, scales } => {
                        if codes.len() == (fan_out + extra[i]) * fan_in && scales.len() == fan_out + extra[i] {
                            at[i] = ExtraRows { rows: codes.ptr_at(fan_out * fan_in), scales: scales.ptr_at(fan_out) };
                            continue;
                        }
                        if fan_in * fan_out != codes.len() || scales.len() != fan_out {
                            return Err(EngineError::Backend("a projection's 8-bit weight is not [fan-out, fan-in] with a scale per row".into()));
                        }
                        let mut wide = cuda.gpu.alloc_zeros::<u8>(codes.len() + extra[i] * fan_in).map_err(gpu_err)?;
                        stream.memcpy_dtod(codes.slice(), &mut wide.slice_mut().slice_mut(0..codes.len())).map_err(copy_err)?;
                        let mut wide_scales = cuda.gpu.alloc_zeros::<f32>(fan_out + extra[i]).map_err(gpu_err)?;
                        stream.memcpy_dtod(scales.slice(), &mut wide_scales.slice_mut().slice_mut(0..fan_out)).map_err(copy_err)?;
                        at[i] = ExtraRows { rows: wide.ptr_at(codes.len()), scales: wide_scales.ptr_at(fan_out) };
                        *linear = Linear::W8 { codes: wide, scales: wide_scales };
                    }
                }
            }
            rows.push(at);
        }
        Ok(Some(rows))
    }

    /// Bytes the weights take on the device.
    pub fn bytes(&self) -> usize {
        let mut b = self.embed.len() * 2 + self.final_norm.len() * 4 + self.lm_head.as_ref().map_or(0, |l| l.len() * 2);
        for l in &self.layers {
            b += l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes();
            b += (l.input_norm.len() + l.post_norm.len() + l.qkv_bias.as_ref().map_or(0, |x| x.len())) * 4;
        }
        b
    }

    /// The 8-bit format the decoder linears will have on the device: `quantization` when asked,
    /// else the format of a checkpoint whose every linear is already row-quantized with per-token
    /// activations (an FP8 checkpoint), else None (bf16).
    pub fn w8_format_of(w: &ModelWeights, quantization: Option<RowFormat>) -> Option<RowFormat> {
        if quantization.is_some() {
            return quantization;
        }
        let mut formats = w.layers.iter().flat_map(|l| [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj]).map(|m| match &m.data {
            MatrixData::RowQuant(q) if q.activations == Activations::PerToken => Some(q.format),
            _ => None,
        });
        let first = formats.next().flatten()?;
        formats.all(|f| f == Some(first)).then_some(first)
    }

    /// Uploads host weights: bf16 (dequantized to f32, then rounded on the host, nearest even), or
    /// with `w8` the decoder linears as 8-bit codes + row scales (quantized on the host by
    /// `RowQuantMatrix::quantize` where they are not 8-bit already).
    /// `lora_rows`: zero rows to leave after the q|k|v, o, gate|up and down weights (bf16, or 8-bit
    /// codes with zero row scales) for LoRA's fused shrink ([`GpuWeights::extend_rows_for_lora`] then finds them there instead of
    /// rebuilding each weight).
    pub fn upload(cuda: &Cuda, w: &ModelWeights, w8: Option<RowFormat>, lora_rows: [usize; 4]) -> Result<Self> {
        w.validate().map_err(EngineError::Unsupported)?;
        // `extra` zero rows of the parts' width after them.
        let mats_with = |parts: &[&Matrix], extra: usize| -> Result<DevBuf<u16>> {
            let total: usize = parts.iter().map(|m| m.rows * m.cols).sum();
            let width = parts.first().map_or(0, |m| m.cols);
            let mut bits = Vec::with_capacity(total + extra * width);
            for m in parts {
                bits.extend(m.to_f32().into_iter().map(|v| bf16::from_f32(v).to_bits()));
            }
            bits.resize(total + extra * width, 0);
            cuda.gpu.upload(&bits).map_err(gpu_err)
        };
        let mats = |parts: &[&Matrix]| mats_with(parts, 0);
        let linear = |what: &str, parts: &[&Matrix], lora_rows: usize| -> Result<Linear> {
            let Some(format) = w8 else { return Ok(Linear::Bf16(mats_with(parts, lora_rows)?)) };
            let mut quantized = Vec::with_capacity(parts.len());
            for m in parts {
                quantized.push(match &m.data {
                    MatrixData::RowQuant(q) if q.format == format && q.activations == Activations::PerToken => q.clone(),
                    MatrixData::RowQuant(q) => {
                        return Err(EngineError::Unsupported(format!(
                            "{what}: the CUDA backend cannot mix {} weights ({:?} activations) into a {} model",
                            q.format.name(),
                            q.activations,
                            format.name()
                        )))
                    }
                    _ => RowQuantMatrix::quantize(format, m.rows, m.cols, &m.to_f32()).map_err(|e| EngineError::Unsupported(format!("--quantization {}: {what}: {e}", format.name())))?,
                });
            }
            let refs: Vec<&RowQuantMatrix> = quantized.iter().collect();
            let fused = RowQuantMatrix::concat_rows(&refs).ok_or_else(|| EngineError::Unsupported(format!("{what}: parts of different widths")))?;
            // LoRA's rows (codes and scales) start as zeros after the weight's own.
            let width = parts.first().map_or(0, |m| m.cols);
            let mut codes = fused.codes().to_vec();
            codes.resize(codes.len() + lora_rows * width, 0);
            let mut scales = fused.scales().to_vec();
            scales.resize(scales.len() + lora_rows, 0.0);
            Ok(Linear::W8 { codes: cuda.gpu.upload(&codes).map_err(gpu_err)?, scales: cuda.gpu.upload(&scales).map_err(gpu_err)? })
        };
        let vec32 = |v: &[f32]| -> Result<DevBuf<f32>> { cuda.gpu.upload(v).map_err(gpu_err) };
        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, l) in w.layers.iter().enumerate() {
            let qkv_bias = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(vec32(&[q.as_slice(), k, v].concat())?),
                (None, None, None) => None,
                _ => return Err(EngineError::Unsupported("q/k/v biases must be all present or all absent".into())),
            };
            layers.push(LayerWeights {
                input_norm: vec32(&l.input_layernorm)?,
                qkv: linear(&format!("layers.{i}.qkv_proj"), &[&l.q_proj, &l.k_proj, &l.v_proj], lora_rows[0])?,
                qkv_bias,
                o: linear(&format!("layers.{i}.o_proj"), &[&l.o_proj], lora_rows[1])?,
                post_norm: vec32(&l.post_attention_layernorm)?,
                gate_up: linear(&format!("layers.{i}.gate_up_proj"), &[&l.gate_proj, &l.up_proj], lora_rows[2])?,
                down: linear(&format!("layers.{i}.down_proj"), &[&l.down_proj], lora_rows[3])?,
            });
        }
        Ok(GpuWeights {
            embed: mats(&[&w.embed_tokens])?,
            layers,
            final_norm: vec32(&w.norm)?,
            lm_head: w.lm_head.as_ref().map(|m| mats(&[m])).transpose()?,
            w8: w8.map(w8_format),
        })
    }

    /// Random weights generated on the device (for `--load-format dummy` benchmarks of big models):
    /// matrices uniform with std 1/sqrt(fan_in), embeddings uniform in ±1, norms 1, biases 0. With
    /// `w8`, each decoder linear is made in bf16 and quantized row by row on the device (the same
    /// kernel as the activations'), so its codes and scales look like a real model's.
    /// `lora_rows` as in [`GpuWeights::upload`].
    pub fn random(cuda: &Cuda, config: &ModelConfig, seed: u64, w8: Option<RowFormat>, lora_rows: [usize; 4]) -> Result<Self> {
        let h = config.hidden_size;
        let (q, kv, inter) = (config.q_dim(), config.kv_dim(), config.intermediate_size);
        let mut fill = RandomFill { cuda, seed };
        // One bf16 staging matrix as large as the largest linear, reused for every 8-bit one.
        let staging_len = if w8.is_some() { [(q + 2 * kv) * h, h * q, 2 * inter * h, h * inter].into_iter().max().unwrap_or(1) } else { 1 };
        let staging = cuda.gpu.alloc_zeros::<u16>(staging_len).map_err(gpu_err)?;
        let linear = |fill: &mut RandomFill<'_>, rows: usize, cols: usize, lora_rows: usize| -> Result<Linear> {
            let Some(format) = w8 else { return Ok(Linear::Bf16(fill.new_bf16_with_zero_rows(rows * cols, cols, lora_rows * cols)?)) };
            // SAFETY: staging holds at least rows*cols bf16 values (the largest linear).
            unsafe { fill.bf16(staging.ptr(), rows * cols, cols) }?;
            // LoRA's rows (codes and scales) stay zeros after the weight's own.
            let codes = cuda.gpu.alloc_zeros::<u8>((rows + lora_rows) * cols).map_err(gpu_err)?;
            let scales = cuda.gpu.alloc_zeros::<f32>(rows + lora_rows).map_err(gpu_err)?;
            // SAFETY: staging holds rows*cols bf16 values, codes rows*cols bytes, scales rows f32.
            unsafe { cuda.kernels.quant_rows(&cuda.gpu.stream, w8_format(format), codes.ptr(), scales.ptr(), staging.ptr(), rows, cols) }.map_err(gpu_err)?;
            Ok(Linear::W8 { codes, scales })
        };
        let ones = |len: usize| -> Result<DevBuf<f32>> { cuda.gpu.upload(&vec![1.0f32; len]).map_err(gpu_err) };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for _ in 0..config.num_hidden_layers {
            layers.push(LayerWeights {
                input_norm: ones(h)?,
                qkv: linear(&mut fill, q + 2 * kv, h, lora_rows[0])?,
                qkv_bias: if config.attention_bias { Some(cuda.gpu.alloc_zeros::<f32>(q + 2 * kv).map_err(gpu_err)?) } else { None },
                o: linear(&mut fill, h, q, lora_rows[1])?,
                post_norm: ones(h)?,
                gate_up: linear(&mut fill, 2 * inter, h, lora_rows[2])?,
                down: linear(&mut fill, h, inter, lora_rows[3])?,
            });
        }
        let embed = fill.new_bf16(config.vocab_size * h, 3)?; // scale sqrt(3/3) = 1: uniform in ±1
        let lm_head = if config.tie_word_embeddings { None } else { Some(fill.new_bf16(config.vocab_size * h, h)?) };
        let final_norm = ones(h)?;
        cuda.gpu.synchronize().map_err(gpu_err)?;
        Ok(GpuWeights { embed, layers, final_norm, lm_head, w8: w8.map(w8_format) })
    }
}

/// Uniform bf16 fills with std 1/sqrt(fan_in), a new seed for each.
struct RandomFill<'a> {
    cuda: &'a Cuda,
    seed: u64,
}

impl RandomFill<'_> {
    /// # Safety
    /// `ptr` holds at least `len` bf16 values.
    unsafe fn bf16(&mut self, ptr: u64, len: usize, fan_in: usize) -> Result<()> {
        self.seed = self.seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let scale = (3.0f32 / fan_in as f32).sqrt();
        self.cuda.kernels.fill_uniform_bf16(&self.cuda.gpu.stream, ptr, len, self.seed, scale).map_err(gpu_err)
    }

    fn new_bf16(&mut self, len: usize, fan_in: usize) -> Result<DevBuf<u16>> {
        self.new_bf16_with_zero_rows(len, fan_in, 0)
    }

    /// `len` random values followed by `zeros` zeros.
    fn new_bf16_with_zero_rows(&mut self, len: usize, fan_in: usize, zeros: usize) -> Result<DevBuf<u16>> {
        let buf = self.cuda.gpu.alloc_zeros::<u16>(len + zeros).map_err(gpu_err)?;
        // SAFETY: buf holds len (+ zeros) bf16 values.
        unsafe { self.bf16(buf.ptr(), len, fan_in) }?;
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::test_support::tiny_config;
    use crate::model::dummy::dummy_weights;
    use crate::model::quantize::quantize_linear_weights;

    #[test]
    fn the_8bit_format_is_the_flags_else_a_fully_8bit_checkpoints_else_none() {
        let mut w = dummy_weights(&tiny_config(), 1);
        assert_eq!(GpuWeights::w8_format_of(&w, None), None, "f32 weights stay bf16 on the GPU");
        assert_eq!(GpuWeights::w8_format_of(&w, Some(RowFormat::Int8)), Some(RowFormat::Int8));
        quantize_linear_weights(&mut w, RowFormat::Fp8E4m3).unwrap();
        assert_eq!(GpuWeights::w8_format_of(&w, None), Some(RowFormat::Fp8E4m3), "an FP8 checkpoint stays 8-bit");
        // One linear left in floating point: not a fully 8-bit model, so bf16 (dequantized).
        let l0 = &mut w.layers[0];
        l0.o_proj = Matrix::from_f32(l0.o_proj.rows, l0.o_proj.cols, l0.o_proj.to_f32());
        assert_eq!(GpuWeights::w8_format_of(&w, None), None);
    }
}
