// Kiln's mixture-of-experts product: kiln::gathered_matmul(weights, ids, x).
//
// weights [E, O, I] f32, ids [N] int64, x [N, I, K] -> out [N, O, K], out[n] = weights[ids[n]] @ x[n].
// Why: decomposed, the product gathers every routed row's whole expert matrix into a copy first
// (weights[ids] is [N, O, I]), as many bytes again as the product reads. Here each expert's
// matrix is multiplied where it lies: rows that share an expert go through one matrix product
// (BLAS), so a decode step reads each routed expert once and a prefill chunk batches its rows.
//
// One file, two translation units (built like gemv_kernel.cpp): with -DKILN_GATHERED_MATMUL_KERNELS
// nothing (this op has no SIMD code of its own), without it the torch binding.
#ifndef KILN_GATHERED_MATMUL_KERNELS

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <vector>

namespace kiln_gathered_matmul {

// out [N, O, K] with out[n] = product(e, x[rows of e])[the row's place] for each expert e that
// some row routes to: the rows of one expert go through one product, then back to their places.
template <typename Product>
static at::Tensor per_expert(const char* op, const at::Tensor& ids_in, const at::Tensor& x, int64_t E, int64_t O,
                             Product product) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(E);
  for (int64_t n = 0; n < x.size(0); n++) {
    TORCH_CHECK(id[n] >= 0 && id[n] < E, op, ": expert id ", id[n], " is not in [0, ", E, ")");
    rows[id[n]].push_back(n);
  }
  at::Tensor out = at::empty({x.size(0), O, x.size(2)}, x.options());
  for (int64_t e = 0; e < E; e++) {
    if (rows[e].empty()) continue;
    const at::Tensor index = at::tensor(rows[e], ids.options());
    out.index_copy_(0, index, product(e, x.index_select(0, index)));
  }
  return out;
}

at::Tensor gathered_matmul(const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& x_in) {
  const char* op = "kiln::gathered_matmul";
  TORCH_CHECK(weights.dim() == 3 && ids.dim() == 1 && x_in.dim() == 3, op,
              ": weights [experts, out, in], ids [rows], x [rows, in, cols] expected");
  TORCH_CHECK(ids.size(0) == x_in.size(0) && x_in.size(1) == weights.size(2), op, ": shapes do not match");
  const int64_t I = weights.size(2), O = weights.size(1);
  // [O, I] (a view: nothing copied) @ [I, M * K], the rows side by side
  return per_expert(op, ids, x_in.to(weights.scalar_type()), weights.size(0), O, [&](int64_t e, const at::Tensor& xs) {
    const int64_t M = xs.size(0), K = xs.size(2);
    return at::mm(weights.select(0, e), xs.permute({1, 0, 2}).reshape({I, M * K})).view({O, M, K}).permute({1, 0, 2});
  });
}

// Kiln's GEMV kernel (gemv_kernel.cpp, loaded first): x [M, I] @ packed [I, O].
static at::Tensor kiln_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::linear_f32", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, packed, std::nullopt);
}

// The same product with each expert's matrix packed for Kiln's GEMV kernel: packed [E, I, O]
// (weights[e].t() contiguous), so the rows of one expert are one call of the kernel that streams
// a decode step's weights near the memory's bandwidth (BLAS's matrix-vector product does not).
at::Tensor gathered_linear(const at::Tensor& packed, const at::Tensor& ids, const at::Tensor& x_in) {
  const char* op = "kiln::gathered_linear";
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat, op,
              ": packed must be contiguous float32 [experts, in, out]");
  TORCH_CHECK(ids.dim() == 1 && x_in.dim() == 3 && ids.size(0) == x_in.size(0) && x_in.size(1) == packed.size(1),
              op, ": ids [rows] and x [rows, in, cols] do not match packed ", packed.sizes());
  const int64_t I = packed.size(1), O = packed.size(2);
  return per_expert(op, ids, x_in.to(at::kFloat), packed.size(0), O, [&](int64_t e, const at::Tensor& xs) {
    const int64_t M = xs.size(0), K = xs.size(2);
    return kiln_linear(xs.permute({0, 2, 1}).reshape({M * K, I}), packed.select(0, e)).view({M, K, O}).permute({0, 2, 1});
  });
}

}  // namespace kiln_gathered_matmul

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("gathered_matmul(Tensor weights, Tensor ids, Tensor x) -> Tensor");
  m.def("gathered_linear(Tensor packed, Tensor ids, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("gathered_matmul", &kiln_gathered_matmul::gathered_matmul);
  m.impl("gathered_linear", &kiln_gathered_matmul::gathered_linear);
}

#endif  // KILN_GATHERED_MATMUL_KERNELS
