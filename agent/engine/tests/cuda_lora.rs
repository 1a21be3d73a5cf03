//! LoRA on the CUDA backend against PEFT's float32 reference (`lora_reference.json`) and the CPU
//! backend with the same adapters (which matches PEFT within 1e-3, its own tests), on a GPU machine:
//! - the prompt's last-position logits of every case (adapter-a, adapter-b, base) within the bf16
//!   tolerance of `cuda_smollm2.rs` (|Δ| <= 0.75 on the reference top-10);
//! - greedy continuations equal to the CPU backend's, the first divergence allowed only where the
//!   CPU's top-2 logits are within bf16 noise (< 1.0), each case alone and all mixed in one batch;
//! - a slot rewritten between steps serves the new adapter;
//! - over an fp8 base (`--quantization fp8`, issue 17: LoRA stays bf16 on top of the W8A8 linears)
//!   the GPU's logits and greedy tokens against the CPU backend over the same fp8 base, within the
//!   W8A8 bound `W8_ATOL` (|Δ| <= 4 on the CPU's top-10; why so loose: at its definition), once with the fixture
//!   prompts and once with them repeated into one prefill step of 64–512 tokens (cuBLASLt's GEMMs
//!   with the LoRA side stream's SM reserve), and the fixture prompts over an int8 base (its int8
//!   GEMMs and their deferred int32 sums); each adapter alone over an fp8 and an int8 base, whose
//!   one-token decode steps take the shrink inside the 8-bit GEMV's launch;
//! - over the bf16 base, the same with the prompts repeated into one step of more than 512 tokens,
//!   where the updates are added in place and gate|up's is fused into SwiGLU (`lora_expand_swiglu`):
//!   within the bf16 tolerance of the CPU backend;
//! - with q, k and v Hadamard-rotated in a bf16 cache (`fp8-hadamard-qkv`'s rotation without fp8's
//!   rounding), where o_proj's adapter must see the attention output rotated back: the same bf16
//!   tolerance against PEFT and the CPU backend rotating the same way.
//!
//! Skipped with a visible "skipped: no CUDA device: <why>" where no GPU is usable (CI).

mod common;
mod cuda_common;
mod lora_common;

use cuda_common::{argmax, gpu_or_skip, report, top2_margin};
use lora_common::{cases, Case};
use peregrine_engine::backend::cpu::kv_cache::KvFormat;
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::cuda::{CudaBackend, CudaOptions, LoraCapacity, WeightInit};
use peregrine_engine::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use peregrine_engine::lora::LoraAdapter;
use peregrine_engine::model::rowquant::RowFormat;
use peregrine_engine::model::{self, quantize, LoadFormat};

const BF16_ATOL: f32 = 0.75;
const BF16_NOISE_MARGIN: f32 = 1.0;
const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 8;
const STEPS: usize = 16;

fn adapters(config: &peregrine_engine::config::ModelConfig) -> Vec<LoraAdapter> {
    ["adapter-a", "adapter-b"].iter().map(|n| LoraAdapter::load(&lora_common::adapter_dir(n), config, 64).unwrap()).collect()
}

fn backends() -> (CudaBackend, CpuBackend) {
    backends_with(None).expect("CUDA backend")
}

/// The cache's rotation on both backends: q/k (`kv_hadamard`) and v (`kv_hadamard_v`); `model`:
/// the model rotated as `--quantization-rotation` rotates it, and the adapters with it.
#[derive(Clone, Copy, Default)]
struct Rotation {
    qk: bool,
    v: bool,
    model: bool,
}

fn backends_with(quantization: Option<RowFormat>) -> Option<(CudaBackend, CpuBackend)> {
    backends_rotated(quantization, Rotation::default(), 0)
}

/// Both backends with the adapters in slots 0 and 1, the linears quantized to `quantization` (the
/// same values on both); None (with a visible skip) where this GPU cannot run that format.
/// `graph_segment_layers`: the GPU's decode graphs in parts of that many layers (0: whole).
fn backends_rotated(quantization: Option<RowFormat>, rotation: Rotation, graph_segment_layers: usize) -> Option<(CudaBackend, CpuBackend)> {
    let mut loaded = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF");
    let model_rotation = rotation.model.then(|| model::rotate::rotate_residual_stream(&mut loaded.weights, model::rotate::ROTATION_SEED).expect("rotate"));
    let opts = CudaOptions {
        num_blocks: Some(32 * BLOCKS_PER_SEQ),
        block_size: BLOCK,
        max_model_len: BLOCK * BLOCKS_PER_SEQ,
        // Room for a first step of more than 1,024 tokens: the steps that add updates in place (and
        // fuse gate|up's into SwiGLU) rather than through the update buffer and the fused path.
        max_num_batched_tokens: 2048,
        max_num_seqs: 32,
        lora: Some(LoraCapacity { max_loras: 2, max_rank: 64 }),
        quantization,
        kv_hadamard: rotation.qk,
        kv_hadamard_v: rotation.v,
        cuda_graph_segment_layers: graph_segment_layers,
        ..CudaOptions::default()
    };
    let mut gpu = match CudaBackend::new(WeightInit::Host(&loaded.weights), &opts) {
        Ok(g) => g,
        Err(e) if quantization.is_some() && e.to_string().contains("compute capability") && std::env::var_os("PEREGRINE_REQUIRE_FP8").is_none() => {
            report(&format!("skipped: {e}"));
            return None;
        }
        Err(e) => panic!("CUDA backend: {e}"),
    };
    if let Some(format) = quantization {
        quantize::quantize_linear_weights(&mut loaded.weights, format).expect("quantize");
    }
    let mut cpu = CpuBackend::new(loaded.weights.clone(), KvCacheShape { num_blocks: 32 * BLOCKS_PER_SEQ, block_size: BLOCK }, 4).unwrap();
    cpu.set_kv_format(KvFormat { hadamard: rotation.qk, hadamard_v: rotation.v, ..KvFormat::F32 }).unwrap();
    cpu.enable_lora(2, 64).unwrap();
    gpu.enable_lora(2, 64).unwrap();
    for (slot, mut a) in adapters(&loaded.config).into_iter().enumerate() {
        if let Some(r) = &model_rotation {
            r.rotate(&mut a).expect("rotate the adapter");
        }
        cpu.set_lora_slot(slot as u32, &a).unwrap();
        gpu.set_lora_slot(slot as u32, &a).unwrap();
    }
    Some((gpu, cpu))
}

struct Run {
    /// Each case's logits after its prompt.
    first: Vec<Vec<f32>>,
    ids: Vec<Vec<u32>>,
    /// Each case's top-2 margin at each generated step.
    margins: Vec<Vec<f32>>,
}

/// All `cases` together: the prompts as prefill chunks of one step, then one greedy decode token
/// per case per step.
fn run_together(b: &mut dyn Backend, cases: &[Case]) -> Run {
    let mut tokens: Vec<Vec<u32>> = cases.iter().map(|c| c.prompt.clone()).collect();
    let mut context = vec![0usize; cases.len()];
    let mut run = Run { first: vec![Vec::new(); cases.len()], ids: vec![Vec::new(); cases.len()], margins: vec![Vec::new(); cases.len()] };
    for step in 0..=STEPS {
        let mut batch = StepBatch::default();
        for (i, c) in cases.iter().enumerate() {
            let new = &tokens[i][context[i]..];
            batch.seqs.push(SeqChunk {
                start: batch.tokens.len(),
                len: new.len(),
                context_len: context[i],
                block_table: (0..BLOCKS_PER_SEQ as u32).map(|b| i as u32 * BLOCKS_PER_SEQ as u32 + b).collect(),
                wants_logits: true,
                lora_slot: c.slot,
            });
            batch.positions.extend((context[i]..tokens[i].len()).map(|p| p as u32));
            batch.tokens.extend_from_slice(new);
        }
        let logits = b.forward(&batch).unwrap();
        if step == STEPS {
            break;
        }
        for i in 0..cases.len() {
            let row = logits.row(i);
            if step == 0 {
                run.first[i] = row.to_vec();
            }
            let next = argmax(row);
            run.ids[i].push(next);
            run.margins[i].push(top2_margin(row));
            context[i] = tokens[i].len();
            tokens[i].push(next);
        }
    }
    run
}

fn check(cases: &[Case], gpu: &Run, cpu: &Run, what: &str) {
    for (i, c) in cases.iter().enumerate() {
        let row = &gpu.first[i];
        let mut worst = 0f32;
        for (&id, &v) in c.top10_ids.iter().zip(&c.top10_logits) {
            let d = (row[id as usize] - v).abs();
            worst = worst.max(d);
            assert!(d <= BF16_ATOL, "{what} {}: logit of {id} is {}, PEFT reference {v}", c.label, row[id as usize]);
        }
        let (g, h) = (&gpu.ids[i], &cpu.ids[i]);
        match (0..STEPS).find(|&s| g[s] != h[s]) {
            None => report(&format!("{what} {}: max |Δ| {worst:.3} vs PEFT, {STEPS} greedy tokens identical to the CPU backend", c.label)),
            Some(s) => {
                report(&format!(
                    "{what} {}: max |Δ| {worst:.3} vs PEFT, first divergence from the CPU backend at step {s} (CPU top-2 margin {:.4})",
                    c.label, cpu.margins[i][s]
                ));
                assert!(cpu.margins[i][s] < BF16_NOISE_MARGIN, "{what} {}: diverged at step {s} where the CPU's margin is {}", c.label, cpu.margins[i][s]);
            }
        }
    }
}

#[test]
fn adapters_alone_and_mixed_match_peft_and_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    let (mut gpu, mut cpu) = backends();
    let all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    for c in &all {
        let one = std::slice::from_ref(c);
        check(one, &run_together(&mut gpu, one), &run_together(&mut cpu, one), "alone");
    }
    let mut mixed = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    // Neighbours on different slots: many segments per step.
    mixed.sort_by_key(|c| c.prompt.len() * 7 + c.slot.map_or(0, |s| s as usize + 1));
    check(&mixed, &run_together(&mut gpu, &mixed), &run_together(&mut cpu, &mixed), "mixed");
}

#[test]
fn adapters_with_rotated_q_k_v_match_peft_and_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    let (mut gpu, mut cpu) = backends_rotated(None, Rotation { qk: true, v: true, model: false }, 0).expect("CUDA backend");
    let mut mixed = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    mixed.sort_by_key(|c| c.prompt.len() * 7 + c.slot.map_or(0, |s| s as usize + 1));
    check(&mixed, &run_together(&mut gpu, &mixed), &run_together(&mut cpu, &mixed), "q/k/v rotated");
}

/// Decode graphs captured in parts (a new graph every 7 layers, launched back to back) replay the
/// same launches as one graph: every decode step's greedy token and top-2 margin bit for bit, with
/// the adapters mixed in the batch (the LoRA side stream forks and joins inside every part); and
/// the parts' run meets PEFT and the CPU backend as every other case here does.
#[test]
fn decode_graphs_in_parts_give_the_same_bits_as_one_graph() {
    if !gpu_or_skip() {
        return;
    }
    let mut mixed = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    mixed.sort_by_key(|c| c.prompt.len() * 7 + c.slot.map_or(0, |s| s as usize + 1));
    let (mut whole, _) = backends_rotated(None, Rotation::default(), 0).expect("CUDA backend");
    let want = run_together(&mut whole, &mixed);
    drop(whole);
    let (mut parts, mut cpu) = backends_rotated(None, Rotation::default(), 7).expect("CUDA backend");
    let got = run_together(&mut parts, &mixed);
    check(&mixed, &got, &run_together(&mut cpu, &mixed), "decode graphs in parts");
    for (i, c) in mixed.iter().enumerate() {
        assert_eq!(got.ids[i], want.ids[i], "{}: greedy tokens with the graph in parts", c.label);
        let bits = |m: &[f32]| m.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.margins[i]), bits(&want.margins[i]), "{}: top-2 margins with the graph in parts", c.label);
    }
    report(&format!("{} cases, {STEPS} decode steps: the same bits with the decode graph in parts of 7 layers", mixed.len()));
}

#[test]
fn a_rewritten_slot_serves_the_new_adapter() {
    if !gpu_or_skip() {
        return;
    }
    let (mut gpu, mut cpu) = backends();
    let config = gpu.config().clone();
    let b = LoraAdapter::load(&lora_common::adapter_dir("adapter-b"), &config, 64).unwrap();
    gpu.set_lora_slot(0, &b).unwrap();
    cpu.set_lora_slot(0, &b).unwrap();
    let cases: Vec<Case> = cases(&[("adapter-b", 0)]).into_iter().filter(|c| c.slot.is_some()).collect();
    check(&cases, &run_together(&mut gpu, &cases), &run_together(&mut cpu, &cases), "slot 0 rewritten to adapter-b");
}

/// Two correct W8A8 implementations differ by whole logits where the model is sensitive: the GPU's
/// bf16 intermediates move activations across 8-bit code boundaries (see w8_atol in
/// cuda_smollm2_w8a8.rs and tests/w8a8_pos0_emulation.rs: up to ~7 at one SmolLM2 token). Measured
/// here on the H100 (07:33): 0.41–1.83; the base model's wiring is checked tightly by
/// cuda_smollm2_w8a8's position-0 emulation test, so this bound only catches gross LoRA errors.
const W8_ATOL: f32 = 4.0;

/// The fixture cases mixed in one batch, each prompt repeated `repeat` times (no PEFT reference for
/// those: the CPU backend over the same weights, quantized to `quantization` where given, is the
/// reference), against the CPU backend: the top-10 logits after the prompt within `atol`, and the
/// greedy tokens.
fn long_prompts_match_the_cpu_backend(quantization: Option<RowFormat>, atol: f32, repeat: usize, what: &str) {
    long_prompts_match_the_cpu_backend_rotated(quantization, Rotation::default(), atol, repeat, what)
}

fn long_prompts_match_the_cpu_backend_rotated(quantization: Option<RowFormat>, rotation: Rotation, atol: f32, repeat: usize, what: &str) {
    long_prompts_match_the_cpu_backend_copies(quantization, rotation, atol, repeat, 1, what)
}

/// As [`long_prompts_match_the_cpu_backend`], each case `copies` times (more sequences in a step,
/// each as long as the cache's `max_model_len` allows).
fn long_prompts_match_the_cpu_backend_copies(quantization: Option<RowFormat>, rotation: Rotation, atol: f32, repeat: usize, copies: usize, what: &str) {
    let Some((mut gpu, mut cpu)) = backends_rotated(quantization, rotation, 0) else { return };
    let mut mixed: Vec<_> = (0..copies).flat_map(|_| cases(&[("adapter-a", 0), ("adapter-b", 1)])).collect();
    mixed.sort_by_key(|c| c.prompt.len() * 7 + c.slot.map_or(0, |s| s as usize + 1));
    for c in &mut mixed {
        c.prompt = c.prompt.repeat(repeat);
    }
    let (g, h) = (run_together(&mut gpu, &mixed), run_together(&mut cpu, &mixed));
    matches_the_cpu(&mixed, &g, &h, atol, what);
}

/// The GPU's run against the CPU backend's on the same cases: the top-10 logits after the prompt
/// within `atol`, and the greedy tokens up to a near-tie of the CPU's.
fn matches_the_cpu(cases: &[Case], g: &Run, h: &Run, atol: f32, what: &str) {
    for (i, c) in cases.iter().enumerate() {
        let (gl, cl) = (&g.first[i], &h.first[i]);
        let mut ids: Vec<usize> = (0..cl.len()).collect();
        ids.sort_by(|&a, &b| cl[b].total_cmp(&cl[a]));
        let worst = ids[..10].iter().map(|&id| (gl[id] - cl[id]).abs()).fold(0f32, f32::max);
        assert!(worst <= atol, "{what} {}: max |Δ| {worst} against the CPU over its top-10", c.label);
        match (0..STEPS).find(|&s| g.ids[i][s] != h.ids[i][s]) {
            None => report(&format!("{what} {}: max |Δ| {worst:.3} vs the CPU backend, {STEPS} greedy tokens identical", c.label)),
            Some(s) => {
                report(&format!("{what} {}: max |Δ| {worst:.3}, first divergence at step {s} (CPU top-2 margin {:.4})", c.label, h.margins[i][s]));
                assert!(h.margins[i][s] < BF16_NOISE_MARGIN, "{what} {}: diverged at step {s} where the CPU's margin is {}", c.label, h.margins[i][s]);
            }
        }
    }
}

fn fp8_base_matches_the_cpu_backend(repeat: usize, what: &str) {
    long_prompts_match_the_cpu_backend(Some(RowFormat::Fp8E4m3), W8_ATOL, repeat, what);
}

/// Tokens in the first step of [`run_together`] with the fixture prompts repeated `repeat` times.
fn first_step_tokens(repeat: usize) -> usize {
    cases(&[("adapter-a", 0), ("adapter-b", 1)]).iter().map(|c| c.prompt.len() * repeat).sum()
}

/// A step of 513–1,024 tokens (1000 × 128/128's decode steps): past the side stream's plans
/// (dense shrink, SM reserve) but within the update buffer, so q|k|v, o, gate|up and down ride the
/// fused path (`rope_kv_write_lora`, `add_rmsnorm_lora`, `silu_mul_lora` with several tiles a block).
#[test]
fn a_step_of_513_to_1024_tokens_matches_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    let total = first_step_tokens(10);
    assert!((513..=1024).contains(&total), "the first step has {total} tokens, not in 513-1,024");
    long_prompts_match_the_cpu_backend(None, BF16_ATOL, 10, "bf16, prompts x10");
}

#[test]
fn a_step_of_more_than_1024_tokens_matches_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    // Past the update buffer's 1,024 tokens: q|k|v, o and down add their updates in place and
    // gate|up's is fused into SwiGLU (`lora_expand_swiglu`); two copies of every case, so that every
    // sequence stays within the cache.
    let total = 2 * first_step_tokens(10);
    assert!((1025..=2048).contains(&total), "the first step has {total} tokens, not past the update buffer");
    long_prompts_match_the_cpu_backend_copies(None, Rotation::default(), BF16_ATOL, 10, 2, "bf16, prompts x10, two copies");
}

#[test]
fn adapters_over_an_fp8_base_match_the_cpu_backend_over_the_same_fp8_base() {
    if !gpu_or_skip() {
        return;
    }
    fp8_base_matches_the_cpu_backend(1, "fp8 base");
}

/// The same over an int8 base: its multi-token steps' o, down and q|k|v take the fused path with the
/// int8 GEMM's int32 sums and scales left to the consumers.
#[test]
fn adapters_over_an_int8_base_match_the_cpu_backend_over_the_same_int8_base() {
    if !gpu_or_skip() {
        return;
    }
    long_prompts_match_the_cpu_backend(Some(RowFormat::Int8), W8_ATOL, 1, "int8 base");
}

/// Each adapter alone over an fp8 and an int8 base: its decode steps are one token, whose shrink
/// runs as extra blocks of the 8-bit GEMV's launch (`gemv_w8_lora_rows`) and whose expand adds in
/// place after it; against the CPU backend over the same 8-bit base.
#[test]
fn each_adapter_alone_over_an_8bit_base_matches_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
        let Some((mut gpu, mut cpu)) = backends_with(Some(format)) else { continue };
        for c in cases(&[("adapter-a", 0), ("adapter-b", 1)]) {
            let one = std::slice::from_ref(&c);
            let (g, h) = (run_together(&mut gpu, one), run_together(&mut cpu, one));
            matches_the_cpu(one, &g, &h, W8_ATOL, &format!("{format:?} base, alone"));
        }
    }
}

/// A LoRA prefill step of 64–512 tokens over the fp8 base: the step where cuBLASLt's GEMMs run with
/// the SM target that leaves the LoRA side stream its SMs (`LORA_SM_RESERVE`).
#[test]
fn a_long_lora_step_over_an_fp8_base_matches_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    let total = first_step_tokens(4);
    assert!((64..=512).contains(&total), "the first step has {total} tokens, outside the SM-reserve range");
    fp8_base_matches_the_cpu_backend(4, "fp8 base, prompts x4");
}

/// `--quantization int8 --quantization-rotation` with adapters: the rotated adapters over the
/// rotated int8 base (down's A reading `silu_mul_quant`'s rotated bf16 output) against the CPU
/// backend over the same, in a step of 64–512 tokens and in decode.
#[test]
fn rotated_adapters_over_a_rotated_int8_base_match_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    let rotation = Rotation { model: true, ..Rotation::default() };
    long_prompts_match_the_cpu_backend_rotated(Some(RowFormat::Int8), rotation, W8_ATOL, 1, "rotated int8 base");
    long_prompts_match_the_cpu_backend_rotated(Some(RowFormat::Int8), rotation, W8_ATOL, 4, "rotated int8 base, prompts x4");
}
