//! One GPU: its context and stream, the compiled kernel module, cuBLAS, and thin helpers
//! for launching kernels on raw device pointers.
//!
//! Everything runs on one stream, in order, like the CPU engine's single thread, so cudarc's
//! per-buffer event tracking (made for several streams) is switched off: it would record
//! events on every launch, and a decode step launches hundreds of kernels.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};

use crate::{kernels, ActDtype, CudaError};

/// Kernel parameters: a pointer to each argument's value, in order. The values may be
/// temporaries: they live until the end of the statement that launches.
#[macro_export]
macro_rules! kargs {
    ($($x:expr),* $(,)?) => { &mut [$(&$x as *const _ as *mut std::ffi::c_void),*] };
}

/// A device pointer as a kernel argument (kernels take plain pointers; offsets are ours).
pub type DevPtr = u64;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace, ours so that cuBLAS never allocates while a CUDA graph is being
    /// captured (allocation is not allowed then).
    _blas_workspace: CudaSlice<u8>,
    functions: HashMap<&'static str, CudaFunction>,
    pub act: ActDtype,
    pub sm_count: usize,
    pub name: String,
}

/// Opens device 0 with `act` as the GEMM operand type, or returns `None` after printing
/// "skipped: no CUDA device" when there is no driver or device, for examples such as
/// `transfer_bench` that say so and exit on GPU-less machines. Tests do not use it: the GPU
/// tests are `#[ignore]`d and fail without a device (`tests/common`), so that none can pass
/// by skipping. Any other failure (a kernel that does not compile, a missing cuBLAS) panics:
/// a GPU that is present must work. With `PK_CUDA_REQUIRE=1` (set by scripts/gpu/check.sh on
/// the GPU machine) a missing device panics too.
pub fn cuda_or_skip(act: ActDtype) -> Option<Gpu> {
    match Gpu::new(0, act) {
        Ok(g) => Some(g),
        Err(CudaError::NoDevice(why)) if std::env::var("PK_CUDA_REQUIRE").as_deref() != Ok("1") => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Err(e) => panic!("CUDA device unusable: {e}"),
    }
}

/// Whether libcuda can be opened (cudarc panics on first use when it cannot).
pub fn driver_available() -> bool {
    // SAFETY: the call takes no arguments and only tries to dlopen libcuda by its candidate
    // names, dropping the handle again; loading runs the library's initialisers, as every
    // later use of the driver does anyway.
    std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false)
}

impl Gpu {
    /// Opens device `ordinal`, compiles the kernels for it with NVRTC and creates a cuBLAS
    /// handle on its stream.
    pub fn new(ordinal: usize, act: ActDtype) -> Result<Gpu, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDevice("libcuda.so not found".into()));
        }
        if !kernels::nvrtc_available() {
            return Err(CudaError::NoDevice(
                "libnvrtc.so not found (LD_LIBRARY_PATH)".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice(e.to_string()))?;
        // SAFETY: this crate uses a single stream, so no cross-stream ordering is needed.
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default one: CUDA graphs can only be captured
        // from a created stream.
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let ptx = kernels::compile(kernels::virtual_arch(major, minor)?, act)?;
        let module = match ctx.load_module(ptx) {
            Ok(m) => m,
            Err(e) => {
                // A driver older than this NVRTC cannot JIT its PTX; machine code for the
                // exact chip still loads (CUDA's minor-version compatibility).
                eprintln!("pk-cuda: the driver refused the PTX ({e}); loading sm_{major}{minor} machine code instead");
                let cubin = kernels::compile_cubin(
                    &kernels::program_source(),
                    &format!("sm_{major}{minor}"),
                    act,
                )?;
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?
            }
        };
        let mut functions = HashMap::new();
        for &name in kernels::KERNEL_NAMES {
            functions.insert(name, module.load_function(name)?);
        }
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let blas = CudaBlas::new(stream.clone())?;
        // 32 MiB: NVIDIA's recommendation for Hopper.
        let workspace_bytes = 32usize << 20;
        let workspace = stream.alloc_zeros::<u8>(workspace_bytes)?;
        {
            let (p, _sync) = workspace.device_ptr(&stream);
            // SAFETY: the buffer outlives the handle: both live in `Gpu`, where `blas` is
            // declared before `_blas_workspace` and so is dropped first.
            let status = unsafe {
                blas_sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut _, workspace_bytes)
            };
            if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(CudaError::Blas(cudarc::cublas::result::CublasError(status)));
            }
        }
        let name = ctx.name()?;
        Ok(Gpu {
            ctx,
            stream,
            blas,
            _blas_workspace: workspace,
            functions,
            act,
            sm_count,
            name,
        })
    }

    pub fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is not in KERNEL_NAMES"))
    }

    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros::<T>(len.max(1))?)
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if host.is_empty() {
            // cudarc refuses empty copies; a one-element buffer stands in.
            // SAFETY: the element is left uninitialised, but it stands in for an empty upload:
            // callers size their reads by `host.len()`, which is 0 here, so it is never read.
            return Ok(unsafe { self.stream.alloc::<T>(1)? });
        }
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `host` into the start of `dst` (which must be at least as long).
    pub fn upload_into<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        if !host.is_empty() {
            let mut view = dst.slice_mut(..host.len());
            self.stream.memcpy_htod(host, &mut view)?;
        }
        Ok(())
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); len];
        if len > 0 {
            self.stream.memcpy_dtoh(&src.slice(..len), &mut out[..])?;
            // A copy into pageable memory returns once done, by the driver's documentation;
            // the explicit wait makes that independent of the host buffer's kind.
            self.stream.synchronize()?;
        }
        Ok(out)
    }

    /// Enqueues a copy of `bytes` from device address `src` to `dst` on the stream (within
    /// one buffer, where cudarc's typed copies would need two borrows of it).
    ///
    /// # Safety
    /// Both ranges must lie inside live allocations of this context and must not overlap.
    pub unsafe fn copy_raw(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())?;
        Ok(())
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// The buffer's device address, for kernel arguments and cuBLAS.
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// Launches `name` with `grid × block` threads and `shared_bytes` of dynamic shared
    /// memory; `params` points at each argument's value (build it with [`kargs!`]).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type (device
    /// pointers as u64, `int` as i32, `long long` as i64, `float` as f32), and every pointer
    /// must cover what the kernel reads and writes.
    pub unsafe fn launch(
        &self,
        name: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        self.launch_on(&self.stream, name, grid, block, shared_bytes, params)
    }

    /// [`Gpu::launch`] on another stream of this context (the transfers' copy stream).
    ///
    /// # Safety
    /// As for [`Gpu::launch`]; the caller orders the streams (events) around what the
    /// kernel reads and writes.
    pub unsafe fn launch_on(
        &self,
        stream: &CudaStream,
        name: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        let f = self.function(name);
        // Kernels and cuBLAS run in the context current on the calling thread.
        self.ctx.bind_to_thread()?;
        cudarc::driver::result::launch_kernel(
            f.cu_function(),
            (grid.max(1), 1, 1),
            (block, 1, 1),
            shared_bytes,
            stream.cu_stream(),
            params,
        )?;
        Ok(())
    }

    /// Grid size for a grid-stride loop over `n` elements with 256-thread blocks.
    pub fn grid_for(&self, n: usize) -> u32 {
        (n.div_ceil(256)).min(self.sm_count * 32).max(1) as u32
    }

    fn act_type(&self) -> blas_sys::cudaDataType {
        match self.act {
            ActDtype::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            ActDtype::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        }
    }

    /// `y[n_tokens × rows] = x[n_tokens × cols] · wᵀ + beta · y`, with `w` row-major
    /// `[rows × cols]` and `x` in act_t, `y` in f32 (beta 1 adds into the residual stream).
    ///
    /// cuBLAS is column-major: row-major `w` is a column-major `cols × rows` matrix, so
    /// `yᵀ (rows × n) = op_T(w) · xᵀ (cols × n)`, which is `gemm(T, N)` with leading
    /// dimensions cols, cols and rows. For one token cuBLAS picks its GEMV kernels; we use
    /// it for every batch size (see scripts/gpu/README.md for how to check that choice).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: DevPtr,
        rows: usize,
        cols: usize,
        x: DevPtr,
        n_tokens: usize,
        y: DevPtr,
        beta: f32,
    ) -> Result<(), CudaError> {
        let alpha = 1.0f32;
        let t = self.act_type();
        self.ctx.bind_to_thread()?;
        // SAFETY: the caller's buffers hold rows × cols, n_tokens × cols and n_tokens × rows
        // elements (checked by the forward pass's sizes); alpha and beta live across the call.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n_tokens as i32,
                cols as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                t,
                cols as i32,
                x as *const _,
                t,
                cols as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                rows as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }
}
