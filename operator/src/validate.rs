//! Checks of a ModelDeployment that the schema and CEL rules cannot make (or that objects written with
//! validation off could slip past). A failure becomes a `Degraded` condition, and nothing is created.

use peregrine_crds::{reasons, Dtype, ModelDeploymentSpec, ModelFormat, ModelTask, RemoteScheme, SourceUri, GPUS_MESSAGE, GPU_BUDGET_MESSAGE, SLO_TASK_MESSAGE, TENSOR_PARALLEL_MESSAGE};

/// Why a spec cannot be acted on: a condition reason and a message for the user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    pub reason: &'static str,
    pub message: String,
}

impl SpecError {
    fn new(reason: &'static str, message: impl Into<String>) -> Self {
        SpecError { reason, message: message.into() }
    }
}

/// Validates the parts of the spec that need no API calls; returns the parsed model URI.
pub fn validate_spec(spec: &ModelDeploymentSpec) -> Result<SourceUri, SpecError> {
    let uri = SourceUri::parse(&spec.model.uri)
        .map_err(|e| SpecError::new(reasons::UNSUPPORTED_URI, format!("spec.model.uri: {e}")))?;
    if let SourceUri::Remote { scheme: RemoteScheme::Https, .. } = &uri {
        // An https URL names one file; a Hugging Face folder cannot be fetched from one URL.
        if spec.model.format == ModelFormat::Safetensors {
            return Err(SpecError::new(
                reasons::UNSUPPORTED_URI,
                "spec.model.uri: https:// fetches a single file; use format gguf, or s3://, gs:// or pvc:// for a safetensors folder",
            ));
        }
    }
    let gpus = spec.resources.gpus;
    if ![0, 1, 2, 4, 8].contains(&gpus) {
        return Err(SpecError::new(reasons::TOO_MANY_GPUS, format!("{GPUS_MESSAGE} (asked for {gpus})")));
    }
    if let Some(tp) = spec.resources.tensor_parallel_size.filter(|&tp| tp != gpus) {
        return Err(SpecError::new(reasons::INVALID_SPEC, format!("{TENSOR_PARALLEL_MESSAGE} (tensorParallelSize {tp}, gpus {gpus})")));
    }
    if spec.resources.gpus == 0 {
        if let Some(dtype) = spec.engine.dtype {
            if !matches!(dtype, Dtype::Auto | Dtype::Float32 | Dtype::Int8) {
                return Err(SpecError::new(
                    reasons::NO_GPUS_FOR_DTYPE,
                    format!("resources.gpus is 0 (CPU backend) but engine.dtype is {}; use auto, float32 or int8, or ask for GPUs", dtype.as_flag()),
                ));
            }
        }
    }
    if let Some(a) = &spec.autoscaling {
        if a.max_replicas < a.min_replicas {
            return Err(SpecError::new(
                reasons::INVALID_SPEC,
                format!("autoscaling.maxReplicas ({}) is less than minReplicas ({})", a.max_replicas, a.min_replicas),
            ));
        }
        if let Some(budget) = a.max_gpus.filter(|&b| i64::from(b) < i64::from(a.min_replicas) * i64::from(gpus)) {
            return Err(SpecError::new(reasons::INVALID_SPEC, format!("{GPU_BUDGET_MESSAGE} (maxGpus {budget}, minReplicas {}, gpus {gpus})", a.min_replicas)));
        }
        validate_slo_task(spec)?;
    }
    if spec.replicas < 0 {
        return Err(SpecError::new(reasons::INVALID_SPEC, "replicas must not be negative"));
    }
    for claim in &spec.adapter_volumes {
        if SourceUri::parse(&format!("pvc://{claim}/x")).is_err() {
            return Err(SpecError::new(reasons::INVALID_SPEC, format!("adapterVolumes: {claim:?} is not a valid claim name")));
        }
    }
    // BERT-family encoders run on the CUDA backend too; decoder embeddings (`--task embed` on a
    // decoder) only on the CPU, and on a GPU pod the agent would refuse them at start and the pod
    // would only restart. A GGUF is always a decoder, so that case is refused here; an HF folder
    // with task embed may be either, and only the agent can tell (it refuses a decoder's).
    if spec.model.task == ModelTask::Embed && is_gguf(spec) && gpus > 0 {
        return Err(SpecError::new(
            reasons::INVALID_SPEC,
            format!("model.task embed on a GGUF (a decoder's last-token embeddings) runs on the CPU backend only for now: set resources.gpus to 0 (asked for {gpus}); BERT-family encoder folders run on GPUs"),
        ));
    }
    // Checked last, so that a spec with other mistakes hears of those first: the schema, the
    // Deployment the operator would build and the agent's flag all take 2, 4 or 8 GPUs, but the
    // agent's multi-GPU (NCCL) path is not built, so its pods would only stop at start. Refused here
    // instead, with nothing created; lift this when the agent serves `--tensor-parallel-size` on CUDA.
    if gpus > AGENT_MAX_GPUS {
        return Err(SpecError::new(
            reasons::TOO_MANY_GPUS,
            format!("resources.gpus {gpus}: tensor parallelism needs the agent's multi-GPU (NCCL) path, which is not built yet; use 0 (CPU) or 1"),
        ));
    }
    Ok(uri)
}

/// Whether the model is a GGUF file (by its format, or its URI where the format is auto).
fn is_gguf(spec: &ModelDeploymentSpec) -> bool {
    match spec.model.format {
        ModelFormat::Gguf => true,
        ModelFormat::Safetensors => false,
        ModelFormat::Auto => spec.model.uri.to_ascii_lowercase().ends_with(".gguf"),
    }
}

/// The most GPUs one agent pod can use today.
const AGENT_MAX_GPUS: i32 = 1;

/// The SLO fits the task ([`SLO_TASK_RULE`](peregrine_crds::SLO_TASK_RULE) says the same at
/// admission): TTFT and TPOT for generation; for an encoder, which has neither, the e2e p95 alone.
fn validate_slo_task(spec: &ModelDeploymentSpec) -> Result<(), SpecError> {
    let Some(a) = &spec.autoscaling else { return Ok(()) };
    let slo = &a.slo;
    let fits = if spec.model.task.is_encoder() {
        slo.e2e_p95_seconds.is_some() && slo.ttft_p95_seconds.is_none() && slo.tpot_p95_seconds.is_none()
    } else {
        slo.ttft_p95_seconds.is_some() && slo.tpot_p95_seconds.is_some()
    };
    if fits {
        Ok(())
    } else {
        Err(SpecError::new(reasons::INVALID_SPEC, format!("{SLO_TASK_MESSAGE} (model.task is {})", spec.model.task.as_str())))
    }
}

/// Checks the ModelDeployment's name: it names the Service, so it must be a DNS-1035 label (the
/// CEL rule says the same at admission; this catches objects written before it).
pub fn validate_name(name: &str) -> Result<(), SpecError> {
    let label = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if label {
        Ok(())
    } else {
        Err(SpecError::new(
            reasons::INVALID_NAME,
            format!("metadata.name {name:?} is not a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, no dots); it names the Service"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_crds::{AutoscalingSpec, LatencySlo, ModelSource, ModelTask};

    fn spec(uri: &str) -> ModelDeploymentSpec {
        ModelDeploymentSpec { model: ModelSource { uri: uri.into(), ..Default::default() }, replicas: 1, ..Default::default() }
    }

    /// A generate deployment's autoscaling with these bounds and GPU budget, the rest defaulted.
    fn autoscaling(min_replicas: i32, max_replicas: i32, max_gpus: Option<i32>) -> AutoscalingSpec {
        let slo = LatencySlo { ttft_p95_seconds: Some(1.0), tpot_p95_seconds: Some(0.1), e2e_p95_seconds: None };
        AutoscalingSpec { max_gpus, ..AutoscalingSpec::new(min_replicas, max_replicas, slo) }
    }

    #[test]
    fn table() {
        let ok = spec("pvc://models/m.gguf");
        assert!(validate_spec(&ok).is_ok());

        let cases: Vec<(&str, ModelDeploymentSpec, &str, &str)> = vec![
            ("unknown scheme", spec("hf://org/model"), reasons::UNSUPPORTED_URI, "unknown URI scheme"),
            ("https folder", {
                let mut s = spec("https://host/model");
                s.model.format = ModelFormat::Safetensors;
                s
            }, reasons::UNSUPPORTED_URI, "single file"),
            ("gpu dtype without gpus", {
                let mut s = spec("file:///m.gguf");
                s.resources.gpus = 0;
                s.engine.dtype = Some(Dtype::Bfloat16);
                s
            }, reasons::NO_GPUS_FOR_DTYPE, "engine.dtype is bfloat16"),
            ("max < min", {
                let mut s = spec("file:///m.gguf");
                s.autoscaling = Some(autoscaling(3, 2, None));
                s
            }, reasons::INVALID_SPEC, "maxReplicas (2) is less than minReplicas (3)"),
            ("three gpus", {
                let mut s = spec("file:///m.gguf");
                s.resources.gpus = 3;
                s
            }, reasons::TOO_MANY_GPUS, "0 (CPU), 1, 2, 4 or 8"),
            ("sixteen gpus", {
                let mut s = spec("file:///m.gguf");
                s.resources.gpus = 16;
                s
            }, reasons::TOO_MANY_GPUS, "(asked for 16)"),
            ("tensor parallel size beside other gpus", {
                let mut s = spec("file:///m.gguf");
                s.resources.gpus = 2;
                s.resources.tensor_parallel_size = Some(4);
                s
            }, reasons::INVALID_SPEC, "tensorParallelSize 4, gpus 2"),
            ("gpu budget below min replicas", {
                let mut s = spec("file:///m.gguf");
                s.resources.gpus = 4;
                s.autoscaling = Some(autoscaling(2, 8, Some(6)));
                s
            }, reasons::INVALID_SPEC, "maxGpus 6, minReplicas 2, gpus 4"),
            ("bad adapter volume", {
                let mut s = spec("file:///m.gguf");
                s.adapter_volumes = vec!["Bad_Name".into()];
                s
            }, reasons::INVALID_SPEC, "adapterVolumes"),
        ];
        for (name, spec, reason, message) in cases {
            let err = validate_spec(&spec).expect_err(name);
            assert_eq!(err.reason, reason, "{name}");
            assert!(err.message.contains(message), "{name}: {}", err.message);
        }

        // 2, 4 and 8 GPUs pass every other check but are refused until the agent serves them.
        for gpus in [2, 4, 8] {
            let mut tp = spec("file:///m.gguf");
            tp.resources.gpus = gpus;
            tp.resources.tensor_parallel_size = Some(gpus);
            let err = validate_spec(&tp).expect_err("no multi-GPU agent yet");
            assert_eq!(err.reason, reasons::TOO_MANY_GPUS, "{gpus} GPUs");
            assert!(err.message.contains("not built yet"), "{}", err.message);
        }

        let mut cpu = spec("file:///m.gguf");
        cpu.resources.gpus = 0;
        cpu.engine.dtype = Some(Dtype::Float32);
        assert!(validate_spec(&cpu).is_ok());
    }

    #[test]
    fn names_must_be_dns_1035_labels() {
        for good in ["smol", "llama-3-1-8b", "a", "m1"] {
            assert_eq!(validate_name(good), Ok(()), "{good}");
        }
        for bad in ["llama-3.1-8b", "3b-model", "Llama", "end-", "", &"x".repeat(64)] {
            let err = validate_name(bad).expect_err(bad);
            assert_eq!(err.reason, reasons::INVALID_NAME);
        }
    }

    #[test]
    fn the_slo_fits_the_task() {
        let with_slo = |task: ModelTask, slo: LatencySlo| {
            let mut s = spec("file:///m");
            s.model.task = task;
            // Encoders run on the CPU backend only (checked below).
            s.resources.gpus = 0;
            // The CRD's defaults for everything else.
            let autoscaling = serde_json::json!({"maxReplicas": 2, "slo": slo});
            s.autoscaling = Some(serde_json::from_value(autoscaling).expect("an autoscaling spec"));
            validate_spec(&s)
        };
        let generation = LatencySlo { ttft_p95_seconds: Some(1.0), tpot_p95_seconds: Some(0.1), e2e_p95_seconds: None };
        let request = LatencySlo { ttft_p95_seconds: None, tpot_p95_seconds: None, e2e_p95_seconds: Some(0.2) };
        assert!(with_slo(ModelTask::Generate, generation.clone()).is_ok());
        for task in [ModelTask::Embed, ModelTask::Rerank, ModelTask::Classify] {
            assert!(with_slo(task, request.clone()).is_ok(), "{task:?}");
            let err = with_slo(task, generation.clone()).expect_err("ttft on an encoder");
            assert_eq!(err.reason, reasons::INVALID_SPEC);
            assert!(err.message.contains("e2eP95Seconds only") && err.message.contains(task.as_str()), "{}", err.message);
        }
        let err = with_slo(ModelTask::Generate, request).expect_err("no ttft for generation");
        assert!(err.message.contains("generate needs ttftP95Seconds"), "{}", err.message);
    }

    #[test]
    fn encoders_run_on_a_gpu_and_gguf_embeddings_need_the_cpu() {
        for task in [ModelTask::Embed, ModelTask::Rerank, ModelTask::Classify] {
            let mut s = spec("pvc://models/minilm");
            s.model.task = task;
            s.resources.gpus = 1;
            assert!(validate_spec(&s).is_ok(), "{task:?} on a GPU");
        }
        for (uri, format) in [("pvc://models/m.gguf", ModelFormat::Auto), ("pvc://models/m", ModelFormat::Gguf)] {
            let mut s = spec(uri);
            s.model.format = format;
            s.model.task = ModelTask::Embed;
            s.resources.gpus = 1;
            let err = validate_spec(&s).expect_err("GGUF embeddings on a GPU pod");
            assert_eq!(err.reason, reasons::INVALID_SPEC);
            assert!(err.message.contains("CPU backend only") && err.message.contains("embed"), "{}", err.message);
            s.resources.gpus = 0;
            assert!(validate_spec(&s).is_ok(), "GGUF embeddings on the CPU");
        }
    }
}
