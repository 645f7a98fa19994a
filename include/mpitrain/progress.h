// What a run shows while it trains (rank 0): the progress line (loss, lr, gradient norm, tokens/s,
// ms/step, MFU, communication share, ETA), the JSONL metrics file (log.metrics, default
// <train.out_dir>/metrics.jsonl) and TensorBoard event files (log.tensorboard, default
// <train.out_dir>/tensorboard). Time spent in evaluation and checkpoints is kept out of the step
// timings (untimed()).
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/tensorboard.h"

namespace mpitrain {

// What the progress line needs to know about the run besides its config.
struct RunFacts {
  int64_t tokens_per_step = 0;
  int64_t first_step = 0;       // > 0: resumed after this step
  double flops_per_token = 0;   // model FLOPs of one trained token (mfu.h)
  double peak_flops = 0;        // the peak FLOP/s of all ranks' devices together; 0 = unknown (no MFU)
  bool communicates = false;    // gradients travel between ranks: report the communication share
  bool loss_scaling = false;    // fp16: report the loss scale
  std::string host;             // for the TensorBoard file name
};

// The values of one progress report.
struct StepReport {
  int64_t step = 0;         // 0-based step just done
  double loss = 0, lr = 0, grad_norm = 0;
  double comm_seconds = 0;  // exposed gradient communication since the last report (SpanTimer)
  double loss_scale = 0;
  // Mixtures of experts: the load-balancing loss (averaged as the loss is; < 0: none, the model has
  // no experts) and each sparse layer's expert load, max / mean tokens per expert (rank 0's last
  // micro-batch).
  double aux_loss = -1;
  std::vector<double> expert_load;
  double z_loss = -1;   // train.moe_z_loss_coef: the router z-loss (averaged as the loss is; < 0: none)
  double dropped = -1;  // train.moe_capacity_factor: the share of rank 0's last micro-batch's token copies dropped
  // parallel.ep: rank 0's seconds inside the experts' all-to-alls (forward and backward, waiting for
  // the group included) since the last report, evaluation's excluded (< 0: no expert parallelism).
  double ep_seconds = -1;
  // parallel.pp: rank 0's seconds waiting for the neighbouring stages (pipeline_wait_seconds) since
  // the last report, evaluation's excluded (< 0: no pipeline).
  double pp_wait_seconds = -1;
  // data.weights: the tokens trained from each source of the mixture so far (empty: no mixture).
  std::vector<double> source_tokens{};
};

class Progress {
 public:
  // `writer`: this rank prints and writes the metrics and TensorBoard events (rank 0). A file that
  // cannot be opened is a UsageError naming log.metrics or log.tensorboard.
  Progress(const Config& cfg, bool writer, const RunFacts& facts);

  // Marks the start of a step; the first call starts the clock of the first interval.
  void start_step();

  // At a log step, after the loss was read (on a GPU that waits for the queued work, so the
  // interval's time is real): tokens/s and ms/step averaged over the steps since the last report.
  // Also: MFU = FLOPs per token x tokens/s / peak (when the peak is known), and the communication
  // share = exposed gradient communication / the interval's time.
  void report(const StepReport& r);
  void report_val(int64_t step, double val_loss);
  // eval.tasks: a task's accuracy at `step` (log line, metrics.jsonl, TensorBoard's tasks/ scalars)
  // and its examples per second (the scoring's wall time, kept out of the step timings).
  void report_task(int64_t step, const std::string& task, double acc, double acc_norm, int64_t examples, double seconds);
  // DiLoCo's outer step `outer` after step `step`: the MiB rank 0 has sent between islands and the
  // seconds spent in outer steps so far, and that time's share of the training time so far (log
  // line, metrics.jsonl, TensorBoard's diloco/ scalars).
  void report_outer(int64_t step, int64_t outer, double mib, double seconds);

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
  RunFacts facts_;
  int64_t last_reported_;
  double elapsed_ = 0;
  bool timing_ = false;
  Clock::time_point interval_start_;
  std::ofstream metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

// "12m05s", "2h07m"
std::string human_duration(double seconds);

}  // namespace mpitrain
