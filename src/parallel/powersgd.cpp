// PowerSGD gradient compression (see powersgd.h).
#include "mpitrain/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <string>

#include "mpitrain/error.h"

namespace mpitrain {

void orthonormalize_columns(torch::Tensor& p) {
  const int64_t r = p.size(1);
  for (int64_t i = 0; i < r; ++i) {
    torch::Tensor col = p.narrow(1, i, 1);  // n x 1, a view
    // A zero column (a zero gradient) stays zero instead of becoming NaN (PyTorch's hook: the same).
    col.div_(col.norm() + 1e-8);
    if (i + 1 < r) {
      torch::Tensor rest = p.narrow(1, i + 1, r - i - 1);
      rest.sub_(col.matmul(col.t().matmul(rest)));
    }
  }
}

namespace {
// FNV-1a: a parameter's name as a number, the same on every machine.
uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ULL;
  for (const unsigned char c : name) h = (h ^ c) * 0x100000001B3ULL;
  return h;
}
}  // namespace

PowerSgd::PowerSgd(std::vector<torch::Tensor> params, Communicator& comm, int64_t rank, uint64_t seed,
                   const std::vector<std::string>& names)
    : params_(std::move(params)), comm_(comm) {
  MPITRAIN_CHECK(names.empty() || names.size() == params_.size(), "PowerSgd: a name for every parameter");
  std::vector<torch::Tensor> plain;
  for (size_t k = 0; k < params_.size(); ++k) {
    const torch::Tensor& p = params_[k];
    const int64_t rows = p.dim() == 2 ? p.size(0) : 0, cols = p.dim() == 2 ? p.size(1) : 0;
    const int64_t r = std::min({rank, rows, cols});
    if (p.dim() != 2 || r * (rows + cols) >= rows * cols) {
      plain.push_back(p);
      continue;
    }
    Matrix m{k, rows, cols, r, {}, {}};
    // Each Q from a generator of its own, keyed by the run's seed and the parameter's name: the same
    // draws on every rank, and whichever parameters a rank holds (a pipeline stage's, the shared ones).
    at::Generator gen = at::detail::createCPUGenerator(seed + 0x9E3779B97F4A7C15ULL +
                                                       name_hash(names.empty() ? std::to_string(k) : names[k]));
    m.q = at::randn({cols, r}, gen, torch::dtype(torch::kFloat32)).to(p.device());
    orthonormalize_columns(m.q);
    m.error = torch::zeros({rows, cols}, p.options().dtype(torch::kFloat32));
    mats_.push_back(std::move(m));
  }
  if (!plain.empty()) {  // one bucket: a bound above their total size
    double mib = 1;
    for (const auto& p : plain) mib += static_cast<double>(p.nbytes()) / (1 << 20);
    plain_ = std::make_unique<GradSync>(std::move(plain), comm_, mib, /*overlap=*/false);
  }
}

uint64_t PowerSgd::bytes_per_step() const {
  uint64_t n = 0;
  for (const auto& m : mats_) n += static_cast<uint64_t>((m.rows + m.cols) * m.rank);
  return 4 * n + (plain_ ? plain_->bytes_per_step() : 0);
}

uint64_t PowerSgd::uncompressed_bytes() const {
  uint64_t n = 0;
  for (const auto& p : params_) n += static_cast<uint64_t>(p.numel());
  return 4 * n;
}

void PowerSgd::reduce_grads() {
  if (comm_.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& p : params_)
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);

  if (plain_) plain_->all_reduce_grads();  // the plain tensors: one bucket
  if (mats_.empty()) return;

  // M = grad + error, formed in the error buffer (this rank's; no copy of the gradients), and
  // P = M Q for every matrix, written straight into one flat buffer that is all-reduced.
  int64_t p_len = 0, q_len = 0;
  for (const auto& m : mats_) p_len += m.rows * m.rank, q_len += m.cols * m.rank;
  const auto opts = mats_.front().error.options();
  torch::Tensor p_all = torch::empty({p_len}, opts), q_all = torch::empty({q_len}, opts);
  std::vector<torch::Tensor> pmats, qmats;
  for (int64_t i = 0, at = 0, bt = 0; i < static_cast<int64_t>(mats_.size()); ++i) {
    auto& m = mats_[static_cast<size_t>(i)];
    m.error.add_(params_[m.param].grad().view({m.rows, m.cols}));
    pmats.push_back(p_all.narrow(0, at, m.rows * m.rank).view({m.rows, m.rank}));
    qmats.push_back(q_all.narrow(0, bt, m.cols * m.rank).view({m.cols, m.rank}));
    at += m.rows * m.rank, bt += m.cols * m.rank;
    torch::mm_out(pmats.back(), m.error, m.q);
  }
  comm_.all_reduce(p_all, ReduceOp::sum);  // orthonormalised next: the scale does not matter
  // Q = Mᵀ P with P orthonormal, all-reduced and averaged: P Qᵀ = P Pᵀ mean(M).
  for (size_t i = 0; i < mats_.size(); ++i) {
    orthonormalize_columns(pmats[i]);
    torch::mm_out(qmats[i], mats_[i].error.t(), pmats[i]);
  }
  comm_.all_reduce(q_all, ReduceOp::avg);
  for (size_t i = 0; i < mats_.size(); ++i) {
    auto& m = mats_[i];
    m.q.copy_(qmats[i]);  // the warm start of the next step
    torch::Tensor g = params_[m.param].mutable_grad().view({m.rows, m.cols});
    torch::mm_out(g, pmats[i], m.q.t());  // the gradient: P Qᵀ
    m.error.sub_(g);  // error feedback: what this rank's M lost, added to the next step's gradient
  }
}

}  // namespace mpitrain
