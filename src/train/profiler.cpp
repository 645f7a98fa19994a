// The step profiler (see profiler.h): libtorch's Kineto profiler API, and the Chrome trace
// written from its events (Debian's libtorch has no Kineto library, so its own save() is not
// available everywhere; the events are).
#include "mpitrain/profiler.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {

namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

struct StepProfiler::Active {
  std::unique_ptr<at::RecordFunction> step;  // the open "ProfilerStep#N" annotation
};

namespace {

std::set<impl::ActivityType> activities(bool cuda) {
  std::set<impl::ActivityType> a{impl::ActivityType::CPU};
  if (cuda) a.insert(impl::ActivityType::CUDA);
  return a;
}

// One complete ("X") event of the Chrome trace format, times in microseconds.
nlohmann::json trace_event(const prof::KinetoEvent& e) {
#if TORCH_VERSION_MAJOR >= 2
  const double start_us = static_cast<double>(e.startNs()) / 1e3, dur_us = static_cast<double>(e.durationNs()) / 1e3;
#else
  const double start_us = static_cast<double>(e.startUs()), dur_us = static_cast<double>(e.durationUs());
#endif
  const bool gpu = e.deviceType() == c10::DeviceType::CUDA || e.deviceType() == c10::DeviceType::HIP;
  const std::string name = e.name();
  const char* cat = gpu ? "gpu" : name.rfind("ProfilerStep#", 0) == 0 ? "user_annotation" : "cpu_op";
  return {{"name", name}, {"ph", "X"}, {"cat", cat}, {"ts", start_us}, {"dur", dur_us},
          {"pid", gpu ? concat("GPU ", static_cast<int>(e.deviceIndex())) : std::string("CPU")},
          {"tid", gpu ? e.deviceResourceId() : static_cast<int64_t>(e.startThreadId())}};
}

}  // namespace

StepProfiler::StepProfiler(int64_t first, int64_t count, std::string path, int gpu)
    : first_(first), count_(count), path_(std::move(path)), gpu_(gpu) {}

StepProfiler::~StepProfiler() {
  try {
    finish();
  } catch (const std::exception&) {
    // a profile is not worth a second error while the run unwinds from a first one
  }
}

void StepProfiler::begin_step(int64_t step) {
  if (first_ <= 0 || step < first_ || step >= first_ + count_) return;
  if (!active_) {
    impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                /*profile_memory=*/false);
    prof::prepareProfiler(config, activities(gpu_ >= 0));
    prof::enableProfiler(config, activities(gpu_ >= 0));
    active_ = std::make_unique<Active>();
  }
  active_->step = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (active_->step->isActive())
    active_->step->before(concat("ProfilerStep#", step), c10::ArrayRef<const c10::IValue>{});
}

void StepProfiler::end_step(int64_t step) {
  if (!active_) return;
  if (gpu_ >= 0) torch::cuda::synchronize(gpu_);  // the step's kernels inside its span
  active_->step.reset();  // closes the step's annotation
  if (step + 1 >= first_ + count_) finish();
}

void StepProfiler::finish() {
  if (!active_) return;
  active_->step.reset();
  active_.reset();
  auto result = prof::disableProfiler();
  std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
  nlohmann::json events = nlohmann::json::array();
  for (const auto& e : result->events()) events.push_back(trace_event(e));
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
    if (!out) throw UsageError(concat("log.profile_start: cannot write the profile '", path_, "'"));
  }
  std::filesystem::rename(tmp, path_);
  std::filesystem::path kineto(path_);
  kineto.replace_extension(".kineto.json");
  bool saved_kineto = false;
  try {
    result->save(kineto.string());
    saved_kineto = true;
  } catch (const c10::Error&) {
    // libtorch without Kineto (Debian's): only the trace written above
  }
  log::info(concat("profile: ", events.size(), " events of steps ", first_, "-", first_ + count_ - 1, " in ", path_,
                   saved_kineto ? concat(" (Kineto's own trace: ", kineto.string(), ")") : std::string(),
                   "; bench/profile_summary.py tabulates it"));
}

}  // namespace mpitrain
