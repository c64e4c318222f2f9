//! Launcher of kernels/layout.cu: the device layout of NVFP4 codes, which every NVFP4 kernel
//! reads (kernels/common.cuh), and its host mirror.

use cudarc::driver::{CudaStream, DevicePtrMut, LaunchConfig};

use crate::launch::{blocks, device_args, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

#[repr(C)]
struct LayoutArgs {
    words: u64,
    n: u64,
}
device_args!(LayoutArgs, 16);

/// Grid-stride blocks of the layout kernel: enough to fill any device, few enough to launch
/// once per matrix cheaply.
const LAYOUT_MAX_BLOCKS: u32 = 4096;

/// Bit `b` (0 m, 1 e0, 2 e1, 3 sign) of code `c` of a format.md code word: where it lands in
/// the device word (kernels/common.cuh `nvfp4_device_bit`).
fn nvfp4_device_bit(c: u32, b: u32) -> u32 {
    let rot = |p: u32| [2u32, 6, 12, 8][p as usize];
    let target = if b < 3 { 6 + b } else { 15 } + 16 * (c & 1);
    let r = if c >> 1 == 3 && b == 2 { 0 } else { rot(c >> 1) };
    (target + 32 - r) & 31
}

/// One code word (format.md 3.5: code c in bits 4c..4c+3) in the device layout, as
/// [`KernelSet::nvfp4_device_layout`] writes it.
pub fn nvfp4_device_word(w: u32) -> u32 {
    (0..32).filter(|i| w >> i & 1 == 1).fold(0, |out, i| out | 1 << nvfp4_device_bit(i / 4, i % 4))
}

impl KernelSet {
    /// Rewrites NVFP4 code words in place into the device layout (kernels/layout.cu): every
    /// NVFP4 kernel reads codes only in that layout, so each matrix's codes go through this
    /// once, after their upload. `codes` holds whole 32-bit words.
    pub fn nvfp4_device_layout(&self, stream: &CudaStream, codes: &mut impl DevicePtrMut<u8>) -> Result<()> {
        let c = Check::new(Kernel::Nvfp4DeviceLayout);
        let n = codes.len();
        c.ensure(n.is_multiple_of(4), || format!("{n} code bytes are not whole 32-bit words"))?;
        if n == 0 {
            return Ok(());
        }
        let (p, _g) = dptr_mut(codes, stream);
        c.aligned("codes", p, 4)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks(n / 4, 256).min(LAYOUT_MAX_BLOCKS), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &LayoutArgs { words: p, n: (n / 4) as u64 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_bits_are_a_permutation() {
        let mut seen = [false; 32];
        for c in 0..8 {
            for b in 0..4 {
                let d = nvfp4_device_bit(c, b) as usize;
                assert!(!seen[d], "bit {d} taken twice");
                seen[d] = true;
            }
        }
        assert_eq!(nvfp4_device_word(u32::MAX), u32::MAX);
        assert_eq!(nvfp4_device_word(0), 0);
    }
}
