//! `peregrine-agent eval` on the CPU with SmolLM2: its unquantized reference equals transformers'
//! float32 logits (`fixtures/smollm2/reference.json`) and perplexity (`fixtures/smollm2/perplexity.json`,
//! made by `scripts/make-perplexity-fixture.py` on the first 256 tokens of the built-in text), and
//! the 8-bit weight rows stay within the bounds `tests/quant_fidelity.rs` checks against the same
//! fixture (`fidelity::SMOLLM2_WEIGHT_BOUNDS`, the one set of bounds).

mod common;

use peregrine_agent::eval::{EvalArgs, KvOption, Variant, WeightOption};
use peregrine_agent::runtime::{DeviceArg, KvCacheDtypeArg, LoadFormatArg};
use peregrine_engine::bench::fidelity::{self, SMOLLM2_WEIGHT_BOUNDS};
use peregrine_engine::model::quantize::Granularity;
use peregrine_engine::model::rowquant::{Activations, RowFormat};

fn fixture(name: &str) -> serde_json::Value {
    let path = peregrine_testkit::fixtures_dir().join("smollm2").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// GPTQ's text KL at most this fraction of round-to-nearest's (rotated int8 W8A8).
const GPTQ_KL_RATIO: f64 = 0.75;

#[test]
fn eval_on_the_cpu_matches_transformers_and_the_fidelity_bounds() {
    let perplexity = fixture("perplexity.json");
    let prefix = perplexity["prefix_tokens"].as_u64().unwrap() as usize;
    let args = EvalArgs {
        model: peregrine_testkit::test_model(),
        load_format: LoadFormatArg::Auto,
        device: Some(DeviceArg::Cpu),
        threads: Some(2),
        quantization: None,
        quantization_rotation: false,
        quantization_gptq: false,
        kv_cache_dtype: None,
        text: None,
        text_tokens: prefix,
        chunk: 64,
        reference_logits: Some(peregrine_testkit::fixtures_dir().join("smollm2").join("reference.json")),
    };
    let bounded: Vec<Variant> = SMOLLM2_WEIGHT_BOUNDS
        .iter()
        .map(|&(_, format, activations, _, _)| Variant {
            weights: WeightOption::Quantized { format, granularity: Granularity::PerRow, activations, rotated: false, gptq: false },
            kv: KvOption::Native,
        })
        .collect();
    let mut variants = bounded.clone();
    // `--kv-cache-dtype fp8` (whatever FP8_KV_DEFAULT names: fp8-hadamard) and fp8-hadamard-qkv.
    variants.push(Variant { weights: WeightOption::Unquantized, kv: KvOption::from_flag(KvCacheDtypeArg::Fp8) });
    variants.push(Variant { weights: WeightOption::Unquantized, kv: KvOption::from_flag(KvCacheDtypeArg::Fp8HadamardQkv) });
    // `--kv-cache-dtype int8` and `--quantization int8 --quantization-rotation`.
    let int8_kv = Variant { weights: WeightOption::Unquantized, kv: KvOption::from_flag(KvCacheDtypeArg::Int8) };
    let int8_rotated = Variant {
        weights: WeightOption::Quantized { format: RowFormat::Int8, granularity: Granularity::PerRow, activations: Activations::PerToken, rotated: true, gptq: false },
        kv: KvOption::Native,
    };
    // ... and with `--quantization-gptq`.
    let int8_rotated_gptq = Variant {
        weights: WeightOption::Quantized { format: RowFormat::Int8, granularity: Granularity::PerRow, activations: Activations::PerToken, rotated: true, gptq: true },
        kv: KvOption::Native,
    };
    variants.extend([int8_kv, int8_rotated, int8_rotated_gptq]);
    let report = args.evaluate_variants(&variants, |line| eprintln!("{line}")).unwrap();

    // The reference is transformers' model: same prompt tokens, logits within 1e-3 at every position.
    let reference = fixture("reference.json");
    let prompts = reference["prompts"].as_array().unwrap();
    assert_eq!(report.reference.prompts.len(), prompts.len());
    for ((tokens, rows), p) in report.reference.prompts.iter().zip(prompts) {
        assert_eq!(tokens, &ids(&p["input_ids"]), "{}", p["prompt"]);
        let want = fidelity::prompts_from_reference(&serde_json::json!({ "prompts": [p] })).unwrap().remove(0);
        let mut f = fidelity::Fidelity::default();
        for (row, (top, logits)) in rows.iter().zip(&want.positions) {
            f.add(row, top, logits);
        }
        assert_eq!(f.top1_agree, f.positions, "{}", p["prompt"]);
        assert!(f.max_abs_diff < 1e-3, "{}: {f:?}", p["prompt"]);
    }

    // Perplexity of the same tokens as transformers'.
    assert_eq!(report.text_tokens, prefix);
    let want_ids = ids(&perplexity["input_ids"]);
    assert_eq!(report.reference.text.nll.len(), prefix - 1);
    let want_ppl = perplexity["prefix_perplexity"].as_f64().unwrap();
    let got_ppl = report.reference_perplexity();
    assert!((got_ppl / want_ppl - 1.0).abs() < 1e-3, "perplexity {got_ppl}, transformers {want_ppl}");
    let want_nll: Vec<f64> = perplexity["nll"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    for (i, (g, w)) in report.reference.text.nll.iter().zip(&want_nll).enumerate() {
        assert!((g - w).abs() < 2e-3, "token {} ({}): NLL {g}, transformers {w}", i + 1, want_ids[i + 1]);
    }

    for (variant, (label, _, _, max_mean, min_top1)) in bounded.iter().zip(SMOLLM2_WEIGHT_BOUNDS) {
        let c = &report.row(variant).unwrap().comparison;
        assert_eq!(c.logits.positions, 36);
        assert!(c.logits.mean_abs_diff() <= max_mean, "{label}: mean |Δlogit| {} > {max_mean}", c.logits.mean_abs_diff());
        assert!(c.logits.top1_agree >= min_top1, "{label}: top-1 {}/36 < {min_top1}", c.logits.top1_agree);
        // 8-bit weights cost something, never everything: KL and perplexity finite and near the reference.
        let ppl = c.text.perplexity();
        assert!(c.kl_mean() > 0.0 && c.kl_max.is_finite(), "{label}: {c:?}");
        assert!(ppl.is_finite() && (ppl / got_ppl - 1.0).abs() < 0.25, "{label}: perplexity {ppl} vs {got_ppl}");
        // The change's 95 % interval (7 blocks of 32 tokens here) holds the change and has width.
        let change = fidelity::PerplexityChange::between(&report.reference.text, &c.text).unwrap();
        assert!((change.change - (ppl / got_ppl - 1.0)).abs() < 1e-9, "{label}: {change:?}");
        assert!(change.low < change.change && change.change < change.high, "{label}: {change:?}");
    }
    // The reference against itself: no change, and an interval of none.
    let itself = fidelity::PerplexityChange::between(&report.reference.text, &report.reference.text).unwrap();
    assert_eq!((itself.change, itself.low, itself.high), (0.0, 0.0, 0.0));
    // Over the prompts (docs/benchmarks.md): q/k rotated 0.302, q/k/v rotated 0.192; 30 % above for
    // other summation orders. The second bound fails if fp8-hadamard-qkv loses v's rotation (or its
    // undoing, which would move every logit far more).
    for (i, max_mean) in [(3, 0.40), (4, 0.25)] {
        let fp8_kv = &report.row(&variants[i]).unwrap().comparison;
        assert!(fp8_kv.logits.mean_abs_diff() > 0.0 && fp8_kv.text.perplexity().is_finite(), "{fp8_kv:?}");
        assert!(fp8_kv.logits.mean_abs_diff() <= max_mean, "{:?}: mean |Δ| {} > {max_mean}", variants[i], fp8_kv.logits.mean_abs_diff());
        // The text's KL covers every one of its positions here (256 < TEXT_KL_MAX_POSITIONS).
        assert_eq!(fp8_kv.text_kl_positions, prefix);
        assert!(fp8_kv.text_kl_mean() > 0.0 && fp8_kv.text_kl_mean() < 0.05, "{:?}: text KL {}", variants[i], fp8_kv.text_kl_mean());
    }

    // The int8 cache (docs/benchmarks.md, 1198 tokens: mean |Δ| 0.055 over the prompts, text KL
    // 0.00025) well inside the fp8 cache's: a third of fp8-hadamard's 0.30 at most.
    let int8_kv = &report.row(&int8_kv).unwrap().comparison;
    let fp8_kv = &report.row(&variants[3]).unwrap().comparison;
    assert!(int8_kv.logits.mean_abs_diff() > 0.0 && int8_kv.logits.mean_abs_diff() < fp8_kv.logits.mean_abs_diff() / 3.0, "int8 KV {int8_kv:?} vs fp8 {fp8_kv:?}");
    assert!(int8_kv.text_kl_mean() < fp8_kv.text_kl_mean() / 3.0, "int8 KV text KL {} vs fp8 {}", int8_kv.text_kl_mean(), fp8_kv.text_kl_mean());
    // The rotated residual stream and the online rotation of down_proj's input make int8 W8A8 far
    // closer to the model than the unrotated one (1198 tokens: text KL 0.029 -> 0.0047, mean |Δ|
    // 1.20 -> 0.27; without the online rotation 0.011 and 0.69, which these bounds refuse).
    let rotated = &report.row(&int8_rotated).unwrap().comparison;
    let plain = &report.row(&bounded[1]).unwrap().comparison;
    eprintln!("int8 W8A8 text KL {:.5} -> rotated {:.5}; mean |Δ| {:.3} -> {:.3}", plain.text_kl_mean(), rotated.text_kl_mean(), plain.logits.mean_abs_diff(), rotated.logits.mean_abs_diff());
    assert!(rotated.text_kl_mean() < 0.25 * plain.text_kl_mean(), "rotation: text KL {} vs {}", rotated.text_kl_mean(), plain.text_kl_mean());
    assert!(rotated.logits.mean_abs_diff() < 0.4 * plain.logits.mean_abs_diff(), "rotation: {rotated:?} vs {plain:?}");
    // GPTQ's rounding on top (1198 tokens: text KL 0.0047 -> 0.0025, top-1 35 -> 36 of 36).
    let gptq = &report.row(&int8_rotated_gptq).unwrap().comparison;
    eprintln!("rotated int8 W8A8 text KL {:.5} -> GPTQ {:.5}; top-1 {} -> {}", rotated.text_kl_mean(), gptq.text_kl_mean(), rotated.logits.top1_agree, gptq.logits.top1_agree);
    assert!(gptq.text_kl_mean() < GPTQ_KL_RATIO * rotated.text_kl_mean(), "GPTQ: text KL {} vs {}", gptq.text_kl_mean(), rotated.text_kl_mean());
    assert!(gptq.logits.top1_agree >= rotated.logits.top1_agree, "GPTQ: {gptq:?} vs {rotated:?}");

    // `--reference-logits`: the reference against transformers' float32 logits (the same figures as
    // above), and every row against them too, close to its figure against the reference.
    let r2 = report.reference_vs_fixture.expect("reference vs --reference-logits");
    assert_eq!((r2.positions, r2.top1_agree), (36, 36));
    assert!(r2.max_abs_diff < 1e-3, "{r2:?}");
    for row in &report.rows {
        let (own, fixed) = (&row.comparison.logits, row.comparison.fixture.expect("each row against --reference-logits"));
        assert_eq!(fixed.positions, 36);
        assert!((own.mean_abs_diff() - fixed.mean_abs_diff()).abs() < 1e-3, "{:?}: {own:?} vs {fixed:?}", row.variant);
    }
}
