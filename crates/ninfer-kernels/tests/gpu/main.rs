//! Every kernel of ninfer-kernels against a CPU reference on random inputs, on a real GPU.
//! Without a CUDA driver or device each test prints "no GPU" and returns.
// Reference code indexes several arrays in step; clarity beats iterator chains here.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

mod attention;
mod bench;
mod common;
mod embed;
mod fused;
mod gdn;
mod gemv;
mod layout;
mod load;
mod mats;
mod moe;
mod norm;
mod rope;
mod route_fold;
mod sample;
