//! One GPU: its context, the one stream all work runs on, and the facts the backend sizes itself by.
//!
//! Everything runs on a single non-default stream (capturable into CUDA graphs), so cudarc's
//! per-buffer event tracking is switched off: ordering comes from the stream itself.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

use crate::{KernelError, Result};

/// Checks that the CUDA driver library can be loaded and that `ordinal` names a device, without
/// panicking (cudarc panics when a library it needs is absent, so probe first).
pub fn probe(ordinal: usize) -> Result<()> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(KernelError::NoDevice(
            "libcuda.so (the NVIDIA driver) was not found; set LD_LIBRARY_PATH to its folder \
             (e.g. /usr/local/nvidia/lib64) or use --device cpu"
                .into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| KernelError::NoDevice(format!("the driver reports no usable device ({e})")))?;
    if count <= 0 {
        return Err(KernelError::NoDevice("the driver reports 0 devices".into()));
    }
    if ordinal >= count as usize {
        return Err(KernelError::NoDevice(format!("device {ordinal} asked for, only {count} present")));
    }
    // SAFETY: as above, dlopen probes only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::MissingLibrary("libnvrtc.so (add /usr/local/cuda/lib64 to LD_LIBRARY_PATH)".into()));
    }
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(KernelError::MissingLibrary("libcublas.so (add /usr/local/cuda/lib64 to LD_LIBRARY_PATH)".into()));
    }
    Ok(())
}

/// A GPU with its stream.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Compute capability (major, minor).
    pub arch: (i32, i32),
    pub name: String,
    pub ordinal: usize,
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self> {
        probe(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: all buffers are created after this and used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let arch = ctx.compute_capability()?;
        let name = ctx.name()?;
        Ok(Gpu { ctx, stream, arch, name, ordinal })
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DevBuf<T>> {
        let slice = self.stream.alloc_zeros::<T>(len.max(1))?;
        Ok(DevBuf::new(slice, &self.stream, len))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<DevBuf<T>> {
        if host.is_empty() {
            // cudarc refuses zero-length copies; keep a 1-element allocation for a valid pointer.
            let slice = unsafe { self.stream.alloc::<T>(1)? };
            return Ok(DevBuf::new(slice, &self.stream, 0));
        }
        let slice = self.stream.clone_htod(host)?;
        Ok(DevBuf::new(slice, &self.stream, host.len()))
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// A device allocation with its raw address, which the launch wrappers take (offsets into a buffer,
/// e.g. one layer of the KV cache, are plain address arithmetic).
pub struct DevBuf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
    len: usize,
}

impl<T> DevBuf<T> {
    fn new(slice: CudaSlice<T>, stream: &CudaStream, len: usize) -> Self {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        DevBuf { slice, ptr, len }
    }

    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Device address of element `i` (not bounds-checked beyond a debug assertion).
    pub fn ptr_at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T: DeviceRepr + Default + Clone> DevBuf<T> {
    /// Copies the first `len` elements back (synchronous).
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); self.len];
        if self.len > 0 {
            stream.memcpy_dtoh(&self.slice.slice(0..self.len), &mut out)?;
        }
        Ok(out)
    }

    /// Copies `host` into the start of the buffer (asynchronous with respect to the host only when the
    /// host memory is pinned; pageable copies return once staged).
    pub fn write(&mut self, stream: &Arc<CudaStream>, host: &[T]) -> Result<()> {
        self.write_at(stream, 0, host)
    }

    /// Copies `host` into the buffer starting at element `offset` (see [`DevBuf::write`]).
    pub fn write_at(&mut self, stream: &Arc<CudaStream>, offset: usize, host: &[T]) -> Result<()> {
        let end = offset.checked_add(host.len()).filter(|&e| e <= self.slice.len());
        let Some(end) = end else {
            return Err(KernelError::Unsupported(format!(
                "copy of {} elements at offset {offset} into a buffer of {}",
                host.len(),
                self.slice.len()
            )));
        };
        if !host.is_empty() {
            stream.memcpy_htod(host, &mut self.slice.slice_mut(offset..end))?;
        }
        Ok(())
    }
}

impl Gpu {
    /// Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), timed with events
    /// over `reps` copies of a `bytes`-sized buffer after one warm-up copy; the median is returned.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let src = self.stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = self.stream.alloc_zeros::<u8>(bytes)?;
        self.stream.memcpy_dtod(&src, &mut dst)?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            let start = self.ctx.new_event(flags)?;
            let end = self.ctx.new_event(flags)?;
            start.record(&self.stream)?;
            self.stream.memcpy_dtod(&src, &mut dst)?;
            end.record(&self.stream)?;
            end.synchronize()?;
            times.push(start.elapsed_ms(&end)? as f64 / 1e3);
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(2.0 * bytes as f64 / times[times.len() / 2])
    }
}
