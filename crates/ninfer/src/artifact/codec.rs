//! Reference quantizers and dequantizers for every encoding of the artifact (docs/format.md §3).
//!
//! This is the one implementation: the converter (through `ninfer._core.quantize`), the CPU
//! backend and the GPU kernels' tests all use it. Values are f32; a matrix is seen as rows of `k`
//! elements (the last dimension), groups never cross rows.

use half::{bf16, f16};

use super::{ArtifactError, Encoding};

/// One stored plane of an encoded tensor: its name, element shape and raw little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub name: String,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// E2M1 magnitudes for the three magnitude bits (model-spec.md §4.1).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

pub fn e2m1_to_f32(code: u8) -> f32 {
    let m = E2M1_VALUES[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Nearest E2M1 code; ties go to the code with an even mantissa bit (round half to even).
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 8u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 7;
    }
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for (i, &v) in E2M1_VALUES.iter().enumerate() {
        let err = (a - v).abs();
        if err < best_err || (err == best_err && i % 2 == 0) {
            best = i as u8;
            best_err = err;
        }
    }
    sign | best
}

/// FP8 E4M3 (`float8_e4m3fn`): bias 7, no infinities, S.1111.111 is NaN, max 448.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 3) & 0xF) as i32;
    let m = (code & 7) as f32;
    if e == 15 && (code & 7) == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * (m / 8.0) * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Nearest E4M3 code, saturating at ±448, ties to the even code.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(448.0);
    // The positive codes are monotone in value, so a binary search over 0..=126 finds the pair
    // around `a`.
    let (mut lo, mut hi) = (0u8, 126u8);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (vl, vh) = (e4m3_to_f32(lo), e4m3_to_f32(hi));
    let pick = if a - vl < vh - a || (a - vl == vh - a && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | pick
}

/// Round half to even, as numpy and torch do.
fn round_even(x: f32) -> f32 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

fn group_of(enc: Encoding) -> usize {
    match enc {
        Encoding::Q8G32 | Encoding::Q4G32 => 32,
        Encoding::Q6G64 => 64,
        Encoding::Nvfp4 => 16,
        _ => 1,
    }
}

/// Checks that `shape` can hold `enc` and returns (rows, k).
pub fn rows_and_k(enc: Encoding, shape: &[usize]) -> Result<(usize, usize), ArtifactError> {
    let k = *shape.last().ok_or_else(|| ArtifactError::Shape("a tensor needs at least one dimension".into()))?;
    let rows = shape[..shape.len() - 1].iter().product::<usize>();
    let g = group_of(enc);
    if k % g != 0 {
        return Err(ArtifactError::Shape(format!(
            "{enc} needs the last dimension to be a multiple of {g}, got shape {shape:?}"
        )));
    }
    Ok((rows, k))
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect()
}

fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    *s.last_mut().unwrap() = last;
    s
}

/// Symmetric integer groups: scale = amax/qmax stored as f16 and used as stored.
fn int_groups(x: &[f32], group: usize, qmin: i32, qmax: i32) -> (Vec<i32>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / group);
    for g in x.chunks(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = f16::from_f32(amax / qmax as f32).to_f32();
        scales.push(s);
        for v in g {
            q.push(if s == 0.0 { 0 } else { (round_even(v / s) as i32).clamp(qmin, qmax) });
        }
    }
    (q, scales)
}

/// Quantizes `x` (row-major, `shape`) into the parts of `enc`. For `nvfp4`, `segments` is P of
/// docs/format.md (row segments per matrix with their own global scale); other encodings ignore it.
pub fn quantize(enc: Encoding, x: &[f32], shape: &[usize], segments: usize) -> Result<Vec<Part>, ArtifactError> {
    let (rows, k) = rows_and_k(enc, shape)?;
    if rows * k != x.len() {
        return Err(ArtifactError::Shape(format!("{} values do not fill shape {shape:?}", x.len())));
    }
    let part = |name: &str, shape: Vec<usize>, bytes| Part { name: name.into(), shape, bytes };
    Ok(match enc {
        Encoding::F32 => vec![part("data", shape.to_vec(), x.iter().flat_map(|v| v.to_le_bytes()).collect())],
        Encoding::Bf16 => vec![part(
            "data",
            shape.to_vec(),
            x.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        )],
        Encoding::F16 => vec![part("data", shape.to_vec(), f16_bytes(x))],
        Encoding::Fp8E4m3 => {
            let mut codes = Vec::with_capacity(x.len());
            let mut scales = Vec::with_capacity(rows);
            for r in x.chunks(k) {
                let amax = r.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = if amax == 0.0 { 1.0 } else { amax / 448.0 };
                scales.push(s);
                codes.extend(r.iter().map(|v| f32_to_e4m3(v / s)));
            }
            vec![
                part("data", shape.to_vec(), codes),
                part("scale", vec![rows], scales.iter().flat_map(|v| v.to_le_bytes()).collect()),
            ]
        }
        Encoding::Q8G32 => {
            let (q, s) = int_groups(x, 32, -127, 127);
            vec![
                part("q", shape.to_vec(), q.iter().map(|v| *v as i8 as u8).collect()),
                part("scales", with_last(shape, k / 32), f16_bytes(&s)),
            ]
        }
        Encoding::Q4G32 => {
            let (q, s) = int_groups(x, 32, -8, 7);
            let packed = q.chunks(2).map(|p| ((p[0] + 8) as u8) | (((p[1] + 8) as u8) << 4)).collect();
            vec![part("q", with_last(shape, k / 2), packed), part("scales", with_last(shape, k / 32), f16_bytes(&s))]
        }
        Encoding::Q6G64 => {
            let (q, s) = int_groups(x, 64, -32, 31);
            let u: Vec<u8> = q.iter().map(|v| (v + 32) as u8).collect();
            let ql = u.chunks(2).map(|p| (p[0] & 15) | ((p[1] & 15) << 4)).collect();
            let qh = u.chunks(4).map(|p| (0..4).fold(0u8, |b, i| b | ((p[i] >> 4) << (2 * i)))).collect();
            vec![
                part("ql", with_last(shape, k / 2), ql),
                part("qh", with_last(shape, k / 4), qh),
                part("scales", with_last(shape, k / 64), f16_bytes(&s)),
            ]
        }
        Encoding::Nvfp4 => quantize_nvfp4(x, shape, rows, k, segments)?,
    })
}

/// ModelOpt's NVFP4 export rule (model-spec.md §4.2): global = amax/(6·448) per matrix segment,
/// block scale = e4m3(block_amax / (6·global)), code = nearest E2M1 of x/(scale·global).
fn quantize_nvfp4(x: &[f32], shape: &[usize], rows: usize, k: usize, segments: usize) -> Result<Vec<Part>, ArtifactError> {
    let n = if shape.len() >= 2 { shape[shape.len() - 2] } else { 1 };
    let m = rows / n;
    if segments == 0 || n % segments != 0 {
        return Err(ArtifactError::Shape(format!("nvfp4: {n} rows cannot be split into {segments} segments")));
    }
    let seg_rows = n / segments;
    let mut globals = Vec::with_capacity(m * segments);
    let mut codes = vec![0u8; rows * k / 2];
    let mut scales = vec![0u8; rows * k / 16];
    for seg in 0..m * segments {
        let r0 = seg * seg_rows;
        let vals = &x[r0 * k..(r0 + seg_rows) * k];
        let amax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
        let global = if amax == 0.0 { 1.0 } else { amax / (6.0 * 448.0) };
        globals.push(global);
        for (b, block) in vals.chunks(16).enumerate() {
            let bamax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sc = if bamax == 0.0 { 0x38 } else { f32_to_e4m3((bamax / (6.0 * global)).max(2f32.powi(-9))) };
            let bi = r0 * k / 16 + b;
            scales[bi] = sc;
            let denom = e4m3_to_f32(sc) * global;
            for (j, v) in block.iter().enumerate() {
                let c = f32_to_e2m1(v / denom);
                let idx = bi * 16 + j;
                codes[idx / 2] |= if idx.is_multiple_of(2) { c } else { c << 4 };
            }
        }
    }
    Ok(vec![
        Part { name: "codes".into(), shape: with_last(shape, k / 2), bytes: codes },
        Part { name: "scales".into(), shape: with_last(shape, k / 16), bytes: scales },
        Part { name: "global".into(), shape: vec![m, segments], bytes: globals.iter().flat_map(|v| v.to_le_bytes()).collect() },
    ])
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32()
}

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// The parts of one tensor as byte slices, looked up by name.
pub trait PartSource {
    fn part(&self, name: &str) -> Result<&[u8], ArtifactError>;
}

/// Dequantizes rows `[row0, row0 + nrows)` of a tensor of `shape` into `out` (nrows·k values).
/// Row-ranged so that a backend can expand one expert of a bank without touching the rest.
pub fn dequantize_rows(
    enc: Encoding,
    parts: &dyn PartSource,
    shape: &[usize],
    row0: usize,
    out: &mut [f32],
) -> Result<(), ArtifactError> {
    let (rows, k) = rows_and_k(enc, shape)?;
    let nrows = out.len() / k.max(1);
    if out.len() != nrows * k || row0 + nrows > rows {
        return Err(ArtifactError::Shape(format!("rows {row0}..{} outside shape {shape:?}", row0 + nrows)));
    }
    let base = row0 * k;
    match enc {
        Encoding::F32 => {
            let d = parts.part("data")?;
            out.iter_mut().enumerate().for_each(|(i, o)| *o = f32_at(d, base + i));
        }
        Encoding::Bf16 => {
            let d = parts.part("data")?;
            out.iter_mut().enumerate().for_each(|(i, o)| {
                let j = base + i;
                *o = bf16::from_bits(u16::from_le_bytes([d[2 * j], d[2 * j + 1]])).to_f32()
            });
        }
        Encoding::F16 => {
            let d = parts.part("data")?;
            out.iter_mut().enumerate().for_each(|(i, o)| *o = f16_at(d, base + i));
        }
        Encoding::Fp8E4m3 => {
            let (d, s) = (parts.part("data")?, parts.part("scale")?);
            out.iter_mut().enumerate().for_each(|(i, o)| {
                let j = base + i;
                *o = e4m3_to_f32(d[j]) * f32_at(s, j / k)
            });
        }
        Encoding::Q8G32 => {
            let (q, s) = (parts.part("q")?, parts.part("scales")?);
            out.iter_mut().enumerate().for_each(|(i, o)| {
                let j = base + i;
                *o = (q[j] as i8) as f32 * f16_at(s, j / 32)
            });
        }
        Encoding::Q4G32 => {
            let (q, s) = (parts.part("q")?, parts.part("scales")?);
            out.iter_mut().enumerate().for_each(|(i, o)| {
                let j = base + i;
                let u = (q[j / 2] >> (4 * (j % 2))) & 15;
                *o = (u as f32 - 8.0) * f16_at(s, j / 32)
            });
        }
        Encoding::Q6G64 => {
            let (ql, qh, s) = (parts.part("ql")?, parts.part("qh")?, parts.part("scales")?);
            out.iter_mut().enumerate().for_each(|(i, o)| {
                let j = base + i;
                let lo = (ql[j / 2] >> (4 * (j % 2))) & 15;
                let hi = (qh[j / 4] >> (2 * (j % 4))) & 3;
                *o = ((lo | (hi << 4)) as f32 - 32.0) * f16_at(s, j / 64)
            });
        }
        Encoding::Nvfp4 => {
            let (c, s, g) = (parts.part("codes")?, parts.part("scales")?, parts.part("global")?);
            let n = if shape.len() >= 2 { shape[shape.len() - 2] } else { 1 };
            let nglob = g.len() / 4;
            let segs = nglob / (rows / n);
            let seg_rows = n / segs.max(1);
            out.iter_mut().enumerate().for_each(|(i, o)| {
                let j = base + i;
                let r = j / k;
                let glob = f32_at(g, (r / n) * segs + (r % n) / seg_rows);
                let code = (c[j / 2] >> (4 * (j % 2))) & 15;
                *o = e2m1_to_f32(code) * e4m3_to_f32(s[j / 16]) * glob
            });
        }
    }
    Ok(())
}

/// Expected byte length of every part of `enc` for `shape` (used to validate headers).
pub fn part_lengths(enc: Encoding, shape: &[usize], segments: usize) -> Result<Vec<(&'static str, usize)>, ArtifactError> {
    let (rows, k) = rows_and_k(enc, shape)?;
    let n = rows * k;
    Ok(match enc {
        Encoding::F32 => vec![("data", 4 * n)],
        Encoding::Bf16 | Encoding::F16 => vec![("data", 2 * n)],
        Encoding::Fp8E4m3 => vec![("data", n), ("scale", 4 * rows)],
        Encoding::Q8G32 => vec![("q", n), ("scales", 2 * n / 32)],
        Encoding::Q4G32 => vec![("q", n / 2), ("scales", 2 * n / 32)],
        Encoding::Q6G64 => vec![("ql", n / 2), ("qh", n / 4), ("scales", 2 * n / 64)],
        Encoding::Nvfp4 => {
            let nn = if shape.len() >= 2 { shape[shape.len() - 2] } else { 1 };
            vec![("codes", n / 2), ("scales", n / 16), ("global", 4 * (rows / nn) * segments)]
        }
    })
}
