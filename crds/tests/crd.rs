//! The CRD YAML against the types, and the CEL rules against good and bad objects, evaluated by
//! kube's CEL validator the way the API server evaluates them (schema defaults applied first).

use std::path::{Path, PathBuf};

use kube::core::cel::Validator;
use kube::CustomResourceExt;
use peregrine_crds::{LoraAdapter, ModelDeployment};
use serde_json::{json, Value};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn checked_in_yaml_matches_the_types() {
    let generated = peregrine_crds::crd_yaml().unwrap();
    for file in ["crds/peregrine-crds.yaml", "charts/peregrine/crds/peregrine-crds.yaml"] {
        let on_disk = std::fs::read_to_string(repo_root().join(file)).unwrap();
        assert!(
            on_disk == generated,
            "{file} is out of date with the types: run `cargo run -p peregrine-crds --bin crdgen > {file}`"
        );
    }
}

fn schema_of(crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition) -> Value {
    let schema = crd.spec.versions[0].schema.as_ref().unwrap().open_api_v3_schema.as_ref().unwrap();
    serde_json::to_value(schema).unwrap()
}

/// The CEL rules' verdict: `Ok` or the messages of the failed rules.
fn cel(object: &Value, old: Option<&Value>) -> Result<(), Vec<String>> {
    let schema = match object["kind"].as_str() {
        Some("ModelDeployment") => schema_of(&ModelDeployment::crd()),
        Some("LoraAdapter") => schema_of(&LoraAdapter::crd()),
        other => panic!("unexpected kind {other:?}"),
    };
    Validator::new()
        .validate(&schema, object, old)
        .map_err(|errors| errors.into_vec().into_iter().map(|e| e.message).collect())
}

fn examples() -> Vec<Value> {
    let mut out = Vec::new();
    for file in ["smollm2-cpu.yaml", "llama-gpu-full.yaml", "minilm-embed-cpu.yaml"] {
        let text = std::fs::read_to_string(repo_root().join("crds/examples").join(file)).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc).unwrap();
            out.push(value);
        }
    }
    out
}

#[test]
fn examples_parse_into_the_types_and_pass_every_rule() {
    let examples = examples();
    assert_eq!(examples.len(), 5);
    for value in &examples {
        match value["kind"].as_str() {
            Some("ModelDeployment") => {
                let md: ModelDeployment = serde_json::from_value(value.clone()).unwrap();
                // Nothing the user wrote is lost on the way through the types.
                let back = serde_json::to_value(&md).unwrap();
                assert_eq!(back["spec"]["model"], value["spec"]["model"]);
            }
            Some("LoraAdapter") => {
                let _: LoraAdapter = serde_json::from_value(value.clone()).unwrap();
            }
            other => panic!("unexpected kind {other:?}"),
        }
        assert_eq!(cel(value, None), Ok(()), "{}", value["metadata"]["name"]);
    }
}

#[test]
fn full_example_fills_every_issue_7_and_8_field() {
    let md: ModelDeployment = serde_json::from_value(examples()[2].clone()).unwrap();
    let a = md.spec.autoscaling.unwrap();
    assert_eq!((a.min_replicas, a.max_replicas), (2, 8));
    assert_eq!(a.slo.e2e_p95_seconds, Some(10.0));
    assert_eq!(a.provisioned_throughput.unwrap().requests_per_second, Some(20.0));
    let r = md.spec.rollout.unwrap();
    assert!(!r.auto_promote);
    assert_eq!(r.progress_deadline_seconds, 1800);
    assert_eq!(r.steps[1].canary_percent, Some(50));
    let suite = r.regression.unwrap().suite;
    assert_eq!(suite.cases[1].expect.kind, peregrine_crds::ExpectationKind::SameAsStable);
    assert_eq!(suite.cases[2].adapter.as_deref(), Some("sql-helper"));
}

#[test]
fn defaults_match_the_documented_ones() {
    let md: ModelDeployment = serde_json::from_value(json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "m"},
        "spec": {"model": {"uri": "file:///m.gguf"},
                 "autoscaling": {"maxReplicas": 3, "slo": {"ttftP95Seconds": 1.0, "tpotP95Seconds": 0.1}},
                 "rollout": {"steps": [{"canaryReplicas": 1}]}}
    }))
    .unwrap();
    assert_eq!(md.spec.replicas, 1);
    assert_eq!(md.spec.resources.gpus, 1);
    assert_eq!(md.spec.resources.gpu_resource_name, "nvidia.com/gpu");
    let a = md.spec.autoscaling.unwrap();
    assert_eq!(a.min_replicas, 1);
    assert_eq!(
        (a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds, a.evaluation_window_seconds),
        (30, 300, 60)
    );
    assert!(!a.scale_to_zero.enabled);
    let r = md.spec.rollout.unwrap();
    assert_eq!(r.strategy, peregrine_crds::RolloutStrategy::Canary);
    assert!(r.auto_promote);
    assert_eq!(r.max_failures, 0);
    assert_eq!(r.progress_deadline_seconds, 600, "like a Deployment's progressDeadlineSeconds");
    // The API server applies the same default and refuses a deadline below one second.
    let schema = schema_of(&ModelDeployment::crd());
    let deadline = &schema["properties"]["spec"]["properties"]["rollout"]["properties"]["progressDeadlineSeconds"];
    assert_eq!(deadline["default"], json!(600));
    assert_eq!(deadline["minimum"].as_f64(), Some(1.0));
}

/// Sets `value` at a JSON pointer, creating objects on the way.
fn set(object: &mut Value, pointer: &str, value: Value) {
    let mut cur = object;
    let parts: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        cur = match cur {
            Value::Array(items) => &mut items[part.parse::<usize>().unwrap()],
            Value::Object(map) => {
                if last {
                    map.insert(part.to_string(), value);
                    return;
                }
                map.entry(part.to_string()).or_insert_with(|| json!({}))
            }
            _ => panic!("cannot descend into {pointer}"),
        };
    }
}

fn remove(object: &mut Value, pointer: &str) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    object.pointer_mut(parent).unwrap().as_object_mut().unwrap().remove(key);
}

#[test]
fn bad_model_deployments_are_refused_with_a_clear_message() {
    let base = examples()[2].clone();
    let cases: Vec<(&str, Box<dyn Fn(&mut Value)>, &str)> = vec![
        ("ftp uri", Box::new(|v| set(v, "/spec/model/uri", json!("ftp://host/m")) ), "uri must be pvc://"),
        ("bare path", Box::new(|v| set(v, "/spec/model/uri", json!("/models/m.gguf"))), "uri must be pvc://"),
        ("pvc without path", Box::new(|v| set(v, "/spec/model/uri", json!("pvc://models"))), "uri must be pvc://"),
        ("gpu dtype on cpu", Box::new(|v| set(v, "/spec/resources/gpus", json!(0))), "engine.dtype must be auto, float32 or int8"),
        ("max < min", Box::new(|v| set(v, "/spec/autoscaling/maxReplicas", json!(1))), "maxReplicas must be >= minReplicas"),
        ("min 0 without scale to zero", Box::new(|v| set(v, "/spec/autoscaling/minReplicas", json!(0))), "minReplicas may be 0 only with scaleToZero"),
        ("zero ttft slo", Box::new(|v| set(v, "/spec/autoscaling/slo/ttftP95Seconds", json!(0.0))), "ttftP95Seconds must be > 0"),
        ("kv usage > 1", Box::new(|v| set(v, "/spec/autoscaling/maxKvCacheUsage", json!(1.5))), "maxKvCacheUsage must be in (0, 1]"),
        ("gpu mem > 1", Box::new(|v| set(v, "/spec/engine/gpuMemoryUtilization", json!(1.2))), "gpuMemoryUtilization must be in (0, 1]"),
        ("cpu loras < loras", Box::new(|v| set(v, "/spec/engine/maxCpuLoras", json!(2))), "maxCpuLoras must be at least maxLoras"),
        ("step with both", Box::new(|v| set(v, "/spec/rollout/steps/0/canaryPercent", json!(10))), "exactly one of canaryReplicas and canaryPercent"),
        ("step with neither", Box::new(|v| remove(v, "/spec/rollout/steps/0/canaryReplicas")), "exactly one of canaryReplicas and canaryPercent"),
        ("canary without steps", Box::new(|v| set(v, "/spec/rollout/steps", json!([]))), "rollout.steps must not be empty"),
        ("regression step without suite", Box::new(|v| remove(v, "/spec/rollout/regression")), "runRegression needs rollout.regression"),
        ("cases and configmap", Box::new(|v| set(v, "/spec/rollout/regression/suite/configMapRef", json!({"name": "c"}))), "exactly one of cases and configMapRef"),
        ("prompt and messages", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/0/messages", json!([{"role": "user", "content": "x"}]))), "exactly one of prompt, messages and input"),
        ("prompt and input", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/0/input", json!("x"))), "exactly one of prompt, messages and input"),
        ("documents without input", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/0/documents", json!(["d"]))), "documents go with input"),
        ("tolerance on contains", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/0/expect/tolerance", json!(0.1))), "tolerance applies only to withinTolerance"),
        ("encoder task with a ttft slo", Box::new(|v| set(v, "/spec/model/task", json!("embed"))), "autoscaling.slo must fit model.task"),
        ("generate without tpot", Box::new(|v| remove(v, "/spec/autoscaling/slo/tpotP95Seconds")), "generate needs ttftP95Seconds and tpotP95Seconds"),
        ("regex without value", Box::new(|v| remove(v, "/spec/rollout/regression/suite/cases/2/expect/value")), "expect.value is required"),
        ("threshold on contains", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/0/expect/threshold", json!(0.5))), "threshold applies only to sameAsStable"),
        ("bad role", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/1/messages/0/role", json!("robot"))), "role must be system, user or assistant"),
        ("latency factor < 1", Box::new(|v| set(v, "/spec/rollout/regression/thresholds/maxLatencyFactor", json!(0.5))), "maxLatencyFactor must be >= 1"),
        ("long name", Box::new(|v| set(v, "/metadata/name", json!("x".repeat(60)))), "at most 52 characters"),
        ("dotted name", Box::new(|v| set(v, "/metadata/name", json!("llama-3.1-8b"))), "must be a DNS-1035 label"),
        ("name with a leading digit", Box::new(|v| set(v, "/metadata/name", json!("8b-llama"))), "must be a DNS-1035 label"),
        ("three gpus", Box::new(|v| set(v, "/spec/resources/gpus", json!(3))), "resources.gpus must be 0 (CPU), 1, 2, 4 or 8"),
        ("sixteen gpus", Box::new(|v| set(v, "/spec/resources/gpus", json!(16))), "resources.gpus must be 0 (CPU), 1, 2, 4 or 8"),
        ("tensor parallel size without its gpus", Box::new(|v| set(v, "/spec/resources/tensorParallelSize", json!(2))), "tensorParallelSize must equal resources.gpus"),
        ("gpu budget below min replicas", Box::new(|v| set(v, "/spec/autoscaling/maxGpus", json!(1))), "maxGpus must cover minReplicas"),
        ("memory in GB", Box::new(|v| set(v, "/spec/resources/container/limits/memory", json!("32GB"))), "must be a Kubernetes quantity"),
        ("extraArgs repeats a typed field", Box::new(|v| set(v, "/spec/engine/extraArgs", json!(["--log-json", "--max-lora-rank=8"]))), "must not repeat a flag"),
        ("extraArgs repeats the port", Box::new(|v| set(v, "/spec/engine/extraArgs", json!(["--port", "9000"]))), "must not repeat a flag"),
        ("extraArgs repeats the gRPC port", Box::new(|v| set(v, "/spec/engine/extraArgs", json!(["--grpc-port=50052"]))), "must not repeat a flag"),
        ("extraArgs sets the quantization an 8-bit dtype sets", Box::new(|v| {
            set(v, "/spec/engine/dtype", json!("int8"));
            set(v, "/spec/engine/extraArgs", json!(["--quantization=fp8"]));
        }), "must not set --quantization"),
        ("extraArgs turns the rotation on beside dtype fp8", Box::new(|v| {
            set(v, "/spec/engine/dtype", json!("fp8"));
            set(v, "/spec/engine/extraArgs", json!(["--quantization-rotation"]));
        }), "must not set --quantization"),
        ("duplicate case names", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/1/name", json!(examples()[2]["spec"]["rollout"]["regression"]["suite"]["cases"][0]["name"].clone()))), "case names must be unique"),
        ("cpu as words", Box::new(|v| set(v, "/spec/resources/container/requests/cpu", json!("four"))), "must be a Kubernetes quantity"),
    ];
    for (name, mutate, want) in cases {
        let mut object = base.clone();
        mutate(&mut object);
        let errors = cel(&object, None).expect_err(name);
        assert!(errors.iter().any(|m| m.contains(want)), "{name}: wanted {want:?}, got {errors:?}");
    }
}

#[test]
fn tensor_parallel_pods_pass_every_rule() {
    for gpus in [2, 4, 8] {
        let mut object = examples()[2].clone();
        set(&mut object, "/spec/resources/gpus", json!(gpus));
        assert_eq!(cel(&object, None), Ok(()), "gpus {gpus}");
        set(&mut object, "/spec/resources/tensorParallelSize", json!(gpus));
        set(&mut object, "/spec/autoscaling/maxGpus", json!(gpus * 8));
        assert_eq!(cel(&object, None), Ok(()), "tensorParallelSize {gpus} beside gpus {gpus}");
        let md: ModelDeployment = serde_json::from_value(object).unwrap();
        assert_eq!(md.spec.resources.tensor_parallel_size(), gpus);
    }
}

#[test]
fn encoder_example_fits_its_task_and_bad_encoder_specs_are_refused() {
    let base = examples()[4].clone();
    let md: ModelDeployment = serde_json::from_value(base.clone()).unwrap();
    assert_eq!(md.spec.model.task, peregrine_crds::ModelTask::Embed);
    let a = md.spec.autoscaling.unwrap();
    assert_eq!((a.slo.ttft_p95_seconds, a.slo.tpot_p95_seconds, a.slo.e2e_p95_seconds), (None, None, Some(0.2)));
    let cases = md.spec.rollout.unwrap().regression.unwrap().suite.cases;
    assert_eq!(cases[0].expect.values.len(), 384);
    let cases: Vec<(&str, Box<dyn Fn(&mut Value)>, &str)> = vec![
        ("encoder without an e2e slo", Box::new(|v| set(v, "/spec/autoscaling/slo", json!({"ttftP95Seconds": 0.1, "tpotP95Seconds": 0.01}))), "e2eP95Seconds only"),
        ("cosineAtLeast without values", Box::new(|v| remove(v, "/spec/rollout/regression/suite/cases/0/expect/values")), "expect.values (the golden vector) is required"),
        ("threshold on withinTolerance", Box::new(|v| set(v, "/spec/rollout/regression/suite/cases/0/expect/type", json!("withinTolerance"))), "threshold applies only to sameAsStable and cosineAtLeast"),
        ("negative tolerance", Box::new(|v| {
            set(v, "/spec/rollout/regression/suite/cases/1/expect", json!({"type": "withinTolerance", "values": [0.5], "tolerance": -1.0}));
        }), "tolerance must be >= 0"),
    ];
    for (name, mutate, want) in cases {
        let mut object = base.clone();
        mutate(&mut object);
        let errors = cel(&object, None).expect_err(name);
        assert!(errors.iter().any(|m| m.contains(want)), "{name}: wanted {want:?}, got {errors:?}");
    }
    // A generate model may keep an e2e objective beside TTFT/TPOT; an unset task is generate.
    let mut object = examples()[2].clone();
    set(&mut object, "/spec/model/task", json!("generate"));
    assert_eq!(cel(&object, None), Ok(()));
}

#[test]
fn quantities_the_api_server_parses_are_accepted() {
    let mut object = examples()[2].clone();
    for (cpu, memory) in [(json!("500m"), json!("1.5Gi")), (json!(4), json!("34359738368")), (json!("2"), json!("32G")), (json!("0.5"), json!("1e9"))] {
        set(&mut object, "/spec/resources/container/requests", json!({"cpu": cpu, "memory": memory}));
        assert_eq!(cel(&object, None), Ok(()), "{cpu} {memory}");
    }
}

#[test]
fn cpu_deployment_with_auto_float32_or_int8_dtype_is_accepted() {
    let mut object = examples()[0].clone();
    for dtype in ["auto", "float32", "int8"] {
        set(&mut object, "/spec/engine/dtype", json!(dtype));
        assert_eq!(cel(&object, None), Ok(()), "{dtype}");
    }
    // int8 with extra flags that are not the quantization's.
    set(&mut object, "/spec/engine/extraArgs", json!(["--log-json"]));
    assert_eq!(cel(&object, None), Ok(()));
    set(&mut object, "/spec/engine/dtype", json!("float16"));
    assert!(cel(&object, None).is_err());
}

#[test]
fn adapter_deployment_ref_is_immutable_and_uri_checked() {
    let old = examples()[1].clone();
    assert_eq!(cel(&old, Some(&old)), Ok(()));
    let mut moved = old.clone();
    set(&mut moved, "/spec/deploymentRef/name", json!("other"));
    let errors = cel(&moved, Some(&old)).unwrap_err();
    assert!(errors.iter().any(|m| m.contains("deploymentRef is immutable")), "{errors:?}");
    // On create there is no old object and any deployment may be named.
    assert_eq!(cel(&moved, None), Ok(()));

    let mut bad = old.clone();
    set(&mut bad, "/spec/source/uri", json!("hf://org/adapter"));
    let errors = cel(&bad, None).unwrap_err();
    assert!(errors.iter().any(|m| m.contains("uri must be pvc://")), "{errors:?}");
}

#[test]
fn crd_names_scale_and_columns() {
    let md = ModelDeployment::crd();
    assert_eq!(md.metadata.name.as_deref(), Some("modeldeployments.serving.peregrine.dev"));
    assert_eq!(md.spec.names.short_names.as_deref(), Some(&["md".to_string(), "mdep".to_string()][..]));
    let version = &md.spec.versions[0];
    let scale = version.subresources.as_ref().unwrap().scale.as_ref().unwrap();
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(scale.status_replicas_path, ".status.replicas");
    assert_eq!(scale.label_selector_path.as_deref(), Some(".status.selector"));
    let columns: Vec<_> = version.additional_printer_columns.as_ref().unwrap().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(columns, ["Model", "Desired", "Ready", "Endpoint", "Status", "Age", "Progress"]);
    // `-o wide` only, like Model: the Progressing message (with the agents' load progress) is long.
    let progress = version.additional_printer_columns.as_ref().unwrap().iter().find(|c| c.name == "Progress").unwrap();
    assert_eq!(progress.json_path, ".status.conditions[?(@.type==\"Progressing\")].message");
    assert_eq!(progress.priority, Some(1));
    let lora = LoraAdapter::crd();
    assert_eq!(lora.spec.names.short_names.as_deref(), Some(&["lora".to_string()][..]));
    assert!(lora.spec.versions[0].subresources.as_ref().unwrap().status.is_some());
}

#[test]
fn status_lists_merge_per_key_so_controllers_share_them() {
    let md = schema_of(&ModelDeployment::crd());
    let conditions = &md["properties"]["status"]["properties"]["conditions"];
    assert_eq!(conditions["x-kubernetes-list-type"], "map");
    assert_eq!(conditions["x-kubernetes-list-map-keys"], json!(["type"]));
    let lora = schema_of(&LoraAdapter::crd());
    let pods = &lora["properties"]["status"]["properties"]["pods"];
    assert_eq!(pods["x-kubernetes-list-type"], "map");
    assert_eq!(pods["x-kubernetes-list-map-keys"], json!(["name"]));
}
