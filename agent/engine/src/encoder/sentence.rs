//! The Sentence-Transformers module chain of a model folder (`modules.json`): the Transformer, then
//! Pooling (`1_Pooling/config.json`: CLS, mean, max, mean-sqrt-len, last token; several modes are
//! concatenated in Sentence-Transformers' order), then any Dense layers and Normalize, applied to one
//! sequence's hidden states at a time. Without `modules.json` the model pools by mean, unnormalized.

use std::path::Path;

use serde_json::Value;

use super::weights::Linear;
use crate::model::safetensors::SafetensorsFolder;
use crate::model::Matrix;
use crate::{EngineError, Result};

/// One pooling mode; the order of the variants is the order Sentence-Transformers concatenates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingMode {
    Cls,
    Max,
    Mean,
    MeanSqrtLen,
    LastToken,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseActivation {
    Identity,
    Tanh,
}

/// A step after pooling.
#[derive(Debug, Clone)]
pub enum PostStep {
    Dense { linear: Linear, activation: DenseActivation },
    Normalize,
}

#[derive(Debug, Clone)]
pub struct SentencePipeline {
    pub pooling: Vec<PoolingMode>,
    pub steps: Vec<PostStep>,
    /// Sentence-Transformers' `max_seq_length` (`sentence_bert_config.json`), when given.
    pub max_seq_length: Option<usize>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| EngineError::invalid_model(path, format!("not valid JSON: {e}")))
}

/// Module folders must stay inside the model folder: one plain relative component.
fn module_dir(dir: &Path, modules: &Path, path: &str) -> Result<std::path::PathBuf> {
    if path.is_empty() {
        return Ok(dir.to_path_buf());
    }
    if Path::new(path).components().count() != 1 || path == ".." || path == "." {
        return Err(EngineError::invalid_model(modules, format!("bad module path {path:?}")));
    }
    Ok(dir.join(path))
}

impl SentencePipeline {
    /// Mean pooling and nothing else: what a folder without `modules.json` gets.
    pub fn mean_only() -> SentencePipeline {
        SentencePipeline { pooling: vec![PoolingMode::Mean], steps: Vec::new(), max_seq_length: None }
    }

    /// Reads `modules.json` and the modules it names; `hidden` is the Transformer's output width.
    pub fn load(dir: &Path, hidden: usize) -> Result<SentencePipeline> {
        let modules_path = dir.join("modules.json");
        let mut pipeline = SentencePipeline::mean_only();
        let sbert = dir.join("sentence_bert_config.json");
        if sbert.is_file() {
            pipeline.max_seq_length = read_json(&sbert)?
                .get("max_seq_length")
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n > 0);
        }
        if !modules_path.is_file() {
            return Ok(pipeline);
        }
        let json = read_json(&modules_path)?;
        let modules = json
            .as_array()
            .ok_or_else(|| EngineError::invalid_model(&modules_path, "not a list of modules"))?;
        let mut width = hidden;
        let mut pooled = false;
        for m in modules {
            let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
            let path = m.get("path").and_then(Value::as_str).unwrap_or("");
            let class = ty.rsplit('.').next().unwrap_or("");
            match class {
                "Transformer" if path.is_empty() && !pooled => {}
                "Transformer" => {
                    return Err(EngineError::Unsupported(
                        "a Transformer module outside the model folder's root".into(),
                    ))
                }
                "Pooling" => {
                    let cfg = read_json(&module_dir(dir, &modules_path, path)?.join("config.json"))?;
                    pipeline.pooling = pooling_modes(&cfg)
                        .map_err(|m| EngineError::invalid_model(&modules_path, m))?;
                    width *= pipeline.pooling.len();
                    pooled = true;
                }
                "Dense" => {
                    let (linear, activation) = dense(&module_dir(dir, &modules_path, path)?, width)?;
                    width = linear.weight.rows;
                    pipeline.steps.push(PostStep::Dense { linear, activation });
                }
                "Normalize" => pipeline.steps.push(PostStep::Normalize),
                _ => {
                    return Err(EngineError::Unsupported(format!(
                        "Sentence-Transformers module {ty:?} (Transformer, Pooling, Dense, Normalize are supported)"
                    )))
                }
            }
        }
        Ok(pipeline)
    }

    /// The embedding's width for a Transformer output of `hidden`.
    pub fn output_dim(&self, hidden: usize) -> usize {
        let mut width = hidden * self.pooling.len();
        for step in &self.steps {
            if let PostStep::Dense { linear, .. } = step {
                width = linear.weight.rows;
            }
        }
        width
    }

    /// Whether the output is L2-normalized last (then a client's shorter `dimensions` are re-normalized).
    pub fn normalizes(&self) -> bool {
        matches!(self.steps.last(), Some(PostStep::Normalize))
    }

    /// Pools one sequence's hidden states (`rows × hidden`, every row a real token) and runs the
    /// steps after pooling.
    pub fn embed(&self, rows: &[f32], hidden: usize) -> Vec<f32> {
        self.embed_with(rows, hidden, true)
    }

    /// [`Self::embed`], leaving out a final Normalize step when `final_normalize` is false.
    pub fn embed_with(&self, rows: &[f32], hidden: usize, final_normalize: bool) -> Vec<f32> {
        self.finish(pool(rows, hidden, &self.pooling), final_normalize)
    }

    /// The steps after pooling, over a sequence's pooled vector (`pooling.len() × hidden`, as
    /// [`pool`] makes it with [`Self::pooling`]), leaving out a final Normalize step when
    /// `final_normalize` is false.
    pub fn finish(&self, pooled: Vec<f32>, final_normalize: bool) -> Vec<f32> {
        let mut out = pooled;
        let steps = match self.steps.split_last() {
            Some((PostStep::Normalize, before)) if !final_normalize => before,
            _ => &self.steps[..],
        };
        for step in steps {
            match step {
                PostStep::Dense { linear, activation } => {
                    let mut y = linear_apply(linear, &out);
                    if *activation == DenseActivation::Tanh {
                        y.iter_mut().for_each(|v| *v = v.tanh());
                    }
                    out = y;
                }
                PostStep::Normalize => l2_normalize(&mut out),
            }
        }
        out
    }
}

/// One sequence's hidden states (`rows × hidden`, every row a real token, at least one) pooled as
/// each of `modes` says, concatenated in that order. Means are summed in f64, so they do not drift
/// with the sequence's length (the CUDA encoder's pooling kernel does the same).
pub fn pool(rows: &[f32], hidden: usize, modes: &[PoolingMode]) -> Vec<f32> {
    let n = rows.len() / hidden;
    let mut out = Vec::with_capacity(hidden * modes.len());
    for mode in modes {
        match mode {
            PoolingMode::Cls => out.extend_from_slice(&rows[..hidden]),
            PoolingMode::LastToken => out.extend_from_slice(&rows[(n - 1) * hidden..]),
            PoolingMode::Max => {
                let mut m = rows[..hidden].to_vec();
                for row in rows.chunks_exact(hidden).skip(1) {
                    for (a, &b) in m.iter_mut().zip(row) {
                        *a = a.max(b);
                    }
                }
                out.extend(m);
            }
            PoolingMode::Mean | PoolingMode::MeanSqrtLen => {
                let mut sum = vec![0f64; hidden];
                for row in rows.chunks_exact(hidden) {
                    for (a, &b) in sum.iter_mut().zip(row) {
                        *a += b as f64;
                    }
                }
                let div = if *mode == PoolingMode::Mean { n as f64 } else { (n as f64).sqrt() };
                out.extend(sum.iter().map(|s| (s / div) as f32));
            }
        }
    }
    out
}

/// `y = W·x + b` for one vector, f64 sums.
pub fn linear_apply(linear: &Linear, x: &[f32]) -> Vec<f32> {
    let mut row = vec![0f32; linear.weight.cols];
    (0..linear.weight.rows)
        .map(|r| {
            linear.weight.row_into(r, &mut row);
            let dot: f64 = row.iter().zip(x).map(|(&a, &c)| a as f64 * c as f64).sum();
            (dot + linear.bias[r] as f64) as f32
        })
        .collect()
}

/// Scales to unit L2 norm; as torch's `normalize`, the norm is clamped at 1e-12.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
}

fn pooling_modes(cfg: &Value) -> std::result::Result<Vec<PoolingMode>, String> {
    let on = |key: &str| cfg.get(key).and_then(Value::as_bool).unwrap_or(false);
    if on("pooling_mode_weightedmean_tokens") {
        return Err("weighted-mean pooling is not supported".into());
    }
    if cfg.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        return Err("pooling with include_prompt=false is not supported".into());
    }
    let modes: Vec<PoolingMode> = [
        ("pooling_mode_cls_token", PoolingMode::Cls),
        ("pooling_mode_max_tokens", PoolingMode::Max),
        ("pooling_mode_mean_tokens", PoolingMode::Mean),
        ("pooling_mode_mean_sqrt_len_tokens", PoolingMode::MeanSqrtLen),
        ("pooling_mode_lasttoken", PoolingMode::LastToken),
    ]
    .into_iter()
    .filter(|(key, _)| on(key))
    .map(|(_, mode)| mode)
    .collect();
    if modes.is_empty() {
        return Err("the pooling config enables no mode".into());
    }
    Ok(modes)
}

/// A Dense module: `config.json` (`in_features`, `out_features`, `bias`, `activation_function`) and
/// `model.safetensors` (`linear.weight`, `linear.bias`).
fn dense(dir: &Path, width: usize) -> Result<(Linear, DenseActivation)> {
    let cfg_path = dir.join("config.json");
    let cfg = read_json(&cfg_path)?;
    let get = |k: &str| cfg.get(k).and_then(Value::as_u64).map(|n| n as usize);
    let (Some(inp), Some(out)) = (get("in_features"), get("out_features")) else {
        return Err(EngineError::invalid_model(&cfg_path, "in_features/out_features missing"));
    };
    if inp != width || out == 0 {
        return Err(EngineError::invalid_model(&cfg_path, format!("Dense takes {inp} features, the pooled vector has {width}")));
    }
    let activation = match cfg.get("activation_function").and_then(Value::as_str).unwrap_or("") {
        a if a.ends_with("Identity") => DenseActivation::Identity,
        a if a.ends_with("Tanh") => DenseActivation::Tanh,
        other => return Err(EngineError::Unsupported(format!("Dense activation {other:?} (Identity, Tanh supported)"))),
    };
    let st = SafetensorsFolder::open(dir)?;
    let (shape, w) = st.tensor_f32("linear.weight")?;
    if shape != [out, inp] {
        return Err(EngineError::invalid_model(&cfg_path, format!("linear.weight has shape {shape:?}, expected [{out}, {inp}]")));
    }
    let bias = if cfg.get("bias").and_then(Value::as_bool).unwrap_or(true) {
        let (shape, b) = st.tensor_f32("linear.bias")?;
        if shape != [out] {
            return Err(EngineError::invalid_model(&cfg_path, format!("linear.bias has shape {shape:?}, expected [{out}]")));
        }
        b
    } else {
        vec![0.0; out]
    };
    Ok((Linear { weight: Matrix::from_f32(out, inp, w), bias }, activation))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_modes_follow_the_config_in_sentence_transformers_order() {
        let cfg = serde_json::json!({"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true});
        assert_eq!(pooling_modes(&cfg).unwrap(), [PoolingMode::Cls, PoolingMode::Mean]);
        assert!(pooling_modes(&serde_json::json!({})).is_err());
        assert!(pooling_modes(&serde_json::json!({"pooling_mode_weightedmean_tokens": true})).is_err());
    }

    #[test]
    fn pools_each_mode() {
        // Two tokens of width 2: [1, 4] and [3, -2].
        let rows = [1.0, 4.0, 3.0, -2.0];
        let p = |pooling: Vec<PoolingMode>| SentencePipeline { pooling, steps: vec![], max_seq_length: None }.embed(&rows, 2);
        assert_eq!(p(vec![PoolingMode::Cls]), [1.0, 4.0]);
        assert_eq!(p(vec![PoolingMode::LastToken]), [3.0, -2.0]);
        assert_eq!(p(vec![PoolingMode::Max]), [3.0, 4.0]);
        assert_eq!(p(vec![PoolingMode::Mean]), [2.0, 1.0]);
        let s = 2f32.sqrt();
        assert_eq!(p(vec![PoolingMode::MeanSqrtLen]), [4.0 / s, 2.0 / s]);
        assert_eq!(p(vec![PoolingMode::Cls, PoolingMode::Max]), [1.0, 4.0, 3.0, 4.0]);
    }

    #[test]
    fn dense_then_normalize() {
        let linear = Linear { weight: Matrix::from_f32(1, 2, vec![1.0, 1.0]), bias: vec![-3.0] };
        let pipe = SentencePipeline {
            pooling: vec![PoolingMode::Mean],
            steps: vec![PostStep::Dense { linear, activation: DenseActivation::Tanh }, PostStep::Normalize],
            max_seq_length: None,
        };
        assert_eq!(pipe.output_dim(2), 1);
        // mean [2, 1] → 2 + 1 - 3 = 0 → tanh 0 → normalize leaves 0 (norm clamped).
        assert_eq!(pipe.embed(&[1.0, 4.0, 3.0, -2.0], 2), [0.0]);
        let mut v = [3.0, 4.0];
        l2_normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
    }
}
