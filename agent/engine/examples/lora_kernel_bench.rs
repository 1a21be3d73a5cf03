//! Times the CPU LoRA update alone for one decode step of SmolLM2-135M shapes: batch 32, rank 16,
//! 4 adapters, all seven projections of all 30 layers. `cargo run --release --example lora_kernel_bench`.

use std::time::Instant;

use peregrine_engine::backend::{SeqChunk, StepBatch};
use peregrine_engine::config::{Architecture, ModelConfig};
use peregrine_engine::backend::cpu::lora::{CpuLora, Rows, RowsMut};
use peregrine_engine::lora::{LoraAdapter, RandomAdapterSpec, TargetModule};

fn main() {
    let cfg = ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        vocab_size: 49152,
        max_position_embeddings: 8192,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        attention_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    };
    let (batch, rank, adapters) = (32usize, 16usize, 4usize);
    let mut lora = CpuLora::new(&cfg, adapters, 64);
    for s in 0..adapters {
        lora.set_slot(
            s as u32,
            &LoraAdapter::random(&cfg, &RandomAdapterSpec::new(rank, s as u64)),
        )
        .unwrap();
    }
    let seqs = (0..batch)
        .map(|i| SeqChunk {
            start: i,
            len: 1,
            context_len: 10,
            block_table: vec![],
            wants_logits: true,
            lora_slot: Some((i % adapters) as u32),
        })
        .collect();
    let step = StepBatch {
        tokens: vec![0; batch],
        positions: vec![0; batch],
        seqs,
    };
    lora.begin_step(&step).unwrap();
    let x = vec![0.01f32; batch * cfg.intermediate_size];
    let mut y = vec![0.0f32; batch * cfg.intermediate_size];
    let run = |lora: &CpuLora, y: &mut Vec<f32>| {
        for layer in 0..cfg.num_hidden_layers {
            for m in TargetModule::ALL {
                let (fan_in, fan_out) = m.dims(&cfg);
                lora.apply(
                    layer,
                    m,
                    Rows {
                        data: &x,
                        stride: fan_in,
                        offset: 0,
                    },
                    RowsMut {
                        data: &mut y[..batch * fan_out],
                        stride: fan_out,
                        offset: 0,
                    },
                );
            }
        }
    };
    run(&lora, &mut y);
    let iters = 50;
    let t = Instant::now();
    for _ in 0..iters {
        run(&lora, &mut y);
    }
    let per_step = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "LoRA update, batch {batch}, rank {rank}, {adapters} adapters, 7 modules x {} layers: {:.2} ms/step ({} rayon threads)",
        cfg.num_hidden_layers,
        per_step * 1e3,
        rayon::current_num_threads()
    );
}
