// Fused elementwise ops of the decoder layer on CPU (fused_cpu.cpp); bound in paged_attention_cpu.cpp.
#pragma once

#include <torch/extension.h>

namespace kvpilot_cpu {

// The ops take float32, bfloat16 or float16 (one dtype for all of an op's tensors); half() rounds to the
// half-precision types and is the identity for float32.
//
// weight * half(rms_norm(float(x))): x [num_tokens, hidden] (rows contiguous), weight [hidden].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// residual <- half(x + residual), then rms_norm(residual, weight, eps); residual contiguous like x.
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
// Neox rotary embedding applied in place to q [T, H, D] and k [T, Hkv, D]; cos, sin [T, D].
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
// half(silu(gate)) * up of gate_up [T, 2 * I] (gate first): [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// Stores key/value [T, Hkv, D] (rows may be strided) into the caches' slots (caches addressed by their
// strides, the head dimension contiguous); negative slots are skipped. key/value are in the caches'
// dtype, or float32 over bfloat16 or float16 caches (rounded to nearest even, as torch's .to() rounds).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping);

}  // namespace kvpilot_cpu
