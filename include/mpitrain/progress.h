// What a run shows while it trains (rank 0): the progress line (loss, lr, gradient norm, tokens/s,
// ms/step, ETA) and the JSONL metrics file (log.metrics, default <train.out_dir>/metrics.jsonl).
// Time spent in evaluation and checkpoints is kept out of the step timings (untimed()).
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>

#include "mpitrain/config.h"

namespace mpitrain {

class Progress {
 public:
  // `writer`: this rank prints and writes the metrics (rank 0). Opening the metrics file fails
  // with a UsageError naming log.metrics.
  Progress(const Config& cfg, bool writer, int64_t tokens_per_step, int64_t first_step);

  // Marks the start of a step; the first call starts the clock of the first interval.
  void start_step();

  // At a log step, after the loss was read (on a GPU that waits for the queued work, so the
  // interval's time is real): tokens/s and ms/step averaged over the steps since the last report.
  void report(int64_t step, double loss, double lr, double norm);
  void report_val(int64_t step, double val_loss);

  // Runs fn without counting its time in the current interval (evaluation, checkpoints).
  template <class Fn>
  auto untimed(Fn&& fn) {
    struct Shift {
      Progress& p;
      Clock::time_point t0 = Clock::now();
      ~Shift() { p.interval_start_ += Clock::now() - t0; }
    } shift{*this};
    return fn();
  }

 private:
  using Clock = std::chrono::steady_clock;
  const Config& cfg_;
  int64_t tokens_per_step_;
  int64_t first_step_;
  int64_t last_reported_;
  double elapsed_ = 0;
  bool timing_ = false;
  Clock::time_point interval_start_;
  std::ofstream metrics_;
};

// "12m05s", "2h07m"
std::string human_duration(double seconds);

}  // namespace mpitrain
