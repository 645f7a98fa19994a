// bench/data_reader: tokens/s per rank of the training reader (TokenDataset::batch, what the
// BatchPrefetcher's read runs: shuffled windows widened to the int32 tokens training takes)
// against a baseline measured in the same run: memcpy of the same number of token bytes (uint16)
// from the page-cached, memory-mapped shard. Run under mpirun with 1, 2, 4 ranks
// (bench/data_reader.sh does).
//
//   bench_data_reader [--tokens N] [--seq-len T] [--rows B] [--seconds S] [--dir D]
#include <fcntl.h>
#include "mpitrain/mpi_native.h"
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mpitrain/shards.h"

#include "args.h"

using namespace mpitrain;
using bench::arg;
using bench::arg_str;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const auto n_tokens = static_cast<uint64_t>(arg(argc, argv, "--tokens", 50e6));
  const auto T = static_cast<int64_t>(arg(argc, argv, "--seq-len", 1024));
  const auto rows = static_cast<int64_t>(arg(argc, argv, "--rows", 16));
  const double seconds = arg(argc, argv, "--seconds", 3);
  const std::string dir = arg_str(argc, argv, "--dir", "/tmp");
  const std::string path = dir + "/mpitrain-bench-train-00000.h5";

  // ---- one shard of random GPT-2-sized tokens, written once ----
  if (rank == 0) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || static_cast<uint64_t>(st.st_size) < n_tokens * 2) {
      std::vector<uint32_t> tokens(n_tokens);
      std::mt19937 rng(1);
      for (auto& t : tokens) t = rng() % 50257;
      ShardMeta meta;
      meta.vocab_size = 50257;
      meta.eot_token = 50256;
      meta.tokenizer = "gpt2";
      write_shard(path, tokens, {}, meta);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);

  TokenDataset data({path}, T, 1234, /*shuffle=*/true);
  const int64_t per_batch = rows * T;  // tokens trained on per micro-batch
  std::vector<int32_t> buf(static_cast<size_t>(rows * (T + 1)));

  // ---- the reader: this rank's slices of consecutive micro-steps, as training reads them ----
  for (int i = 0; i < 3; ++i) data.batch(static_cast<uint64_t>(i) * size * rows, rank, rows, buf.data());  // warm
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  int64_t batches = 0;
  while (MPI_Wtime() - t0 < seconds) {
    data.batch(static_cast<uint64_t>(batches) * size * rows, rank, rows, buf.data());
    ++batches;
  }
  const double reader = static_cast<double>(batches * per_batch) / (MPI_Wtime() - t0);

  // ---- baseline: memcpy of the same token bytes from the page-cached mapping ----
  int fd = ::open(path.c_str(), O_RDONLY);
  struct stat st {};
  ::fstat(fd, &st);
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  const auto* bytes = static_cast<const unsigned char*>(map);
  const size_t chunk = static_cast<size_t>((T + 1) * 2);  // one window of uint16 tokens
  std::vector<unsigned char> dst(static_cast<size_t>(rows) * chunk);
  volatile unsigned char sink = 0;
  for (size_t off = 0; off < file_bytes; off += 4096) sink = sink + bytes[off];  // page cache
  std::mt19937_64 rng(rank);
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = MPI_Wtime();
  int64_t copies = 0;
  while (MPI_Wtime() - t0 < seconds) {
    for (int64_t r = 0; r < rows; ++r) {
      const size_t off = (rng() % (file_bytes / chunk - 1)) * chunk;
      std::memcpy(dst.data() + static_cast<size_t>(r) * chunk, bytes + off, chunk);
    }
    sink = sink + dst[static_cast<size_t>(copies) % dst.size()];
    ++copies;
  }
  const double baseline = static_cast<double>(copies * per_batch) / (MPI_Wtime() - t0);
  ::munmap(map, file_bytes);
  ::close(fd);

  std::vector<double> r_all(size), b_all(size);
  MPI_Gather(&reader, 1, MPI_DOUBLE, r_all.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(&baseline, 1, MPI_DOUBLE, b_all.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    const double r_min = *std::min_element(r_all.begin(), r_all.end());
    double r_mean = 0, b_mean = 0;
    for (int i = 0; i < size; ++i) r_mean += r_all[i] / size, b_mean += b_all[i] / size;
    std::printf("| %5d | %10lld x %-5lld | %18.1f | %18.1f | %18.1f | %6.2f |\n", size,
                static_cast<long long>(rows), static_cast<long long>(T), r_mean / 1e6, r_min / 1e6,
                b_mean / 1e6, r_mean / b_mean);
  }
  MPI_Finalize();
  return 0;
}
