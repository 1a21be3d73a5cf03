//! The kernel sources, compiled at run time with NVRTC into PTX for the device's architecture and
//! cached on disk, so `cargo build` needs no CUDA toolkit and a second start skips compilation.
//!
//! Cache key: xxh3-128 of (sources, compile options, target architecture). The driver JIT-compiles
//! the PTX at module load (and keeps its own cache of the result).

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::{KernelError, Result};

/// Every kernel file, with the shared header first. Order is part of the cache key.
const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../cuda/common.cuh")),
    ("embedding.cu", include_str!("../cuda/embedding.cu")),
    ("rmsnorm.cu", include_str!("../cuda/rmsnorm.cu")),
    ("rope_kv.cu", include_str!("../cuda/rope_kv.cu")),
    // After rope_kv.cu (f2e4m3); defines the 8-bit formats' names gemv_fp8.cu and gemm_w8a8.cu use, and
    // the attention output's quantizer the attention kernels call.
    ("quant8.cu", include_str!("../cuda/quant8.cu")),
    ("attention.cu", include_str!("../cuda/attention.cu")),
    ("attention_tiled.cu", include_str!("../cuda/attention_tiled.cu")),
    ("attention_mma.cu", include_str!("../cuda/attention_mma.cu")),
    // After attention_mma.cu: its tile loader, geometry and mma helpers.
    ("attention_mma_f8.cu", include_str!("../cuda/attention_mma_f8.cu")),
    ("silu_mul.cu", include_str!("../cuda/silu_mul.cu")),
    ("argmax.cu", include_str!("../cuda/argmax.cu")),
    ("gemv.cu", include_str!("../cuda/gemv.cu")),
    // After rope_kv.cu and attention_mma.cu: uses their e4m3 conversions.
    ("gemv_fp8.cu", include_str!("../cuda/gemv_fp8.cu")),
    // After attention_mma.cu (cp.async helpers).
    ("gemm_w8a8.cu", include_str!("../cuda/gemm_w8a8.cu")),
    // After gemm_w8a8.cu (its mma8 wrappers).
    ("gemv_mma8.cu", include_str!("../cuda/gemv_mma8.cu")),
    ("fill.cu", include_str!("../cuda/fill.cu")),
    ("sample.cu", include_str!("../cuda/sample.cu")),
    ("token_mask.cu", include_str!("../cuda/token_mask.cu")),
    ("lora.cu", include_str!("../cuda/lora.cu")),
    // The BERT-family encoder's kernels (f32 activations).
    ("encoder.cu", include_str!("../cuda/encoder.cu")),
];

/// The single translation unit NVRTC compiles (`#line` keeps error messages pointing at real files).
pub fn program_source() -> String {
    let mut src = String::new();
    for (name, text) in SOURCES {
        src.push_str(&format!("#line 1 \"{name}\"\n"));
        src.push_str(text);
        src.push('\n');
    }
    src
}

fn options(arch: (i32, i32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{}{}", arch.0, arch.1),
        "--std=c++17".into(),
        // Kernels opt into fast intrinsics explicitly (__expf, exp2f); keep IEEE division and sqrt.
        "--fmad=true".into(),
    ]
}

/// Where compiled PTX is kept: `$PEREGRINE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/peregrine/kernels`,
/// else `~/.cache/peregrine/kernels`; None when none of these can be formed.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("PEREGRINE_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("peregrine").join("kernels"))
}

pub fn cache_key(arch: (i32, i32)) -> String {
    let mut material = program_source();
    material.push_str(&options(arch).join(" "));
    format!("{:032x}-sm{}{}", xxhash_rust::xxh3::xxh3_128(material.as_bytes()), arch.0, arch.1)
}

/// Compiles (or loads from the cache) and loads the module into `ctx`.
pub fn load_module(ctx: &Arc<CudaContext>, arch: (i32, i32)) -> Result<Arc<CudaModule>> {
    let path = cache_dir().map(|d| d.join(format!("{}.ptx", cache_key(arch))));
    if let Some(p) = &path {
        if let Some(text) = std::fs::read_to_string(p).ok().filter(|t| !t.contains('\0')) {
            match ctx.load_module(Ptx::from_src(text)) {
                Ok(m) => return Ok(m),
                // A damaged cache entry is rebuilt, not fatal.
                Err(e) => tracing::warn!("cached PTX {} failed to load ({e}); recompiling", p.display()),
            }
        }
    }
    let text = compile_ptx(arch)?;
    if let Some(p) = &path {
        if let Err(e) = write_atomically(p, &text) {
            tracing::warn!("cannot cache PTX at {}: {e}", p.display());
        }
    }
    Ok(ctx.load_module(Ptx::from_src(text))?)
}

/// Compiles the kernels to PTX for `arch` with NVRTC (needs libnvrtc, no GPU).
pub fn compile_ptx(arch: (i32, i32)) -> Result<String> {
    // SAFETY: dlopen probe only; cudarc would panic on a missing library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::MissingLibrary("libnvrtc.so (add /usr/local/cuda/lib64 to LD_LIBRARY_PATH)".into()));
    }
    let started = std::time::Instant::now();
    let opts = CompileOptions { options: options(arch), name: Some("peregrine.cu".into()), ..Default::default() };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(program_source(), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            KernelError::Compile(log.to_string_lossy().into_owned())
        }
        other => KernelError::Compile(format!("{other:?}")),
    })?;
    tracing::info!("compiled CUDA kernels for sm_{}{} in {:?}", arch.0, arch.1, started.elapsed());
    Ok(ptx.to_src())
}

fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A unique temporary name, then rename: concurrent processes never see half a file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}
