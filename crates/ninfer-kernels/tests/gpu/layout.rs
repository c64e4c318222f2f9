//! The device layout of NVFP4 codes (kernels/layout.cu) against its host mirror.

use ninfer_kernels::nvfp4_device_word;

use crate::common::*;

#[test]
fn nvfp4_device_layout_matches_the_host_mirror() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(41);
    // More words than one pass of the grid-stride loop's largest grid (4096 blocks of 256).
    for n in [4usize, 4 * 1000, 4 * (4096 * 256 + 77)] {
        let bytes = rng.bytes(n);
        let mut d = up(&s, &bytes);
        g.ks.nvfp4_device_layout(&s, &mut d).expect("launch");
        let got = down(&s, &d);
        for (i, (w, o)) in bytes.chunks(4).zip(got.chunks(4)).enumerate() {
            let want = nvfp4_device_word(u32::from_le_bytes(w.try_into().unwrap()));
            assert_eq!(u32::from_le_bytes(o.try_into().unwrap()), want, "word {i} of {}", n / 4);
        }
    }
    let mut odd = up(&s, &[0u8; 6]);
    assert!(g.ks.nvfp4_device_layout(&s, &mut odd).is_err(), "6 bytes are not whole words");
}
