//! Synthetic adapters and request mixes for benchmarks (`peregrine-agent bench --lora`): random
//! weights shaped for a base model, seeded, and a Zipf distribution over adapters.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::adapter::{LoraAdapter, LoraPair};
use super::target::TargetModule;
use crate::config::ModelConfig;

/// What a random adapter looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomAdapterSpec {
    pub rank: usize,
    pub alpha: f32,
    pub targets: Vec<TargetModule>,
    /// Values are uniform in `[-std·√3, std·√3]` (standard deviation `std`), like PEFT-style
    /// small random init; 0.02 keeps a 135M model's activations finite and fluent.
    pub std: f32,
    pub seed: u64,
}

impl RandomAdapterSpec {
    /// All seven projections, `alpha = 2r`, std 0.02.
    pub fn new(rank: usize, seed: u64) -> RandomAdapterSpec {
        RandomAdapterSpec {
            rank,
            alpha: 2.0 * rank as f32,
            targets: TargetModule::ALL.to_vec(),
            std: 0.02,
            seed,
        }
    }
}

impl LoraAdapter {
    /// A random adapter for `base`, reproducible from `spec.seed`.
    pub fn random(base: &ModelConfig, spec: &RandomAdapterSpec) -> LoraAdapter {
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        let bound = spec.std * 3f32.sqrt();
        let mut fill =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-bound..=bound)).collect() };
        let rank = spec.rank.max(1);
        let mut targets = spec.targets.clone();
        targets.sort();
        targets.dedup();
        let layers = (0..base.num_hidden_layers)
            .map(|_| {
                let mut per_module: [Option<LoraPair>; 7] = Default::default();
                for m in &targets {
                    let (fan_in, fan_out) = m.dims(base);
                    let a = fill(rank * fan_in);
                    let b = fill(fan_out * rank);
                    per_module[m.index()] = Some(LoraPair { a: a.into(), b: b.into() });
                }
                per_module
            })
            .collect();
        LoraAdapter {
            rank,
            scaling: spec.alpha / rank as f32,
            targets,
            layers,
            digest: String::new(),
        }
    }
}

/// Zipf over `0..n`: `P(k) ∝ 1 / (k + 1)^s`, sampled by inverting the cumulative distribution.
#[derive(Debug, Clone)]
pub struct ZipfSampler {
    cdf: Vec<f64>,
    rng: ChaCha8Rng,
}

impl ZipfSampler {
    /// `n ≥ 1` items (a zero `n` is treated as one), exponent `s ≥ 0` (0 = uniform).
    pub fn new(n: usize, s: f64, seed: u64) -> ZipfSampler {
        let weights: Vec<f64> = (0..n.max(1))
            .map(|k| 1.0 / ((k + 1) as f64).powf(s.max(0.0)))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        ZipfSampler {
            cdf,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniform draw in `[0, 1)` from the same stream.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random()
    }

    pub fn sample(&mut self) -> usize {
        let u: f64 = self.rng.random();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::test_support::tiny_config;

    #[test]
    fn random_adapters_are_shaped_for_the_model_and_seeded() {
        let cfg = tiny_config();
        let spec = RandomAdapterSpec::new(4, 9);
        let a = LoraAdapter::random(&cfg, &spec);
        assert_eq!(a, LoraAdapter::random(&cfg, &spec));
        assert_ne!(a, LoraAdapter::random(&cfg, &RandomAdapterSpec::new(4, 10)));
        assert_eq!(a.layers.len(), cfg.num_hidden_layers);
        for m in TargetModule::ALL {
            let (i, o) = m.dims(&cfg);
            let p = a.pair(0, m).unwrap();
            assert_eq!((p.a.len(), p.b.len()), (4 * i, o * 4));
        }
        assert_eq!(a.scaling, 2.0);
    }

    #[test]
    fn zipf_frequencies_follow_the_law() {
        let mut z = ZipfSampler::new(4, 1.0, 1);
        let mut counts = [0usize; 4];
        let n = 200_000;
        for _ in 0..n {
            counts[z.sample()] += 1;
        }
        let h: f64 = 1.0 + 0.5 + 1.0 / 3.0 + 0.25;
        for (k, &c) in counts.iter().enumerate() {
            let want = 1.0 / ((k + 1) as f64 * h);
            assert!((c as f64 / n as f64 - want).abs() < 0.01, "k={k}: {c}");
        }
    }
}
