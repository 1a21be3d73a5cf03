//! The `peregrine-agent serve` command line for a ModelDeployment.

use peregrine_crds::{Dtype, ModelDeployment, ModelFormat, ModelTask};

/// Arguments of the agent container. `model_path` is where the model is inside the container.
///
/// The flags are `peregrine-agent serve`'s own (mostly vLLM's names); unset engine fields are left
/// out so the agent's own defaults apply. `spec.engine.dtype: fp8` becomes `--quantization fp8`
/// (8-bit linears, W8A8), `int8` `--quantization int8 --quantization-rotation` (int8 W8A8 over the
/// rotated model, its faithful form); the other dtypes pass nothing: the agent has no `--dtype` and
/// computes in bf16 on GPUs, f32 on the CPU (see docs/crd-reference.md).
pub fn agent_args(md: &ModelDeployment, model_path: &str, port: i32) -> Vec<String> {
    let spec = &md.spec;
    let engine = &spec.engine;
    let mut args = vec![
        "serve".to_string(),
        "--model".to_string(),
        model_path.to_string(),
        "--served-model-name".to_string(),
        md.served_model_name(),
        "--host".to_string(),
        "0.0.0.0".to_string(),
        "--port".to_string(),
        port.to_string(),
        "--device".to_string(),
        if spec.resources.gpus > 0 { "cuda" } else { "cpu" }.to_string(),
        // The operator pushes adapters into every pod; an agent started without LoRA refuses them.
        "--enable-lora".to_string(),
    ];
    if spec.model.format != ModelFormat::Auto {
        args.extend(["--load-format".to_string(), spec.model.format.as_flag().to_string()]);
    }
    // An encoder folder says its own task; a decoder serves embeddings (last-token) only when told.
    if spec.model.task == ModelTask::Embed {
        args.extend(["--task".to_string(), "embed".to_string()]);
    }
    // Encoders answer gRPC too (packed floats for large embedding batches); see docs/grpc.md.
    if super::serves_grpc(md) {
        args.extend(["--grpc-port".to_string(), super::AGENT_GRPC_PORT.to_string()]);
    }
    // The 8-bit dtypes. int8 comes rotated: unrotated int8 W8A8 costs SmolLM2 +2.1 % perplexity,
    // rotated +0.6 % (docs/benchmarks.md).
    match engine.dtype {
        Some(Dtype::Fp8) => args.extend(["--quantization".to_string(), "fp8".to_string()]),
        Some(Dtype::Int8) => args.extend(["--quantization".to_string(), "int8".to_string(), "--quantization-rotation".to_string()]),
        _ => {}
    }
    let mut flag = |name: &str, value: Option<String>| {
        if let Some(value) = value {
            args.push(format!("--{name}"));
            args.push(value);
        }
    };
    // One rank per GPU; left out at 1 so single-GPU pods keep the command line they had.
    let tp = spec.resources.tensor_parallel_size();
    flag("tensor-parallel-size", (tp > 1).then(|| tp.to_string()));
    flag("max-model-len", engine.max_model_len.map(|v| v.to_string()));
    flag("max-num-seqs", engine.max_num_seqs.map(|v| v.to_string()));
    flag("max-num-batched-tokens", engine.max_num_batched_tokens.map(|v| v.to_string()));
    flag("gpu-memory-utilization", engine.gpu_memory_utilization.map(|v| v.to_string()));
    flag("max-loras", engine.max_loras.map(|v| v.to_string()));
    flag("max-lora-rank", engine.max_lora_rank.map(|v| v.to_string()));
    flag("max-cpu-loras", engine.max_cpu_loras.map(|v| v.to_string()));
    // Prefix caching is on by default in the agent; it only has a flag to turn it off.
    if engine.enable_prefix_caching == Some(false) {
        args.push("--disable-prefix-caching".to_string());
    }
    args.extend(engine.extra_args.iter().cloned());
    args
}
