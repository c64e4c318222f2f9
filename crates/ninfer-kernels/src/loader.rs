//! Loading the embedded kernel images: choose the image for the device's compute capability,
//! load every module and resolve every symbol of the table up front, so a missing kernel shows
//! at start-up and never in the middle of serving.

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::launch::{KernelError, Result};
use crate::table::Kernel;

/// The compiled forms of one kernel file, embedded by build.rs.
pub(crate) struct ModuleImage {
    pub name: &'static str,
    pub sm90a: &'static [u8],
    pub sm120a: &'static [u8],
    pub ptx: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/embedded.rs"));

/// Which embedded image a [`KernelSet`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// Cubin for compute capability 9.0 (H100, H200), Hopper-specific features enabled.
    Sm90a,
    /// Cubin for compute capability 12.x (RTX 50 series, RTX PRO 6000).
    Sm120a,
    /// compute_90 PTX, compiled by the driver at load for any other card of capability >= 9.0.
    Ptx90,
}

impl ImageKind {
    fn label(self) -> &'static str {
        match self {
            ImageKind::Sm90a => "sm_90a cubin",
            ImageKind::Sm120a => "sm_120a cubin",
            ImageKind::Ptx90 => "compute_90 PTX",
        }
    }

    /// The image for a compute capability, or None when the card is too old for any of them.
    pub fn for_capability(major: i32, minor: i32) -> Option<ImageKind> {
        match (major, minor) {
            (9, 0) => Some(ImageKind::Sm90a),
            (12, _) => Some(ImageKind::Sm120a),
            (m, _) if m >= 9 => Some(ImageKind::Ptx90),
            _ => None,
        }
    }
}

/// Every kernel of ninfer, loaded into one CUDA context.
pub struct KernelSet {
    ctx: Arc<CudaContext>,
    image: ImageKind,
    device_name: String,
    capability: (i32, i32),
    num_sms: usize,
    functions: Vec<CudaFunction>,
    /// Per kernel, the blocks of 256 threads the device holds at once (occupancy x SMs).
    resident_256: Vec<u32>,
    _modules: Vec<Arc<CudaModule>>,
}

impl KernelSet {
    /// Loads the image matching the device of `ctx`. A sm_120a cubin that the driver rejects
    /// (a 12.x card other than the one it was built for) falls back to the PTX image.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability()?;
        let Some(kind) = ImageKind::for_capability(major, minor) else {
            return Err(KernelError::UnsupportedDevice {
                name: ctx.name()?,
                major,
                minor,
            });
        };
        match Self::load_image(ctx, kind) {
            Err(KernelError::ModuleLoad { .. }) if kind == ImageKind::Sm120a => {
                Self::load_image(ctx, ImageKind::Ptx90)
            }
            other => other,
        }
    }

    /// Loads a chosen image (tests use this to check the PTX fallback on any card).
    pub fn load_image(ctx: &Arc<CudaContext>, kind: ImageKind) -> Result<Self> {
        let (major, minor) = ctx.compute_capability()?;
        let device_name = ctx.name()?;
        if major < 9 {
            return Err(KernelError::UnsupportedDevice {
                name: device_name,
                major,
                minor,
            });
        }
        let num_sms =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let mut modules: Vec<(&'static str, Arc<CudaModule>)> = Vec::new();
        for img in MODULE_IMAGES {
            let ptx = match kind {
                ImageKind::Sm90a => Ptx::from_binary(img.sm90a.to_vec()),
                ImageKind::Sm120a => Ptx::from_binary(img.sm120a.to_vec()),
                ImageKind::Ptx90 => Ptx::from_src(String::from_utf8_lossy(img.ptx).into_owned()),
            };
            let module = ctx
                .load_module(ptx)
                .map_err(|source| KernelError::ModuleLoad {
                    module: img.name,
                    image: kind.label(),
                    source,
                })?;
            modules.push((img.name, module));
        }
        let mut functions = Vec::with_capacity(Kernel::ALL.len());
        for &k in Kernel::ALL {
            let module = modules
                .iter()
                .find(|(name, _)| *name == k.module())
                .map(|(_, m)| m)
                .ok_or(KernelError::MissingModule(k.module()))?;
            let func =
                module
                    .load_function(k.symbol())
                    .map_err(|source| KernelError::MissingSymbol {
                        module: k.module(),
                        symbol: k.symbol(),
                        source,
                    })?;
            // Attention tiles use more than the default 48 KiB of dynamic shared memory.
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_optin - func.shared_size_bytes()?,
            )?;
            functions.push(func);
        }
        let resident_256 = functions
            .iter()
            .map(|f| Ok(f.occupancy_max_active_blocks_per_multiprocessor(256, 0, None)? * num_sms.max(1) as u32))
            .collect::<Result<Vec<u32>>>()?;
        Ok(Self {
            ctx: ctx.clone(),
            image: kind,
            device_name,
            capability: (major, minor),
            num_sms: num_sms.max(1) as usize,
            functions,
            resident_256,
            _modules: modules.into_iter().map(|(_, m)| m).collect(),
        })
    }

    /// The blocks of 256 threads of `k` that the device holds at once (at least one).
    pub(crate) fn resident_256(&self, k: Kernel) -> u32 {
        self.resident_256[k.index()].max(1)
    }

    /// The blocks of `threads` threads and `smem` bytes of dynamic shared memory of `k` that
    /// the device holds at once (at least one per multiprocessor), from the driver's occupancy.
    pub(crate) fn resident(&self, k: Kernel, threads: u32, smem: usize) -> Result<usize> {
        let per_sm = self.function(k).occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?;
        Ok((per_sm as usize).max(1) * self.num_sms())
    }

    /// The resolved function of a kernel.
    pub fn function(&self, k: Kernel) -> &CudaFunction {
        &self.functions[k.index()]
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn image(&self) -> ImageKind {
        self.image
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Number of streaming multiprocessors, used to size split-KV and other grids.
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }
}

#[cfg(test)]
mod tests {
    use super::MODULE_IMAGES;

    /// Every kernel is launched allowed to overlap the one ahead of it (launch.rs), which is
    /// safe only because each waits for it inside: every entry of the compute_90 PTX must hold
    /// `griddepcontrol.wait` (and release its dependents). Needs no GPU.
    #[test]
    fn every_kernel_waits_for_the_kernel_ahead() {
        let mut entries = 0;
        for img in MODULE_IMAGES {
            let ptx = std::str::from_utf8(img.ptx).expect("PTX is text");
            for body in ptx.split(".entry ").skip(1) {
                let name = body.split('(').next().unwrap_or("").trim();
                assert!(body.contains("griddepcontrol.wait"), "{}: kernel {name} never waits for the kernel ahead", img.name);
                assert!(body.contains("griddepcontrol.launch_dependents"), "{}: kernel {name} never releases its dependents", img.name);
                entries += 1;
            }
        }
        assert_eq!(entries, crate::table::Kernel::ALL.len(), "PTX entries against the kernel table");
    }
}
