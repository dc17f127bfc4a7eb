// The small-batch linear with bfloat16-stored weights (linear_cpu.cpp); bound in paged_attention_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <string>

namespace kvpilot_cpu {

// x [M, K] float32 (rows contiguous) times the weight [N, K] packed as bfloat16 panels
// [ceil(N / 16), K, 16] (panel p, feature k, column c holds weight[16 p + c, k]; padding columns zero):
// float32 [M, n_out], accumulated in float32.
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w_packed, int64_t n_out);

// The inner loop this build runs: "avx512", "avx2" (with FMA) or "portable".
std::string linear_bf16w_path();

}  // namespace kvpilot_cpu
