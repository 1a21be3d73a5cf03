//! Which SIMD kernels this CPU can run, detected once at run time.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F (+BW/VL) with FMA.
    Avx512,
    /// AVX2 with FMA.
    Avx2,
    /// Whatever the compile target allows (SSE2 on x86-64, NEON on aarch64, ...).
    Generic,
}

impl Isa {
    /// The best kernels this CPU supports. `PEREGRINE_CPU_ISA=generic|avx2` caps it (for testing
    /// the fallbacks and comparing speed).
    pub fn detect() -> Isa {
        let best = Self::available().into_iter().next().unwrap_or(Isa::Generic);
        match std::env::var("PEREGRINE_CPU_ISA").ok().as_deref() {
            Some("generic") => Isa::Generic,
            Some("avx2") if best == Isa::Avx512 => Isa::Avx2,
            _ => best,
        }
    }

    /// Every ISA this CPU can run, best first.
    pub fn available() -> Vec<Isa> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            if avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                out.push(Isa::Avx512);
            }
            if avx2 {
                out.push(Isa::Avx2);
            }
        }
        out.push(Isa::Generic);
        out
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Generic => "generic",
        }
    }
}
