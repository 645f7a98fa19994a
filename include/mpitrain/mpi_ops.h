// MPI as the code outside the MPI room (src/comm/, src/launch/, src/data/pack*.cpp) sees it: a
// communicator handle and the few host-side operations that code needs, without <mpi.h>. So every
// other translation unit (the model, state, training loop, their tests) compiles to the same
// object against Open MPI and against the MPICH ABI, and the second family's build recompiles the
// room only (scripts/build-mpich.sh, from the same ccache). The room's sources include
// mpitrain/mpi_native.h, which converts these handles to MPI's own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mpitrain {

// A communicator. MpiComm{} is MPI_COMM_NULL. Open MPI's MPI_Comm is a pointer and MPICH's an
// int: both fit in an intptr_t.
enum class MpiComm : std::intptr_t {};

// A nonblocking point-to-point operation in flight (mpi::isend). Open MPI's MPI_Request is a
// pointer and MPICH's an int, as MPI_Comm.
enum class MpiRequest : std::intptr_t {};

// The reductions of every communicator (comm.h) and of the host-side all_reduce below.
enum class ReduceOp { sum, avg, max, min };

namespace mpi {

MpiComm world();  // MPI_COMM_WORLD
MpiComm self();   // MPI_COMM_SELF
int rank(MpiComm comm);
int size(MpiComm comm);
void barrier(MpiComm comm);

// In place on every rank of `comm`: sum, max or min (avg is refused: Error).
void all_reduce(int* values, int count, ReduceOp op, MpiComm comm);
void all_reduce(int64_t* values, int count, ReduceOp op, MpiComm comm);
void all_reduce(double* values, int count, ReduceOp op, MpiComm comm);
void all_reduce(float* values, int count, ReduceOp op, MpiComm comm);
template <class T>
T all_reduced(T value, ReduceOp op, MpiComm comm) {
  all_reduce(&value, 1, op, comm);
  return value;
}

// Root's `bytes` bytes at `data` to every rank (the ranks of one job share a byte order).
void broadcast(void* data, size_t bytes, int root, MpiComm comm);
// Root's string to every rank (its length first).
void broadcast(std::string& text, int root, MpiComm comm);
template <class T>
void broadcast_value(T& value, int root, MpiComm comm) {
  broadcast(&value, sizeof value, root, comm);
}

// Every rank's `bytes` bytes at `mine` on `root`, in rank order, at `all` (size() * bytes there;
// unused elsewhere).
void gather(const void* mine, void* all, size_t bytes, int root, MpiComm comm);
// Every rank's `bytes` bytes at `mine` on every rank, in rank order, at `all` (size() * bytes).
void all_gather(const void* mine, void* all, size_t bytes, MpiComm comm);
// Every rank's list on `root` in rank order (elsewhere: empty).
std::vector<std::vector<uint64_t>> gather_lists(const std::vector<uint64_t>& mine, int root, MpiComm comm);

// Point to point (pipeline parallelism's activations and their gradients): a nonblocking send of
// `bytes` at `data` to rank `dest` of `comm` with `tag` (the buffer stays alive and unchanged until
// wait()), a blocking receive of exactly `bytes` from `source` with `tag`, and a nonblocking one
// (the buffer stays alive and untouched until wait_received(), which checks that `bytes` came).
MpiRequest isend(const void* data, size_t bytes, int dest, int tag, MpiComm comm);
void recv(void* data, size_t bytes, int source, int tag, MpiComm comm);
MpiRequest irecv(void* data, size_t bytes, int source, int tag, MpiComm comm);
void wait(MpiRequest& request);  // MPI_Wait; the request becomes MPI_REQUEST_NULL
void wait_received(MpiRequest& request, size_t bytes);
void cancel(MpiRequest& request);  // a receive not waited for: MPI_Cancel, then MPI_Wait
MpiRequest null_request();         // MPI_REQUEST_NULL (what wait() leaves; cancel() ignores it)

// MPI_Comm_split: color < 0 is MPI_UNDEFINED (this rank gets MpiComm{}).
MpiComm split(MpiComm comm, int color, int key);
// MPI_Comm_create_group: a communicator of `ranks` of `comm`, rank i of it `ranks[i]`; collective
// over those ranks only, each calling it with the same list and `tag`.
MpiComm create_group(MpiComm comm, const std::vector<int>& ranks, int tag);
// The ranks of `comm` on this host (MPI_Comm_split_type SHARED).
MpiComm split_host(MpiComm comm, int key);
MpiComm dup(MpiComm comm);
// Frees an owned communicator and sets it to MpiComm{}; MpiComm{} is left alone.
void free(MpiComm& comm);

// MPI runs with MPI_THREAD_MULTIPLE (collectives from more than one thread).
bool thread_multiple();
// MPI_Get_processor_name.
std::string processor_name();

}  // namespace mpi
}  // namespace mpitrain
