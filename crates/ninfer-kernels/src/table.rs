//! The one table of kernel symbols: every kernel of every module, by name. Launchers refer to
//! kernels only through [`Kernel`]; [`crate::KernelSet::load`] resolves all of them up front.

macro_rules! kernel_table {
    ($($variant:ident => $module:literal, $symbol:literal;)*) => {
        /// One kernel of the embedded modules.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($variant,)*
        }

        impl Kernel {
            /// Every kernel, in table order (the order of [`crate::KernelSet`]'s functions).
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The kernel file (without `.cu`) that defines this kernel.
            pub fn module(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $module,)*
                }
            }

            /// The exported (extern "C") symbol.
            pub fn symbol(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $symbol,)*
                }
            }

            pub(crate) fn index(self) -> usize {
                self as usize
            }
        }
    };
}

kernel_table! {
    Nvfp4DeviceLayout => "layout", "ninfer_nvfp4_device_layout";
    RmsNorm => "norm", "ninfer_rms_norm";
    AddRmsNorm => "norm", "ninfer_add_rms_norm";
    GatedRmsNorm => "norm", "ninfer_gated_rms_norm";
    GemvBf16B1 => "gemv", "ninfer_gemv_bf16_b1";
    GemvBf16NormB1 => "fused", "ninfer_gemv_bf16_norm_b1";
    GemvQ8NormB1 => "fused", "ninfer_gemv_q8_g32_norm_b1";
    GemvBf16NormConvB1 => "fused", "ninfer_gemv_bf16_norm_conv_b1";
    GemvQ8NormConvB1 => "fused", "ninfer_gemv_q8_g32_norm_conv_b1";
    GemvQ8NormBulkB1 => "fused", "ninfer_gemv_q8_g32_norm_bulk_b1";
    GemvQ8NormConvBulkB1 => "fused", "ninfer_gemv_q8_g32_norm_conv_bulk_b1";
    GemvQ8GnormBulkB1 => "fused", "ninfer_gemv_q8_g32_gnorm_bulk_b1";
    GemvQ8GnormBulkB8 => "fused", "ninfer_gemv_q8_g32_gnorm_bulk_b8";
    GemvQ8GnormBulkRouteB1 => "fused", "ninfer_gemv_q8_g32_gnorm_bulk_route_b1";
    GemvQ8BulkRouteB1 => "fused", "ninfer_gemv_q8_g32_bulk_route_b1";
    GemvQ8NormBulkB8 => "fused", "ninfer_gemv_q8_g32_norm_bulk_b8";
    GemvQ8NormConvBulkB8 => "fused", "ninfer_gemv_q8_g32_norm_conv_bulk_b8";
    GemvBf16GnormB1 => "fused", "ninfer_gemv_bf16_gnorm_b1";
    GemvQ8GnormB1 => "fused", "ninfer_gemv_q8_g32_gnorm_b1";
    GemvBf16NormMmaB8 => "fused", "ninfer_gemv_bf16_norm_mma_b8";
    GemvBf16NormMmaB16 => "fused", "ninfer_gemv_bf16_norm_mma_b16";
    GemvQ8NormMmaB8 => "fused", "ninfer_gemv_q8_g32_norm_mma_b8";
    GemvQ8NormMmaB16 => "fused", "ninfer_gemv_q8_g32_norm_mma_b16";
    GemvBf16NormConvMmaB8 => "fused", "ninfer_gemv_bf16_norm_conv_mma_b8";
    GemvBf16NormConvMmaB16 => "fused", "ninfer_gemv_bf16_norm_conv_mma_b16";
    GemvQ8NormConvMmaB8 => "fused", "ninfer_gemv_q8_g32_norm_conv_mma_b8";
    GemvQ8NormConvMmaB16 => "fused", "ninfer_gemv_q8_g32_norm_conv_mma_b16";
    GemvBf16MmaB8 => "gemv", "ninfer_gemv_bf16_mma_b8";
    GemvBf16MmaB16 => "gemv", "ninfer_gemv_bf16_mma_b16";
    GemvQ8B1 => "gemv", "ninfer_gemv_q8_g32_b1";
    GemvQ8BulkB1 => "gemv", "ninfer_gemv_q8_g32_bulk_b1";
    GemvQ8BulkB8 => "gemv", "ninfer_gemv_q8_g32_bulk_b8";
    GemvQ8BulkB16 => "gemv", "ninfer_gemv_q8_g32_bulk_b16";
    GemvQ8MmaB8 => "gemv", "ninfer_gemv_q8_g32_mma_b8";
    GemvQ8MmaB16 => "gemv", "ninfer_gemv_q8_g32_mma_b16";
    GemvQ6MmaB2 => "gemv", "ninfer_gemv_q6_g64_mma_b2";
    GemvQ6MmaB4 => "gemv", "ninfer_gemv_q6_g64_mma_b4";
    GemvQ6MmaB8 => "gemv", "ninfer_gemv_q6_g64_mma_b8";
    GemvQ6MmaB16 => "gemv", "ninfer_gemv_q6_g64_mma_b16";
    GemvQ4B1 => "gemv", "ninfer_gemv_q4_g32_b1";
    GemvQ4B2 => "gemv", "ninfer_gemv_q4_g32_b2";
    GemvQ4B4 => "gemv", "ninfer_gemv_q4_g32_b4";
    GemvQ4B8 => "gemv", "ninfer_gemv_q4_g32_b8";
    GemvQ4B16 => "gemv", "ninfer_gemv_q4_g32_b16";
    GemvNvfp4B1 => "gemv", "ninfer_gemv_nvfp4_b1";
    GemvNvfp4B2 => "gemv", "ninfer_gemv_nvfp4_b2";
    GemvNvfp4B4 => "gemv", "ninfer_gemv_nvfp4_b4";
    GemvNvfp4B8 => "gemv", "ninfer_gemv_nvfp4_b8";
    GemvNvfp4B16 => "gemv", "ninfer_gemv_nvfp4_b16";
    MoeGateUpBf16 => "experts", "ninfer_moe_gate_up_bf16";
    MoeDownBf16 => "experts", "ninfer_moe_down_bf16";
    MoeGateUpQ8 => "experts", "ninfer_moe_gate_up_q8_g32";
    MoeDownQ8 => "experts", "ninfer_moe_down_q8_g32";
    MoeGateUpQ6 => "experts", "ninfer_moe_gate_up_q6_g64";
    MoeDownQ6 => "experts", "ninfer_moe_down_q6_g64";
    MoeGateUpQ4 => "experts", "ninfer_moe_gate_up_q4_g32";
    MoeDownQ4 => "experts", "ninfer_moe_down_q4_g32";
    MoeGateUpNvfp4 => "experts", "ninfer_moe_gate_up_nvfp4";
    MoeDownNvfp4 => "experts", "ninfer_moe_down_nvfp4";
    MoeRoute => "moe", "ninfer_moe_route";
    MoeGateUpGroupedNvfp4 => "experts", "ninfer_moe_gate_up_grouped_nvfp4";
    MoeDownGroupedNvfp4 => "experts", "ninfer_moe_down_grouped_nvfp4";
    MoeCombine => "experts", "ninfer_moe_combine";
    MoeGateUpMmaNvfp4 => "experts_batch", "ninfer_moe_gate_up_mma_nvfp4";
    MoeDownMmaNvfp4 => "experts_batch", "ninfer_moe_down_mma_nvfp4";
    MoeDownOneNvfp4 => "experts_batch", "ninfer_moe_down_one_nvfp4";
    EmbedBf16 => "embed", "ninfer_embed_bf16";
    EmbedQ8 => "embed", "ninfer_embed_q8_g32";
    QkNormRope => "rope", "ninfer_qk_norm_rope";
    GdnConv => "gdn", "ninfer_gdn_conv";
    GdnRecurrent => "gdn", "ninfer_gdn_recurrent";
    GdnChunked => "gdn", "ninfer_gdn_chunked";
    Attention => "attention", "ninfer_attention";
    AttentionCombine => "attention", "ninfer_attention_combine";
    AttentionMma => "attention", "ninfer_attention_mma";
    AttentionMmaDecode => "attention", "ninfer_attention_mma_decode";
    Argmax => "sample", "ninfer_argmax";
    Sample => "sample", "ninfer_sample";
}
