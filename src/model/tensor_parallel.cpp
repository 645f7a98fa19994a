// Tensor-parallel building blocks (see tensor_parallel.h).
#include "mpitrain/tensor_parallel.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <utility>

#include "mpitrain/error.h"
#include "mpitrain/fused_ops.h"  // apply_autograd_function

namespace mpitrain {

namespace F = torch::nn::functional;

namespace {

std::atomic<int64_t> collective_ns{0}, ep_ns{0};

// Times one collective (or its start, or its wait) into `into`: tp's collective_ns, ep's ep_ns.
template <class Fn>
void timed(Fn&& fn, std::atomic<int64_t>& into = collective_ns) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  into += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
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
    return {summed(g[0], comm_from_handle(ctx->saved_data["comm"].toInt())), torch::Tensor()};
  }
};

class TpReduce : public torch::autograd::Function<TpReduce> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, int64_t comm) {
    return summed(x, comm_from_handle(comm));
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*, torch::autograd::tensor_list g) {
    return {g[0], torch::Tensor()};
  }
};

// An uninitialised tensor of x's row shape and options for the sum of `recv` rows: what an exchange
// of x's rows receives.
torch::Tensor received_rows(const torch::Tensor& x, const std::vector<int64_t>& recv) {
  int64_t rows = 0;
  for (int64_t r : recv) rows += r;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  return torch::empty(shape, x.options());
}

}  // namespace

// An exchange in flight: started by EpPost, finished by EpWait; in backward the gradients go back
// the other way, started by EpWait's backward and finished by EpPost's. The autograd engine runs
// what lies between the two in the forward order (the experts that need no exchange) between the
// two backwards too: it runs the ready function created last first.
struct EpPending : torch::CustomClassHolder {
  std::vector<int64_t> send, recv;
  Communicator* comm = nullptr;
  std::unique_ptr<Work> work;
  torch::Tensor in, out;  // kept alive while the exchange reads and fills them

  void start(const torch::Tensor& x, const std::vector<int64_t>& to, const std::vector<int64_t>& from) {
    out = received_rows(x, from);
    in = x.contiguous();
    timed([&] { work = comm->all_to_all_async(in, to, out, from); }, ep_ns);
  }
  torch::Tensor finish() {
    MPITRAIN_CHECK(work, "expert exchange: finished before it started");
    timed([&] { work->wait(); }, ep_ns);
    work.reset();
    in = torch::Tensor();
    return std::exchange(out, torch::Tensor());
  }
};

namespace {

c10::intrusive_ptr<EpPending> pending_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<EpPending>(ctx->saved_data["pending"].toCapsule());
}

class EpPost : public torch::autograd::Function<EpPost> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const c10::intrusive_ptr<EpPending>& pending) {
    ctx->saved_data["pending"] = c10::IValue::make_capsule(pending);
    pending->start(x, pending->send, pending->recv);
    return pending->out;  // filled by the time EpWait returns it
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list) {
    return {pending_of(ctx)->finish(), torch::Tensor()};
  }
};

class EpWait : public torch::autograd::Function<EpWait> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& started,
                               const c10::intrusive_ptr<EpPending>& pending) {
    ctx->saved_data["pending"] = c10::IValue::make_capsule(pending);
    torch::Tensor out = pending->finish();
    MPITRAIN_CHECK(out.is_same(started), "expert exchange: waited for another exchange");
    return out;
  }
  // Starts the gradients' way back; EpPost's backward receives them. The gradient handed on is a
  // stand-in of the right shape (the exchange reads it until then, and EpPost ignores it).
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    const c10::intrusive_ptr<EpPending> pending = pending_of(ctx);
    pending->start(g[0], pending->recv, pending->send);
    return {g[0], torch::Tensor()};
  }
};

// Ids from `start` in a slice of `n`: which of `ids` fall in it, and their index in it (0 where
// they do not).
std::pair<torch::Tensor, torch::Tensor> in_slice(const torch::Tensor& ids, int64_t start, int64_t n) {
  torch::Tensor mine = (ids >= start) & (ids < start + n);
  torch::Tensor local = (ids - start).masked_fill(mine.logical_not(), 0);
  return {mine, local};
}

// Each row's largest logit over this rank's slice; -inf where the slice holds no class (its rows
// are all vocabulary padding, ModelArgs::vocab_live), which the max over the tp group ignores.
torch::Tensor row_max_of(const torch::Tensor& logits) {
  if (logits.size(1) == 0)
    return torch::full({logits.size(0)}, -std::numeric_limits<float>::infinity(), logits.options());
  return std::get<0>(logits.max(1));
}

// Each row's target logit where this rank's slice holds the target, else 0.
torch::Tensor held_target_logit(const torch::Tensor& logits, const torch::Tensor& mine, const torch::Tensor& cols) {
  if (logits.size(1) == 0) return torch::zeros({logits.size(0)}, logits.options());
  return logits.gather(1, cols.unsqueeze(1)).squeeze(1) * mine.to(logits.scalar_type());
}

}  // namespace

int64_t comm_handle(Communicator& comm) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&comm)); }
Communicator& comm_from_handle(int64_t handle) { return *reinterpret_cast<Communicator*>(static_cast<intptr_t>(handle)); }

torch::Tensor ep_exchange_counts(const torch::Tensor& counts, Communicator& ep) {
  torch::Tensor arriving = torch::empty_like(counts);
  const std::vector<int64_t> ones(static_cast<size_t>(ep.size()), 1);
  timed([&] { ep.all_to_all(counts, ones, arriving, ones); }, ep_ns);
  return arriving;
}

EpExchange::EpExchange(const torch::Tensor& x, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows,
                       Communicator& ep)
    : pending_(c10::make_intrusive<EpPending>()) {
  pending_->send = std::move(send_rows);
  pending_->recv = std::move(recv_rows);
  pending_->comm = &ep;
  started_ = apply_autograd_function<EpPost>(x, pending_);
}

EpExchange::~EpExchange() = default;

torch::Tensor EpExchange::wait() {
  MPITRAIN_CHECK(started_.defined(), "expert exchange: waited for twice");
  return apply_autograd_function<EpWait>(std::exchange(started_, torch::Tensor()), pending_);
}

double ep_collective_seconds() { return static_cast<double>(ep_ns.load()) * 1e-9; }

torch::Tensor tp_copy(const torch::Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return x;
  return apply_autograd_function<TpCopy>(x, comm_handle(tp));
}

torch::Tensor tp_reduce(const torch::Tensor& x, Communicator& tp) {
  if (tp.size() == 1) return x;
  return apply_autograd_function<TpReduce>(x, comm_handle(tp));
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& idx, const torch::Tensor& local, int64_t vocab_start,
                                       Communicator& tp) {
  if (tp.size() == 1) return F::embedding(idx, local);
  const auto [mine, rows] = in_slice(idx, vocab_start, local.size(0));
  return tp_reduce(F::embedding(rows, local) * mine.unsqueeze(-1).to(local.scalar_type()), tp);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& targets,
                                           int64_t vocab_start, Communicator& tp) {
  const torch::Tensor logits = local_logits.to(torch::kFloat32);
  const torch::Tensor t = targets.to(torch::kLong);
  // The row maxima over the whole vocabulary keep the exponentials in range; a constant per row,
  // so no gradient flows through them.
  torch::Tensor row_max = row_max_of(logits.detach());
  timed([&] { tp.all_reduce(row_max, ReduceOp::max); });
  const torch::Tensor shifted = logits - row_max.unsqueeze(1);
  const torch::Tensor sum_exp = tp_reduce(shifted.exp().sum(1), tp);
  const auto [mine, cols] = in_slice(t, vocab_start, logits.size(1));
  const torch::Tensor target_logit = tp_reduce(held_target_logit(shifted, mine, cols), tp);
  return (sum_exp.log() - target_logit).mean();
}

torch::Tensor vocab_parallel_chunk_loss(torch::Tensor& logits, const torch::Tensor& targets, int64_t vocab_start,
                                       Communicator& tp, double grad_scale) {
  torch::Tensor row_max = row_max_of(logits);
  timed([&] { tp.all_reduce(row_max, ReduceOp::max); });
  logits.sub_(row_max.unsqueeze(1));
  const auto [mine, cols] = in_slice(targets.to(torch::kLong), vocab_start, logits.size(1));
  const torch::Tensor held = mine.to(logits.dtype());
  // [sum of exponentials, the target's shifted logit] per row, both summed over the tp ranks
  torch::Tensor sums = torch::stack({logits.exp().sum(1), held_target_logit(logits, mine, cols)}, 1).contiguous();
  timed([&] { tp.all_reduce(sums, ReduceOp::sum); });
  const torch::Tensor sum_exp = sums.select(1, 0), target = sums.select(1, 1);
  if (grad_scale != 0 && logits.size(1) > 0) {
    logits.exp_().div_(sum_exp.unsqueeze(1));
    logits.scatter_add_(1, cols.unsqueeze(1), -held.unsqueeze(1));
    logits.mul_(grad_scale);
  }
  return (sum_exp.log() - target).sum();
}

double tp_collective_seconds() { return static_cast<double>(collective_ns.load()) * 1e-9; }

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

std::vector<int64_t> tp_shard_shape(c10::IntArrayRef whole, TpSplit split, int64_t size) {
  std::vector<int64_t> shard = whole.vec();
  const size_t dim = split == TpSplit::cols ? 1 : 0;
  if (split != TpSplit::replicated) {
    MPITRAIN_CHECK(shard.size() > dim && shard[dim] % (split == TpSplit::qkv_rows ? 3 * size : size) == 0,
                   "tp_shard_shape: a dimension the tp degree does not split");
    shard[dim] /= size;
  }
  return shard;
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
