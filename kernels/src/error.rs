//! The kernels crate's one error type.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No usable GPU: the driver library is missing, it reports no device, or the ordinal is out of range.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A CUDA library (NVRTC, cuBLAS) that the backend needs could not be loaded.
    #[error("CUDA library missing: {0}")]
    MissingLibrary(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC compile failed: {0}")]
    Compile(String),
    #[error("cuBLAS: {0:?}")]
    Blas(CublasError),
    /// A launch whose shapes the kernels do not support (caught before launching).
    #[error("unsupported kernel shape: {0}")]
    Unsupported(String),
}

impl From<CublasError> for KernelError {
    fn from(e: CublasError) -> Self {
        KernelError::Blas(e)
    }
}
