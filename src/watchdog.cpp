// The collective watchdog (see watchdog.h).
#include "mpitrain/watchdog.h"

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {
namespace {

using Clock = std::chrono::steady_clock;

struct State {
  std::mutex mu;
  bool started = false;
  double timeout_s = 300, first_timeout_s = 900;
  bool seen_first = false;
  const char* op = nullptr;  // the collective in progress, or null
  Clock::time_point began;
  double limit_s = 0;
  int64_t step = -1;
  std::function<void()> abort_hook;
};

State& state() {
  static State s;
  return s;
}

[[noreturn]] void fire(const char* op, int64_t step, double waited) {
  auto& s = state();
  char msg[512];
  std::snprintf(msg, sizeof msg,
                "watchdog: collective %s at step %lld has not completed after %.0f s "
                "(fault.collective_timeout_s); another rank stopped calling collectives or died. "
                "Aborting the job.",
                op, static_cast<long long>(step), waited);
  log::error(msg);
  if (s.abort_hook) s.abort_hook();
  // MPI_Abort from this thread: the main thread is stuck inside MPI, so nothing else can.
  MPI_Abort(MPI_COMM_WORLD, kExitWatchdog);
  std::this_thread::sleep_for(std::chrono::seconds(10));
  std::_Exit(kExitWatchdog);  // if MPI could not abort, dying still ends the job under mpirun
}

void run() {
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto& s = state();
    const char* op = nullptr;
    double waited = 0;
    int64_t step = 0;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.op) continue;
      waited = std::chrono::duration<double>(Clock::now() - s.began).count();
      if (waited < s.limit_s) continue;
      op = s.op;
      step = s.step;
    }
    fire(op, step, waited);
  }
}

}  // namespace

void Watchdog::start(double timeout_s, double first_timeout_s) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.timeout_s = timeout_s;
  s.first_timeout_s = first_timeout_s;
  if (!s.started) {
    s.started = true;
    std::thread(run).detach();
  }
}

void Watchdog::set_step(int64_t step) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.step = step;
}

void Watchdog::on_abort(std::function<void()> hook) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.abort_hook = std::move(hook);
}

Watchdog::Scope::Scope(const char* op) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.started) return;
  s.op = op;
  s.began = Clock::now();
  s.limit_s = s.seen_first ? s.timeout_s : s.first_timeout_s;
}

Watchdog::Scope::~Scope() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.op = nullptr;
  s.seen_first = true;
}

void maybe_hang_for_test(int rank, int64_t step) {
  const char* spec = std::getenv("MPITRAIN_TEST_HANG");
  if (!spec) return;
  int r = -1;
  long long at = -1;
  if (std::sscanf(spec, "%d:%lld", &r, &at) != 2 || r != rank || step < at) return;
  log::any_rank(log::Level::warn, concat("test fault MPITRAIN_TEST_HANG: stopping collectives at step ", step));
  while (true) ::pause();
}

}  // namespace mpitrain
