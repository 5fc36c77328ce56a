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

at::Tensor gathered_matmul(const at::Tensor& weights, const at::Tensor& ids_in, const at::Tensor& x_in) {
  const char* op = "kiln::gathered_matmul";
  TORCH_CHECK(weights.dim() == 3 && ids_in.dim() == 1 && x_in.dim() == 3, op,
              ": weights [experts, out, in], ids [rows], x [rows, in, cols] expected");
  TORCH_CHECK(ids_in.size(0) == x_in.size(0) && x_in.size(1) == weights.size(2), op, ": shapes do not match");
  const int64_t N = x_in.size(0), O = weights.size(1), K = x_in.size(2), E = weights.size(0);
  at::Tensor ids = ids_in.to(at::kLong).contiguous(), x = x_in.to(weights.scalar_type());
  at::Tensor out = at::empty({N, O, K}, x.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  // the rows of each expert, in order
  std::vector<std::vector<int64_t>> rows(E);
  for (int64_t n = 0; n < N; n++) {
    TORCH_CHECK(id[n] >= 0 && id[n] < E, op, ": expert id ", id[n], " is not in [0, ", E, ")");
    rows[id[n]].push_back(n);
  }
  for (int64_t e = 0; e < E; e++) {
    if (rows[e].empty()) continue;
    const at::Tensor w = weights.select(0, e);  // [O, I], a view: nothing copied
    if (rows[e].size() == 1) {
      const int64_t n = rows[e][0];
      at::Tensor row = out.select(0, n);
      at::mm_out(row, w, x.select(0, n));
      continue;
    }
    // [I, rows * K]: the rows side by side, one product, then back to their places
    at::Tensor index = at::tensor(rows[e], ids.options());
    at::Tensor columns = x.index_select(0, index).permute({1, 0, 2}).reshape({x.size(1), -1});
    at::Tensor product = at::mm(w, columns).reshape({O, (int64_t)rows[e].size(), K}).permute({1, 0, 2});
    out.index_copy_(0, index, product);
  }
  return out;
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
at::Tensor gathered_linear(const at::Tensor& packed, const at::Tensor& ids_in, const at::Tensor& x_in) {
  const char* op = "kiln::gathered_linear";
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat, op,
              ": packed must be contiguous float32 [experts, in, out]");
  TORCH_CHECK(ids_in.dim() == 1 && x_in.dim() == 3 && ids_in.size(0) == x_in.size(0) &&
                  x_in.size(1) == packed.size(1),
              op, ": ids [rows] and x [rows, in, cols] do not match packed ", packed.sizes());
  const int64_t N = x_in.size(0), I = packed.size(1), O = packed.size(2), K = x_in.size(2), E = packed.size(0);
  at::Tensor ids = ids_in.to(at::kLong).contiguous(), x = x_in.to(at::kFloat);
  at::Tensor out = at::empty({N, O, K}, x.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(E);
  for (int64_t n = 0; n < N; n++) {
    TORCH_CHECK(id[n] >= 0 && id[n] < E, op, ": expert id ", id[n], " is not in [0, ", E, ")");
    rows[id[n]].push_back(n);
  }
  for (int64_t e = 0; e < E; e++) {
    if (rows[e].empty()) continue;
    const int64_t M = (int64_t)rows[e].size();
    at::Tensor index = at::tensor(rows[e], ids.options());
    at::Tensor columns = x.index_select(0, index).permute({0, 2, 1}).reshape({M * K, I});  // [M*K, I]
    at::Tensor product = kiln_linear(columns, packed.select(0, e));                        // [M*K, O]
    out.index_copy_(0, index, product.view({M, K, O}).permute({0, 2, 1}));
  }
  return out;
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
