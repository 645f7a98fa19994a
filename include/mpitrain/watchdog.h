// The collective watchdog: every collective runs under a deadline. A background thread checks
// it; on expiry it logs the operation, the step, this rank and host, and aborts the whole job
// (MPI_Abort; NCCL communicators are aborted first by the hook the NCCL backend registers).
// Without it, one rank that stops calling collectives hangs every other rank forever.
//
// Exit code of a watchdog abort: kExitWatchdog (signals.h documents all codes).
#pragma once

#include <cstdint>
#include <functional>

namespace mpitrain {

constexpr int kExitWatchdog = 3;

class Watchdog {
 public:
  // Starts the checking thread (idempotent; later calls update the timeouts).
  static void start(double timeout_s, double first_timeout_s);
  // The step that collectives belong to, for the message.
  static void set_step(int64_t step);
  // Called once before aborting (e.g. ncclCommAbort).
  static void on_abort(std::function<void()> hook);

  // Marks one collective: the deadline runs from construction to destruction.
  class Scope {
   public:
    explicit Scope(const char* op);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };
};

// Test-only fault hook: with MPITRAIN_TEST_HANG="RANK:STEP" in the environment, that rank stops
// calling collectives (sleeps) once it reaches that step. Returns immediately otherwise.
void maybe_hang_for_test(int rank, int64_t step);

}  // namespace mpitrain
