// Collectives over a fixed group of ranks, on torch tensors.
//
// Contract: every rank of the group calls every method in the same order, with tensors of the
// same shape and dtype. Operations a backend cannot do throw Error; none silently does nothing.
// Reductions take fp32/fp64/integer tensors, and bf16/fp16 ones for sum and avg (MPI: a
// user-defined sum that adds in fp32 and rounds once per step; NCCL: its own).
// Backends: MPI (CPU tensors; device tensors are staged through host memory) and, in GPU
// builds, NCCL (bootstrapped over MPI: rank 0's unique id travels by MPI_Bcast).
#pragma once

#include "mpitrain/mpi_ops.h"
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace mpitrain {

// A collective in flight (Communicator::all_reduce_async). wait() makes its result visible to
// the work that follows: MPI waits for the request on the host; NCCL makes the caller's current
// CUDA stream wait for the communication stream (no host synchronisation).
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // Lets the collective advance without waiting for it (MPI: MPI_Testall, since MPI moves a
  // non-blocking collective on only inside MPI calls); a no-op where the backend moves it itself.
  // Not concurrent with wait() on the same Work.
  virtual void progress() {}
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "mpi", "nccl"
  virtual void all_reduce(torch::Tensor& t, ReduceOp op) = 0;  // in place
  virtual void broadcast(torch::Tensor& t, int root) = 0;       // in place
  // out holds size() * in.numel() elements; rank r's `in` lands at out's r-th slice of dim 0
  // (out.view({size(), -1})[r]).
  virtual void all_gather(const torch::Tensor& in, torch::Tensor& out) = 0;
  // The reverse: `in` holds size() * out.numel() elements; out = the reduction over all ranks of
  // their `in`'s r-th slice of dim 0 (in.view({size(), -1})[r]) on rank r (ZeRO-1's gradients).
  virtual void reduce_scatter(const torch::Tensor& in, torch::Tensor& out, ReduceOp op) = 0;
  virtual void barrier() = 0;
  // Rows to every rank and from every rank (expert parallelism's token dispatch): `in` holds
  // sum(in_rows) rows along dim 0, the first in_rows[0] for rank 0, the next in_rows[1] for rank 1,
  // ...; `out` (the same dtype and row width) receives sum(out_rows) rows, out_rows[q] of them from
  // rank q, in rank order. in_rows[q] on this rank must be out_rows[this rank] on rank q.
  virtual void all_to_all(const torch::Tensor& in, const std::vector<int64_t>& in_rows, torch::Tensor& out,
                          const std::vector<int64_t>& out_rows) = 0;

  // Starts an in-place all-reduce of `t` and returns at once; `t` must stay alive and unchanged
  // until wait(). Every rank must start async collectives in the same order. The default runs
  // the blocking all_reduce (already complete when returned).
  virtual std::unique_ptr<Work> all_reduce_async(torch::Tensor& t, ReduceOp op);
  // The same for reduce_scatter: `in` and `out` stay alive and `in` unchanged until wait().
  virtual std::unique_ptr<Work> reduce_scatter_async(const torch::Tensor& in, torch::Tensor& out, ReduceOp op);
  // The same for all_gather (ZeRO-3's prefetch): `in` and `out` stay alive, `in` unchanged and
  // `out` unread until wait().
  virtual std::unique_ptr<Work> all_gather_async(const torch::Tensor& in, torch::Tensor& out);
  // The same for all_to_all (expert parallelism's dispatch, overlapped with the experts that need
  // no exchange): `in` and `out` stay alive, `in` unchanged and `out` unread until wait().
  virtual std::unique_ptr<Work> all_to_all_async(const torch::Tensor& in, const std::vector<int64_t>& in_rows,
                                                 torch::Tensor& out, const std::vector<int64_t>& out_rows);
  // Point to point (the pipeline's stage transfers, PipeChannels): starts sending `t` to rank
  // `peer`, or receiving into `t` (contiguous, the size the peer sends) from it, and returns at
  // once; `t` stays alive and, sending, unchanged, receiving, unread until wait(). Messages from
  // one rank to another arrive in the order sent, matched by that order alone (NCCL has no tags).
  // MPI: a device tensor goes through host memory (a send copies it out at once, a receive lands
  // in wait()); a receive never waited for is cancelled when its Work goes. NCCL: on the
  // communication stream, after the work the caller's stream has queued so far. The default
  // throws Error.
  virtual std::unique_ptr<Work> send_async(const torch::Tensor& t, int peer);
  virtual std::unique_ptr<Work> recv_async(torch::Tensor& t, int peer);
  // Throws Error if a collective already started has failed (NCCL's asynchronous errors).
  virtual void check_async_errors() {}

  // Bytes this rank has handed to reducing collectives (all_reduce, reduce_scatter: the input's
  // size), what gradient compression (comm.grad_dtype) halves; tests and the log read it.
  virtual uint64_t reduced_bytes() const { return reduced_bytes_; }

 protected:
  void count_reduced(const torch::Tensor& t) { reduced_bytes_ += static_cast<uint64_t>(t.nbytes()); }

 private:
  uint64_t reduced_bytes_ = 0;
};

// all_gather and reduce_scatter's shape rule, for every backend: `whole` (named `whole_name` in
// the message) holds `size` x part.numel() elements of part's dtype; Error "<op>: ..." otherwise.
void check_gather_sizes(const char* op, const char* whole_name, const torch::Tensor& whole,
                        const torch::Tensor& part, int size);
// all_to_all's shape rule: one count per rank on each side, `in` and `out` contiguous, of one dtype and
// row width, holding as many rows as their counts say; Error "all_to_all: ..." otherwise. Returns
// the bytes of one row.
int64_t check_all_to_all(const torch::Tensor& in, const std::vector<int64_t>& in_rows, const torch::Tensor& out,
                         const std::vector<int64_t>& out_rows, int size);

// The MPI backend over `comm` (not owned; it must outlive the communicator).
std::unique_ptr<Communicator> make_mpi_communicator(MpiComm comm);

// True in builds with the NCCL backend (CMake found CUDA libtorch and NCCL).
bool have_nccl();

// The backend the config asks for: "mpi", "nccl", or "auto" (NCCL on CUDA devices when built
// with NCCL, else MPI). Throws UsageError for "nccl" in a build without it or on a CPU device.
std::unique_ptr<Communicator> make_communicator(const std::string& backend, MpiComm comm,
                                                const torch::Device& device);

}  // namespace mpitrain
