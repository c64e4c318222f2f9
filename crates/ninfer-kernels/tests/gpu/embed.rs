//! embed.cu: embedding rows gathered from bf16 and q8_g32 tables.

use ninfer_kernels::bf16;

use crate::common::*;
use crate::mats::*;

#[test]
fn embed_bf16_and_q8_tables() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(500);
    let (vocab, dim) = (1000, 256);
    let ids = [5i32, 999, 0, -1, 1000, 5, 77];
    for enc in [Enc::Bf16, Enc::Q8] {
        let table = HostMat::random(enc, 1, vocab, dim, 1, &mut rng);
        let w = table.dequant_expert(0);
        let dt = table.upload(&s);
        let did = up(&s, &ids);
        let ldo = dim + 16;
        let mut out = nan_bf16(&s, ids.len() * ldo);
        g.ks.embed(&s, &dt.view(), &did, ids.len(), &mut out, ldo)
            .unwrap();
        let got = down(&s, &out);
        for (t, &id) in ids.iter().enumerate() {
            let row = &got[t * ldo..t * ldo + dim];
            if (0..vocab as i32).contains(&id) {
                let want: Vec<bf16> = w[id as usize * dim..(id as usize + 1) * dim]
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect();
                assert_eq!(row, &want[..], "{enc:?} row of token {t} (id {id})");
            } else {
                assert!(
                    row.iter().all(|v| *v == bf16::ZERO),
                    "{enc:?} id {id} must give zeros"
                );
            }
            assert!(
                got[t * ldo + dim..(t + 1) * ldo].iter().all(|v| v.is_nan()),
                "wrote past dim"
            );
        }
    }
}
