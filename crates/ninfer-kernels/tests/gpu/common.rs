//! Test plumbing: the shared device and kernels (or None without a GPU), a seeded RNG,
//! bf16/f16/E4M3/E2M1 host helpers per docs/format.md section 3, and the error checks.

use std::sync::{Arc, OnceLock};

use ninfer_kernels::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use ninfer_kernels::{bf16, f16, KernelSet};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub ks: KernelSet,
}

static GPU: OnceLock<Option<Gpu>> = OnceLock::new();

/// The GPU and its kernels, or None (with a printed "no GPU" line) when there is no driver
/// or device: every GPU test returns early then.
pub fn gpu() -> Option<&'static Gpu> {
    let g = GPU.get_or_init(|| {
        // SAFETY: only probes whether libcuda can be opened.
        if !unsafe { ninfer_kernels::cudarc::driver::sys::is_culib_present() } {
            return None;
        }
        match CudaContext::device_count() {
            Ok(n) if n > 0 => {}
            _ => return None,
        }
        let ctx = CudaContext::new(0).expect("CUDA context");
        let ks = KernelSet::load(&ctx).expect("load kernels");
        Some(Gpu { ctx, ks })
    });
    if g.is_none() {
        println!("no GPU: skipping");
    }
    g.as_ref()
}

impl Gpu {
    pub fn stream(&self) -> Arc<CudaStream> {
        self.ctx.new_stream().expect("stream")
    }
}

pub fn up<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).expect("upload")
}

pub fn down<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Vec<T> {
    s.synchronize().expect("kernel ran");
    let v = s.clone_dtoh(d).expect("download");
    s.synchronize().expect("download done");
    v
}

/// Device buffers poisoned with NaN, so that an element a kernel fails to write shows.
pub fn nan_bf16(s: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    up(s, &vec![bf16::NAN; n])
}
pub fn nan_f32(s: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    up(s, &vec![f32::NAN; n])
}

/// SplitMix64: small, seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }
    /// bf16 values, normal with the given standard deviation.
    pub fn bf16s(&mut self, n: usize, sd: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.normal() * sd)).collect()
    }
    pub fn f32s(&mut self, n: usize, sd: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * sd).collect()
    }
    /// Positive f16 scales in [lo, hi).
    pub fn f16_scales(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f16> {
        (0..n)
            .map(|_| f16::from_f32(lo + (hi - lo) * self.uniform() as f32))
            .collect()
    }
    /// A random permutation prefix: `k` distinct values below `n`.
    pub fn distinct(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

pub fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// E4M3 (float8_e4m3fn) per format.md: bias 7, exponent 0 subnormal, S.1111.111 NaN.
pub fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 15 && (b & 7) == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * mag
}

/// E2M1 code (low 4 bits) per format.md.
pub fn e2m1(code: u8) -> f32 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = MAG[(code & 7) as usize];
    if code & 8 != 0 {
        -v
    } else {
        v
    }
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Relative L2 error; panics on any non-finite output (NaN never passes).
pub fn rel_l2(name: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{name}: element {i} is {g} (want {w})");
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(name, got, want);
    println!("{name}: relative L2 error {e:.3e}");
    assert!(e < tol, "{name}: relative L2 error {e:.3e} >= {tol:.0e}");
}
