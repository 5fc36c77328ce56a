// Kiln's mixture-of-experts products: kiln::gathered_matmul(weights, ids, x), gathered_linear (the same
// through Kiln's f32 GEMV kernel) and gathered_linear_q (quantized experts through its int8 / int4 kernels).
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

using Optional = std::optional<at::Tensor>;
using Int8Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&);
using Int4Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&,
                              const Optional&, int64_t, const Optional&);

// The product over quantized experts: each routed expert's codes go through Kiln's int8 or int4
// kernel (loaded first: int8_kernel.cpp, gemv_kernel.cpp, int4_kernel.cpp), which read them as they
// lie, so a decode step reads only the routed experts' codes. Which kernel, by `weight`'s form:
//   u8 [E, panels, K/4, 64]  linear_q8's panels per expert (int8_kernel.pack_int8_weight), scales [E, O]
//   i8 [E, K, O]             linear_i8's [K, N] per expert, scales [E, O]
//   u8 [E, O, K/2]           the IR's packed int4 codes, for linear_q4 with scales [E, O, G], zeros, group_size
at::Tensor gathered_linear_q(const at::Tensor& weight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& zeros, const at::Tensor& ids, const at::Tensor& x_in,
                             int64_t group_size, const std::optional<at::Tensor>& decode_scales) {
  const char* op = "kiln::gathered_linear_q";
  const bool q8 = weight.scalar_type() == at::kByte && weight.dim() == 4;
  const bool i8 = weight.scalar_type() == at::kChar && weight.dim() == 3;
  const bool q4 = weight.scalar_type() == at::kByte && weight.dim() == 3;
  TORCH_CHECK(q8 || i8 || q4, op, ": weight must be u8 [E, panels, K/4, 64], i8 [E, K, O] or u8 [E, O, K/2], got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t E = weight.size(0), O = scales.size(1);
  const int64_t I = q8 ? weight.size(2) * 4 : i8 ? weight.size(1) : weight.size(2) * 2;
  TORCH_CHECK(scales.size(0) == E && ids.dim() == 1 && x_in.dim() == 3 && ids.size(0) == x_in.size(0) &&
                  x_in.size(1) == I,
              op, ": scales [experts, out, ...], ids [rows] and x [rows, ", I, ", cols] expected, got scales ",
              scales.sizes(), ", x ", x_in.sizes());
  auto expert = [](const Optional& t, int64_t e) { return t ? Optional(t->select(0, e)) : std::nullopt; };
  return per_expert(op, ids, x_in.to(at::kFloat), E, O, [&](int64_t e, const at::Tensor& xs) {
    const int64_t M = xs.size(0), K = xs.size(2);
    const at::Tensor rows = xs.permute({0, 2, 1}).reshape({M * K, I});
    const at::Tensor w = weight.select(0, e), s = scales.select(0, e);
    at::Tensor y;
    // Each kernel is looked up on first use: only the ones a model's experts need are loaded.
    if (q8) {
      static auto q8_op = c10::Dispatcher::singleton().findSchemaOrThrow("kiln::linear_q8", "").typed<Int8Linear>();
      y = q8_op.call(rows, w, s, std::nullopt);
    } else if (i8) {
      static auto i8_op = c10::Dispatcher::singleton().findSchemaOrThrow("kiln::linear_i8", "").typed<Int8Linear>();
      y = i8_op.call(rows, w, s, std::nullopt);
    } else {
      static auto q4_op = c10::Dispatcher::singleton().findSchemaOrThrow("kiln::linear_q4", "").typed<Int4Linear>();
      y = q4_op.call(rows, w, s, expert(zeros, e), std::nullopt, group_size, expert(decode_scales, e));
    }
    return y.view({M, K, O}).permute({0, 2, 1});
  });
}

}  // namespace kiln_gathered_matmul

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("gathered_matmul(Tensor weights, Tensor ids, Tensor x) -> Tensor");
  m.def("gathered_linear(Tensor packed, Tensor ids, Tensor x) -> Tensor");
  m.def("gathered_linear_q(Tensor weight, Tensor scales, Tensor? zeros, Tensor ids, Tensor x, int group_size, "
        "Tensor? decode_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("gathered_matmul", &kiln_gathered_matmul::gathered_matmul);
  m.impl("gathered_linear", &kiln_gathered_matmul::gathered_linear);
  m.impl("gathered_linear_q", &kiln_gathered_matmul::gathered_linear_q);
}

#endif  // KILN_GATHERED_MATMUL_KERNELS
