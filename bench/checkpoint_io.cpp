// bench/checkpoint_io: checkpoint save and load against `dd` moving the same number of bytes to
// and from the same disk, in one run, median of --runs. Save is compared with
// `dd if=/dev/zero bs=4M conv=fsync` (write + fsync, as the checkpoint's own fsync), load with
// `dd of=/dev/null bs=4M` of that file, each read after dropping the page cache (root only; else
// both read from a warm cache and the table says so). Then the stall of checkpoint.async saves:
// the first and the later ones, as a share of a synchronous save. bench/checkpoint_io.sh runs it.
//
//   bench_checkpoint_io [--dir D] [--runs N] [--warmup 2] [--layers 12] [--embd 768] [--vocab 50304] [--seq 1024]
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/log.h"

#include "args.h"

using namespace mpitrain;
using bench::arg;
using bench::arg_str;
using bench::Clock;
using bench::median;
using bench::seconds_since;

namespace {

// Empties the page cache so the next read comes from the disk; false when not allowed (not root).
bool drop_caches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  return static_cast<bool>(f.flush());
}

double run_timed(const std::string& cmd) {
  const auto t0 = Clock::now();
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "bench_checkpoint_io: '%s' failed\n", cmd.c_str());
    std::exit(1);
  }
  return seconds_since(t0);
}

int64_t file_bytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = arg_str(argc, argv, "--dir", "/tmp/mpitrain-bench-ckpt");
  const int runs = static_cast<int>(arg(argc, argv, "--runs", 5));
  GPTDims d;
  d.n_layer = static_cast<int64_t>(arg(argc, argv, "--layers", 12));
  d.n_embd = static_cast<int64_t>(arg(argc, argv, "--embd", 768));
  d.n_head = 12;
  d.seq_len = static_cast<int64_t>(arg(argc, argv, "--seq", 1024));
  d.vocab_size = static_cast<int64_t>(arg(argc, argv, "--vocab", 50304));
  log::set_level(log::Level::warn);  // the per-save info lines would interleave with the table

  torch::manual_seed(1);
  GPT model(d);
  OptimConfig ocfg;
  AdamW opt(model->named_params(), ocfg);
  {
    torch::NoGradGuard no_grad;  // moments as after some training: random, not zeros
    for (size_t i = 0; i < opt.size(); ++i) {
      opt.exp_avg(i).normal_(0, 1e-3);
      opt.exp_avg_sq(i).uniform_(0, 1e-6);
    }
  }
  opt.set_steps_taken(100);
  TrainState st;
  st.step = 100;

  const std::string ckdir = dir + "/ckpt", dd_file = dir + "/dd.bin.";
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + ckdir + "'").c_str());
  const std::string path = save_checkpoint(ckdir, model, opt, st, 1);
  const int64_t bytes = file_bytes(path);
  const int64_t blocks = (bytes + (4 << 20) - 1) / (4 << 20);
  bool cold = true;

  // The first rounds are not timed: on a virtual machine the first use of fresh memory for the page
  // cache costs the host's page faults (seen here: dd alone 4.2 s, then 0.7 s), whoever comes first.
  const int warmup = static_cast<int>(arg(argc, argv, "--warmup", 2));
  std::vector<double> save_s, dd_write_s, load_s, dd_read_s;
  for (int r = -warmup; r < runs; ++r) {
    if (r == 0) save_s.clear(), dd_write_s.clear(), load_s.clear(), dd_read_s.clear();
    // dd writes a new file each run and removes the previous one afterwards, as a checkpoint
    // (keep: 1) does: both fill new pages of the page cache.
    const std::string dd_new = dd_file + std::to_string(r), dd_old = dd_file + std::to_string(r - 1);
    dd_write_s.push_back(run_timed("dd if=/dev/zero of='" + dd_new + "' bs=4M count=" + std::to_string(blocks) +
                                   " conv=fsync status=none && rm -f '" + dd_old + "'"));
    st.step = 101 + warmup + r;
    auto t0 = Clock::now();
    save_checkpoint(ckdir, model, opt, st, 1);
    save_s.push_back(seconds_since(t0));

    cold = drop_caches() && cold;
    dd_read_s.push_back(run_timed("dd if='" + dd_new + "' of=/dev/null bs=4M status=none"));
    cold = drop_caches() && cold;
    TrainState loaded;
    t0 = Clock::now();
    load_checkpoint(ckdir + "/" + checkpoint_name(st.step), model, &opt, loaded);
    load_s.push_back(seconds_since(t0));
  }

  const double mb = static_cast<double>(bytes) / 1e6;
  std::printf("checkpoint: GPT-2 %lldL/%lld/vocab %lld, %.0f M parameters + AdamW state = %.1f MB; median of %d runs%s\n",
              static_cast<long long>(d.n_layer), static_cast<long long>(d.n_embd), static_cast<long long>(d.vocab_size),
              static_cast<double>(bytes) / 12e6, mb, runs, cold ? "; reads after dropping the page cache" : "; page cache NOT dropped (not root): reads are warm");
  std::printf("\n| operation | mpitrain s | mpitrain MB/s | dd s | dd MB/s | ratio (mpitrain / dd) |\n");
  std::printf("|-----------|-----------:|--------------:|-----:|--------:|----------------------:|\n");
  auto row = [&](const char* what, const std::vector<double>& ours, const std::vector<double>& dd) {
    const double a = median(ours), b = median(dd);
    std::printf("| %s | %.2f | %.0f | %.2f | %.0f | %.2f |\n", what, a, mb / a, b, mb / b, b / a);
  };
  row("save (write + fsync)", save_s, dd_write_s);
  row("load (read + verify)", load_s, dd_read_s);

  // ---- checkpoint.async: how long save() holds the loop, first save and later ones ----
  std::vector<double> stalls;
  {
    AsyncCheckpointWriter writer(ckdir, 1, /*async=*/true);
    writer.prepare(model, full_state_of(opt));  // as the training loop does at start-up
    for (int r = 0; r < std::max(runs, 3); ++r) {
      st.step = 200 + r;
      const auto t0 = Clock::now();
      writer.save(model, opt, st);
      stalls.push_back(seconds_since(t0));
      writer.wait();  // the loop would train meanwhile; the bench measures the stall alone
    }
  }
  const double sync_s = median(save_s);
  std::vector<double> later(stalls.begin() + 1, stalls.end());
  std::printf("\n| checkpoint.async | loop stall ms | share of a synchronous save (%.0f ms) |\n", sync_s * 1e3);
  std::printf("|------------------|--------------:|------:|\n");
  std::printf("| first save | %.0f | %.3f |\n", stalls[0] * 1e3, stalls[0] / sync_s);
  std::printf("| later saves (median of %zu) | %.0f | %.3f |\n", later.size(), median(later) * 1e3,
              median(later) / sync_s);
  std::system(("rm -rf '" + dir + "'").c_str());
  return 0;
}
