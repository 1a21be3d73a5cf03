//! The host emulation of the CUDA backend's W8A8 forward at position 0 (`common/w8a8_pos0.rs`)
//! reproduces the CPU backend exactly when no bf16 rounding is applied (so the GPU test that compares
//! the CUDA backend with the emulation *with* the GPU's roundings tests the GPU's wiring, not the
//! emulation), and prints how far the GPU's bf16 rounding points alone move the W8A8 logits: for fp8
//! on SmolLM2 they move some tokens' top logits by several units (prompt 0's first token: about 7),
//! which is the size of the gap between the two backends that cuda_smollm2_w8a8 measures.

mod common;
#[path = "common/w8a8_pos0.rs"]
mod w8a8_pos0;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use peregrine_engine::model::rowquant::RowFormat;
use peregrine_engine::model::{self, quantize, LoadFormat, ModelWeights};
use w8a8_pos0::{logits, top10_gap, Rounding, ALL};

fn first_token(t: u32) -> StepBatch {
    StepBatch {
        tokens: vec![t],
        positions: vec![0],
        seqs: vec![SeqChunk { start: 0, len: 1, context_len: 0, block_table: vec![0], wants_logits: true, lora_slot: None }],
    }
}

#[test]
fn the_emulation_without_rounding_is_the_cpu_backend_and_the_gpus_roundings_are_measured() {
    let w: ModelWeights = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF").weights;
    let reference = common::reference();
    let mut tokens: Vec<u32> = Vec::new();
    for p in reference["prompts"].as_array().unwrap() {
        let t = p["input_ids"][0].as_u64().unwrap() as u32;
        if !tokens.contains(&t) {
            tokens.push(t);
        }
    }
    for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
        let mut q = w.clone();
        quantize::quantize_linear_weights(&mut q, format).unwrap();
        let mut cpu = CpuBackend::new(q.clone(), KvCacheShape { num_blocks: 4, block_size: 16 }, 2).expect("CPU backend");
        for (i, &t) in tokens.iter().enumerate() {
            let want = cpu.forward(&first_token(t)).unwrap().row(0).to_vec();
            let exact = top10_gap(&logits(&q, t, &[]), &want);
            assert!(exact <= 1e-3, "{format:?} token {t}: the emulation without rounding is {exact} from the CPU backend");
            let mut line = format!("{format:?} token {t} at position 0: emulation = CPU backend (max |Δ| {exact:.1e}); the GPU's bf16 roundings move the top-10 logits by {:.3}", top10_gap(&logits(&q, t, &ALL), &want));
            if i == 0 {
                let each: Vec<String> = ALL.iter().map(|&r: &Rounding| format!("{r:?} {:.3}", top10_gap(&logits(&q, t, &[r]), &want))).collect();
                line.push_str(&format!(" (each alone: {})", each.join(", ")));
            }
            eprintln!("{line}");
        }
    }
}
