//! Launchers of kernels/sample.cu: greedy argmax (a cluster of blocks a row, dependent launch)
//! and temperature / top-k / top-p / min-p sampling driven by a caller-supplied uniform random
//! number per row (one cooperative launch spreads each row over many blocks, so a 248k
//! vocabulary is not left to one multiprocessor).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use crate::launch::{device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

/// Sampling parameters of one row, as the kernel reads them (mirror of `SampleParams`).
/// `temperature <= 0` means greedy; `top_k <= 0`, `top_p >= 1` and `min_p <= 0` disable
/// those filters; `u` is a uniform random number in `[0, 1)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingRow {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub u: f32,
    pub top_k: i32,
    pub pad: [i32; 3],
}
device_args!(SamplingRow, 32);

#[repr(C)]
struct SampleArgs {
    logits: u64,
    params: u64,
    out: u64,
    ws: u64,
    rows: i32,
    vocab: i32,
    ld: i32,
    pad: i32,
}
device_args!(SampleArgs, 48);

#[repr(C)]
struct ArgmaxArgs {
    logits: u64,
    out: u64,
    rows: i32,
    vocab: i32,
    ld: i32,
    pad: i32,
}
device_args!(ArgmaxArgs, 32);

/// Blocks a row of `ninfer_argmax` (`ARGMAX_CLUSTER`, one cluster) and their threads.
const ARGMAX_CLUSTER: u32 = 8;
const ARGMAX_THREADS: u32 = 1024;

const THREADS: u32 = 512;
/// Most blocks one row is spread over (`SAMPLE_MAX_SLICES` in kernels/sample.cu).
const MAX_SLICES: usize = 128;
/// Scratch words per row for `slices` blocks (`SAMPLE_WS_WORDS`).
fn ws_words(slices: usize) -> usize {
    4097 + 4 * slices
}

impl KernelSet {
    /// Blocks of the sampling kernel that can be resident at once on this device.
    fn sample_capacity(&self) -> Result<usize> {
        let per_sm = self
            .function(Kernel::Sample)
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)?;
        Ok((per_sm as usize * self.num_sms()).max(1))
    }

    /// u32 words of scratch [`KernelSet::sample`] needs for `rows` rows.
    pub fn sample_workspace_len(&self, rows: usize) -> Result<usize> {
        Ok(rows.min(self.sample_capacity()?).max(1) * ws_words(MAX_SLICES))
    }

    /// `out[r]` = index of the largest of `logits[r*ld .. r*ld + vocab]` (ties to the lowest
    /// index, NaN never chosen).
    pub fn argmax(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        vocab: usize,
        ld: usize,
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let c = Check::new(Kernel::Argmax);
        check_rows(&c, logits.len(), out.len(), rows, vocab, ld)?;
        c.ensure(rows <= 65_535, || format!("{rows} rows, more than a grid's 65,535 along y"))?;
        if rows == 0 {
            return Ok(());
        }
        let (lp, _gl) = dptr(logits, stream);
        let (op, _go) = dptr_mut(out, stream);
        let args = ArgmaxArgs { logits: lp, out: op, rows: rows as i32, vocab: vocab as i32, ld: ld as i32, pad: 0 };
        let cfg = LaunchConfig { grid_dim: (ARGMAX_CLUSTER, rows as u32, 1), block_dim: (ARGMAX_THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, Kernel::Argmax, cfg, &args)
    }

    /// One token per row drawn from the filtered softmax of the logits (see kernels/sample.cu
    /// for the exact definition), with `params[r]` for row r.
    pub fn sample(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        vocab: usize,
        ld: usize,
        params: &impl DevicePtr<SamplingRow>,
        out: &mut impl DevicePtrMut<i32>,
        workspace: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let c = Check::new(Kernel::Sample);
        c.len("params", params.len(), rows)?;
        check_rows(&c, logits.len(), out.len(), rows, vocab, ld)?;
        let (pp, _gp) = dptr(params, stream);
        let wl = workspace.len();
        if rows == 0 {
            return Ok(());
        }
        let capacity = self.sample_capacity()?;
        let per_launch = rows.min(capacity);
        let slices = (capacity / per_launch)
            .clamp(1, MAX_SLICES)
            .min(vocab.div_ceil(1024).max(1));
        c.len("workspace", wl, per_launch * ws_words(slices))?;
        let (lp, _gl) = dptr(logits, stream);
        let (op, _go) = dptr_mut(out, stream);
        let (wp, _gw) = dptr_mut(workspace, stream);
        let mut r0 = 0;
        while r0 < rows {
            let n = per_launch.min(rows - r0);
            let args = SampleArgs {
                logits: lp + (r0 * ld * 4) as u64,
                params: pp + (r0 * std::mem::size_of::<SamplingRow>()) as u64,
                out: op + (r0 * 4) as u64,
                ws: wp,
                rows: n as i32,
                vocab: vocab as i32,
                ld: ld as i32,
                pad: 0,
            };
            let cfg = LaunchConfig {
                grid_dim: (slices as u32, n as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch_cooperative_struct(stream, Kernel::Sample, cfg, &args)?;
            r0 += n;
        }
        Ok(())
    }
}

/// The shapes both kernels take: `rows` rows of `ld` logits, the first `vocab` of each read.
fn check_rows(c: &Check, logits: usize, out: usize, rows: usize, vocab: usize, ld: usize) -> Result<()> {
    c.ensure(vocab > 0 && ld >= vocab, || format!("vocab {vocab}, ld {ld}"))?;
    c.len("logits", logits, if rows == 0 { 0 } else { (rows - 1) * ld + vocab })?;
    c.len("out", out, rows)?;
    c.i32("vocab", vocab)?;
    c.i32("ld", ld)?;
    Ok(())
}
