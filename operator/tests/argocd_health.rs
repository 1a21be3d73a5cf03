//! The Argo CD health checks shipped in `charts/peregrine/argocd/`, run by a Lua 5.1 interpreter
//! (mlua, vendored PUC Lua 5.1: the language of gopher-lua, which Argo CD runs them on) against
//! objects shaped like the ones the operator writes.

use std::path::Path;

use mlua::{Lua, Table, Value as LuaValue};
use serde_json::{json, Value};

fn script(kind: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/peregrine/argocd").join(format!("{kind}-health.lua"));
    std::fs::read_to_string(path).unwrap()
}

/// JSON to Lua as Argo CD hands objects to the script: objects and arrays become tables (arrays
/// 1-based), null becomes nil.
fn to_lua(lua: &Lua, value: &Value) -> LuaValue {
    match value {
        Value::Null => LuaValue::Nil,
        Value::Bool(b) => LuaValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => LuaValue::Integer(i),
            None => LuaValue::Number(n.as_f64().unwrap()),
        },
        Value::String(s) => LuaValue::String(lua.create_string(s).unwrap()),
        Value::Array(items) => {
            let table = lua.create_table().unwrap();
            for (i, item) in items.iter().enumerate() {
                table.set(i + 1, to_lua(lua, item)).unwrap();
            }
            LuaValue::Table(table)
        }
        Value::Object(map) => {
            let table = lua.create_table().unwrap();
            for (k, v) in map {
                table.set(k.as_str(), to_lua(lua, v)).unwrap();
            }
            LuaValue::Table(table)
        }
    }
}

/// Runs the health script of `kind` on `object`: (status, message).
fn health(kind: &str, object: &Value) -> (String, String) {
    let lua = Lua::new();
    lua.globals().set("obj", to_lua(&lua, object)).unwrap();
    let hs: Table = lua.load(script(kind)).set_name(kind).eval().unwrap();
    (hs.get("status").unwrap(), hs.get("message").unwrap())
}

#[test]
fn the_interpreter_is_lua_5_1_as_in_argo_cd() {
    // Lua 5.2+ only (goto, integer division, the utf8 library) would pass under 5.4 and fail in
    // Argo CD: the scripts must be run by 5.1.
    let lua = Lua::new();
    assert_eq!(lua.globals().get::<String>("_VERSION").unwrap(), "Lua 5.1");
    assert!(lua.load("local x = 7 // 2").exec().is_err(), "5.3's integer division must not parse");
}

fn cond(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z"})
}

fn md(generation: i64, status: Value) -> Value {
    json!({"apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
           "metadata": {"name": "llama", "namespace": "serving", "generation": generation}, "status": status})
}

fn md_conditions(observed: i64, conditions: Vec<Value>) -> Value {
    md(3, json!({"observedGeneration": observed, "replicas": 2, "readyReplicas": 2, "conditions": conditions}))
}

fn stable_ready() -> Vec<Value> {
    vec![
        cond("Ready", "True", "AllReplicasReady", "2/2 replicas ready"),
        cond("Progressing", "False", "Stable", "no change in progress"),
        cond("Degraded", "False", "Stable", "no problems"),
    ]
}

#[test]
fn model_deployment_healthy_when_ready_and_stable() {
    assert_eq!(health("modeldeployment", &md_conditions(3, stable_ready())), ("Healthy".into(), "2/2 replicas ready".into()));
    let mut zero = stable_ready();
    zero[0] = cond("Ready", "True", "ScaledToZero", "scaled to zero replicas");
    assert_eq!(health("modeldeployment", &md_conditions(3, zero)).0, "Healthy");
    // A finished rollout leaves its conditions False: still healthy.
    let mut done = stable_ready();
    done.push(cond("RolloutProgressing", "False", "Stable", "revision abc is serving"));
    done.push(cond("RolloutPaused", "False", "NotPaused", ""));
    done.push(cond("RolloutFailed", "False", "NoFailure", ""));
    assert_eq!(health("modeldeployment", &md_conditions(3, done)).0, "Healthy");
}

#[test]
fn model_deployment_progressing_cases() {
    // No status yet, or a status about an older generation.
    assert_eq!(health("modeldeployment", &md(1, Value::Null)).0, "Progressing");
    let (status, message) = health("modeldeployment", &md_conditions(2, stable_ready()));
    assert_eq!(status, "Progressing");
    assert!(message.contains("generation 3"), "{message}");
    // Pods starting.
    let starting = vec![
        cond("Ready", "False", "ReplicasNotReady", "0/2 replicas ready"),
        cond("Progressing", "True", "RollingUpdate", "0/2 replicas updated, 0 ready"),
        cond("Degraded", "False", "Stable", "no problems"),
    ];
    assert_eq!(health("modeldeployment", &md_conditions(3, starting)), ("Progressing".into(), "0/2 replicas updated, 0 ready".into()));
    // Mid-canary: Ready stays True (stable pods serve) but the change is not out.
    let mut canary = stable_ready();
    canary.push(cond("RolloutProgressing", "True", "CanaryStep", "step 1/3: 1 canary pod"));
    let (status, message) = health("modeldeployment", &md_conditions(3, canary.clone()));
    assert_eq!(status, "Progressing");
    assert!(message.contains("step 1/3"), "{message}");
    // A timed step pause is still progress.
    canary.push(cond("RolloutPaused", "True", "StepPause", "30s of the step's pause left"));
    assert_eq!(health("modeldeployment", &md_conditions(3, canary)).0, "Progressing");
}

#[test]
fn model_deployment_suspended_when_a_person_must_act() {
    let mut paused = stable_ready();
    paused.push(cond("RolloutProgressing", "True", "PausedByAnnotation", "step 1: paused"));
    paused.push(cond("RolloutPaused", "True", "PausedByAnnotation", "paused by annotation; remove it to resume"));
    assert_eq!(health("modeldeployment", &md_conditions(3, paused)).0, "Suspended");
    let mut awaiting = stable_ready();
    awaiting.push(cond("RolloutProgressing", "True", "AwaitingPromotion", "every step passed; abc awaits promotion"));
    assert_eq!(health("modeldeployment", &md_conditions(3, awaiting)).0, "Suspended");
}

#[test]
fn model_deployment_degraded_cases() {
    let invalid = vec![
        cond("Ready", "False", "TooManyGpus", "resources.gpus must be 0 or 1"),
        cond("Progressing", "False", "Stable", "no change in progress"),
        cond("Degraded", "True", "TooManyGpus", "resources.gpus must be 0 or 1"),
    ];
    let (status, message) = health("modeldeployment", &md_conditions(3, invalid));
    assert_eq!(status, "Degraded");
    assert!(message.starts_with("TooManyGpus: "), "{message}");
    let mut rolled_back = stable_ready();
    rolled_back.push(cond("RolloutFailed", "True", "RegressionFailed", "step 1: 2/10 cases failed"));
    let (status, message) = health("modeldeployment", &md_conditions(3, rolled_back));
    assert_eq!(status, "Degraded");
    assert!(message.contains("2/10 cases failed"), "{message}");
}

fn adapter(generation: i64, status: Value) -> Value {
    json!({"apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "LoraAdapter",
           "metadata": {"name": "sql", "namespace": "serving", "generation": generation}, "status": status})
}

#[test]
fn lora_adapter_health() {
    assert_eq!(health("loraadapter", &adapter(1, Value::Null)).0, "Progressing");
    let ready = json!({"phase": "Ready", "observedGeneration": 2, "conditions": [
        cond("Loaded", "True", "Loaded", "loaded in 2/2 pods"), cond("Ready", "True", "Loaded", "loaded in 2/2 pods")]});
    assert_eq!(health("loraadapter", &adapter(2, ready.clone())), ("Healthy".into(), "loaded in 2/2 pods".into()));
    // Edited since: not healthy until the operator has acted on the edit.
    assert_eq!(health("loraadapter", &adapter(3, ready)).0, "Progressing");
    let loading = json!({"phase": "Loading", "observedGeneration": 2, "conditions": [
        cond("Loaded", "False", "PartiallyLoaded", "loaded in 1/2 pods"), cond("Ready", "False", "PartiallyLoaded", "loaded in 1/2 pods")]});
    assert_eq!(health("loraadapter", &adapter(2, loading)), ("Progressing".into(), "PartiallyLoaded: loaded in 1/2 pods".into()));
    let failed = json!({"phase": "Failed", "observedGeneration": 2, "conditions": [
        cond("Loaded", "False", "LoadFailed", "loading failed in every pod (2)"), cond("Ready", "False", "LoadFailed", "x")]});
    let (status, message) = health("loraadapter", &adapter(2, failed));
    assert_eq!(status, "Degraded");
    assert!(message.starts_with("LoadFailed: "), "{message}");
    let conflict = json!({"phase": "Ready", "observedGeneration": 2, "conditions": [
        cond("Loaded", "True", "Loaded", "loaded in 2/2 pods"),
        cond("Conflict", "True", "ServedNameConflict", "served name \"sql\" is also served by LoraAdapter other")]});
    let (status, message) = health("loraadapter", &adapter(2, conflict));
    assert_eq!(status, "Degraded");
    assert!(message.contains("LoraAdapter other"), "{message}");
}
