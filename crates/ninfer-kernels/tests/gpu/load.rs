//! Loading: image choice by compute capability, every symbol resolving, the PTX fallback.

use ninfer_kernels::{ImageKind, Kernel, KernelError, KernelSet};

use crate::common::*;

#[test]
fn image_choice_by_capability() {
    assert_eq!(ImageKind::for_capability(9, 0), Some(ImageKind::Sm90a));
    assert_eq!(ImageKind::for_capability(12, 0), Some(ImageKind::Sm120a));
    assert_eq!(ImageKind::for_capability(12, 1), Some(ImageKind::Sm120a));
    assert_eq!(ImageKind::for_capability(10, 0), Some(ImageKind::Ptx90));
    assert_eq!(ImageKind::for_capability(8, 9), None);
}

#[test]
fn every_symbol_resolves() {
    let Some(g) = gpu() else { return };
    let (major, minor) = g.ks.compute_capability();
    println!(
        "device {} (compute capability {major}.{minor}), image {:?}",
        g.ks.device_name(),
        g.ks.image()
    );
    assert_eq!(Some(g.ks.image()), ImageKind::for_capability(major, minor));
    let mut names = std::collections::HashSet::new();
    for &k in Kernel::ALL {
        assert!(names.insert(k.symbol()), "duplicate symbol {}", k.symbol());
        assert!(
            g.ks.function(k).num_regs().unwrap() > 0,
            "{} has no code",
            k.symbol()
        );
    }
    println!("{} kernels resolved", Kernel::ALL.len());
}

#[test]
fn ptx_image_loads_and_resolves() {
    let Some(g) = gpu() else { return };
    let t = std::time::Instant::now();
    let ks = KernelSet::load_image(&g.ctx, ImageKind::Ptx90).expect("PTX image loads");
    println!(
        "PTX image JIT-compiled in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    for &k in Kernel::ALL {
        assert!(ks.function(k).num_regs().unwrap() > 0);
    }
}

#[test]
fn foreign_cubin_is_a_clear_error() {
    let Some(g) = gpu() else { return };
    let other = match g.ks.image() {
        ImageKind::Sm90a => ImageKind::Sm120a,
        _ => ImageKind::Sm90a,
    };
    match KernelSet::load_image(&g.ctx, other) {
        Err(e @ KernelError::ModuleLoad { .. }) => println!("expected: {e}"),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("a cubin for another architecture loaded"),
    }
}
