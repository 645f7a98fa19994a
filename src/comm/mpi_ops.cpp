// The host-side MPI operations of mpi_ops.h, and MPI's error text: the MPI room's small door for
// the code that is compiled without <mpi.h>.
#include "mpitrain/mpi_ops.h"

#include "mpitrain/error.h"
#include "mpitrain/mpi_native.h"

namespace mpitrain {

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<size_t>(len));
}

namespace mpi {
namespace {

MPI_Op op_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::avg: break;
  }
  throw Error("mpi::all_reduce: avg is not an MPI reduction of host values");
}

void all_reduce_typed(void* values, int count, MPI_Datatype type, ReduceOp op, MpiComm comm) {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, count, type, op_of(op), to_mpi(comm)));
}

// MPI's counts are ints: a larger byte count is refused, not truncated.
int byte_count(size_t bytes) {
  MPITRAIN_CHECK(bytes <= static_cast<size_t>(INT32_MAX), "mpi: a message over 2 GiB");
  return static_cast<int>(bytes);
}

}  // namespace

MpiComm world() { return from_mpi(MPI_COMM_WORLD); }
MpiComm self() { return from_mpi(MPI_COMM_SELF); }

int rank(MpiComm comm) {
  int r = 0;
  MPI_CHECK(MPI_Comm_rank(to_mpi(comm), &r));
  return r;
}

int size(MpiComm comm) {
  int n = 1;
  MPI_CHECK(MPI_Comm_size(to_mpi(comm), &n));
  return n;
}

void barrier(MpiComm comm) { MPI_CHECK(MPI_Barrier(to_mpi(comm))); }

void all_reduce(int* values, int count, ReduceOp op, MpiComm comm) {
  all_reduce_typed(values, count, MPI_INT, op, comm);
}
void all_reduce(int64_t* values, int count, ReduceOp op, MpiComm comm) {
  all_reduce_typed(values, count, MPI_INT64_T, op, comm);
}
void all_reduce(double* values, int count, ReduceOp op, MpiComm comm) {
  all_reduce_typed(values, count, MPI_DOUBLE, op, comm);
}
void all_reduce(float* values, int count, ReduceOp op, MpiComm comm) {
  all_reduce_typed(values, count, MPI_FLOAT, op, comm);
}

void broadcast(void* data, size_t bytes, int root, MpiComm comm) {
  MPI_CHECK(MPI_Bcast(data, byte_count(bytes), MPI_BYTE, root, to_mpi(comm)));
}

void broadcast(std::string& text, int root, MpiComm comm) {
  int64_t n = static_cast<int64_t>(text.size());
  broadcast_value(n, root, comm);
  text.resize(static_cast<size_t>(n));
  if (n > 0) broadcast(text.data(), static_cast<size_t>(n), root, comm);
}

void gather(const void* mine, void* all, size_t bytes, int root, MpiComm comm) {
  const int n = byte_count(bytes);
  MPI_CHECK(MPI_Gather(mine, n, MPI_BYTE, all, n, MPI_BYTE, root, to_mpi(comm)));
}

void all_gather(const void* mine, void* all, size_t bytes, MpiComm comm) {
  const int n = byte_count(bytes);
  MPI_CHECK(MPI_Allgather(mine, n, MPI_BYTE, all, n, MPI_BYTE, to_mpi(comm)));
}

std::vector<std::vector<uint64_t>> gather_lists(const std::vector<uint64_t>& mine, int root, MpiComm comm) {
  const int me = rank(comm), n = size(comm);
  MPITRAIN_CHECK(mine.size() <= static_cast<size_t>(INT32_MAX), "mpi::gather_lists: a list over 2^31 elements");
  int count = static_cast<int>(mine.size());
  std::vector<int> counts(me == root ? static_cast<size_t>(n) : 0);
  MPI_CHECK(MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, root, to_mpi(comm)));
  std::vector<int> displs(counts.size());
  int64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    displs[r] = static_cast<int>(total);
    total += counts[r];
  }
  MPITRAIN_CHECK(total <= INT32_MAX, "mpi::gather_lists: over 2^31 elements in all");
  std::vector<uint64_t> all(static_cast<size_t>(total));
  MPI_CHECK(MPI_Gatherv(mine.data(), count, MPI_UINT64_T, all.data(), counts.data(), displs.data(), MPI_UINT64_T,
                        root, to_mpi(comm)));
  std::vector<std::vector<uint64_t>> lists(counts.size());
  for (size_t r = 0; r < counts.size(); ++r)
    lists[r].assign(all.begin() + displs[r], all.begin() + displs[r] + counts[r]);
  return lists;
}

MpiRequest isend(const void* data, size_t bytes, int dest, int tag, MpiComm comm) {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_CHECK(MPI_Isend(data, byte_count(bytes), MPI_BYTE, dest, tag, to_mpi(comm), &request));
  return static_cast<MpiRequest>((std::intptr_t)request);  // NOLINT (a pointer or an int, as MPI_Comm)
}

namespace {
// A receive that completed with `status` brought exactly `bytes`.
void check_received(const MPI_Status& status, size_t bytes) {
  int got = 0;
  MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &got));
  MPITRAIN_CHECK(static_cast<size_t>(got) == bytes, concat("mpi: received ", got, " bytes from rank ", status.MPI_SOURCE,
                                                           ", expected ", bytes));
}
}  // namespace

void recv(void* data, size_t bytes, int source, int tag, MpiComm comm) {
  MPI_Status status;
  MPI_CHECK(MPI_Recv(data, byte_count(bytes), MPI_BYTE, source, tag, to_mpi(comm), &status));
  check_received(status, bytes);
}

MpiRequest irecv(void* data, size_t bytes, int source, int tag, MpiComm comm) {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_CHECK(MPI_Irecv(data, byte_count(bytes), MPI_BYTE, source, tag, to_mpi(comm), &request));
  return static_cast<MpiRequest>((std::intptr_t)request);  // NOLINT
}

void wait(MpiRequest& request) {
  MPI_Request r = (MPI_Request)static_cast<std::intptr_t>(request);  // NOLINT
  MPI_CHECK(MPI_Wait(&r, MPI_STATUS_IGNORE));
  request = static_cast<MpiRequest>((std::intptr_t)r);  // NOLINT
}

MpiRequest null_request() { return static_cast<MpiRequest>((std::intptr_t)MPI_REQUEST_NULL); }  // NOLINT

void cancel(MpiRequest& request) {
  MPI_Request r = (MPI_Request)static_cast<std::intptr_t>(request);  // NOLINT
  if (r == MPI_REQUEST_NULL) return;
  MPI_Cancel(&r);  // (errors ignored: a job on its way out)
  MPI_Wait(&r, MPI_STATUS_IGNORE);
  request = static_cast<MpiRequest>((std::intptr_t)r);  // NOLINT
}

void wait_received(MpiRequest& request, size_t bytes) {
  MPI_Request r = (MPI_Request)static_cast<std::intptr_t>(request);  // NOLINT
  MPI_Status status;
  MPI_CHECK(MPI_Wait(&r, &status));
  request = static_cast<MpiRequest>((std::intptr_t)r);  // NOLINT
  check_received(status, bytes);
}

MpiComm split(MpiComm comm, int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(to_mpi(comm), color < 0 ? MPI_UNDEFINED : color, key, &out));
  return from_mpi(out);
}

MpiComm create_group(MpiComm comm, const std::vector<int>& ranks, int tag) {
  MPI_Group all = MPI_GROUP_NULL, part = MPI_GROUP_NULL;
  MPI_CHECK(MPI_Comm_group(to_mpi(comm), &all));
  MPI_CHECK(MPI_Group_incl(all, static_cast<int>(ranks.size()), ranks.data(), &part));
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_create_group(to_mpi(comm), part, tag, &out));
  MPI_Group_free(&part);
  MPI_Group_free(&all);
  return from_mpi(out);
}

MpiComm split_host(MpiComm comm, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(to_mpi(comm), MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, &out));
  return from_mpi(out);
}

MpiComm dup(MpiComm comm) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_dup(to_mpi(comm), &out));
  return from_mpi(out);
}

void free(MpiComm& comm) {
  if (comm == MpiComm{}) return;
  MPI_Comm c = to_mpi(comm);
  MPI_Comm_free(&c);
  comm = MpiComm{};
}

bool thread_multiple() {
  int provided = MPI_THREAD_SINGLE;
  MPI_CHECK(MPI_Query_thread(&provided));
  return provided >= MPI_THREAD_MULTIPLE;
}

std::string processor_name() {
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(host, &len);
  return std::string(host, static_cast<size_t>(len > 0 ? len : 0));
}

}  // namespace mpi
}  // namespace mpitrain
