//! Launcher of kernels/embed.cu: embedding rows gathered to bf16 (model-spec.md 2.2).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::gemv::{MatrixView, Weights};
use crate::launch::{device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

#[repr(C)]
struct EmbedArgs {
    p0: u64,
    p1: u64,
    ids: u64,
    out: u64,
    tokens: i32,
    vocab: i32,
    dim: i32,
    ldo: i32,
}
device_args!(EmbedArgs, 48);

impl KernelSet {
    /// `out[t, :] = table[ids[t], :]` as bf16, for a bf16 or q8_g32 table `[V, H]` (a
    /// [`MatrixView`] with rows = V, cols = H). Ids outside `[0, V)` give zero rows.
    pub fn embed(
        &self,
        stream: &CudaStream,
        table: &MatrixView,
        ids: &impl DevicePtr<i32>,
        tokens: usize,
        out: &mut impl DevicePtrMut<bf16>,
        ldo: usize,
    ) -> Result<()> {
        let kernel = match table.weights {
            Weights::Bf16 { .. } => Kernel::EmbedBf16,
            Weights::Q8G32 { .. } => Kernel::EmbedQ8,
            _ => {
                return Err(Check::new(Kernel::EmbedBf16)
                    .fail("embedding tables are bf16 or q8_g32".to_string()))
            }
        };
        let c = Check::new(kernel);
        c.ensure(table.experts == 1, || {
            "an embedding table is one matrix".to_string()
        })?;
        c.ensure(ldo >= table.cols && ldo.is_multiple_of(8), || {
            format!("ldo {ldo} (dim {})", table.cols)
        })?;
        let (il, ol) = (ids.len(), out.len());
        let (m, _gm) = table.mat_args(&c, stream)?;
        let (ip, _gi) = dptr(ids, stream);
        let (op, _go) = dptr_mut(out, stream);
        c.len("ids", il, tokens)?;
        c.len(
            "out",
            ol,
            if tokens == 0 {
                0
            } else {
                (tokens - 1) * ldo + table.cols
            },
        )?;
        c.aligned("out", op, 16)?;
        if tokens == 0 {
            return Ok(());
        }
        let args = EmbedArgs {
            p0: m.p0,
            p1: m.p1,
            ids: ip,
            out: op,
            tokens: c.i32("tokens", tokens)?,
            vocab: m.rows,
            dim: m.cols,
            ldo: c.i32("ldo", ldo)?,
        };
        let cfg = LaunchConfig {
            grid_dim: (c.i32("tokens", tokens)? as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}
