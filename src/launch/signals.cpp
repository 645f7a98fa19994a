// Stop-signal flags (see signals.h). The handlers only store the signal number: everything else
// (agreement across ranks, the checkpoint) happens in the training loop, outside signal context.
#include "mpitrain/signals.h"

#include <unistd.h>

#include <csignal>
#include <initializer_list>

namespace mpitrain {
namespace {

volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_stop_signal(int signo) {
  if (signo == SIGINT && g_signal == SIGINT) {
    static const char msg[] = "mpitrain: second SIGINT, exiting now without a checkpoint\n";
    (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
    ::_exit(kExitInterrupted);
  }
  if (g_signal == 0) {
    g_signal = signo;
    // Once stopping, a launcher that has gone away (mpirun killed, its output pipes closed) must
    // not end this rank at its next log line before the checkpoint is on disk: writes to a closed
    // pipe then fail with EPIPE instead of raising SIGPIPE. (Before a stop signal SIGPIPE keeps
    // its default, so ranks orphaned by a dead launcher do not train on unseen.)
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  } else if (signo == SIGINT) {
    g_signal = SIGINT;  // a later Ctrl-C still arms the immediate exit
  }
}

}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(s, &sa, nullptr);
}

int pending_stop_signal() { return g_signal; }

int exit_code_for_signal(int signo) {
  return signo == SIGINT || signo == SIGUSR2 ? kExitInterrupted : signo == 0 ? kExitOk : kExitPreempted;
}

void clear_stop_signal() { g_signal = 0; }

}  // namespace mpitrain
