//! Codec exactness against hand-computed values, and one test per kind of broken file.

use super::codec::*;
use super::*;

#[test]
fn e2m1_all_codes() {
    let want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
    for (c, w) in want.iter().enumerate() {
        assert_eq!(e2m1_to_f32(c as u8), *w, "code {c}");
        assert_eq!(e2m1_to_f32(f32_to_e2m1(*w)), *w);
    }
    // Ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 2.5 -> 2.0, 5 -> 4.0.
    for (x, w) in [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (100.0, 6.0)] {
        assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), w, "x = {x}");
        assert_eq!(e2m1_to_f32(f32_to_e2m1(-x)), -w, "x = -{x}");
    }
}

#[test]
fn e4m3_edges() {
    assert_eq!(e4m3_to_f32(0x00), 0.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(e4m3_to_f32(0x07), 7.0 / 8.0 * 2f32.powi(-6)); // largest subnormal
    assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0x7E), 448.0);
    assert!(e4m3_to_f32(0x7F).is_nan());
    assert_eq!(e4m3_to_f32(0xFE), -448.0);
    assert_eq!(e4m3_to_f32(0xBE), -1.75);
    assert_eq!(f32_to_e4m3(1000.0), 0x7E, "saturates");
    assert_eq!(f32_to_e4m3(1.0), 0x38);
    // Every finite code round-trips.
    for c in 0u8..=255 {
        let v = e4m3_to_f32(c);
        if v.is_finite() && !(v == 0.0 && c == 0x80) {
            assert_eq!(f32_to_e4m3(v), c, "code {c:#x}");
        }
    }
    // 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39): to even.
    assert_eq!(f32_to_e4m3(1.0625), 0x38);
}

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect()
}

fn roundtrip(enc: Encoding, x: &[f32], shape: &[usize]) -> Vec<f32> {
    struct P(Vec<Part>);
    impl PartSource for P {
        fn part(&self, name: &str) -> Result<&[u8], ArtifactError> {
            Ok(&self.0.iter().find(|p| p.name == name).unwrap().bytes)
        }
    }
    let parts = P(quantize(enc, x, shape, 1).unwrap());
    let mut out = vec![0f32; x.len()];
    dequantize_rows(enc, &parts, shape, 0, &mut out).unwrap();
    out
}

#[test]
fn integer_groups_hand_computed() {
    // One q8 group: amax 127 -> scale 1 exactly, values are integers: exact.
    let mut x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
    x[5] = 127.0;
    assert_eq!(roundtrip(Encoding::Q8G32, &x, &[1, 32]), x);
    // q4: amax 7 -> scale 1; q6: amax 31 -> scale 1.
    let x4: Vec<f32> = (0..32).map(|i| (i % 15) as f32 - 7.0).collect();
    assert_eq!(roundtrip(Encoding::Q4G32, &x4, &[1, 32]), x4);
    let x6: Vec<f32> = (0..64).map(|i| (i % 63) as f32 - 31.0).collect();
    assert_eq!(roundtrip(Encoding::Q6G64, &x6, &[1, 64]), x6);
    // Group boundaries: a large value in group 1 must not change group 0's scale.
    let mut y = vec![1.0f32; 64];
    y[40] = 1000.0;
    let r = roundtrip(Encoding::Q8G32, &y, &[1, 64]);
    assert_eq!(&r[..32], &roundtrip(Encoding::Q8G32, &y[..32], &[1, 32])[..]);
    assert!((r[0] - 1.0).abs() < 1e-3 && r[1] < 2.0);
}

#[test]
fn every_encoding_bounded_error() {
    let shape = [3, 128];
    let x = ramp(384);
    for (enc, tol) in [
        (Encoding::F32, 0.0),
        (Encoding::Bf16, 4e-3),
        (Encoding::F16, 5e-4),
        (Encoding::Fp8E4m3, 0.07),
        (Encoding::Q8G32, 0.005),
        (Encoding::Q6G64, 0.02),
        (Encoding::Q4G32, 0.08),
        (Encoding::Nvfp4, 0.15),
    ] {
        let r = roundtrip(enc, &x, &shape);
        let num: f32 = x.iter().zip(&r).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f32 = x.iter().map(|a| a * a).sum();
        let rel = (num / den).sqrt();
        assert!(rel <= tol, "{enc}: rel err {rel} > {tol}");
        assert!(r.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn nvfp4_exact_on_representable_values() {
    // Values e2m1 * 2^-2 with block amax 6*0.25: global = amax/(6*448), block scale ... exact.
    let x: Vec<f32> = (0..32).map(|i| e2m1_to_f32((i % 16) as u8) * 0.25).collect();
    let r = roundtrip(Encoding::Nvfp4, &x, &[1, 32]);
    for (a, b) in x.iter().zip(&r) {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} vs {b}");
    }
}

fn tmpdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ninfer-art-{}-{:?}", std::process::id(), std::thread::current().id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write_small(path: &std::path::Path) {
    let mut w = ArtifactWriter::create(path, 8192).unwrap();
    w.set_meta("qwen3_5_moe", "t", serde_json::json!({"recipe": "test"}));
    w.set_component("text", serde_json::json!({"hidden_size": 64}));
    w.add_f32("a", Encoding::Q8G32, &[2, 64], "text", &ramp(128)).unwrap();
    w.add_f32("b", Encoding::Nvfp4, &[2, 4, 32], "text", &ramp(256)).unwrap();
    w.add_resource("tokenizer.json", b"{}").unwrap();
    w.finish().unwrap();
}

#[test]
fn write_read_roundtrip() {
    let p = tmpdir().join("ok.ninfer");
    write_small(&p);
    let a = Artifact::open(&p).unwrap();
    a.verify().unwrap();
    assert_eq!(a.tensor("a").unwrap().shape, &[2, 64]);
    assert_eq!(a.resource("tokenizer.json").unwrap(), b"{}");
    let b = a.tensor("b").unwrap();
    assert_eq!(b.to_f32().unwrap(), roundtrip(Encoding::Nvfp4, &ramp(256), &[2, 4, 32]));
    assert_eq!(b.rows_f32(4, 2).unwrap(), b.to_f32().unwrap()[4 * 32..6 * 32]);
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(&bytes[..8], b"NINFER\0\x01");
    for part in a.header().tensors["b"].parts.values() {
        assert_eq!(part.offset % 256, 0);
    }
}

fn broken(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> String {
    let p = tmpdir().join(format!("{name}.ninfer"));
    write_small(&p);
    let mut bytes = std::fs::read(&p).unwrap();
    edit(&mut bytes);
    std::fs::write(&p, &bytes).unwrap();
    match Artifact::open(&p).and_then(|a| a.verify()) {
        Ok(()) => panic!("{name}: a broken file opened"),
        Err(e) => e.to_string(),
    }
}

fn replace_in_header(bytes: &mut [u8], from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let pos = bytes.windows(from.len()).position(|w| w == from.as_bytes()).expect("pattern in header");
    bytes[pos..pos + to.len()].copy_from_slice(to.as_bytes());
}

#[test]
fn broken_files_name_the_problem() {
    assert!(broken("magic", |b| b[0] = b'X').contains("bad magic"));
    assert!(broken("version", |b| b[7] = 9).contains("unsupported format version 9"));
    assert!(broken("hdrlen", |b| b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes())).contains("header length"));
    assert!(broken("truncated", |b| {
        let n = b.len() - 100;
        b.truncate(n)
    })
    .contains("runs past the end of the file"));
    assert!(broken("encoding", |b| replace_in_header(b, "\"q8_g32\"", "\"q9_g32\"")).contains("unknown encoding `q9_g32`"));
    assert!(broken("checksum", |b| {
        // The first byte of the data section is the first byte of tensor `a`.
        let len = u64::from_le_bytes(b[8..16].try_into().unwrap());
        let data = (32 + len).div_ceil(DATA_ALIGN) as usize * DATA_ALIGN as usize;
        b[data] ^= 0xFF
    })
    .contains("checksum mismatch"));
    assert!(broken("json", |b| b[40] = b'{').contains("header is not valid JSON"));
    assert!(broken("resource", |b| {
        let n = b.len();
        b[n - 1] ^= 0xFF
    })
    .contains("checksum mismatch in `resource tokenizer.json`"));
}
