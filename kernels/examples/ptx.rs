//! Prints the PTX NVRTC makes for the kernels (for reading register/local-memory use without a GPU):
//! `cargo run -p peregrine-kernels --example ptx -- 90 > kernels.ptx` (needs libnvrtc only).
fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "90".into());
    let (major, minor) = arch.split_at(1);
    let arch = (major.parse().unwrap_or(9), minor.parse().unwrap_or(0));
    match peregrine_kernels::compile::compile_ptx(arch) {
        Ok(ptx) => print!("{ptx}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
