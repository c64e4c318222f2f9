//! Shared launch plumbing: the error type, argument checks, raw device pointers taken from
//! cudarc slices and views (with their stream-ordering guards), and the launch call itself.

use cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};

use crate::loader::KernelSet;
use crate::table::Kernel;

/// Everything a kernel load or launch can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    #[error(
        "no ninfer kernels for {name} (compute capability {major}.{minor}): the build carries \
         sm_90a and sm_120a cubins and compute_90 PTX, so it needs compute capability 9.0 or newer"
    )]
    UnsupportedDevice {
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("kernel module {module} ({image}) did not load: {source}")]
    ModuleLoad {
        module: &'static str,
        image: &'static str,
        source: DriverError,
    },
    #[error("kernel {symbol} is missing from module {module}: {source}")]
    MissingSymbol {
        module: &'static str,
        symbol: &'static str,
        source: DriverError,
    },
    #[error("launching {kernel} ({grid:?} blocks of {block:?}, {smem} bytes of shared memory): {source}")]
    Launch {
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        source: DriverError,
    },
    #[error("kernel module {0} is not embedded in this build")]
    MissingModule(&'static str),
    #[error("{kernel}: {msg}")]
    BadArgs { kernel: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// Argument checks of one launcher; every failed check names the kernel.
pub(crate) struct Check {
    pub kernel: Kernel,
}

impl Check {
    pub fn new(kernel: Kernel) -> Self {
        Self { kernel }
    }

    pub fn fail(&self, msg: String) -> KernelError {
        KernelError::BadArgs {
            kernel: self.kernel.symbol(),
            msg,
        }
    }

    pub fn ensure(&self, ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(self.fail(msg()))
        }
    }

    /// A buffer of `have` elements must hold at least `need`.
    pub fn len(&self, what: &str, have: usize, need: usize) -> Result<()> {
        self.ensure(have >= need, || {
            format!("{what} holds {have} elements, needs {need}")
        })
    }

    /// A device address must be a multiple of `align` bytes.
    pub fn aligned(&self, what: &str, ptr: u64, align: u64) -> Result<()> {
        self.ensure(ptr.is_multiple_of(align), || {
            format!("{what} at {ptr:#x} is not {align}-byte aligned")
        })
    }

    /// A size must fit the i32 the kernels index with.
    pub fn i32(&self, what: &str, v: usize) -> Result<i32> {
        i32::try_from(v).map_err(|_| self.fail(format!("{what} = {v} does not fit in i32")))
    }
}

/// Device address of a read-only buffer; the guard orders the launch after earlier writes.
pub(crate) fn dptr<'a, T, P: DevicePtr<T>>(
    p: &'a P,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    p.device_ptr(stream)
}

/// Device address of a buffer the kernel writes.
pub(crate) fn dptr_mut<'a, T, P: DevicePtrMut<T>>(
    p: &'a mut P,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    p.device_ptr_mut(stream)
}

/// Grid size for `n` items of `per_block` each.
pub(crate) fn blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

impl KernelSet {
    /// Launches `kernel` with one by-value argument struct (the kernels take their parameters
    /// as a single `#[repr(C)]` struct mirrored in the .cu file).
    pub(crate) fn launch_struct<A: DeviceRepr>(&self, stream: &CudaStream, kernel: Kernel, cfg: LaunchConfig, args: &A) -> Result<()> {
        self.launch_with(stream, kernel, cfg, args, false)
    }

    /// As `launch_struct`, as a cooperative launch (all blocks resident, grid-wide barriers);
    /// the caller sizes the grid from the kernel's occupancy.
    pub(crate) fn launch_cooperative_struct<A: DeviceRepr>(&self, stream: &CudaStream, kernel: Kernel, cfg: LaunchConfig, args: &A) -> Result<()> {
        self.launch_with(stream, kernel, cfg, args, true)
    }

    fn launch_with<A: DeviceRepr>(&self, stream: &CudaStream, kernel: Kernel, cfg: LaunchConfig, args: &A, cooperative: bool) -> Result<()> {
        check_grid(kernel, &cfg)?;
        let launched = if cooperative {
            let mut builder = stream.launch_builder(self.function(kernel));
            builder.arg(args);
            // SAFETY: each launcher checked the buffer sizes, shapes and alignment the kernel's
            // contract requires, and `A` mirrors the kernel's parameter struct field for field.
            unsafe { builder.launch_cooperative(cfg) }.map(|_| ())
        } else {
            // SAFETY: as above.
            unsafe { launch_dependent(stream, self.function(kernel).cu_function(), cfg, args) }
        };
        launched.map_err(|e| launch_error(kernel, cfg, e))
    }
}

/// Launches with programmatic stream serialization allowed: the kernel may start while the
/// one ahead of it in the stream runs, and waits for it inside (`grid_wait()`, common.cuh, a
/// rule every kernel keeps). This hides most of a launch's latency between dependent kernels,
/// in CUDA graphs too, and lets a projection read its weights early.
///
/// # Safety
/// `args` must mirror the kernel's single parameter struct, and the buffers it points at must
/// be valid for what the kernel does with them.
unsafe fn launch_dependent<A: DeviceRepr>(stream: &CudaStream, f: sys::CUfunction, cfg: LaunchConfig, args: &A) -> std::result::Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    // SAFETY: the attribute value is a C union; zeroed is a valid value of every member.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut params = [args as *const A as *mut std::ffi::c_void];
    // SAFETY: the caller's contract; `params` and `config` outlive the call, which copies them.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

/// The grid limits of every CUDA device since compute capability 3.0: x below 2^31, y and z at
/// most 65,535. A launch past them fails with an unnamed "invalid argument"; this names it.
fn check_grid(kernel: Kernel, cfg: &LaunchConfig) -> Result<()> {
    let (x, y, z) = cfg.grid_dim;
    Check::new(kernel).ensure((1..(1 << 31)).contains(&x) && (1..=65_535).contains(&y) && (1..=65_535).contains(&z), || {
        format!("grid ({x}, {y}, {z}) outside the device limits (x < 2^31, y and z at most 65,535)")
    })
}

/// A failed launch names the kernel and its launch shape: a config error (a grid the device
/// refuses, say) is then found without a debugger.
fn launch_error(kernel: Kernel, cfg: LaunchConfig, source: DriverError) -> KernelError {
    KernelError::Launch { kernel: kernel.symbol(), grid: cfg.grid_dim, block: cfg.block_dim, smem: cfg.shared_mem_bytes, source }
}

/// Marks a `#[repr(C)]` argument struct as passable to a kernel; its size is asserted here and
/// by a `static_assert` beside the mirrored struct in the .cu file.
macro_rules! device_args {
    ($t:ty, $size:expr) => {
        // SAFETY: plain-old-data with C layout, mirrored by the kernel's parameter struct.
        unsafe impl cudarc::driver::DeviceRepr for $t {}
        const _: () = assert!(std::mem::size_of::<$t>() == $size);
    };
}
pub(crate) use device_args;
