// The progress line and the JSONL metrics (see progress.h).
#include "mpitrain/progress.h"

#include <cstdio>
#include <filesystem>

#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {

std::string human_duration(double seconds) {
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s / 60) % 60);
  else std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  return buf;
}

Progress::Progress(const Config& cfg, bool writer, int64_t tokens_per_step, int64_t first_step)
    : cfg_(cfg), tokens_per_step_(tokens_per_step), first_step_(first_step), last_reported_(first_step) {
  if (!writer) return;
  const std::string path =
      cfg.log.metrics.empty() ? cfg.train.out_dir + "/metrics.jsonl" : cfg.log.metrics;
  std::error_code ec;  // a failure shows as the open below failing
  if (auto slash = path.rfind('/'); slash != std::string::npos) std::filesystem::create_directories(path.substr(0, slash), ec);
  metrics_.open(path, std::ios::app);
  if (!metrics_) throw UsageError(concat("log.metrics: cannot write '", path, "'"));
}

void Progress::start_step() {
  if (!timing_) {
    interval_start_ = Clock::now();
    timing_ = true;
  }
}

void Progress::report(int64_t step, double loss, double lr, double norm) {
  const auto now = Clock::now();
  const double interval = std::chrono::duration<double>(now - interval_start_).count();
  const int64_t steps = std::max<int64_t>(1, step + 1 - last_reported_);
  interval_start_ = now;
  last_reported_ = step + 1;
  elapsed_ += interval;
  const double dt = interval / static_cast<double>(steps);
  const int64_t done = step + 1 - first_step_;
  const double avg = elapsed_ / static_cast<double>(std::max<int64_t>(1, done));
  const double tok_s = static_cast<double>(tokens_per_step_) / dt;
  char line[256];
  std::snprintf(line, sizeof line,
                "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms/step | ETA %s",
                static_cast<long long>(step + 1), static_cast<long long>(cfg_.train.steps), loss, lr,
                norm, tok_s, dt * 1e3,
                human_duration(avg * static_cast<double>(cfg_.train.steps - step - 1)).c_str());
  log::info(line);
  if (metrics_.is_open()) {
    std::snprintf(line, sizeof line,
                  "{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6e, \"grad_norm\": %.6f, "
                  "\"tokens_per_s\": %.1f, \"ms_per_step\": %.2f}",
                  static_cast<long long>(step + 1), loss, lr, norm, tok_s, dt * 1e3);
    metrics_ << line << "\n" << std::flush;
  }
}

void Progress::report_val(int64_t step, double val_loss) {
  log::info(concat("step ", step, " | val loss ", val_loss));
  if (metrics_.is_open()) {
    char line[128];
    std::snprintf(line, sizeof line, "{\"step\": %lld, \"val_loss\": %.6f}",
                  static_cast<long long>(step), val_loss);
    metrics_ << line << "\n" << std::flush;
  }
}

}  // namespace mpitrain
