//! Table tests of the pure spec → Deployment/Service functions, one assertion per spec field.

use std::path::Path;

use k8s_openapi::api::core::v1::Container;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use peregrine_crds::{ModelDeployment, SourceUri};
use peregrine_operator::config::OperatorConfig;
use peregrine_operator::desired::args::agent_args;
use peregrine_operator::desired::deployment::desired_deployment;
use peregrine_operator::desired::service::desired_service;
use serde_json::{json, Value};

/// The example with every field set (crds/examples/llama-gpu-full.yaml), with a uid for owner refs.
fn full() -> ModelDeployment {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/examples/llama-gpu-full.yaml")).unwrap();
    let doc = serde_yaml::Deserializer::from_str(&text).next().unwrap();
    let mut value: Value = serde::Deserialize::deserialize(doc).unwrap();
    value["metadata"]["uid"] = json!("uid-1");
    serde_json::from_value(value).unwrap()
}

fn minimal(uri: &str, format: &str) -> ModelDeployment {
    serde_json::from_value(json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "m", "namespace": "ns", "uid": "uid-2"},
        "spec": {"model": {"uri": uri, "format": format}, "resources": {"gpus": 0}}
    }))
    .unwrap()
}

fn build(md: &ModelDeployment) -> k8s_openapi::api::apps::v1::Deployment {
    let uri = SourceUri::parse(&md.spec.model.uri).unwrap();
    desired_deployment(md, &uri, &OperatorConfig::default())
}

fn agent(d: &k8s_openapi::api::apps::v1::Deployment) -> Container {
    d.spec.as_ref().unwrap().template.spec.as_ref().unwrap().containers[0].clone()
}

#[test]
fn every_engine_setting_becomes_its_agent_flag() {
    let md = full();
    let args = agent_args(&md, "/models/Llama-3.1-8B-Instruct", 8000);
    let want: Vec<String> = [
        "serve", "--model", "/models/Llama-3.1-8B-Instruct",
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "0.0.0.0", "--port", "8000", "--device", "cuda", "--enable-lora",
        "--load-format", "safetensors",
        "--max-model-len", "8192", "--max-num-seqs", "256",
        "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.9",
        "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "16",
        "--log-json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(args, want);

    // Unset settings are left to the agent's defaults; the name defaults to the object's.
    let args = agent_args(&minimal("file:///m.gguf", "auto"), "/m.gguf", 8000);
    assert_eq!(args, ["serve", "--model", "/m.gguf", "--served-model-name", "m", "--host", "0.0.0.0", "--port", "8000", "--device", "cpu", "--enable-lora"]);

    let mut off = minimal("file:///m.gguf", "gguf");
    off.spec.engine.enable_prefix_caching = Some(false);
    let args = agent_args(&off, "/m.gguf", 8000);
    assert!(args.ends_with(&["--load-format".to_string(), "gguf".into(), "--disable-prefix-caching".into()]), "{args:?}");
    assert_agent_accepts(&args);
}

/// Long flags of `peregrine-agent serve` (agent/src/runtime.rs `RuntimeArgs`, agent/src/serve/args.rs),
/// plus those the GPU/LoRA work adds to it (`--device`, `--gpu-memory-utilization`, `--max-loras`,
/// `--max-lora-rank`, `--max-cpu-loras`). The agent's names are the truth: a flag the operator
/// generates that is not here makes the pod crash-loop on "unexpected argument".
const AGENT_SERVE_FLAGS: &[&str] = &[
    "model", "load-format", "max-model-len", "max-num-seqs", "max-num-batched-tokens", "block-size", "num-kv-blocks",
    "kv-cache-memory", "disable-prefix-caching", "threads", "seed", "served-model-name", "host", "port",
    "max-waiting-requests", "max-body-bytes", "api-key", "api-keys-file", "rate-limit-rpm", "rate-limit-tpm",
    "drain-delay", "shutdown-grace-period", "otlp-endpoint", "log-json",
    "device", "gpu-memory-utilization", "max-loras", "max-lora-rank", "max-cpu-loras", "lora-modules", "enable-lora",
    "quantization", "quantization-rotation", "task", "grpc-port", "tensor-parallel-size",
];

fn assert_agent_accepts(args: &[String]) {
    assert_eq!(args[0], "serve");
    for arg in args.iter().filter_map(|a| a.strip_prefix("--")) {
        let name = arg.split('=').next().unwrap();
        assert!(AGENT_SERVE_FLAGS.contains(&name), "peregrine-agent serve has no --{name} (args: {args:?})");
    }
}

#[test]
fn generated_flags_are_the_agents() {
    // Every engine setting set, prefix caching both ways, GPU and CPU.
    let mut md = full();
    assert_agent_accepts(&agent_args(&md, "/m", 8000));
    md.spec.engine.enable_prefix_caching = Some(false);
    md.spec.engine.extra_args.clear();
    let args = agent_args(&md, "/m", 8000);
    assert!(args.contains(&"--disable-prefix-caching".to_string()), "{args:?}");
    assert!(!args.iter().any(|a| a.contains("dtype") || a.contains("enable-prefix")), "{args:?}");
    assert_agent_accepts(&args);
    assert_agent_accepts(&agent_args(&minimal("file:///m.gguf", "gguf"), "/m.gguf", 8000));
}

#[test]
fn task_embed_becomes_task_embed_and_the_others_pass_nothing() {
    use peregrine_crds::ModelTask;
    let mut md = minimal("file:///m.gguf", "gguf");
    md.spec.model.task = ModelTask::Embed;
    let args = agent_args(&md, "/m.gguf", 8000);
    let at = args.iter().position(|a| a == "--task").expect("--task");
    assert_eq!(args[at + 1], "embed");
    assert_agent_accepts(&args);
    for task in [ModelTask::Generate, ModelTask::Rerank, ModelTask::Classify] {
        md.spec.model.task = task;
        let args = agent_args(&md, "/m.gguf", 8000);
        assert!(!args.iter().any(|a| a == "--task"), "{task:?}: {args:?}");
    }
}

#[test]
fn gpus_set_the_gpu_limit_and_the_tensor_parallel_size() {
    for (gpus, written) in [(1, None), (2, None), (4, Some(4)), (8, Some(8))] {
        let mut md = full();
        md.spec.resources.gpus = gpus;
        md.spec.resources.tensor_parallel_size = written;
        let args = agent_args(&md, "/m", 8000);
        let tp = args.iter().position(|a| a == "--tensor-parallel-size").map(|at| args[at + 1].clone());
        if gpus == 1 {
            assert_eq!(tp, None, "one GPU keeps the command line it had: {args:?}");
        } else {
            assert_eq!(tp, Some(gpus.to_string()), "{args:?}");
        }
        assert_agent_accepts(&args);
        let limits = agent(&build(&md)).resources.unwrap().limits.unwrap();
        assert_eq!(limits["nvidia.com/gpu"], Quantity(gpus.to_string()), "one GPU per rank");
    }
    let cpu = agent_args(&minimal("file:///m.gguf", "gguf"), "/m.gguf", 8000);
    assert!(!cpu.iter().any(|a| a.contains("tensor-parallel")), "{cpu:?}");
}

#[test]
fn dtype_fp8_and_int8_become_quantization_and_the_others_pass_nothing() {
    use peregrine_crds::Dtype;
    let mut md = full();
    md.spec.engine.dtype = Some(Dtype::Fp8);
    let args = agent_args(&md, "/m", 8000);
    let at = args.iter().position(|a| a == "--quantization").expect("--quantization");
    assert_eq!(args[at + 1], "fp8");
    assert_eq!(args.iter().filter(|a| *a == "--quantization").count(), 1);
    assert!(!args.iter().any(|a| a == "--quantization-rotation"), "fp8 is not rotated (it loses by it): {args:?}");
    assert_agent_accepts(&args);
    // int8: W8A8 over the rotated model.
    md.spec.engine.dtype = Some(Dtype::Int8);
    let args = agent_args(&md, "/m", 8000);
    let at = args.iter().position(|a| a == "--quantization").expect("--quantization");
    assert_eq!(args[at + 1], "int8");
    assert_eq!(args.iter().filter(|a| a.starts_with("--quantization")).count(), 2, "{args:?}");
    assert!(args.iter().any(|a| a == "--quantization-rotation"), "{args:?}");
    assert_agent_accepts(&args);
    for dtype in [Dtype::Auto, Dtype::Float32, Dtype::Float16, Dtype::Bfloat16] {
        md.spec.engine.dtype = Some(dtype);
        let args = agent_args(&md, "/m", 8000);
        assert!(!args.iter().any(|a| a.contains("quantization") || a.contains("dtype")), "{dtype:?}: {args:?}");
    }
}

#[test]
fn deployment_carries_every_pod_field() {
    let md = full();
    let d = build(&md);
    let meta = &d.metadata;
    assert_eq!(meta.name.as_deref(), Some("llama-8b"));
    assert_eq!(meta.namespace.as_deref(), Some("serving"));
    let owner = &meta.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.uid.as_str(), owner.controller), ("ModelDeployment", "uid-1", Some(true)));

    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    assert_eq!(spec.selector.match_labels.as_ref().unwrap().get("serving.peregrine.dev/model-deployment").map(String::as_str), Some("llama-8b"));
    let rolling = spec.strategy.as_ref().unwrap().rolling_update.as_ref().unwrap();
    assert_eq!((rolling.max_surge.clone(), rolling.max_unavailable.clone()), (Some(IntOrString::Int(1)), Some(IntOrString::Int(0))));

    let pod = spec.template.spec.as_ref().unwrap();
    let labels = spec.template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
    assert_eq!(labels["serving.peregrine.dev/model-deployment"], "llama-8b");
    // Argo CD's tracking label stays off the children (it would adopt and prune them).
    assert!(!labels.contains_key("app.kubernetes.io/instance"), "{labels:?}");
    assert!(!meta.labels.as_ref().unwrap().contains_key("app.kubernetes.io/instance"));
    assert_eq!(pod.readiness_gates.as_ref().unwrap()[0].condition_type, "serving.peregrine.dev/adapters-loaded");
    assert_eq!(pod.termination_grace_period_seconds, Some(45), "drain 30 s + preStop 5 s + margin");
    assert_eq!(pod.node_selector.as_ref().unwrap()["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(pod.tolerations.as_ref().unwrap()[0].key.as_deref(), Some("nvidia.com/gpu"));
    assert!(pod.affinity.as_ref().unwrap().pod_anti_affinity.is_some());
    assert_eq!(pod.priority_class_name.as_deref(), Some("inference-high"));
    assert_eq!(pod.image_pull_secrets.as_ref().unwrap()[0].name, "ghcr");

    let c = agent(&d);
    assert_eq!(c.image.as_deref(), Some("ghcr.io/peregrine/peregrine-agent:0.1.0"));
    assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
    let resources = c.resources.as_ref().unwrap();
    let limits = resources.limits.as_ref().unwrap();
    let requests = resources.requests.as_ref().unwrap();
    assert_eq!(limits["nvidia.com/gpu"], Quantity("1".into()));
    assert_eq!(requests["nvidia.com/gpu"], Quantity("1".into()));
    assert_eq!(requests["cpu"], Quantity("4".into()));
    assert_eq!(limits["memory"], Quantity("48Gi".into()));
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| p.as_ref().unwrap().http_get.as_ref().unwrap().path.clone().unwrap();
    assert_eq!(probe_path(&c.liveness_probe), "/health");
    assert_eq!(probe_path(&c.readiness_probe), "/ready");
    assert_eq!(probe_path(&c.startup_probe), "/health");
    let startup = c.startup_probe.as_ref().unwrap();
    assert_eq!(startup.period_seconds.unwrap() * startup.failure_threshold.unwrap(), 1800, "30 minutes to load a model");
    assert_eq!(c.lifecycle.as_ref().unwrap().pre_stop.as_ref().unwrap().sleep.as_ref().unwrap().seconds, 5);
    assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 8000);

    // s3 safetensors folder: fetched with `aws s3 sync` into the emptyDir, using the Secret.
    let init = &pod.init_containers.as_ref().unwrap()[0];
    assert_eq!(init.image.as_deref(), Some("amazon/aws-cli:2.22.0"));
    assert_eq!(
        init.command.as_ref().unwrap(),
        &["aws", "s3", "sync", "s3://models/meta-llama/Llama-3.1-8B-Instruct", "/models/Llama-3.1-8B-Instruct"]
    );
    assert_eq!(init.env_from.as_ref().unwrap()[0].secret_ref.as_ref().unwrap().name, "s3-credentials");
    let volumes: Vec<&str> = pod.volumes.as_ref().unwrap().iter().map(|v| v.name.as_str()).collect();
    assert_eq!(volumes, ["model-cache", "pvc-adapters"]);
    let mounts: Vec<(String, String, Option<bool>)> =
        c.volume_mounts.as_ref().unwrap().iter().map(|m| (m.name.clone(), m.mount_path.clone(), m.read_only)).collect();
    assert_eq!(
        mounts,
        [
            ("model-cache".to_string(), "/models".to_string(), Some(true)),
            ("pvc-adapters".to_string(), "/mnt/pvc/adapters".to_string(), Some(true)),
        ]
    );
}

#[test]
fn each_source_scheme_gets_its_volume_or_fetch_step() {
    struct Case {
        uri: &'static str,
        format: &'static str,
        model_path: &'static str,
        init_command: Option<Vec<&'static str>>,
        volumes: Vec<&'static str>,
    }
    let cases = [
        Case { uri: "pvc://weights/smol/model.gguf", format: "gguf", model_path: "/mnt/pvc/weights/smol/model.gguf", init_command: None, volumes: vec!["pvc-weights"] },
        Case { uri: "file:///opt/models/m.gguf", format: "auto", model_path: "/opt/models/m.gguf", init_command: None, volumes: vec![] },
        Case {
            uri: "s3://b/dir/m.gguf",
            format: "auto",
            model_path: "/models/m.gguf",
            init_command: Some(vec!["aws", "s3", "cp", "s3://b/dir/m.gguf", "/models/m.gguf"]),
            volumes: vec!["model-cache"],
        },
        Case {
            uri: "gs://b/hf-folder",
            format: "safetensors",
            model_path: "/models/hf-folder",
            init_command: Some(vec!["gcloud", "storage", "cp", "--recursive", "gs://b/hf-folder", "/models/"]),
            volumes: vec!["model-cache"],
        },
        Case {
            uri: "https://host/files/m.gguf?download=true",
            format: "gguf",
            model_path: "/models/m.gguf",
            init_command: Some(vec!["curl", "-fSL", "--retry", "5", "-o", "/models/m.gguf", "https://host/files/m.gguf?download=true"]),
            volumes: vec!["model-cache"],
        },
    ];
    for case in cases {
        let md = minimal(case.uri, case.format);
        let d = build(&md);
        let pod = d.spec.as_ref().unwrap().template.spec.clone().unwrap();
        let args = agent(&d).args.unwrap();
        assert_eq!(args[2], case.model_path, "{}", case.uri);
        let init = pod.init_containers.map(|c| c[0].command.clone().unwrap());
        assert_eq!(init, case.init_command.map(|c| c.iter().map(|s| s.to_string()).collect::<Vec<_>>()), "{}", case.uri);
        let volumes: Vec<String> = pod.volumes.unwrap_or_default().into_iter().map(|v| v.name).collect();
        assert_eq!(volumes, case.volumes, "{}", case.uri);
        // CPU pods ask for no GPU.
        let resources = agent(&d).resources.unwrap();
        assert!(resources.limits.is_none() && resources.requests.is_none(), "{}", case.uri);
    }
}

#[test]
fn default_image_comes_from_the_operator_config() {
    let md = minimal("file:///m.gguf", "auto");
    let mut config = OperatorConfig::default();
    config.agent_image = "registry.local/peregrine-agent:dev".into();
    let d = desired_deployment(&md, &SourceUri::parse("file:///m.gguf").unwrap(), &config);
    assert_eq!(agent(&d).image.as_deref(), Some("registry.local/peregrine-agent:dev"));
    assert_eq!(agent(&d).image_pull_policy, None);
}

#[test]
fn service_selects_the_pods_on_the_http_port() {
    let md = full();
    let s = desired_service(&md, 8000);
    assert_eq!(s.metadata.name.as_deref(), Some("llama-8b"));
    assert_eq!(s.metadata.owner_references.as_ref().unwrap()[0].uid, "uid-1");
    let spec = s.spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert_eq!(spec.selector.unwrap()["serving.peregrine.dev/model-deployment"], "llama-8b");
    let port = &spec.ports.unwrap()[0];
    assert_eq!((port.port, port.target_port.clone()), (8000, Some(IntOrString::String("http".into()))));
}

/// With an operator admin key, each ModelDeployment gets a Secret holding it (owned by the
/// deployment, in its namespace) and the agent container reads it as `PEREGRINE_ADMIN_API_KEYS`,
/// the agent's `--admin-api-key`; without one, the pod has no such variable.
#[test]
fn the_operator_admin_key_reaches_the_agent_through_a_secret() {
    use peregrine_operator::desired::admin_key::{self, AdminKey};

    let md = minimal("pvc://models/llama", "safetensors");
    assert_eq!(agent(&build(&md)).env, None);

    let key = AdminKey::new("sk-admin-1").unwrap();
    let config = OperatorConfig { admin_api_key: Some(key.clone()), ..OperatorConfig::default() };
    let uri = SourceUri::parse(&md.spec.model.uri).unwrap();
    let env = agent(&desired_deployment(&md, &uri, &config)).env.unwrap();
    assert_eq!(env.len(), 1);
    assert_eq!(env[0].name, "PEREGRINE_ADMIN_API_KEYS");
    assert_eq!(env[0].value, None, "the key is not written into the pod spec");
    let from = env[0].value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
    assert_eq!((from.name.as_str(), from.key.as_str(), from.optional), ("m-agent-admin", "admin-api-key", Some(false)));

    let secret = admin_key::desired_secret(&md, &key);
    assert_eq!(secret.metadata.name.as_deref(), Some("m-agent-admin"));
    assert_eq!(secret.metadata.namespace.as_deref(), Some("ns"));
    assert_eq!(secret.string_data.unwrap()["admin-api-key"], "sk-admin-1");
    let owner = &secret.metadata.owner_references.unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.uid.as_str(), owner.controller), ("ModelDeployment", "uid-2", Some(true)));
}

/// Encoder tasks start the agent with `--grpc-port` and expose that port, named `grpc`, on the
/// container and the Service (`appProtocol: grpc`); generation has neither.
#[test]
fn encoder_tasks_open_the_grpc_port_on_the_pod_and_the_service() {
    use peregrine_crds::ModelTask;
    use peregrine_operator::desired::AGENT_GRPC_PORT;
    let mut md = minimal("file:///enc", "safetensors");
    for task in [ModelTask::Embed, ModelTask::Rerank, ModelTask::Classify] {
        md.spec.model.task = task;
        let args = agent_args(&md, "/enc", 8000);
        let at = args.iter().position(|a| a == "--grpc-port").unwrap_or_else(|| panic!("{task:?}: {args:?}"));
        assert_eq!(args[at + 1], AGENT_GRPC_PORT.to_string());
        assert_agent_accepts(&args);
        let c = agent(&build(&md));
        let ports: Vec<(String, i32)> = c.ports.unwrap().into_iter().map(|p| (p.name.unwrap(), p.container_port)).collect();
        assert_eq!(ports, vec![("http".to_string(), 8000), ("grpc".to_string(), AGENT_GRPC_PORT)], "{task:?}");
        // Probes stay on HTTP (same readiness as gRPC health).
        assert!(c.readiness_probe.unwrap().http_get.is_some());
        let service_ports = desired_service(&md, 8000).spec.unwrap().ports.unwrap();
        let grpc = service_ports.iter().find(|p| p.name.as_deref() == Some("grpc")).expect("a grpc Service port");
        assert_eq!(grpc.port, AGENT_GRPC_PORT);
        assert_eq!(grpc.target_port, Some(IntOrString::String("grpc".into())));
        assert_eq!(grpc.app_protocol.as_deref(), Some("grpc"));
    }
    md.spec.model.task = ModelTask::Generate;
    assert!(!agent_args(&md, "/enc", 8000).iter().any(|a| a == "--grpc-port"));
    assert_eq!(agent(&build(&md)).ports.unwrap().len(), 1);
    assert_eq!(desired_service(&md, 8000).spec.unwrap().ports.unwrap().len(), 1);
}
