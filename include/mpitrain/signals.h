// Graceful stops: SIGUSR1 (Slurm's warning before preemption or the time limit), SIGTERM, SIGINT
// and SIGUSR2 (what `mpitrain-run` sends through mpirun for a Ctrl-C) set a flag; the training
// loop checks it after every step, all ranks agree, write a checkpoint and exit with a documented
// code. A second SIGINT exits at once.
#pragma once

namespace mpitrain {

// Exit codes (docs/operations.md).
constexpr int kExitOk = 0;
constexpr int kExitError = 1;       // an internal failure on some rank (the job was aborted)
constexpr int kExitUsage = 2;       // bad input: config, data, checkpoint, command line
constexpr int kExitPreempted = 75;  // stopped by SIGUSR1/SIGTERM after a checkpoint: requeue me
constexpr int kExitInterrupted = 130;  // stopped by SIGINT/SIGUSR2 after a checkpoint

// Installs the handlers (idempotent).
void install_stop_signals();
// The first stop signal received (SIGUSR1, SIGUSR2, SIGTERM, SIGINT), or 0.
int pending_stop_signal();
// The exit code for a stop caused by `signo`.
int exit_code_for_signal(int signo);
// Tests: forget a received signal.
void clear_stop_signal();

}  // namespace mpitrain
