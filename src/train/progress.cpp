// The progress line and the JSONL metrics (see progress.h).
#include "mpitrain/progress.h"

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {

namespace {
// printf into a string (the lines here are short).
template <class... Args>
std::string format(const char* fmt, Args... args) {
  char buf[320];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}
}  // namespace

std::string human_duration(double seconds) {
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s / 60) % 60);
  else std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  return buf;
}

Progress::Progress(const Config& cfg, bool writer, const RunFacts& facts)
    : cfg_(cfg), facts_(facts), last_reported_(facts.first_step) {
  if (!writer) return;
  const std::string path =
      cfg.log.metrics.empty() ? cfg.train.out_dir + "/metrics.jsonl" : cfg.log.metrics;
  std::error_code ec;  // a failure shows as the open below failing
  if (auto slash = path.rfind('/'); slash != std::string::npos) std::filesystem::create_directories(path.substr(0, slash), ec);
  metrics_.open(path, std::ios::app);
  if (!metrics_) throw UsageError(concat("log.metrics: cannot write '", path, "'"));
  if (cfg.log.tensorboard != "off") {
    const std::string dir = cfg.log.tensorboard.empty() ? cfg.train.out_dir + "/tensorboard" : cfg.log.tensorboard;
    tensorboard_ = std::make_unique<TensorBoardWriter>(dir, facts.host, "log.tensorboard");
    // A resumed run continues after its checkpoint's step: the points an earlier process logged
    // after that step (it died before its next checkpoint) are dropped by TensorBoard.
    if (facts.first_step > 0) tensorboard_->restart(facts.first_step + 1);
  }
}

void Progress::start_step() {
  if (!timing_) {
    interval_start_ = Clock::now();
    timing_ = true;
  }
}

void Progress::report(const StepReport& r) {
  const auto now = Clock::now();
  const double interval = std::chrono::duration<double>(now - interval_start_).count();
  const int64_t steps = std::max<int64_t>(1, r.step + 1 - last_reported_);
  interval_start_ = now;
  last_reported_ = r.step + 1;
  elapsed_ += interval;
  const double dt = interval / static_cast<double>(steps);
  const int64_t done = r.step + 1 - facts_.first_step;
  const double avg = elapsed_ / static_cast<double>(std::max<int64_t>(1, done));
  const double tok_s = static_cast<double>(facts_.tokens_per_step) / dt;
  const double mfu = facts_.peak_flops > 0 ? facts_.flops_per_token * tok_s / facts_.peak_flops : -1;
  const double comm = interval > 0 ? std::min(1.0, r.comm_seconds / interval) : 0;
  const long long step = r.step + 1;

  std::string line = format("step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms/step", step,
                            static_cast<long long>(cfg_.train.steps), r.loss, r.lr, r.grad_norm, tok_s, dt * 1e3);
  if (mfu >= 0) line += format(" | MFU %.1f%%", mfu * 100);
  if (facts_.communicates) line += format(" | comm %.0f%%", comm * 100);
  if (facts_.loss_scaling) line += format(" | scale %g", r.loss_scale);
  const double load = r.expert_load.empty() ? 0 : *std::max_element(r.expert_load.begin(), r.expert_load.end());
  if (r.aux_loss >= 0) line += format(" | aux %.4f | load %.2f", r.aux_loss, load);
  if (r.z_loss >= 0) line += format(" | z %.3f", r.z_loss);
  if (r.dropped >= 0) line += format(" | dropped %.1f%%", 100 * r.dropped);
  const double a2a = r.ep_seconds >= 0 && interval > 0 ? std::min(1.0, r.ep_seconds / interval) : -1;
  if (a2a >= 0) line += format(" | a2a %.0f%%", 100 * a2a);
  const double pp_wait = r.pp_wait_seconds >= 0 && interval > 0 ? std::min(1.0, r.pp_wait_seconds / interval) : -1;
  if (pp_wait >= 0) line += format(" | pp wait %.0f%%", 100 * pp_wait);
  line += " | ETA " + human_duration(avg * static_cast<double>(cfg_.train.steps - r.step - 1));
  log::info(line);

  std::vector<std::pair<std::string, double>> scalars{{"loss/train", r.loss},         {"optim/lr", r.lr},
                                                       {"optim/grad_norm", r.grad_norm}, {"perf/tokens_per_s", tok_s},
                                                       {"perf/ms_per_step", dt * 1e3}};
  // (A step that fp16 skipped has an infinite gradient norm: JSON has no inf, so null.)
  const std::string grad_norm = std::isfinite(r.grad_norm) ? format("%.6f", r.grad_norm) : std::string("null");
  std::string json = format("{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6e, \"grad_norm\": %s, "
                            "\"tokens_per_s\": %.1f, \"ms_per_step\": %.2f",
                            step, r.loss, r.lr, grad_norm.c_str(), tok_s, dt * 1e3);
  if (mfu >= 0) {
    json += format(", \"mfu\": %.5f", mfu);
    scalars.emplace_back("perf/mfu", mfu);
  }
  if (facts_.communicates) {
    json += format(", \"comm_share\": %.5f", comm);
    scalars.emplace_back("perf/comm_share", comm);
  }
  if (facts_.loss_scaling) {
    json += format(", \"loss_scale\": %g", r.loss_scale);
    scalars.emplace_back("optim/loss_scale", r.loss_scale);
  }
  if (r.aux_loss >= 0) {  // the experts' balance: the aux loss, each sparse layer's load (max / mean tokens)
    json += format(", \"aux_loss\": %.6f, \"expert_load\": [", r.aux_loss);
    for (size_t i = 0; i < r.expert_load.size(); ++i) json += format(i ? ", %.4f" : "%.4f", r.expert_load[i]);
    json += "]";
    scalars.emplace_back("moe/aux_loss", r.aux_loss);
    scalars.emplace_back("moe/expert_load_max", load);
  }
  if (r.z_loss >= 0) {
    json += format(", \"z_loss\": %.6f", r.z_loss);
    scalars.emplace_back("moe/z_loss", r.z_loss);
  }
  if (r.dropped >= 0) {
    json += format(", \"dropped\": %.6f", r.dropped);
    scalars.emplace_back("moe/dropped", r.dropped);
  }
  if (a2a >= 0) {
    json += format(", \"all_to_all_share\": %.5f", a2a);
    scalars.emplace_back("moe/all_to_all_share", a2a);
  }
  if (pp_wait >= 0) {
    json += format(", \"pp_wait_share\": %.5f", pp_wait);
    scalars.emplace_back("perf/pp_wait_share", pp_wait);
  }
  if (!r.source_tokens.empty()) {
    json += ", \"source_tokens\": [";
    for (size_t i = 0; i < r.source_tokens.size(); ++i) {
      json += format(i ? ", %.0f" : "%.0f", r.source_tokens[i]);
      scalars.emplace_back(concat("data/source_", i, "_tokens"), r.source_tokens[i]);
    }
    json += "]";
  }
  if (metrics_.is_open()) metrics_ << json << "}\n" << std::flush;
  if (tensorboard_) tensorboard_->scalars(step, scalars);
}

void Progress::report_task(int64_t step, const std::string& task, double acc, double acc_norm, int64_t examples,
                           double seconds) {
  const double rate = seconds > 0 ? static_cast<double>(examples) / seconds : 0;
  log::info(format("step %lld | task %s acc %.4f acc_norm %.4f | %lld examples, %.1f examples/s",
                   static_cast<long long>(step), task.c_str(), acc, acc_norm, static_cast<long long>(examples), rate));
  if (metrics_.is_open())
    metrics_ << format("{\"step\": %lld, \"task\": \"%s\", \"acc\": %.6f, \"acc_norm\": %.6f, \"examples\": %lld, "
                       "\"examples_per_s\": %.3f}",
                       static_cast<long long>(step), task.c_str(), acc, acc_norm, static_cast<long long>(examples), rate)
             << "\n"
             << std::flush;
  if (tensorboard_)
    tensorboard_->scalars(step, {{"tasks/" + task + "/acc", acc}, {"tasks/" + task + "/acc_norm", acc_norm},
                                 {"tasks/" + task + "/examples_per_s", rate}});
}

void Progress::report_outer(int64_t step, int64_t outer, double mib, double seconds) {
  const double wall = elapsed_ + std::chrono::duration<double>(Clock::now() - interval_start_).count();
  const double share = wall > 0 ? seconds / wall : 0.0;
  log::info(concat("diloco: outer step ", outer, " after step ", step, "; ", mib, " MiB sent between islands so far (rank 0), ",
                   seconds, " s in outer steps = ", format("%.1f", 100 * share), "% of the training time"));
  if (metrics_.is_open())
    metrics_ << format("{\"step\": %lld, \"outer_step\": %lld, \"island_mib\": %.3f, \"outer_s\": %.4f, \"outer_share\": %.4f}",
                       static_cast<long long>(step), static_cast<long long>(outer), mib, seconds, share)
             << "\n" << std::flush;
  if (tensorboard_) tensorboard_->scalars(step, {{"diloco/island_mib", mib}, {"diloco/outer_share", share}});
}

void Progress::report_val(int64_t step, double val_loss) {
  log::info(concat("step ", step, " | val loss ", val_loss));
  if (metrics_.is_open())
    metrics_ << format("{\"step\": %lld, \"val_loss\": %.6f}", static_cast<long long>(step), val_loss) << "\n"
             << std::flush;
  if (tensorboard_) tensorboard_->scalars(step, {{"loss/val", val_loss}});
}

}  // namespace mpitrain
