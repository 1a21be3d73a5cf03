//! `adapter_config.json` of a PEFT LoRA adapter: the fields we honour, and a refusal for every
//! feature we do not implement (so an adapter never silently computes something else).

use std::collections::BTreeSet;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::target::TargetModule;
use crate::{EngineError, Result};

/// What the engine needs from `adapter_config.json`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    pub r: usize,
    pub lora_alpha: f32,
    pub use_rslora: bool,
    /// Only changes how PEFT merges into a transposed (Conv1D) base weight; `lora_A`/`lora_B` keep
    /// their `[r, in]` / `[out, r]` shapes either way, so the unmerged update we compute is the same.
    pub fan_in_fan_out: bool,
    pub target_modules: BTreeSet<TargetModule>,
    pub base_model_name_or_path: Option<String>,
}

/// The raw JSON; `Value` where PEFT allows several shapes.
#[derive(Debug, Deserialize)]
struct RawConfig {
    peft_type: Option<String>,
    r: Option<Value>,
    lora_alpha: Option<Value>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    target_modules: Option<Value>,
    bias: Option<String>,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    lora_bias: bool,
    rank_pattern: Option<Value>,
    alpha_pattern: Option<Value>,
    modules_to_save: Option<Value>,
    layers_to_transform: Option<Value>,
    base_model_name_or_path: Option<String>,
}

impl AdapterConfig {
    /// `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
    pub fn scaling(&self) -> f32 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f32).sqrt()
        } else {
            self.lora_alpha / self.r as f32
        }
    }

    pub fn from_file(path: &Path) -> Result<AdapterConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
        AdapterConfig::from_json(&text).map_err(|message| EngineError::invalid_adapter(path, message))
    }

    /// Parses and validates; the error is a message for [`EngineError::InvalidAdapter`].
    pub fn from_json(text: &str) -> std::result::Result<AdapterConfig, String> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| format!("adapter_config.json is not valid: {e}"))?;
        if let Some(t) = &raw.peft_type {
            if !t.eq_ignore_ascii_case("lora") {
                return Err(format!("peft_type {t:?} is not supported (only LORA)"));
            }
        }
        let r = raw
            .r
            .as_ref()
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| "`r` must be a positive integer".to_string())? as usize;
        let lora_alpha = raw
            .lora_alpha
            .as_ref()
            .and_then(Value::as_f64)
            .filter(|a| a.is_finite())
            .ok_or_else(|| "`lora_alpha` must be a finite number".to_string())? as f32;
        match raw.bias.as_deref() {
            None | Some("none") => {}
            Some(other) => return Err(format!("bias {other:?} is not supported (only \"none\")")),
        }
        if raw.use_dora {
            return Err("DoRA adapters (use_dora) are not supported".into());
        }
        if raw.lora_bias {
            return Err("lora_bias is not supported".into());
        }
        for (field, value) in [("rank_pattern", &raw.rank_pattern), ("alpha_pattern", &raw.alpha_pattern)] {
            if value.as_ref().is_some_and(|v| !is_empty_json(v)) {
                return Err(format!("{field} is not supported (one rank and alpha for every module)"));
            }
        }
        if raw.modules_to_save.as_ref().is_some_and(|v| !is_empty_json(v)) {
            return Err("modules_to_save is not supported (the adapter must hold only LoRA tensors)".into());
        }
        if raw.layers_to_transform.as_ref().is_some_and(|v| !is_empty_json(v)) {
            return Err("layers_to_transform is not supported (the adapter must cover every layer)".into());
        }
        let target_modules = parse_targets(raw.target_modules.as_ref())?;
        Ok(AdapterConfig {
            r,
            lora_alpha,
            use_rslora: raw.use_rslora,
            fan_in_fan_out: raw.fan_in_fan_out,
            target_modules,
            base_model_name_or_path: raw.base_model_name_or_path,
        })
    }
}

fn is_empty_json(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// PEFT stores `target_modules` as a list of module names, or as one string that is either
/// `all-linear` or a regex. Regexes are refused: we would have to match them against module paths.
fn parse_targets(value: Option<&Value>) -> std::result::Result<BTreeSet<TargetModule>, String> {
    let names: Vec<&str> = match value {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| "target_modules must hold strings".to_string()))
            .collect::<std::result::Result<_, _>>()?,
        Some(Value::String(s)) if s == "all-linear" => TargetModule::ALL.iter().map(|m| m.peft_name()).collect(),
        Some(Value::String(s)) => match TargetModule::from_peft_name(s) {
            Some(m) => vec![m.peft_name()],
            None => return Err(format!("target_modules {s:?} looks like a regex; list the module names instead")),
        },
        _ => return Err("target_modules is missing".into()),
    };
    let mut targets = BTreeSet::new();
    for name in names {
        let module = TargetModule::from_peft_name(name).ok_or_else(|| {
            format!("target module {name:?} is not supported (q/k/v/o_proj and gate/up/down_proj only)")
        })?;
        targets.insert(module);
    }
    if targets.is_empty() {
        return Err("target_modules is empty".into());
    }
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fixture_style_config() {
        let c = AdapterConfig::from_json(
            r#"{"peft_type":"LORA","r":8,"lora_alpha":16,"target_modules":["k_proj","q_proj"],"bias":"none",
               "use_rslora":false,"rank_pattern":{},"alpha_pattern":{},"modules_to_save":null}"#,
        )
        .unwrap();
        assert_eq!(c.r, 8);
        assert_eq!(c.scaling(), 2.0);
        assert_eq!(c.target_modules.iter().copied().collect::<Vec<_>>(), vec![TargetModule::Q, TargetModule::K]);
    }

    #[test]
    fn rslora_scaling_uses_sqrt_rank() {
        let c = AdapterConfig::from_json(r#"{"r":16,"lora_alpha":8,"use_rslora":true,"target_modules":"all-linear"}"#)
            .unwrap();
        assert_eq!(c.scaling(), 2.0);
        assert_eq!(c.target_modules.len(), 7);
    }

    #[test]
    fn refuses_unsupported_features() {
        for (json, needle) in [
            (r#"{"r":8,"lora_alpha":16,"target_modules":["q_proj"],"bias":"all"}"#, "bias"),
            (r#"{"r":8,"lora_alpha":16,"target_modules":["q_proj"],"use_dora":true}"#, "DoRA"),
            (r#"{"r":8,"lora_alpha":16,"target_modules":["lm_head"]}"#, "lm_head"),
            (r#"{"r":8,"lora_alpha":16,"target_modules":".*proj"}"#, "regex"),
            (r#"{"r":0,"lora_alpha":16,"target_modules":["q_proj"]}"#, "`r`"),
            (r#"{"r":8,"target_modules":["q_proj"]}"#, "lora_alpha"),
            (r#"{"r":8,"lora_alpha":16}"#, "target_modules"),
            (r#"{"r":8,"lora_alpha":16,"target_modules":["q_proj"],"rank_pattern":{"q_proj":4}}"#, "rank_pattern"),
            (r#"{"r":8,"lora_alpha":16,"target_modules":["q_proj"],"peft_type":"IA3"}"#, "IA3"),
            (r#"{"r":8,"#, "not valid"),
        ] {
            let err = AdapterConfig::from_json(json).unwrap_err();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
