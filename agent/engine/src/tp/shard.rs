//! One rank's share of a whole model or LoRA adapter, as the plan says.

use std::ops::Range;

use super::plan::{Split, Tensor, TpError, TpPlan};
use super::slice::{slice_cols, slice_rows};
use crate::lora::{LoraAdapter, LoraPair, TargetModule};
use crate::model::{LayerWeights, Matrix, ModelWeights};

fn slice_err(tensor: String) -> impl FnOnce(String) -> TpError {
    move |message| TpError::Slice { tensor, message }
}

/// `tensor`'s slice for `rank`, cut along the dimension its split names.
fn shard_matrix(plan: &TpPlan, tensor: Tensor, rank: usize, m: &Matrix, name: String) -> Result<Matrix, TpError> {
    let range = plan.range(tensor, rank);
    match tensor.split() {
        Split::Output | Split::Vocab => slice_rows(m, range),
        Split::Input => slice_cols(m, range),
        Split::Replicated => Ok(m.clone()),
    }
    .map_err(slice_err(name))
}

fn shard_vec(v: &[f32], range: Range<usize>, name: String) -> Result<Vec<f32>, TpError> {
    v.get(range.clone())
        .map(<[f32]>::to_vec)
        .ok_or_else(|| TpError::Slice { tensor: name, message: format!("range {range:?} outside its {} values", v.len()) })
}

/// Rank `rank`'s weights: a model of `plan.local_config(&weights.config)`'s shape (whole heads, its
/// intermediate channels, its vocabulary rows; norms replicated). A tied LM head stays tied (the
/// embedding's vocabulary slice is also the head's). Fails, naming the tensor, where a slice would
/// cut a quantization block.
pub fn shard_weights(weights: &ModelWeights, plan: &TpPlan, rank: usize) -> Result<ModelWeights, TpError> {
    let m = |t: Tensor, matrix: &Matrix, name: String| shard_matrix(plan, t, rank, matrix, name);
    // The online rotation of down_proj's input acts on blocks of intermediate channels: each rank
    // can apply it to its own share only where that share is whole blocks.
    let local_inter = plan.local_config(&weights.config).intermediate_size;
    if let Some(b) = weights.down_input_hadamard.filter(|b| !local_inter.is_multiple_of(*b)) {
        return Err(TpError::Slice {
            tensor: Tensor::Down.name().into(),
            message: format!("each rank's {local_inter} intermediate channels are not whole blocks of the {b}-channel rotation (--quantization-rotation)"),
        });
    }
    let mut layers = Vec::with_capacity(weights.layers.len());
    for (i, l) in weights.layers.iter().enumerate() {
        let name = |t: Tensor| format!("layers.{i}.{}", t.name());
        let bias = |t: Tensor, b: &Option<Vec<f32>>| -> Result<Option<Vec<f32>>, TpError> {
            b.as_deref().map(|b| shard_vec(b, plan.range(t, rank), name(t))).transpose()
        };
        layers.push(LayerWeights {
            input_layernorm: l.input_layernorm.clone(),
            q_proj: m(Tensor::Q, &l.q_proj, name(Tensor::Q))?,
            k_proj: m(Tensor::K, &l.k_proj, name(Tensor::K))?,
            v_proj: m(Tensor::V, &l.v_proj, name(Tensor::V))?,
            o_proj: m(Tensor::O, &l.o_proj, name(Tensor::O))?,
            q_bias: bias(Tensor::QBias, &l.q_bias)?,
            k_bias: bias(Tensor::KBias, &l.k_bias)?,
            v_bias: bias(Tensor::VBias, &l.v_bias)?,
            post_attention_layernorm: l.post_attention_layernorm.clone(),
            gate_proj: m(Tensor::Gate, &l.gate_proj, name(Tensor::Gate))?,
            up_proj: m(Tensor::Up, &l.up_proj, name(Tensor::Up))?,
            down_proj: m(Tensor::Down, &l.down_proj, name(Tensor::Down))?,
        });
    }
    Ok(ModelWeights {
        config: plan.local_config(&weights.config),
        embed_tokens: m(Tensor::Embed, &weights.embed_tokens, Tensor::Embed.name().into())?,
        layers,
        norm: weights.norm.clone(),
        lm_head: weights
            .lm_head
            .as_ref()
            .map(|h| m(Tensor::LmHead, h, Tensor::LmHead.name().into()))
            .transpose()?,
        down_input_hadamard: weights.down_input_hadamard,
    })
}

fn plan_tensor(module: TargetModule) -> Tensor {
    match module {
        TargetModule::Q => Tensor::Q,
        TargetModule::K => Tensor::K,
        TargetModule::V => Tensor::V,
        TargetModule::O => Tensor::O,
        TargetModule::Gate => Tensor::Gate,
        TargetModule::Up => Tensor::Up,
        TargetModule::Down => Tensor::Down,
    }
}

/// Rank `rank`'s share of a LoRA adapter, laid out so that no collective beyond the base model's
/// two all-reduces per layer is needed:
/// - an output-split projection (q/k/v/gate/up) sees the full input on every rank, so `A` (`[r, in]`)
///   stays whole and each rank computes the whole shrink `x·Aᵀ` (`r` values per token: cheap,
///   and it saves the all-gather a rank-split `A` would need); `B` (`[out, r]`) is split by the same
///   output rows as the base weight.
/// - an input-split projection (o/down) sees only its slice of the input, so `A` is split by the
///   same input columns as the base weight and `B` stays whole: each rank's `(x_r·A_rᵀ)·Bᵀ` is a
///   partial sum of the update, which the all-reduce after the projection adds up with the base
///   partials (the expand is linear).
pub fn shard_adapter(adapter: &LoraAdapter, plan: &TpPlan, rank: usize) -> Result<LoraAdapter, TpError> {
    let r = adapter.rank;
    let mut layers = Vec::with_capacity(adapter.layers.len());
    for (i, per_module) in adapter.layers.iter().enumerate() {
        let mut out: [Option<LoraPair>; 7] = Default::default();
        for module in TargetModule::ALL {
            let Some(pair) = &per_module[module.index()] else { continue };
            let tensor = plan_tensor(module);
            let range = plan.range(tensor, rank);
            let name = || format!("LoRA layers.{i}.{}", tensor.name());
            let mut pair = pair.clone();
            match tensor.split() {
                Split::Output => {
                    let rows = range.start * r..range.end * r;
                    pair.b = pair.b.slice(rows.clone()).ok_or_else(|| TpError::Slice { tensor: name(), message: format!("range {rows:?} outside its {} values", pair.b.len()) })?;
                }
                Split::Input => {
                    let fan_in = plan.full_len(tensor);
                    if pair.a.len() != r * fan_in {
                        return Err(TpError::Slice { tensor: name(), message: format!("A has {} values, expected {r} × {fan_in}", pair.a.len()) });
                    }
                    pair.a = pair.a.columns(fan_in, range.clone());
                }
                Split::Vocab | Split::Replicated => {}
            }
            out[module.index()] = Some(pair);
        }
        layers.push(out);
    }
    Ok(LoraAdapter { layers, ..adapter.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dummy::dummy_weights;

    #[test]
    fn shards_validate_as_the_local_model_and_join_back() {
        let mut c = crate::lora::test_support::tiny_config();
        c.attention_bias = true;
        let w = dummy_weights(&c, 7);
        let plan = TpPlan::new(&c, 2).unwrap();
        let shards: Vec<ModelWeights> = (0..2).map(|r| shard_weights(&w, &plan, r).unwrap()).collect();
        for s in &shards {
            s.validate().unwrap();
            assert_eq!(s.config, plan.local_config(&c));
        }
        let (l, s0, s1) = (&w.layers[1], &shards[0].layers[1], &shards[1].layers[1]);
        assert_eq!(Matrix::concat_rows(&[&s0.q_proj, &s1.q_proj]).unwrap(), l.q_proj, "q by output rows");
        let o = l.o_proj.to_f32();
        let half = o.len() / l.o_proj.rows / 2;
        for (row, (a, b)) in o.chunks_exact(2 * half).zip(s0.o_proj.to_f32().chunks_exact(half).zip(s1.o_proj.to_f32().chunks_exact(half))) {
            assert_eq!(&row[..half], a, "o by input columns");
            assert_eq!(&row[half..], b);
        }
        let kb = l.k_bias.as_ref().unwrap();
        assert_eq!([s0.k_bias.clone().unwrap(), s1.k_bias.clone().unwrap()].concat(), *kb);
        assert_eq!(shards[1].embed_tokens.rows, c.vocab_size / 2);
    }

    #[test]
    fn the_online_down_rotation_shards_only_in_whole_blocks() {
        let mut c = crate::lora::test_support::tiny_config();
        c.intermediate_size = 80;
        let mut w = dummy_weights(&c, 3);
        let plan = TpPlan::new(&c, 2).unwrap();
        // 40 channels per rank: whole blocks of 8, each rank rotates its own.
        w.down_input_hadamard = Some(8);
        for r in 0..2 {
            assert_eq!(shard_weights(&w, &plan, r).unwrap().down_input_hadamard, Some(8));
        }
        // Blocks of 16 would straddle the ranks (40 = 2.5 blocks).
        w.down_input_hadamard = Some(16);
        let e = shard_weights(&w, &plan, 0).unwrap_err().to_string();
        assert!(e.contains("down_proj") && e.contains("16-channel") && e.contains("40"), "{e}");
    }
}
