//! Model weights in Hugging Face layout, whatever file they came from.
//!
//! Matrices are `[out, in]` row-major (HF `nn.Linear.weight`), either f32 or still in their ggml
//! quantized blocks (dequantized to exactly the same f32 values inside the matmul). q/k rows are in
//! HF order (rotate-half RoPE); the GGUF loader undoes llama.cpp's permutation.

use super::quant::QuantMatrix;
use super::rowquant::RowQuantMatrix;
use crate::config::ModelConfig;

#[derive(Debug, Clone, PartialEq)]
pub enum MatrixData {
    F32(Vec<f32>),
    /// ggml blocks (GGUF files).
    Quant(QuantMatrix),
    /// 8-bit codes with one scale per row (`--quantization`, FP8 checkpoints).
    RowQuant(RowQuantMatrix),
}

/// A `rows × cols` matrix (`[out, in]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl Matrix {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        assert_eq!(data.len(), rows * cols, "matrix data length");
        Matrix {
            rows,
            cols,
            data: MatrixData::F32(data),
        }
    }

    pub fn from_quant(q: QuantMatrix) -> Matrix {
        Matrix {
            rows: q.rows,
            cols: q.cols,
            data: MatrixData::Quant(q),
        }
    }

    pub fn from_row_quant(q: RowQuantMatrix) -> Matrix {
        Matrix {
            rows: q.rows,
            cols: q.cols,
            data: MatrixData::RowQuant(q),
        }
    }

    /// Row `r` as f32 into `out[..cols]`.
    #[inline(always)]
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match &self.data {
            MatrixData::F32(v) => {
                out[..self.cols].copy_from_slice(&v[r * self.cols..(r + 1) * self.cols])
            }
            MatrixData::Quant(q) => q.dequantize_row(r, out),
            MatrixData::RowQuant(q) => q.dequantize_row(r, out),
        }
    }

    /// The whole matrix as f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            MatrixData::F32(v) => v.clone(),
            MatrixData::Quant(_) | MatrixData::RowQuant(_) => {
                let mut out = vec![0f32; self.rows * self.cols];
                if self.cols > 0 {
                    for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
                        self.row_into(r, row);
                    }
                }
                out
            }
        }
    }

    /// Reorders rows: new row `i` is old row `perm[i]`.
    pub fn permute_rows(&self, perm: &[usize]) -> Matrix {
        let data = match &self.data {
            MatrixData::F32(v) => {
                let mut out = Vec::with_capacity(v.len());
                for &src in perm {
                    out.extend_from_slice(&v[src * self.cols..(src + 1) * self.cols]);
                }
                MatrixData::F32(out)
            }
            MatrixData::Quant(q) => MatrixData::Quant(q.permute_rows(perm)),
            MatrixData::RowQuant(q) => MatrixData::RowQuant(q.permute_rows(perm)),
        };
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data,
        }
    }

    /// Stacks matrices of equal width (rows of `parts[0]` first). Quantized parts of one kind stay
    /// quantized (row-quantized ones of one format too); anything else becomes f32. None if widths
    /// differ.
    pub fn concat_rows(parts: &[&Matrix]) -> Option<Matrix> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let quant: Option<Vec<&QuantMatrix>> = parts
            .iter()
            .map(|p| match &p.data {
                MatrixData::Quant(q) => Some(q),
                _ => None,
            })
            .collect();
        if let Some(q) = quant.and_then(|q| QuantMatrix::concat_rows(&q)) {
            return Some(Matrix::from_quant(q));
        }
        let row_quant: Option<Vec<&RowQuantMatrix>> = parts
            .iter()
            .map(|p| match &p.data {
                MatrixData::RowQuant(q) => Some(q),
                _ => None,
            })
            .collect();
        if let Some(q) = row_quant.and_then(|q| RowQuantMatrix::concat_rows(&q)) {
            return Some(Matrix::from_row_quant(q));
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for p in parts {
            data.extend(p.to_f32());
        }
        Some(Matrix::from_f32(rows, cols, data))
    }

    pub fn size_bytes(&self) -> usize {
        match &self.data {
            MatrixData::F32(v) => v.len() * 4,
            MatrixData::Quant(q) => q.size_bytes(),
            MatrixData::RowQuant(q) => q.size_bytes(),
        }
    }
}

/// One decoder layer (Llama/Mistral/Qwen2).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub q_proj: Matrix,
    pub k_proj: Matrix,
    pub v_proj: Matrix,
    pub o_proj: Matrix,
    /// Qwen2 has q/k/v biases.
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub post_attention_layernorm: Vec<f32>,
    pub gate_proj: Matrix,
    pub up_proj: Matrix,
    pub down_proj: Matrix,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelWeights {
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed_tokens: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`; None: tied to `embed_tokens`.
    pub lm_head: Option<Matrix>,
    /// Some(b): down_proj reads the SwiGLU output rotated by the block-diagonal normalized
    /// Walsh–Hadamard matrix of blocks of `b` (a power of two dividing the intermediate size), and
    /// its columns hold that rotation (`model::rotate`): every backend must rotate the SwiGLU output
    /// before down_proj and its LoRA adapter read it. None for a model as loaded.
    pub down_input_hadamard: Option<usize>,
}

impl ModelWeights {
    /// The LM head matrix (the embedding when tied).
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Checks every shape against the config, so a backend can index without further checks.
    pub fn validate(&self) -> Result<(), String> {
        let c = &self.config;
        let (h, q, kv, i, v) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
        );
        if c.num_key_value_heads == 0 || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
            return Err(format!(
                "{} attention heads are not a multiple of {} KV heads",
                c.num_attention_heads, c.num_key_value_heads
            ));
        }
        if !c.head_dim.is_multiple_of(2) || c.head_dim == 0 {
            return Err(format!("head_dim {} must be even", c.head_dim));
        }
        let check = |name: &str, m: &Matrix, rows: usize, cols: usize| -> Result<(), String> {
            if m.rows != rows || m.cols != cols {
                return Err(format!(
                    "{name}: shape [{}, {}], expected [{rows}, {cols}]",
                    m.rows, m.cols
                ));
            }
            Ok(())
        };
        let check_vec = |name: &str, x: &[f32], n: usize| -> Result<(), String> {
            if x.len() != n {
                return Err(format!("{name}: length {}, expected {n}", x.len()));
            }
            Ok(())
        };
        check("embed_tokens", &self.embed_tokens, v, h)?;
        if let Some(m) = &self.lm_head {
            check("lm_head", m, v, h)?;
        }
        check_vec("norm", &self.norm, h)?;
        if self.layers.len() != c.num_hidden_layers {
            return Err(format!(
                "{} layers, config says {}",
                self.layers.len(),
                c.num_hidden_layers
            ));
        }
        for (n, l) in self.layers.iter().enumerate() {
            let p = |s: &str| format!("layers.{n}.{s}");
            check_vec(&p("input_layernorm"), &l.input_layernorm, h)?;
            check_vec(
                &p("post_attention_layernorm"),
                &l.post_attention_layernorm,
                h,
            )?;
            check(&p("q_proj"), &l.q_proj, q, h)?;
            check(&p("k_proj"), &l.k_proj, kv, h)?;
            check(&p("v_proj"), &l.v_proj, kv, h)?;
            check(&p("o_proj"), &l.o_proj, h, q)?;
            check(&p("gate_proj"), &l.gate_proj, i, h)?;
            check(&p("up_proj"), &l.up_proj, i, h)?;
            check(&p("down_proj"), &l.down_proj, h, i)?;
            for (name, b, n) in [
                ("q_bias", &l.q_bias, q),
                ("k_bias", &l.k_bias, kv),
                ("v_bias", &l.v_bias, kv),
            ] {
                if let Some(b) = b {
                    check_vec(&p(name), b, n)?;
                }
            }
        }
        Ok(())
    }
}

/// Row order that turns llama.cpp's interleaved-RoPE q/k rows back into HF's rotate-half order.
///
/// The GGUF converter views each head's rows as `[2, half]` and transposes that to `[half, 2]`, so
/// GGUF row `h*d + 2*i + j` holds HF row `h*d + j*half + i`. Returns `perm` with HF row `r` =
/// GGUF row `perm[r]`.
pub fn unpermute_rope_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut perm = vec![0; n_heads * head_dim];
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                perm[h * head_dim + j * half + i] = h * head_dim + 2 * i + j;
            }
        }
    }
    perm
}

/// The inverse of [`unpermute_rope_rows`]: HF order → GGUF order.
pub fn permute_rope_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let fwd = unpermute_rope_rows(n_heads, head_dim);
    let mut inv = vec![0; fwd.len()];
    for (hf, &gg) in fwd.iter().enumerate() {
        inv[gg] = hf;
    }
    inv
}
