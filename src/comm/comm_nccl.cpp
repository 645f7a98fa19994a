// The NCCL backend (GPU builds only; compiled when CMake finds CUDA libtorch and NCCL, or RCCL
// for ROCm, whose API is NCCL's).
//
// Bootstrap without a rendezvous server: rank 0 calls ncclGetUniqueId, the 128-byte id travels by
// MPI_Bcast, every rank calls ncclCommInitRank on its own GPU, then an MPI barrier. Collectives
// on CUDA tensors are enqueued on the caller's current stream (blocking API) or on a dedicated
// communication stream (all_reduce_async, for the gradient buckets launched during backward),
// with CUDA events ordering the two streams: nothing here synchronises the host except
// barrier(). Tensors on the CPU (loss sums, RNG states, resume scalars) go through the MPI
// backend over the same communicator.
//
// Failures: every NCCL call is checked, and ncclCommGetAsyncError after each enqueue; an error
// is an Error naming the rank and host (the job then ends by MPI_Abort in main). A collective
// that never completes is caught by the watchdog (watchdog.h), whose abort hook calls
// ncclCommAbort before MPI_Abort.
#if defined(MPITRAIN_WITH_RCCL)
#include <rccl/rccl.h>
#else
#include <nccl.h>
#endif

#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/mpi_native.h"
#include "mpitrain/torch_gpu.h"  // CUDA, or ROCm under CUDA's names
#include "mpitrain/watchdog.h"

namespace mpitrain {

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const torch::Device& device);

namespace {

// "NCCL ncclAllReduce failed on [rank 3 @ node07]: unhandled system error (Connection refused)"
[[noreturn]] void nccl_failure(ncclResult_t r, ncclComm_t comm, const char* what) {
  std::string detail;
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') detail = concat(" (", last, ")");
  }
  throw Error(concat("NCCL ", what, " failed on ", log::identity(), ": ", ncclGetErrorString(r), detail));
}

// ncclInProgress (NCCL 2.14) is not a failure: a non-blocking call still under way. Older NCCL and
// RCCL (ROCm 5's is NCCL 2.13) have no such state.
constexpr bool nccl_ok(ncclResult_t r) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
  return r == ncclSuccess || r == ncclInProgress;
#else
  return r == ncclSuccess;
#endif
}

void nccl_check(ncclResult_t r, ncclComm_t comm, const char* what) {
  if (!nccl_ok(r)) nccl_failure(r, comm, what);
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(concat("CUDA ", what, " failed on ", log::identity(), ": ", cudaGetErrorString(e)));
}

ncclDataType_t nccl_type(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return ncclFloat32;
    case torch::kFloat64: return ncclFloat64;
    case torch::kFloat16: return ncclFloat16;
    case torch::kBFloat16: return ncclBfloat16;
    case torch::kInt32: return ncclInt32;
    case torch::kInt64: return ncclInt64;
    case torch::kUInt8: return ncclUint8;
    case torch::kInt8: return ncclInt8;
    default: throw Error(concat("NCCL communicator: unsupported dtype ", t.scalar_type()));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;  // NCCL >= 2.10
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

// Every NCCL communicator alive in this process (one per mesh group), so that the watchdog's abort
// hook aborts all of them: a stuck collective in any group must not keep the process alive.
struct LiveComms {
  std::mutex mu;
  std::vector<ncclComm_t> comms;
};
LiveComms& live_comms() {
  static LiveComms live;
  return live;
}

void register_comm(ncclComm_t c) {
  auto& live = live_comms();
  std::lock_guard<std::mutex> lock(live.mu);
  live.comms.push_back(c);
  Watchdog::on_abort([] {  // the same hook every time: it aborts whatever is registered then
    auto& l = live_comms();
    std::lock_guard<std::mutex> g(l.mu);
    for (ncclComm_t x : l.comms) ncclCommAbort(x);
    l.comms.clear();
  });
}

// True when `c` was still registered (not aborted): then the caller destroys it.
bool unregister_comm(ncclComm_t c) {
  auto& live = live_comms();
  std::lock_guard<std::mutex> lock(live.mu);
  for (auto it = live.comms.begin(); it != live.comms.end(); ++it)
    if (*it == c) {
      live.comms.erase(it);
      return true;
    }
  return false;
}

// An event recorded on the communication stream; wait() orders the caller's current stream
// after it (the host does not wait).
class NcclWork final : public Work {
 public:
  NcclWork(cudaEvent_t done, int device) : done_(done), device_(device) {}
  ~NcclWork() override { (void)cudaEventDestroy(done_); }  // HIP's calls are [[nodiscard]]
  void wait() override {
    cuda_check(cudaStreamWaitEvent(gpu::current_stream(device_).stream(), done_, 0),
               "cudaStreamWaitEvent");
  }

 private:
  cudaEvent_t done_;
  int device_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm mpi, const torch::Device& device)
      : mpi_(mpi), device_(device.index()), host_(make_mpi_communicator(from_mpi(mpi))) {
    rank_ = host_->rank();
    size_ = host_->size();
    gpu::DeviceGuard guard(static_cast<c10::DeviceIndex>(device_));
    // At log level debug NCCL itself says which interface and transport it chose.
    if (log::enabled(log::Level::debug) && std::getenv("NCCL_DEBUG") == nullptr) {
      setenv("NCCL_DEBUG", "INFO", 0);
      setenv("NCCL_DEBUG_SUBSYS", "INIT,NET", 0);
    }

    ncclUniqueId id;
    if (rank_ == 0) nccl_check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
    {
      Watchdog::Scope watch("MPI_Bcast(NCCL unique id)");
      MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, mpi_));
    }
    {
      Watchdog::Scope watch("ncclCommInitRank");
      nccl_check(ncclCommInitRank(&comm_, size_, id, rank_), nullptr, "ncclCommInitRank");
    }
    register_comm(comm_);
    stream_ = std::make_unique<gpu::Stream>(
        gpu::stream_from_pool(/*high_priority=*/true, static_cast<c10::DeviceIndex>(device_)));
    {
      Watchdog::Scope watch("barrier(after ncclCommInitRank)");
      MPI_CHECK(MPI_Barrier(mpi_));
    }
    int version = 0;
    ncclGetVersion(&version);
    const char* ifname = std::getenv("NCCL_SOCKET_IFNAME");
    log::info(concat("NCCL ", version / 10000, ".", (version / 100) % 100, ".", version % 100, ": ", size_,
                     " ranks; communicator ready"));
    log::debug(concat("NCCL_SOCKET_IFNAME=", ifname ? ifname : "(unset: NCCL's own choice)",
                      " (NCCL's INIT/NET lines above name the interface it uses)"));
  }

  ~NcclCommunicator() override {
    if (unregister_comm(comm_)) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  uint64_t reduced_bytes() const override { return Communicator::reduced_bytes() + host_->reduced_bytes(); }

  void all_reduce(torch::Tensor& t, ReduceOp op) override {
    if (!on_device(t)) return host_->all_reduce(t, op);
    count_reduced(t);
    Watchdog::Scope watch("ncclAllReduce");
    nccl_check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t), nccl_op(op), comm_,
                             current()),
               comm_, "ncclAllReduce");
    check_async_errors();
  }

  void broadcast(torch::Tensor& t, int root) override {
    if (!on_device(t)) return host_->broadcast(t, root);
    Watchdog::Scope watch("ncclBroadcast");
    nccl_check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t), root, comm_, current()),
               comm_, "ncclBroadcast");
    check_async_errors();
  }

  void all_gather(const torch::Tensor& in, torch::Tensor& out) override {
    if (!in.is_cuda() || !on_device(out)) return host_->all_gather(in, out);
    check_gather_sizes("all_gather", "out", out, in, size_);
    torch::Tensor src = in.contiguous();
    Watchdog::Scope watch("ncclAllGather");
    nccl_check(ncclAllGather(src.data_ptr(), out.data_ptr(), src.numel(), nccl_type(src), comm_, current()),
               comm_, "ncclAllGather");
    check_async_errors();
  }

  void reduce_scatter(const torch::Tensor& in, torch::Tensor& out, ReduceOp op) override {
    if (!in.is_cuda() || !on_device(out)) return host_->reduce_scatter(in, out, op);
    count_reduced(in);
    check_gather_sizes("reduce_scatter", "in", in, out, size_);
    torch::Tensor src = in.contiguous();
    Watchdog::Scope watch("ncclReduceScatter");
    nccl_check(ncclReduceScatter(src.data_ptr(), out.data_ptr(), out.numel(), nccl_type(out), nccl_op(op), comm_,
                                 current()),
               comm_, "ncclReduceScatter");
    check_async_errors();
  }

  // One grouped ncclSend / ncclRecv per peer, in bytes, on the caller's stream.
  void all_to_all(const torch::Tensor& in, const std::vector<int64_t>& in_rows, torch::Tensor& out,
                  const std::vector<int64_t>& out_rows) override {
    if (!in.is_cuda() || !on_device(out)) return host_->all_to_all(in, in_rows, out, out_rows);
    const int64_t row = check_all_to_all(in, in_rows, out, out_rows, size_);
    Watchdog::Scope watch("ncclSend/ncclRecv(all_to_all)");
    send_recv_rows(in, in_rows, out, out_rows, row, current());
    check_async_errors();
  }

  // On the communication stream, so the experts that need no exchange run meanwhile.
  std::unique_ptr<Work> all_to_all_async(const torch::Tensor& in, const std::vector<int64_t>& in_rows,
                                         torch::Tensor& out, const std::vector<int64_t>& out_rows) override {
    if (!in.is_cuda() || !on_device(out)) return host_->all_to_all_async(in, in_rows, out, out_rows);
    const int64_t row = check_all_to_all(in, in_rows, out, out_rows, size_);
    return on_comm_stream({in, out}, [&](cudaStream_t s) { send_recv_rows(in, in_rows, out, out_rows, row, s); });
  }

  // On the communication stream: each pipeline channel is a communicator of its own two ranks,
  // so its transfers queue on a stream of their own (PipeChannels).
  std::unique_ptr<Work> send_async(const torch::Tensor& t, int peer) override {
    if (!on_device(t)) return host_->send_async(t, peer);
    return on_comm_stream({t}, [&](cudaStream_t s) {
      nccl_check(ncclSend(t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t), peer, comm_, s), comm_, "ncclSend");
    });
  }

  std::unique_ptr<Work> recv_async(torch::Tensor& t, int peer) override {
    if (!on_device(t)) return host_->recv_async(t, peer);
    return on_comm_stream({t}, [&](cudaStream_t s) {
      nccl_check(ncclRecv(t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t), peer, comm_, s), comm_, "ncclRecv");
    });
  }

  // Waits for this rank's GPU work (under the watchdog: a stuck NCCL kernel shows here), then
  // for every rank.
  void barrier() override {
    {
      Watchdog::Scope watch("cudaStreamSynchronize(barrier)");
      cuda_check(cudaStreamSynchronize(current()), "cudaStreamSynchronize");
      cuda_check(cudaStreamSynchronize(stream_->stream()), "cudaStreamSynchronize");
    }
    check_async_errors();
    host_->barrier();
  }

  std::unique_ptr<Work> all_reduce_async(torch::Tensor& t, ReduceOp op) override {
    if (!on_device(t)) return host_->all_reduce_async(t, op);
    count_reduced(t);
    return on_comm_stream({t}, [&](cudaStream_t s) {
      nccl_check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t), nccl_op(op), comm_, s), comm_,
                 "ncclAllReduce");
    });
  }

  std::unique_ptr<Work> reduce_scatter_async(const torch::Tensor& in, torch::Tensor& out, ReduceOp op) override {
    if (!in.is_cuda() || !on_device(out)) return host_->reduce_scatter_async(in, out, op);
    check_gather_sizes("reduce_scatter", "in", in, out, size_);
    on_device(in);
    count_reduced(in);
    return on_comm_stream({in, out}, [&](cudaStream_t s) {
      nccl_check(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(out), nccl_op(op), comm_, s),
                 comm_, "ncclReduceScatter");
    });
  }

  std::unique_ptr<Work> all_gather_async(const torch::Tensor& in, torch::Tensor& out) override {
    if (!in.is_cuda() || !on_device(out)) return host_->all_gather_async(in, out);
    check_gather_sizes("all_gather", "out", out, in, size_);
    on_device(in);
    return on_comm_stream({in, out}, [&](cudaStream_t s) {
      nccl_check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in), comm_, s), comm_,
                 "ncclAllGather");
    });
  }

  // Enqueues `collective` on the communication stream after the work the caller's stream has
  // queued so far; the returned Work orders the caller's stream after it.
  template <class Fn>
  std::unique_ptr<Work> on_comm_stream(std::initializer_list<torch::Tensor> tensors, Fn&& collective) {
    cudaEvent_t ready = nullptr, done = nullptr;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    auto work = std::make_unique<NcclWork>(done, device_);
    // The communication stream starts after everything the compute stream has queued so far
    // (the bucket was just filled there) ...
    cuda_check(cudaEventRecord(ready, current()), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_->stream(), ready, 0), "cudaStreamWaitEvent");
    (void)cudaEventDestroy(ready);  // released once recorded work completes
    // ... and the caching allocator must not hand the tensors' memory to the compute stream while
    // NCCL may still use it.
    for (const auto& t : tensors) gpu::record_stream(t.storage().data_ptr(), *stream_);
    // No watchdog scope here: this runs on autograd's thread (the watchdog's scopes belong to
    // the main thread), and enqueueing does not wait; a bucket that never completes is caught
    // where the main thread synchronises (the logged loss, barrier()).
    collective(stream_->stream());
    cuda_check(cudaEventRecord(done, stream_->stream()), "cudaEventRecord");
    check_async_errors();
    return work;
  }

  // all_to_all's rows as one group of ncclSend/ncclRecv on stream `s` (`row` bytes each).
  void send_recv_rows(const torch::Tensor& in, const std::vector<int64_t>& in_rows, torch::Tensor& out,
                      const std::vector<int64_t>& out_rows, int64_t row, cudaStream_t s) {
    const char* src = static_cast<const char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    nccl_check(ncclGroupStart(), comm_, "ncclGroupStart");
    int64_t so = 0, ro = 0;
    for (int q = 0; q < size_; so += in_rows[q], ro += out_rows[q], ++q) {
      if (in_rows[q] > 0)
        nccl_check(ncclSend(src + so * row, static_cast<size_t>(in_rows[q] * row), ncclUint8, q, comm_, s), comm_,
                   "ncclSend");
      if (out_rows[q] > 0)
        nccl_check(ncclRecv(dst + ro * row, static_cast<size_t>(out_rows[q] * row), ncclUint8, q, comm_, s), comm_,
                   "ncclRecv");
    }
    nccl_check(ncclGroupEnd(), comm_, "ncclGroupEnd");
  }

  void check_async_errors() override {
    ncclResult_t r = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm_, &r), comm_, "ncclCommGetAsyncError");
    if (!nccl_ok(r)) nccl_failure(r, comm_, "collective (asynchronous error)");
  }

 private:
  bool on_device(const torch::Tensor& t) const {
    if (!t.is_cuda()) return false;
    if (t.get_device() != device_)
      throw Error(concat("NCCL communicator on cuda:", device_, " got a tensor on cuda:", t.get_device()));
    if (!t.is_contiguous()) throw Error("NCCL communicator: tensors must be contiguous");
    return true;
  }
  cudaStream_t current() const {
    return gpu::current_stream(static_cast<c10::DeviceIndex>(device_)).stream();
  }

  MPI_Comm mpi_;
  int device_;
  std::unique_ptr<Communicator> host_;
  int rank_ = 0;
  int size_ = 1;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<gpu::Stream> stream_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const torch::Device& device) {
  if (!device.is_cuda() || !device.has_index())
    throw Error("make_nccl_communicator: needs a CUDA device with an index");
  return std::make_unique<NcclCommunicator>(comm, device);
}

}  // namespace mpitrain
