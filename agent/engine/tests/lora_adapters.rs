//! PEFT adapter loading and validation against the fixture adapters and deliberately broken ones.

mod common;
mod lora_common;

use peregrine_engine::config::ModelConfig;
use peregrine_engine::lora::{save_peft, LoraAdapter, LoraValues, RandomAdapterSpec, TargetModule};
use peregrine_engine::EngineError;

use lora_common::{adapter_dir, copy_adapter, lora_reference, smollm2_config};

fn invalid_message(result: Result<LoraAdapter, EngineError>) -> String {
    match result {
        Err(e @ EngineError::InvalidAdapter { .. }) => {
            assert_eq!(e.kind(), "invalid_adapter");
            e.to_string()
        }
        Err(other) => panic!("expected InvalidAdapter, got {other:?}"),
        Ok(_) => panic!("expected InvalidAdapter, got an adapter"),
    }
}

#[test]
fn fixture_adapters_load_with_peft_metadata() {
    let cfg = smollm2_config();
    let reference = lora_reference();
    for name in ["adapter-a", "adapter-b"] {
        let want = &reference["adapters"][name];
        let adapter = LoraAdapter::load(&adapter_dir(name), &cfg, 64).unwrap();
        assert_eq!(adapter.rank as u64, want["r"].as_u64().unwrap());
        assert_eq!(adapter.scaling as f64, want["scaling"].as_f64().unwrap());
        let targets: Vec<&str> = adapter.targets.iter().map(|m| m.peft_name()).collect();
        let mut want_targets: Vec<&str> = want["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        want_targets.sort_by_key(|n| TargetModule::from_peft_name(n).unwrap());
        assert_eq!(targets, want_targets);
        let n_params: usize = adapter
            .layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| p.a.len() + p.b.len())
            .sum();
        assert_eq!(n_params as u64, want["n_lora_params"].as_u64().unwrap());
        let n_tensors = adapter.layers.iter().flatten().flatten().count() * 2;
        assert_eq!(n_tensors as u64, want["lora_tensors"].as_u64().unwrap());
        // The values were drawn from N(0, std): a wrong f16 decoding would not keep that spread.
        let std_a = want["init"]["std_a"].as_f64().unwrap();
        let a: Vec<f64> = adapter
            .layers
            .iter()
            .flatten()
            .flatten()
            .flat_map(|p| p.a.as_f32().iter().map(|&v| v as f64).collect::<Vec<_>>())
            .collect();
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        let std = (a.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / a.len() as f64).sqrt();
        assert!(
            mean.abs() < 1e-3 && (std / std_a - 1.0).abs() < 0.02,
            "{name}: mean {mean} std {std}"
        );
    }
}

/// What the agent reports as the adapter's digest, computed by coreutils.
fn sha256sum_of_files(dir: &std::path::Path) -> String {
    peregrine_testkit::sha256sum_of_files(dir, &["adapter_config.json", "adapter_model.safetensors"])
}

/// The weights only: `digest` records the files read, which an adapter built in memory has none of.
fn without_digest(adapter: LoraAdapter) -> LoraAdapter {
    LoraAdapter { digest: String::new(), ..adapter }
}

/// The fixture adapters are F16 files: their values stay 16-bit in host memory (half of f32's
/// bytes, which is what `--max-cpu-loras` holds), and save back to an F16 file that loads equal.
#[test]
fn sixteen_bit_adapters_stay_sixteen_bit_in_host_memory_and_save_as_read() {
    let cfg = smollm2_config();
    let adapter = LoraAdapter::load(&adapter_dir("adapter-a"), &cfg, 64).unwrap();
    let pairs: Vec<_> = adapter.layers.iter().flatten().flatten().collect();
    assert!(!pairs.is_empty());
    assert!(pairs.iter().all(|p| matches!((&p.a, &p.b), (LoraValues::F16(_), LoraValues::F16(_)))));
    let params: usize = pairs.iter().map(|p| p.a.len() + p.b.len()).sum();
    assert_eq!(adapter.size_bytes(), 2 * params);
    let dir = tempfile::tempdir().unwrap();
    save_peft(&adapter, dir.path()).unwrap();
    let file = std::fs::metadata(dir.path().join("adapter_model.safetensors")).unwrap().len() as usize;
    assert!(file > 2 * params && file < 2 * params + 64 * 1024, "an F16 file: {file} bytes for {params} values");
    let again = LoraAdapter::load(dir.path(), &cfg, 64).unwrap();
    assert!(again.layers.iter().flatten().flatten().all(|p| matches!(p.a, LoraValues::F16(_))));
    assert_eq!(without_digest(again), without_digest(adapter));
}

#[test]
fn random_adapter_round_trips_through_peft_files() {
    let cfg = smollm2_config();
    let adapter = LoraAdapter::random(&cfg, &RandomAdapterSpec::new(4, 42));
    let dir = tempfile::tempdir().unwrap();
    save_peft(&adapter, dir.path()).unwrap();
    let loaded = LoraAdapter::load(dir.path(), &cfg, 64).unwrap();
    assert_eq!(loaded.digest, sha256sum_of_files(dir.path()));
    assert_eq!(without_digest(loaded), adapter);
}

#[test]
fn the_digest_names_the_files_content() {
    let cfg = smollm2_config();
    for name in ["adapter-a", "adapter-b"] {
        let adapter = LoraAdapter::load(&adapter_dir(name), &cfg, 64).unwrap();
        assert_eq!(adapter.digest, sha256sum_of_files(&adapter_dir(name)), "{name}");
    }
    let a = LoraAdapter::load(&adapter_dir("adapter-a"), &cfg, 64).unwrap();
    let b = LoraAdapter::load(&adapter_dir("adapter-b"), &cfg, 64).unwrap();
    assert_ne!(a.digest, b.digest);
}

#[test]
fn shapes_for_another_model_are_refused() {
    let cfg = smollm2_config();
    let other = ModelConfig {
        hidden_size: 512,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        ..cfg.clone()
    };
    let dir = tempfile::tempdir().unwrap();
    save_peft(
        &LoraAdapter::random(&other, &RandomAdapterSpec::new(4, 1)),
        dir.path(),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
    assert!(msg.contains("shape") && msg.contains("expected"), "{msg}");
}

#[test]
fn more_layers_than_the_model_are_refused() {
    let cfg = smollm2_config();
    let deeper = ModelConfig {
        num_hidden_layers: cfg.num_hidden_layers + 2,
        ..cfg.clone()
    };
    let dir = tempfile::tempdir().unwrap();
    save_peft(
        &LoraAdapter::random(&deeper, &RandomAdapterSpec::new(2, 1)),
        dir.path(),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
    assert!(msg.contains("but the base model has 30 layers"), "{msg}");
}

#[test]
fn rank_above_max_lora_rank_is_refused() {
    let msg = invalid_message(LoraAdapter::load(
        &adapter_dir("adapter-b"),
        &smollm2_config(),
        8,
    ));
    assert!(msg.contains("rank 16 exceeds max_lora_rank 8"), "{msg}");
}

#[test]
fn corrupt_safetensors_is_refused() {
    let cfg = smollm2_config();
    let dir = copy_adapter("adapter-a");
    let path = dir.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 7, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
        assert!(
            msg.contains("not a valid safetensors file"),
            "cut {cut}: {msg}"
        );
    }
    // A header that claims an absurd length.
    let mut absurd = bytes.clone();
    absurd[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &absurd).unwrap();
    invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
}

#[test]
fn missing_config_is_refused() {
    let dir = copy_adapter("adapter-a");
    std::fs::remove_file(dir.path().join("adapter_config.json")).unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &smollm2_config(), 64));
    assert!(msg.contains("missing adapter_config.json"), "{msg}");
}

#[test]
fn pickle_bin_adapter_is_refused_with_a_conversion_hint() {
    let dir = copy_adapter("adapter-a");
    std::fs::rename(
        dir.path().join("adapter_model.safetensors"),
        dir.path().join("adapter_model.bin"),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &smollm2_config(), 64));
    assert!(
        msg.contains("pickle .bin adapters are not supported; convert to safetensors"),
        "{msg}"
    );
}

#[test]
fn non_finite_values_are_refused() {
    let cfg = smollm2_config();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut adapter = LoraAdapter::random(&cfg, &RandomAdapterSpec::new(2, 3));
        let LoraValues::F32(b) = &mut adapter.layers[7][TargetModule::Up.index()].as_mut().unwrap().b else { panic!("random adapters are f32") };
        b[5] = bad;
        let dir = tempfile::tempdir().unwrap();
        save_peft(&adapter, dir.path()).unwrap();
        let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
        assert!(
            msg.contains("layers.7.mlp.up_proj.lora_B") && msg.contains("non-finite"),
            "{msg}"
        );
    }
}

#[test]
fn missing_and_extra_tensors_are_refused() {
    let cfg = smollm2_config();
    let spec = RandomAdapterSpec {
        targets: vec![TargetModule::Q],
        ..RandomAdapterSpec::new(2, 5)
    };
    let dir = tempfile::tempdir().unwrap();
    save_peft(&LoraAdapter::random(&cfg, &spec), dir.path()).unwrap();
    let config_path = dir.path().join("adapter_config.json");
    let original = std::fs::read_to_string(&config_path).unwrap();

    // Config promises k_proj too: its tensors are missing.
    std::fs::write(
        &config_path,
        original.replace(r#"["q_proj"]"#, r#"["q_proj","k_proj"]"#),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
    assert!(
        msg.contains("missing tensor") && msg.contains("k_proj"),
        "{msg}"
    );

    // Config lists only v_proj: the q_proj tensors are extra.
    std::fs::write(
        &config_path,
        original.replace(r#"["q_proj"]"#, r#"["v_proj"]"#),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
    assert!(
        msg.contains("q_proj") && msg.contains("does not list"),
        "{msg}"
    );
}

#[test]
fn unsupported_peft_features_are_refused() {
    let dir = copy_adapter("adapter-a");
    let config_path = dir.path().join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(
        &config_path,
        text.replace(r#""use_dora": false"#, r#""use_dora": true"#),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &smollm2_config(), 64));
    assert!(msg.contains("DoRA"), "{msg}");
}

/// Rewrites an f32 PEFT file in bf16 (or f16) and checks the loader decodes those values exactly.
#[test]
fn bf16_and_f16_tensors_decode_exactly() {
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
    let cfg = smollm2_config();
    let spec = RandomAdapterSpec {
        targets: vec![TargetModule::V, TargetModule::Down],
        ..RandomAdapterSpec::new(3, 8)
    };
    let adapter = LoraAdapter::random(&cfg, &spec);
    for dtype in [Dtype::BF16, Dtype::F16] {
        let dir = tempfile::tempdir().unwrap();
        save_peft(&adapter, dir.path()).unwrap();
        let path = dir.path().join("adapter_model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut expected = adapter.clone();
        let mut converted: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, view) in st.iter() {
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let (data, rounded): (Vec<u8>, Vec<f32>) = match dtype {
                Dtype::BF16 => values
                    .iter()
                    .map(|&v| half::bf16::from_f32(v))
                    .map(|h| (h.to_le_bytes(), h.to_f32()))
                    .fold((vec![], vec![]), |(mut d, mut r), (b, f)| {
                        d.extend(b);
                        r.push(f);
                        (d, r)
                    }),
                _ => values
                    .iter()
                    .map(|&v| half::f16::from_f32(v))
                    .map(|h| (h.to_le_bytes(), h.to_f32()))
                    .fold((vec![], vec![]), |(mut d, mut r), (b, f)| {
                        d.extend(b);
                        r.push(f);
                        (d, r)
                    }),
            };
            // Put the rounded values where the loader should put them.
            let layer: usize = name.split('.').nth(4).unwrap().parse().unwrap();
            let module = TargetModule::from_peft_name(name.split('.').nth(6).unwrap()).unwrap();
            let pair = expected.layers[layer][module.index()].as_mut().unwrap();
            if name.contains("lora_A") {
                pair.a = rounded.into()
            } else {
                pair.b = rounded.into()
            }
            converted.push((name.to_string(), view.shape().to_vec(), data));
        }
        let views: Vec<_> = converted
            .iter()
            .map(|(n, s, d)| (n.clone(), TensorView::new(dtype, s.clone(), d).unwrap()))
            .collect();
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        let loaded = without_digest(LoraAdapter::load(dir.path(), &cfg, 64).unwrap());
        assert_eq!(loaded, expected, "{dtype:?}");
        assert_ne!(loaded, adapter, "{dtype:?} rounding must be visible");
    }
}

#[test]
fn unsupported_dtype_is_refused() {
    use safetensors::{tensor::TensorView, Dtype};
    let cfg = smollm2_config();
    let spec = RandomAdapterSpec {
        targets: vec![TargetModule::K],
        ..RandomAdapterSpec::new(1, 8)
    };
    let dir = tempfile::tempdir().unwrap();
    save_peft(&LoraAdapter::random(&cfg, &spec), dir.path()).unwrap();
    let (fan_in, fan_out) = TargetModule::K.dims(&cfg);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        let p = format!("base_model.model.model.layers.{layer}.self_attn.k_proj");
        tensors.push((
            format!("{p}.lora_A.weight"),
            vec![1, fan_in],
            vec![0u8; 8 * fan_in],
        ));
        tensors.push((
            format!("{p}.lora_B.weight"),
            vec![fan_out, 1],
            vec![0u8; 8 * fan_out],
        ));
    }
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F64, s.clone(), d).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.path().join("adapter_model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
    assert!(
        msg.contains("F64") && msg.contains("only F32, F16 and BF16"),
        "{msg}"
    );
}

#[test]
fn bench_adapters_are_written_as_loadable_peft_folders() {
    use peregrine_engine::bench::lora::{random_adapters, write_random_adapters, zipf_assignment};
    let cfg = smollm2_config();
    let dir = tempfile::tempdir().unwrap();
    let written = write_random_adapters(&cfg, 3, 8, 100, dir.path()).unwrap();
    let values = random_adapters(&cfg, 3, 8, 100);
    assert_eq!(
        written.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["adapter-0", "adapter-1", "adapter-2"]
    );
    for ((_, folder), want) in written.iter().zip(values) {
        // Written in bf16: half the bytes of the values they were made from, each rounded once.
        let loaded = without_digest(LoraAdapter::load(folder, &cfg, 64).unwrap());
        assert_eq!(loaded.size_bytes() * 2, want.size_bytes());
        assert_ne!(loaded, want, "random f32 values are not all exact in bf16");
        assert_eq!(loaded, want.into_bf16());
    }
    // Zipf over 4 adapters with a quarter of the requests on the base model.
    let picks = zipf_assignment(40_000, 4, 1.0, 0.25, 3);
    let base = picks.iter().filter(|p| p.is_none()).count() as f64 / picks.len() as f64;
    assert!((base - 0.25).abs() < 0.02, "{base}");
    let count = |k: usize| picks.iter().filter(|p| **p == Some(k)).count() as f64;
    assert!((count(0) / count(1) - 2.0).abs() < 0.2 && (count(0) / count(3) - 4.0).abs() < 0.5);
    assert_eq!(
        zipf_assignment(10, 4, 1.0, 0.0, 3),
        zipf_assignment(10, 4, 1.0, 0.0, 3)
    );
}

type TestResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Every tensor of the safetensors file `bytes`, decoded one element at a time with no shortcut
/// (the loader's semantics before it read tensors in parallel), compared bit for bit
/// with `adapter`: the names of the tensors that differ, and how many tensors were compared.
fn differences_from_elementwise_decode(adapter: &LoraAdapter, bytes: &[u8]) -> TestResult<(Vec<String>, usize)> {
    use safetensors::{Dtype, SafeTensors};
    let st = SafeTensors::deserialize(bytes)?;
    let (mut differ, mut compared) = (Vec::new(), 0);
    for (name, view) in st.iter() {
        let parts: Vec<&str> = name.split('.').collect();
        let (Some(layer), Some(module), Some(which)) = (parts.get(4), parts.get(6), parts.get(7)) else {
            return Err(format!("{name}: not a PEFT LoRA name").into());
        };
        let module = TargetModule::from_peft_name(module).ok_or(format!("{name}: module"))?;
        let pair = adapter.pair(layer.parse()?, module).ok_or(format!("{name} not loaded"))?;
        let got = if *which == "lora_A" { &pair.a } else { &pair.b };
        let want: Vec<f32> = match view.dtype() {
            Dtype::F32 => view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => view.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => view.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(format!("{name}: {other:?}").into()),
        };
        if got.len() != want.len() || got.as_f32().iter().zip(&want).any(|(g, w)| g.to_bits() != w.to_bits()) {
            differ.push(format!("{name} ({:?})", view.dtype()));
        }
        compared += 1;
    }
    Ok((differ, compared))
}

/// `bytes` (an f32 safetensors file) with every tensor stored as `dtype` (round to nearest).
fn with_dtype(bytes: &[u8], dtype: safetensors::Dtype) -> TestResult<Vec<u8>> {
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
    let st = SafeTensors::deserialize(bytes)?;
    let converted: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .iter()
        .map(|(name, view)| {
            let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            let data: Vec<u8> = match dtype {
                Dtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
                Dtype::BF16 => values.flat_map(|v| half::bf16::from_f32(v).to_le_bytes()).collect(),
                _ => values.flat_map(|v| half::f16::from_f32(v).to_le_bytes()).collect(),
            };
            (name.to_string(), view.shape().to_vec(), data)
        })
        .collect();
    let views = converted
        .iter()
        .map(|(n, s, d)| TensorView::new(dtype, s.clone(), d).map(|v| (n.clone(), v)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(safetensors::serialize(views, None)?)
}

/// `bytes` with one more space in its JSON header: every tensor's data then starts at an odd
/// offset, so no tensor can be read in place as f32 or u16 (the loader's unaligned path).
fn with_odd_header(bytes: &[u8]) -> TestResult<Vec<u8>> {
    let len: [u8; 8] = bytes.get(..8).ok_or("short file")?.try_into()?;
    let n = usize::try_from(u64::from_le_bytes(len))?;
    let header = bytes.get(8..8 + n).ok_or("short header")?;
    let mut out = ((n + 1) as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.push(b' ');
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}

#[test]
fn fixture_adapters_decode_as_element_by_element() {
    let cfg = smollm2_config();
    for name in ["adapter-a", "adapter-b"] {
        let dir = adapter_dir(name);
        let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        let loaded = LoraAdapter::load(&dir, &cfg, 64).unwrap();
        let (differ, n) = differences_from_elementwise_decode(&loaded, &bytes).unwrap();
        assert!(differ.is_empty(), "{name}: {differ:?}");
        assert_eq!(n, loaded.layers.iter().flatten().flatten().count() * 2, "{name}");
        // The same adapter from bytes in memory (the path of small files and `from_parts`).
        let config = peregrine_engine::lora::AdapterConfig::from_file(&dir.join("adapter_config.json")).unwrap();
        let from_parts = LoraAdapter::from_parts(&config, &bytes, &cfg, 64).unwrap();
        assert_eq!(without_digest(loaded), from_parts, "{name}");
    }
}

/// A rank-8 adapter on all seven projections (about 10 MB in f32, many pieces) in each dtype, with
/// aligned and unaligned tensor data, loads to exactly the element-by-element values.
#[test]
fn every_dtype_and_alignment_decodes_as_element_by_element() {
    use safetensors::Dtype;
    let cfg = smollm2_config();
    let adapter = LoraAdapter::random(&cfg, &RandomAdapterSpec::new(8, 11));
    let dir = tempfile::tempdir().unwrap();
    save_peft(&adapter, dir.path()).unwrap();
    let path = dir.path().join("adapter_model.safetensors");
    let f32_bytes = std::fs::read(&path).unwrap();
    for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        for odd in [false, true] {
            let mut bytes = with_dtype(&f32_bytes, dtype).unwrap();
            if odd {
                bytes = with_odd_header(&bytes).unwrap();
            }
            std::fs::write(&path, &bytes).unwrap();
            let loaded = LoraAdapter::load(dir.path(), &cfg, 64).unwrap();
            assert_eq!(loaded.digest, sha256sum_of_files(dir.path()), "{dtype:?} odd {odd}");
            let (differ, _) = differences_from_elementwise_decode(&loaded, &bytes).unwrap();
            assert!(differ.is_empty(), "{dtype:?} odd {odd}: {differ:?}");
            if dtype == Dtype::F32 {
                assert_eq!(without_digest(loaded), adapter, "odd {odd}");
            }
        }
    }
}

#[test]
fn the_first_bad_tensor_in_layer_order_is_reported() {
    let cfg = smollm2_config();
    let mut adapter = LoraAdapter::random(&cfg, &RandomAdapterSpec::new(4, 3));
    // Several bad tensors: whichever thread finds one first, the message names the earliest.
    for (layer, module, index) in [(20, TargetModule::Q, 9), (3, TargetModule::Down, 17), (11, TargetModule::O, 1)] {
        let LoraValues::F32(a) = &mut adapter.layers[layer][module.index()].as_mut().unwrap().a else { panic!("random adapters are f32") };
        a[index] = f32::NAN;
    }
    let dir = tempfile::tempdir().unwrap();
    save_peft(&adapter, dir.path()).unwrap();
    for _ in 0..3 {
        let Err(EngineError::InvalidAdapter { message, .. }) = LoraAdapter::load(dir.path(), &cfg, 64) else {
            panic!("expected InvalidAdapter")
        };
        assert_eq!(message, "layers.3.mlp.down_proj.lora_A holds a non-finite value (NaN) at index 17");
    }
}

#[test]
fn two_spellings_of_one_weight_are_refused() {
    use safetensors::{tensor::TensorView, SafeTensors};
    let cfg = smollm2_config();
    let spec = RandomAdapterSpec { targets: vec![TargetModule::V], ..RandomAdapterSpec::new(2, 5) };
    let dir = tempfile::tempdir().unwrap();
    save_peft(&LoraAdapter::random(&cfg, &spec), dir.path()).unwrap();
    let path = dir.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, TensorView<'_>)> = st.iter().map(|(n, v)| (n.to_string(), v)).collect();
    let name = "base_model.model.model.layers.4.self_attn.v_proj.lora_B.weight";
    let copy = views.iter().find(|(n, _)| n == name).unwrap().1.clone();
    views.push((name.replace("lora_B.weight", "lora_B.default.weight"), copy));
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let msg = invalid_message(LoraAdapter::load(dir.path(), &cfg, 64));
    assert!(msg.contains("lora_B.default.weight") && msg.contains("same weight"), "{msg}");
}
