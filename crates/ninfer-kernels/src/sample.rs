//! Launchers of kernels/sample.cu: greedy argmax and temperature / top-k / top-p / min-p
//! sampling driven by a caller-supplied uniform random number per row.

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
    rows: i32,
    vocab: i32,
    ld: i32,
    pad: i32,
}
device_args!(SampleArgs, 40);

impl KernelSet {
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
        self.select(stream, Kernel::Argmax, logits, rows, vocab, ld, None, out)
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
    ) -> Result<()> {
        let c = Check::new(Kernel::Sample);
        c.len("params", params.len(), rows)?;
        let (pp, _gp) = dptr(params, stream);
        self.select(
            stream,
            Kernel::Sample,
            logits,
            rows,
            vocab,
            ld,
            Some(pp),
            out,
        )
    }

    fn select(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        vocab: usize,
        ld: usize,
        params: Option<u64>,
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let c = Check::new(kernel);
        c.ensure(vocab > 0 && ld >= vocab, || {
            format!("vocab {vocab}, ld {ld}")
        })?;
        let (ll, ol) = (logits.len(), out.len());
        c.len(
            "logits",
            ll,
            if rows == 0 {
                0
            } else {
                (rows - 1) * ld + vocab
            },
        )?;
        c.len("out", ol, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let (lp, _gl) = dptr(logits, stream);
        let (op, _go) = dptr_mut(out, stream);
        let args = SampleArgs {
            logits: lp,
            params: params.unwrap_or(0),
            out: op,
            rows: c.i32("rows", rows)?,
            vocab: c.i32("vocab", vocab)?,
            ld: c.i32("ld", ld)?,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (c.i32("rows", rows)? as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, kernel, cfg, &args)
    }
}
