// The MPI communicator backend: CPU tensors reduced in place with MPI; tensors on a device are
// staged through a page-locked host copy (ranks sharing a GPU; GPU runs otherwise use NCCL).
#include <climits>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/mpi_native.h"
#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {
namespace {

// ---- 16-bit floats: MPI has no bf16/fp16 type, nor a sum over them ---------------------------
// Each gets its own 2-byte datatype and a commutative user-defined sum that adds in fp32 and
// rounds to nearest-even once per pairwise step of MPI's reduction (what NCCL does for them too).
// Gradient compression (comm.grad_dtype) sends buckets in these types.
template <class Half>
void sum_halves(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const Half*>(in);
  auto* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Half(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

struct HalfTypes {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL, fp16 = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum = MPI_OP_NULL, fp16_sum = MPI_OP_NULL;
  HalfTypes() {
    for (MPI_Datatype* t : {&bf16, &fp16}) {
      MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, t));
      MPI_CHECK(MPI_Type_commit(t));
    }
    MPI_CHECK(MPI_Op_create(&sum_halves<c10::BFloat16>, /*commute=*/1, &bf16_sum));
    MPI_CHECK(MPI_Op_create(&sum_halves<c10::Half>, /*commute=*/1, &fp16_sum));
  }
};

const HalfTypes& half_types() {
  static const HalfTypes types;  // after MPI_Init: the first 16-bit collective creates them
  return types;
}

bool is_half(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf; }

MPI_Datatype mpi_type(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kBFloat16: return half_types().bf16;
    case torch::kHalf: return half_types().fp16;
    case torch::kFloat32: return MPI_FLOAT;
    case torch::kFloat64: return MPI_DOUBLE;
    case torch::kInt64: return MPI_INT64_T;
    case torch::kInt32: return MPI_INT32_T;
    case torch::kUInt8: return MPI_UINT8_T;
    case torch::kInt8: return MPI_INT8_T;
    default:
      throw Error(concat("MPI communicator: unsupported dtype ", t.scalar_type()));
  }
}

MPI_Op mpi_op(ReduceOp op, const torch::Tensor& t) {
  if (is_half(t)) {
    if (op != ReduceOp::sum && op != ReduceOp::avg)
      throw Error(concat("MPI communicator: only sum and avg over ", t.scalar_type(), " tensors"));
    return t.scalar_type() == torch::kBFloat16 ? half_types().bf16_sum : half_types().fp16_sum;
  }
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_SUM;
}

// A contiguous host tensor holding t's data (t itself when it is one). A device tensor goes into
// page-locked memory from libtorch's caching host allocator (reused from step to step), which the
// copy engine fills directly; a fresh pageable copy (to(kCPU)) first faults its pages in and goes
// through the driver's bounce buffer. Two ranks sharing an H100 with pageable copies all-reduced
// a 4.7 GB gradient at 0.51 GB/s (bench/RESULTS.md, the second lease).
torch::Tensor host_copy(const torch::Tensor& t) {
  if (t.is_cpu()) return t.contiguous();
  torch::Tensor h = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  h.copy_(t);
  return h;
}

// An uninitialised host tensor for a collective's result that goes to `t` (page-locked when t is on
// a device, as above).
torch::Tensor host_output(const torch::Tensor& t, const torch::TensorOptions& options) {
  return torch::empty(t.sizes(), options.device(torch::kCPU).pinned_memory(!t.is_cpu()));
}

// MPI counts are int: large tensors go in pieces.
constexpr int64_t kMaxCount = INT_MAX / 2;

class DoneWork final : public Work {
 public:
  void wait() override {}
};

// MPI_Ialltoallv's counts and displacements (bytes), which must outlive the call.
struct AllToAllCounts {
  explicit AllToAllCounts(int size) : sc(size), sd(size), rc(size), rd(size) {}
  std::vector<int> sc, sd, rc, rd;
};

// A non-blocking collective whose result lands in a contiguous host buffer (the tensor itself, or
// a staging copy of a device tensor that wait() copies back); `input` keeps a staged input alive.
// `what` names it in watchdog messages (a string literal).
class MpiWork final : public Work {
 public:
  MpiWork(const char* what, torch::Tensor host, torch::Tensor target, ReduceOp op, int size, torch::Tensor input = {})
      : what_(what), host_(std::move(host)), target_(std::move(target)), input_(std::move(input)), op_(op),
        size_(size) {}
  ~MpiWork() override {
    try {
      wait();
    } catch (...) {  // only reachable when an MPI error is already ending the job
    }
  }
  std::vector<MPI_Request>& requests() { return requests_; }
  void keep(std::unique_ptr<AllToAllCounts> counts) { counts_ = std::move(counts); }

  void progress() override {
    if (done_) return;
    int flag = 0;  // completed requests become MPI_REQUEST_NULL, which wait()'s MPI_Waitall skips
    MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
  }

  void wait() override {
    if (done_) return;
    done_ = true;
    {
      Watchdog::Scope watch(what_);
      MPI_CHECK(MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE));
    }
    if (op_ == ReduceOp::avg) host_.div_(size_);
    if (target_.defined()) target_.copy_(host_);
  }

 private:
  const char* what_;
  torch::Tensor host_, target_, input_;
  ReduceOp op_;
  int size_;
  std::vector<MPI_Request> requests_;
  std::unique_ptr<AllToAllCounts> counts_;
  bool done_ = false;
};

// A point-to-point transfer in flight (send_async, recv_async) on the contiguous host buffer `host`;
// a receive staged for a device tensor lands in `target` in wait(). A receive never waited for is
// cancelled when it goes (an error on the way), before its buffer does; a send is completed.
class MpiP2pWork final : public Work {
 public:
  MpiP2pWork(torch::Tensor host, torch::Tensor target, bool receive)
      : host_(std::move(host)), target_(std::move(target)), receive_(receive) {}
  ~MpiP2pWork() override {
    if (receive_) {
      mpi::cancel(request_);
      return;
    }
    try {
      wait();
    } catch (...) {  // only reachable when an MPI error is already ending the job
    }
  }
  MpiRequest& request() { return request_; }
  size_t bytes() const { return host_.nbytes(); }

  void wait() override {
    Watchdog::Scope watch(receive_ ? "receive from a neighbouring stage" : "send to a neighbouring stage");
    if (receive_) {
      if (request_ == mpi::null_request()) return;
      mpi::wait_received(request_, bytes());
      if (target_.defined()) target_.copy_(host_);
    } else {
      mpi::wait(request_);
    }
  }

 private:
  torch::Tensor host_, target_;
  bool receive_;
  MpiRequest request_ = mpi::null_request();
};

// The one tag of send_async / recv_async: MPI's order between two ranks is the messages' order.
constexpr int kP2pTag = 0;

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_reduce(torch::Tensor& t, ReduceOp op) override {
    count_reduced(t);
    Watchdog::Scope watch("all_reduce");
    with_host_copy(t, /*copy_back=*/true, [&](torch::Tensor& h) {
      const MPI_Datatype type = mpi_type(h);
      const size_t elem = h.element_size();
      char* base = static_cast<char*>(h.data_ptr());
      for (int64_t off = 0; off < h.numel(); off += kMaxCount) {
        int count = static_cast<int>(std::min(kMaxCount, h.numel() - off));
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, base + off * elem, count, type, mpi_op(op, h), comm_));
      }
      if (op == ReduceOp::avg) {
        if (!h.is_floating_point()) throw Error("all_reduce avg needs a floating-point tensor");
        h.div_(size_);
      }
    });
  }

  void broadcast(torch::Tensor& t, int root) override {
    Watchdog::Scope watch("broadcast");
    with_host_copy(t, /*copy_back=*/rank_ != root, [&](torch::Tensor& h) {
      const MPI_Datatype type = mpi_type(h);
      const size_t elem = h.element_size();
      char* base = static_cast<char*>(h.data_ptr());
      for (int64_t off = 0; off < h.numel(); off += kMaxCount) {
        int count = static_cast<int>(std::min(kMaxCount, h.numel() - off));
        MPI_CHECK(MPI_Bcast(base + off * elem, count, type, root, comm_));
      }
    });
  }

  void all_gather(const torch::Tensor& in, torch::Tensor& out) override {
    check_gather_sizes("all_gather", "out", out, in, size_);
    if (in.numel() > kMaxCount) throw Error("all_gather: input too large for one MPI call");
    Watchdog::Scope watch("all_gather");
    torch::Tensor hin = host_copy(in);
    with_host_copy(out, /*copy_back=*/true, [&](torch::Tensor& hout) {
      const int count = static_cast<int>(hin.numel());
      MPI_CHECK(MPI_Allgather(hin.data_ptr(), count, mpi_type(hin), hout.data_ptr(), count,
                              mpi_type(hout), comm_));
    });
  }

  void reduce_scatter(const torch::Tensor& in, torch::Tensor& out, ReduceOp op) override {
    reduce_scatter_async(in, out, op)->wait();
  }

  void all_to_all(const torch::Tensor& in, const std::vector<int64_t>& in_rows, torch::Tensor& out,
                  const std::vector<int64_t>& out_rows) override {
    all_to_all_async(in, in_rows, out, out_rows)->wait();
  }

  void barrier() override {
    Watchdog::Scope watch("barrier");
    MPI_CHECK(MPI_Barrier(comm_));
  }

  std::unique_ptr<Work> all_reduce_async(torch::Tensor& t, ReduceOp op) override {
    if (op == ReduceOp::avg && !t.is_floating_point())
      throw Error("all_reduce avg needs a floating-point tensor");
    count_reduced(t);
    const bool staged = !(t.is_cpu() && t.is_contiguous());
    torch::Tensor host = staged ? host_copy(t) : t;
    auto work = std::make_unique<MpiWork>("all_reduce(bucket)", host, staged ? t : torch::Tensor(), op, size_);
    const MPI_Datatype type = mpi_type(host);
    const size_t elem = host.element_size();
    char* base = static_cast<char*>(host.data_ptr());
    for (int64_t off = 0; off < host.numel(); off += kMaxCount) {
      int count = static_cast<int>(std::min(kMaxCount, host.numel() - off));
      work->requests().emplace_back();
      MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, base + off * elem, count, type, mpi_op(op, host), comm_,
                               &work->requests().back()));
    }
    return work;
  }

  std::unique_ptr<Work> reduce_scatter_async(const torch::Tensor& in, torch::Tensor& out, ReduceOp op) override {
    check_gather_sizes("reduce_scatter", "in", in, out, size_);
    if (out.numel() > kMaxCount) throw Error("reduce_scatter: output too large for one MPI call");
    if (op == ReduceOp::avg && !out.is_floating_point())
      throw Error("reduce_scatter avg needs a floating-point tensor");
    count_reduced(in);
    torch::Tensor hin = host_copy(in);
    const bool staged = !(out.is_cpu() && out.is_contiguous());
    torch::Tensor hout = staged ? host_output(out, hin.options()) : out;
    auto work = std::make_unique<MpiWork>("reduce_scatter(bucket)", hout, staged ? out : torch::Tensor(), op, size_, hin);
    work->requests().emplace_back();
    MPI_CHECK(MPI_Ireduce_scatter_block(hin.data_ptr(), hout.data_ptr(), static_cast<int>(out.numel()),
                                        mpi_type(hin), mpi_op(op, hin), comm_, &work->requests().back()));
    return work;
  }

  // MPI_Ialltoallv in bytes (any dtype): counts and displacements must fit MPI's int.
  std::unique_ptr<Work> all_to_all_async(const torch::Tensor& in, const std::vector<int64_t>& in_rows,
                                         torch::Tensor& out, const std::vector<int64_t>& out_rows) override {
    const int64_t row = check_all_to_all(in, in_rows, out, out_rows, size_);
    auto counts = std::make_unique<AllToAllCounts>(size_);
    int64_t so = 0, ro = 0;
    for (int q = 0; q < size_; ++q) {
      if ((so + in_rows[q]) * row > INT_MAX || (ro + out_rows[q]) * row > INT_MAX)
        throw Error("all_to_all: more than 2 GiB for one MPI call");
      counts->sc[q] = static_cast<int>(in_rows[q] * row), counts->sd[q] = static_cast<int>(so * row);
      counts->rc[q] = static_cast<int>(out_rows[q] * row), counts->rd[q] = static_cast<int>(ro * row);
      so += in_rows[q], ro += out_rows[q];
    }
    torch::Tensor hin = host_copy(in);
    const bool staged = !(out.is_cpu() && out.is_contiguous());
    torch::Tensor hout = staged ? host_output(out, hin.options()) : out;
    auto work = std::make_unique<MpiWork>("all_to_all", hout, staged ? out : torch::Tensor(), ReduceOp::sum, size_, hin);
    work->requests().emplace_back();
    MPI_CHECK(MPI_Ialltoallv(hin.data_ptr(), counts->sc.data(), counts->sd.data(), MPI_BYTE, hout.data_ptr(),
                             counts->rc.data(), counts->rd.data(), MPI_BYTE, comm_, &work->requests().back()));
    work->keep(std::move(counts));  // MPI may read the arrays until the request completes
    return work;
  }

  std::unique_ptr<Work> send_async(const torch::Tensor& t, int peer) override {
    torch::Tensor host = t.is_cpu() && t.is_contiguous() ? t : t.contiguous().cpu();
    auto work = std::make_unique<MpiP2pWork>(host, torch::Tensor(), false);
    work->request() = mpi::isend(host.data_ptr(), work->bytes(), peer, kP2pTag, from_mpi(comm_));
    return work;
  }

  std::unique_ptr<Work> recv_async(torch::Tensor& t, int peer) override {
    MPITRAIN_CHECK(t.is_contiguous(), "recv_async: a contiguous tensor");
    const bool staged = !t.is_cpu();
    torch::Tensor host = staged ? host_output(t, t.options()) : t;
    auto work = std::make_unique<MpiP2pWork>(host, staged ? t : torch::Tensor(), true);
    work->request() = mpi::irecv(host.data_ptr(), work->bytes(), peer, kP2pTag, from_mpi(comm_));
    return work;
  }

  std::unique_ptr<Work> all_gather_async(const torch::Tensor& in, torch::Tensor& out) override {
    check_gather_sizes("all_gather", "out", out, in, size_);
    if (in.numel() > kMaxCount) throw Error("all_gather: input too large for one MPI call");
    torch::Tensor hin = host_copy(in);
    const bool staged = !(out.is_cpu() && out.is_contiguous());
    torch::Tensor hout = staged ? host_output(out, hin.options()) : out;
    auto work = std::make_unique<MpiWork>("all_gather(prefetch)", hout, staged ? out : torch::Tensor(), ReduceOp::sum,
                                          size_, hin);
    work->requests().emplace_back();
    const int count = static_cast<int>(hin.numel());
    MPI_CHECK(MPI_Iallgather(hin.data_ptr(), count, mpi_type(hin), hout.data_ptr(), count, mpi_type(hout), comm_,
                             &work->requests().back()));
    return work;
  }

 private:
  // Runs fn on a contiguous CPU tensor holding t's data; copies the result back into t when t
  // was not already such a tensor.
  template <class Fn>
  void with_host_copy(torch::Tensor& t, bool copy_back, Fn&& fn) {
    if (t.is_cpu() && t.is_contiguous()) {
      fn(t);
      return;
    }
    torch::Tensor h = host_copy(t);
    fn(h);
    if (copy_back) t.copy_(h);
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::unique_ptr<Work> Communicator::all_reduce_async(torch::Tensor& t, ReduceOp op) {
  all_reduce(t, op);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> Communicator::all_gather_async(const torch::Tensor& in, torch::Tensor& out) {
  all_gather(in, out);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> Communicator::all_to_all_async(const torch::Tensor& in, const std::vector<int64_t>& in_rows,
                                                     torch::Tensor& out, const std::vector<int64_t>& out_rows) {
  all_to_all(in, in_rows, out, out_rows);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> Communicator::reduce_scatter_async(const torch::Tensor& in, torch::Tensor& out, ReduceOp op) {
  reduce_scatter(in, out, op);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> Communicator::send_async(const torch::Tensor&, int) {
  throw Error(concat("the ", name(), " communicator has no point-to-point send"));
}

std::unique_ptr<Work> Communicator::recv_async(torch::Tensor&, int) {
  throw Error(concat("the ", name(), " communicator has no point-to-point receive"));
}

void check_gather_sizes(const char* op, const char* whole_name, const torch::Tensor& whole,
                        const torch::Tensor& part, int size) {
  if (whole.numel() != part.numel() * size || whole.scalar_type() != part.scalar_type())
    throw Error(concat(op, ": ", whole_name, " must hold ", size, " x ", part.numel(), " elements of ",
                       part.scalar_type()));
}

int64_t check_all_to_all(const torch::Tensor& in, const std::vector<int64_t>& in_rows, const torch::Tensor& out,
                         const std::vector<int64_t>& out_rows, int size) {
  if (static_cast<int>(in_rows.size()) != size || static_cast<int>(out_rows.size()) != size)
    throw Error(concat("all_to_all: one row count per rank (", size, ")"));
  int64_t n_in = 0, n_out = 0;
  for (int q = 0; q < size; ++q) {
    if (in_rows[q] < 0 || out_rows[q] < 0) throw Error("all_to_all: a negative row count");
    n_in += in_rows[q], n_out += out_rows[q];
  }
  const int64_t width = in.dim() == 0 || in.size(0) == 0 ? in.numel() : in.numel() / in.size(0);
  const int64_t out_width = out.dim() == 0 || out.size(0) == 0 ? out.numel() : out.numel() / out.size(0);
  if (in.dim() < 1 || out.dim() < 1 || in.size(0) != n_in || out.size(0) != n_out ||
      in.scalar_type() != out.scalar_type() || !in.is_contiguous() || !out.is_contiguous() ||
      (n_in > 0 && n_out > 0 && width != out_width))
    throw Error(concat("all_to_all: in [", in.sizes(), "] and out [", out.sizes(), "] must be contiguous ",
                       "tensors of one dtype and row width holding ", n_in, " and ", n_out, " rows"));
  return (n_in > 0 ? width : out_width) * static_cast<int64_t>(in.element_size());
}

std::unique_ptr<Communicator> make_mpi_communicator(MpiComm comm) {
  return std::make_unique<MpiCommunicator>(to_mpi(comm));
}

#ifdef MPITRAIN_WITH_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const torch::Device& device);  // comm_nccl.cpp
bool have_nccl() { return true; }
#else
bool have_nccl() { return false; }
#endif

std::unique_ptr<Communicator> make_communicator(const std::string& backend, MpiComm comm,
                                                const torch::Device& device) {
  (void)device;  // CPU builds: only the MPI backend exists
  if (backend == "mpi") return make_mpi_communicator(comm);
  if (backend == "auto") {
#ifdef MPITRAIN_WITH_NCCL
    if (device.is_cuda()) return make_nccl_communicator(to_mpi(comm), device);
#endif
    return make_mpi_communicator(comm);
  }
  if (backend == "nccl") {
#ifdef MPITRAIN_WITH_NCCL
    if (!device.is_cuda())
      throw UsageError("comm.backend: 'nccl' needs CUDA devices, but this run trains on the CPU (train.device)");
    return make_nccl_communicator(to_mpi(comm), device);
#else
    throw UsageError("comm.backend: 'nccl' needs a GPU build of mpitrain (this build has no NCCL)");
#endif
  }
  throw UsageError("comm.backend: unknown backend '" + backend + "'");
}

}  // namespace mpitrain
