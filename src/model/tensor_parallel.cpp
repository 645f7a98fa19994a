// Tensor-parallel building blocks (see tensor_parallel.h).
#include "mpitrain/tensor_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "mpitrain/error.h"

namespace mpitrain {

namespace F = torch::nn::functional;

namespace {

// The communicator rides through autograd's saved data as an integer.
int64_t handle(Communicator& c) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&c)); }
Communicator& from_handle(const c10::IValue& v) { return *reinterpret_cast<Communicator*>(static_cast<intptr_t>(v.toInt())); }

std::atomic<int64_t> collective_ns{0};

// Times one tp collective into collective_ns.
template <class Fn>
void timed(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  collective_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// The sum over the tp ranks. 16-bit activations (autocast) are summed in fp32, then rounded once:
// the partial sums of a row-parallel layer add up as they would inside one matmul.
torch::Tensor summed(const torch::Tensor& t, Communicator& comm) {
  const bool half = t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
  torch::Tensor out = half ? t.to(torch::kFloat32).contiguous() : t.clone(at::MemoryFormat::Contiguous);
  timed([&] { comm.all_reduce(out, ReduceOp::sum); });
  return half ? out.to(t.scalar_type()) : out;
}

class TpCopy : public torch::autograd::Function<TpCopy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    return {summed(g[0], from_handle(ctx->saved_data["comm"])), torch::Tensor()};
  }
};

class TpReduce : public torch::autograd::Function<TpReduce> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, int64_t comm) {
    return summed(x, *reinterpret_cast<Communicator*>(static_cast<intptr_t>(comm)));
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*, torch::autograd::tensor_list g) {
    return {g[0], torch::Tensor()};
  }
};

}  // namespace

torch::Tensor tp_copy(const torch::Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return x;
  return TpCopy::apply(x, handle(tp));
}

torch::Tensor tp_reduce(const torch::Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return x;
  return TpReduce::apply(x, handle(tp));
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& idx, const torch::Tensor& local, int64_t vocab_start,
                                       Communicator& tp) {
  if (tp.size() == 1) return F::embedding(idx, local);
  const torch::Tensor mine = (idx >= vocab_start) & (idx < vocab_start + local.size(0));
  const torch::Tensor rows = (idx - vocab_start).masked_fill(mine.logical_not(), 0);
  return tp_reduce(F::embedding(rows, local) * mine.unsqueeze(-1).to(local.scalar_type()), tp);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& targets,
                                           int64_t vocab_start, Communicator& tp) {
  const torch::Tensor logits = local_logits.to(torch::kFloat32);
  const torch::Tensor t = targets.to(torch::kLong);
  // The row maxima over the whole vocabulary keep the exponentials in range; a constant per row,
  // so no gradient flows through them.
  torch::Tensor row_max = std::get<0>(logits.detach().max(1));
  timed([&] { tp.all_reduce(row_max, ReduceOp::max); });
  const torch::Tensor shifted = logits - row_max.unsqueeze(1);
  const torch::Tensor sum_exp = tp_reduce(shifted.exp().sum(1), tp);
  const torch::Tensor mine = (t >= vocab_start) & (t < vocab_start + logits.size(1));
  const torch::Tensor cols = (t - vocab_start).masked_fill(mine.logical_not(), 0);
  const torch::Tensor target_logit =
      tp_reduce(shifted.gather(1, cols.unsqueeze(1)).squeeze(1) * mine.to(torch::kFloat32), tp);
  return (sum_exp.log() - target_logit).mean();
}

namespace {

// One chunk of vocab_parallel_linear_cross_entropy: the sum of its rows' losses and, with
// grad_scale, this rank's logits replaced by grad_scale * (softmax - onehot) over its columns.
torch::Tensor chunk_loss(torch::Tensor& logits, const torch::Tensor& t, int64_t vocab_start, Communicator& tp,
                         double grad_scale) {
  torch::Tensor row_max = std::get<0>(logits.max(1));
  timed([&] { tp.all_reduce(row_max, ReduceOp::max); });
  logits.sub_(row_max.unsqueeze(1));
  const torch::Tensor mine = (t >= vocab_start) & (t < vocab_start + logits.size(1));
  const torch::Tensor cols = (t - vocab_start).masked_fill(mine.logical_not(), 0).unsqueeze(1);
  // [sum of exponentials, the target's shifted logit] per row, both summed over the tp ranks
  torch::Tensor sums = torch::stack({logits.exp().sum(1), logits.gather(1, cols).squeeze(1) * mine.to(logits.dtype())}, 1)
                           .contiguous();
  timed([&] { tp.all_reduce(sums, ReduceOp::sum); });
  const torch::Tensor sum_exp = sums.select(1, 0), target = sums.select(1, 1);
  if (grad_scale != 0) {
    logits.exp_().div_(sum_exp.unsqueeze(1));
    logits.scatter_add_(1, cols, -mine.to(logits.dtype()).unsqueeze(1));
    logits.mul_(grad_scale);
  }
  return (sum_exp.log() - target).sum();
}

class VocabParallelLinearCrossEntropy : public torch::autograd::Function<VocabParallelLinearCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& h, const torch::Tensor& w,
                               const torch::Tensor& t, int64_t vocab_start, int64_t comm, int64_t rows) {
    Communicator& tp = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(comm));
    const int64_t n = h.size(0);
    const double inv_n = 1.0 / static_cast<double>(n);
    const bool grads = ctx != nullptr;
    torch::Tensor grad_h = grads ? torch::empty(h.sizes(), h.options().dtype(torch::kFloat32)) : torch::Tensor();
    torch::Tensor grad_w = grads ? torch::zeros(w.sizes(), w.options().dtype(torch::kFloat32)) : torch::Tensor();
    torch::Tensor total = torch::zeros({}, h.options().dtype(torch::kFloat32));
    for (int64_t start = 0; start < n; start += rows) {
      const int64_t len = std::min(rows, n - start);
      auto hc = h.narrow(0, start, len);
      torch::Tensor logits = torch::matmul(hc, w.t()).to(torch::kFloat32);
      total += chunk_loss(logits, t.narrow(0, start, len), vocab_start, tp, grads ? inv_n : 0.0);
      if (!grads) continue;
      grad_h.narrow(0, start, len).copy_(torch::matmul(logits.to(w.scalar_type()), w));
      grad_w.add_(torch::matmul(logits.t().to(hc.scalar_type()), hc));
    }
    if (grads) {
      ctx->save_for_backward({grad_h, grad_w});
      ctx->saved_data["h_dtype"] = static_cast<int64_t>(h.scalar_type());
      ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    }
    return total * inv_n;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_out) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& g = grad_out[0];
    auto h_dtype = static_cast<torch::ScalarType>(ctx->saved_data["h_dtype"].toInt());
    auto w_dtype = static_cast<torch::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    return {(saved[0] * g).to(h_dtype), (saved[1] * g).to(w_dtype), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& local_weight,
                                                  const torch::Tensor& targets, int64_t vocab_start, Communicator& tp,
                                                  int64_t rows) {
  if (rows <= 0) rows = std::max<int64_t>(1, (int64_t{1} << 26) / std::max<int64_t>(1, local_weight.size(0)));
  const torch::Tensor t = targets.to(torch::kLong);
  if (torch::GradMode::is_enabled() && (hidden.requires_grad() || local_weight.requires_grad()))
    return VocabParallelLinearCrossEntropy::apply(hidden, local_weight, t, vocab_start, handle(tp), rows);
  torch::NoGradGuard no_grad;  // evaluation: the loss alone, chunk by chunk
  return VocabParallelLinearCrossEntropy::forward(nullptr, hidden, local_weight, t, vocab_start, handle(tp), rows);
}

double tp_collective_seconds() { return static_cast<double>(collective_ns.load()) * 1e-9; }

TpSplit tp_split(const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (name == "wte.weight") return TpSplit::rows;
  if (ends_with(".attn.c_attn.weight") || ends_with(".attn.c_attn.bias")) return TpSplit::qkv_rows;
  if (ends_with(".mlp.c_fc.weight") || ends_with(".mlp.c_fc.bias")) return TpSplit::rows;
  if (ends_with(".attn.c_proj.weight") || ends_with(".mlp.c_proj.weight")) return TpSplit::cols;
  return TpSplit::replicated;  // wpe, LayerNorms, the row-parallel layers' biases
}

torch::Tensor tp_shard(const torch::Tensor& whole, TpSplit split, int64_t rank, int64_t size) {
  MPITRAIN_CHECK(rank >= 0 && rank < size, "tp_shard: rank outside the group");
  switch (split) {
    case TpSplit::replicated:
      return whole;
    case TpSplit::rows: {
      const int64_t n = whole.size(0) / size;
      return whole.narrow(0, rank * n, n);
    }
    case TpSplit::cols: {
      const int64_t n = whole.size(1) / size;
      return whole.narrow(1, rank * n, n);
    }
    case TpSplit::qkv_rows: {
      const int64_t e = whole.size(0) / 3, n = e / size;
      return torch::cat({whole.narrow(0, rank * n, n), whole.narrow(0, e + rank * n, n),
                         whole.narrow(0, 2 * e + rank * n, n)});
    }
  }
  return whole;
}

std::vector<TpRun> tp_runs(TpSplit split, c10::IntArrayRef shard, int64_t rank, int64_t size, int64_t begin,
                           int64_t length) {
  int64_t numel = 1;
  for (int64_t d : shard) numel *= d;
  const int64_t inner = shard.size() > 1 ? numel / shard[0] : 1;  // elements per row
  std::vector<TpRun> runs;
  for (int64_t i = begin, end = begin + length; i < end;) {
    int64_t whole = i, n = end - i;
    if (size > 1) switch (split) {
        case TpSplit::replicated:
          break;
        case TpSplit::rows:  // this rank's rows follow the lower ranks'
          whole = rank * numel + i;
          break;
        case TpSplit::qkv_rows: {  // [q_r; k_r; v_r]: block b of this rank sits in block b of the whole
          const int64_t block = numel / 3, b = i / block, within = i % block;
          whole = b * block * size + rank * block + within;
          n = std::min(n, block - within);
          break;
        }
        case TpSplit::cols: {  // row `row`'s inner columns sit after the lower ranks' in that row
          const int64_t row = i / inner, col = i % inner;
          whole = row * inner * size + rank * inner + col;
          n = std::min(n, inner - col);
          break;
        }
      }
    runs.push_back({whole, i - begin, n});
    i += n;
  }
  return runs;
}

std::vector<int64_t> tp_whole_shape(c10::IntArrayRef shard, TpSplit split, int64_t size) {
  std::vector<int64_t> whole = shard.vec();
  if (split == TpSplit::rows || split == TpSplit::qkv_rows) whole[0] *= size;
  if (split == TpSplit::cols) whole[1] *= size;
  return whole;
}

torch::Tensor tp_unshard(const torch::Tensor& shard, TpSplit split, Communicator& tp) {
  const int64_t n = tp.size();
  if (split == TpSplit::replicated || n == 1) return shard;
  const torch::Tensor in = shard.contiguous();
  torch::Tensor all = torch::empty({n * in.numel()}, in.options());
  tp.all_gather(in, all);
  const auto s = in.sizes();
  switch (split) {
    case TpSplit::rows: {  // rank r's rows follow rank r-1's
      std::vector<int64_t> shape = s.vec();
      shape[0] *= n;
      return all.view(shape);
    }
    case TpSplit::cols:  // [n, rows, c] -> [rows, n c]
      return all.view({n, s[0], s[1]}).permute({1, 0, 2}).reshape({s[0], n * s[1]});
    case TpSplit::qkv_rows: {  // each rank's [q_r; k_r; v_r] -> [q_0..q_n; k_0..; v_0..]
      const int64_t rows = s[0] / 3;
      const int64_t inner = in.dim() == 2 ? s[1] : 1;
      torch::Tensor t = all.view({n, 3, rows, inner}).permute({1, 0, 2, 3}).reshape({3 * n * rows, inner});
      return in.dim() == 2 ? t : t.view({3 * n * rows});
    }
    case TpSplit::replicated:
      break;
  }
  return shard;
}

}  // namespace mpitrain
