// The collective watchdog (see watchdog.h).
//
// One background thread per rank, started by attach() (several ranks) or start() (the deadline):
// every 10 ms it answers queries that arrived on the duplicate communicator and checks the
// deadline of the collective in progress. The main thread only touches atomics (Scope).
#include "mpitrain/watchdog.h"
#include "mpitrain/mpi_native.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/mpi_env.h"

namespace mpitrain {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

constexpr int kTagQuery = 0x5744;  // "WD"
constexpr int kTagReply = 0x5745;
constexpr auto kPoll = std::chrono::milliseconds(10);

// What a rank answers to "where are you?". Plain bytes on the wire (same binary everywhere).
struct Reply {
  int32_t rank = -1;
  int32_t in_collective = 0;  // inside collective #seq now
  int32_t firing = 0;         // its own watchdog expired and it is reporting
  int32_t pad = 0;
  int64_t seq = 0;      // collectives entered so far
  int64_t step = -1;    // Watchdog::set_step
  double secs = 0;      // in the current collective, or since leaving the last one
  char op[80] = {};     // the current collective, or the last one
};

struct State {
  // ---- written by the main thread on every collective (atomics only) ----
  std::atomic<uint64_t> version{0};  // odd while Scope updates the fields below (a seqlock)
  std::atomic<uint64_t> seq{0};
  std::atomic<const char*> op{nullptr};       // the collective in progress, or null
  std::atomic<const char*> last_op{nullptr};  // the latest collective entered
  std::atomic<int64_t> step{-1};
  std::atomic<bool> seen_first{false};

  // ---- the watchdog thread's own view, updated each time it looks (every 10 ms): the times
  // come from here, so Scope needs no clock ----
  uint64_t seen_seq = 0;
  bool seen_in = false;
  int64_t seen_since_ns = now_ns();  // when it first saw (seen_seq, seen_in)

  // ---- start() ----
  std::atomic<bool> armed{false};
  std::atomic<double> timeout_s{300}, first_timeout_s{900};

  // ---- attach(): fixed before the thread starts ----
  MPI_Comm comm = MPI_COMM_NULL;  // private duplicate of the world; null: peers are not asked
  int rank = 0, size = 1;
  std::string host = "localhost";
  std::vector<std::string> hosts;  // by world rank (only when comm is set)
  std::string no_peers_why;  // why comm is null with several ranks

  // ---- the thread ----
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread* thread = nullptr;
  std::function<void()> abort_hook;

  // ---- who reports: one rank per job, the lowest of those expiring together ----
  std::mutex fire_mu;
  bool firing = false;
  int queried_by = -1;  // lowest rank that has asked us; someone else is reporting
};

// Never destroyed: the thread may still run while static destructors run at exit.
State& state() {
  static State* s = new State;
  return *s;
}

thread_local int scope_depth = 0;

void copy_op(char (&dst)[80], const char* src) {
  std::snprintf(dst, sizeof dst, "%s", src ? src : "");
}

// This rank's position, consistent: re-read while a Scope is updating it (a seqlock; Scope is the
// only writer). The time in the current state is measured here, to within one poll (10 ms).
// Called from the watchdog thread only.
Reply snapshot() {
  auto& s = state();
  Reply r;
  r.rank = s.rank;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint64_t v = s.version.load(std::memory_order_acquire);
    if (v & 1) continue;
    const uint64_t seq = s.seq.load(std::memory_order_relaxed);
    const char* op = s.op.load(std::memory_order_relaxed);
    const char* last = s.last_op.load(std::memory_order_relaxed);
    r.step = s.step.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.version.load(std::memory_order_relaxed) != v) continue;
    r.seq = static_cast<int64_t>(seq);
    r.in_collective = op != nullptr;
    copy_op(r.op, op ? op : last);
    break;
  }
  const int64_t now = now_ns();
  if (static_cast<uint64_t>(r.seq) != s.seen_seq || (r.in_collective != 0) != s.seen_in) {
    s.seen_seq = static_cast<uint64_t>(r.seq);
    s.seen_in = r.in_collective != 0;
    s.seen_since_ns = now;
  }
  r.secs = static_cast<double>(now - s.seen_since_ns) * 1e-9;
  return r;
}

// Answers every query that has arrived. Called from the watchdog thread only.
void serve_queries() {
  auto& s = state();
  if (s.comm == MPI_COMM_NULL) return;
  for (int n = 0; n < 64; ++n) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kTagQuery, s.comm, &flag, &st) != MPI_SUCCESS || !flag) return;
    int32_t from = -1;
    if (MPI_Recv(&from, 1, MPI_INT32_T, st.MPI_SOURCE, kTagQuery, s.comm, MPI_STATUS_IGNORE) != MPI_SUCCESS)
      return;
    Reply r = snapshot();
    {
      std::lock_guard<std::mutex> lock(s.fire_mu);
      if (s.queried_by < 0 || st.MPI_SOURCE < s.queried_by) s.queried_by = st.MPI_SOURCE;
      r.firing = s.firing;
    }
    // Small and the asker's receive is posted: this completes at once. Never wait long for it
    // (an asker that died meanwhile): after 1 s give the request up and leak its buffer.
    auto* out = new Reply(r);
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(out, sizeof *out, MPI_BYTE, st.MPI_SOURCE, kTagReply, s.comm, &req) != MPI_SUCCESS) {
      delete out;
      continue;
    }
    const auto give_up = Clock::now() + std::chrono::seconds(1);
    int done = 0;
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && Clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (done) delete out;
    else if (req != MPI_REQUEST_NULL) MPI_Request_free(&req);
  }
}

// Asks every other rank where it is; waits at most kQueryDeadlineS. answered[r]: 1 answered.
std::vector<Reply> query_peers(std::vector<char>& answered) {
  auto& s = state();
  std::vector<Reply> replies(static_cast<size_t>(s.size));
  answered.assign(static_cast<size_t>(s.size), 0);
  std::vector<MPI_Request> recv(static_cast<size_t>(s.size), MPI_REQUEST_NULL);
  static int32_t query;  // outlives the sends: we abort right after
  query = s.rank;
  for (int r = 0; r < s.size; ++r) {
    if (r == s.rank) continue;
    if (MPI_Irecv(&replies[r], sizeof(Reply), MPI_BYTE, r, kTagReply, s.comm, &recv[r]) != MPI_SUCCESS) {
      recv[r] = MPI_REQUEST_NULL;
      continue;
    }
    MPI_Request send = MPI_REQUEST_NULL;
    if (MPI_Isend(&query, 1, MPI_INT32_T, r, kTagQuery, s.comm, &send) == MPI_SUCCESS)
      MPI_Request_free(&send);
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(Watchdog::kQueryDeadlineS);
  while (true) {
    bool pending = false;
    for (int r = 0; r < s.size; ++r) {
      if (recv[r] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      if (MPI_Test(&recv[r], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        recv[r] = MPI_REQUEST_NULL;  // a dead peer: counts as not answering
        continue;
      }
      if (flag) answered[r] = 1;
      else pending = true;
    }
    if (!pending || Clock::now() >= deadline) break;
    serve_queries();  // another rank may be asking us at the same time
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return replies;
}

std::string fmt_secs(double s) { return concat(std::fixed, std::setprecision(s < 10 ? 1 : 0), s); }

std::string step_phrase(int64_t step) { return step >= 0 ? concat(" at step ", step) : std::string(); }

std::string where(const Reply& p) {
  std::string out = p.step >= 0 ? concat("it is at step ", p.step, ", ") : std::string("it is ");
  if (p.in_collective)
    return out + concat("waiting in collective #", p.seq, " ", p.op, " for ", fmt_secs(p.secs), " s");
  if (p.seq == 0) return out + concat("outside any collective since start-up (", fmt_secs(p.secs), " s)");
  return out + concat("outside any collective for ", fmt_secs(p.secs), " s (its last was #", p.seq, " ", p.op, ")");
}

std::string rank_host(int r) {
  auto& s = state();
  return concat("rank ", r, " (host ", r < static_cast<int>(s.hosts.size()) ? s.hosts[r] : "?", ")");
}

// The one-line report: this rank's collective, then every rank it waits on and where that is.
std::string compose(const Reply& me, double limit, bool first, const std::vector<Reply>& replies,
                    const std::vector<char>& answered) {
  auto& s = state();
  std::string msg = concat("watchdog: ", me.op, " (collective #", me.seq, ")", step_phrase(me.step), " on rank ",
                           s.rank, " (host ", s.host, ") has not completed after ", fmt_secs(me.secs),
                           " s (", first ? "fault.first_collective_timeout_s" : "fault.collective_timeout_s",
                           " = ", limit, " s)");
  if (s.size == 1) return msg + ". Aborting.";
  if (s.comm == MPI_COMM_NULL)
    return msg + "; which rank stopped is unknown (" + s.no_peers_why + "). Aborting the job.";
  std::vector<int> behind, silent, waiting, other_op, passed;
  for (int r = 0; r < s.size; ++r) {
    if (r == s.rank) continue;
    const Reply& p = replies[r];
    if (!answered[r]) silent.push_back(r);
    else if (p.seq < me.seq) behind.push_back(r);
    else if (p.seq == me.seq && p.in_collective) (std::strcmp(p.op, me.op) == 0 ? waiting : other_op).push_back(r);
    else passed.push_back(r);
  }
  // The likeliest culprits first: ranks outside any collective, then the furthest behind.
  std::stable_sort(behind.begin(), behind.end(), [&](int a, int b) {
    const Reply &x = replies[a], &y = replies[b];
    return x.in_collective != y.in_collective ? !x.in_collective : x.seq < y.seq;
  });
  auto ranks = [](const std::vector<int>& v, const char* one, const char* many) {
    return concat(v.size() == 1 ? "rank " : "ranks ", rank_ranges(v), v.size() == 1 ? one : many);
  };
  constexpr size_t kDetail = 4;  // ranks described one by one; the rest as ranges
  for (size_t i = 0; i < behind.size() && i < kDetail; ++i)
    msg += concat("; ", rank_host(behind[i]), " has not arrived: ", where(replies[behind[i]]));
  if (behind.size() > kDetail)
    msg += "; " + ranks(std::vector<int>(behind.begin() + kDetail, behind.end()), " has not arrived either",
                        " have not arrived either");
  for (size_t i = 0; i < silent.size() && i < kDetail; ++i)
    msg += concat("; ", rank_host(silent[i]), " did not answer within ", Watchdog::kQueryDeadlineS,
                  " s (dead, frozen, or unreachable)");
  if (silent.size() > kDetail)
    msg += "; " + ranks(std::vector<int>(silent.begin() + kDetail, silent.end()), " did not answer either",
                        " did not answer either");
  for (int r : other_op)
    msg += concat("; ", rank_host(r), " is in collective #", me.seq, " too but it is ", replies[r].op,
                  ": the ranks call collectives in different orders");
  if (behind.empty() && silent.empty() && other_op.empty())
    msg += "; every rank has reached this collective, none is behind (an MPI or network stall?)";
  if (!waiting.empty()) msg += "; " + ranks(waiting, " is waiting in it too", " are waiting in it too");
  if (!passed.empty()) msg += "; " + ranks(passed, " has passed it", " have passed it");
  return msg + ". Aborting the job.";
}

[[noreturn]] void abort_job() {
  auto& s = state();
  if (s.abort_hook) s.abort_hook();
  // MPI_Abort from this thread: the main thread is stuck inside MPI, so nothing else can.
  abort_world(kExitWatchdog);
  std::this_thread::sleep_for(std::chrono::seconds(10));
  std::_Exit(kExitWatchdog);  // if MPI could not abort, dying still ends the job under mpirun
}

[[noreturn]] void fire(const Reply& me, double limit, bool first) {
  auto& s = state();
  bool yield = false;
  {
    std::lock_guard<std::mutex> lock(s.fire_mu);
    yield = s.queried_by >= 0;  // another rank's watchdog expired first and is reporting
    if (!yield) s.firing = true;
  }
  std::vector<char> answered;
  std::vector<Reply> replies;
  if (!yield && s.comm != MPI_COMM_NULL) {
    replies = query_peers(answered);
    for (int r = 0; r < s.rank; ++r)
      if (answered[r] && replies[r].firing) yield = true;  // a lower rank reports it
  }
  if (yield) {
    const auto since = Clock::now();
    // Keep answering while the reporting rank aborts the job; abort ourselves if it does not.
    const auto until = Clock::now() + std::chrono::duration<double>(Watchdog::kQueryDeadlineS + 10);
    while (Clock::now() < until) {
      serve_queries();
      std::this_thread::sleep_for(kPoll);
    }
    log::error(concat("watchdog: ", me.op, " (collective #", me.seq, ")", step_phrase(me.step),
                      " has not completed after ",
                      fmt_secs(me.secs + std::chrono::duration<double>(Clock::now() - since).count()), " s; rank ",
                      s.queried_by, " was reporting it but the job is still running. Aborting the job."));
    abort_job();
  }
  log::error(compose(me, limit, first, replies, answered));
  abort_job();
}

void check_deadline() {
  auto& s = state();
  const Reply me = snapshot();  // also keeps the times current
  if (!s.armed.load()) return;
  if (!me.in_collective) return;
  const bool first = !s.seen_first.load();
  const double limit = first ? s.first_timeout_s.load() : s.timeout_s.load();
  if (me.secs >= limit) fire(me, limit, first);
}

void run() {
  auto& s = state();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(s.mu);
      if (s.cv.wait_for(lock, kPoll, [&] { return s.stop; })) return;
    }
    serve_queries();
    check_deadline();
  }
}

void ensure_thread() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.thread && !s.stop) s.thread = new std::thread(run);
}

}  // namespace

void Watchdog::attach(MpiComm world_handle, bool thread_multiple) {
  const MPI_Comm world = to_mpi(world_handle);
  auto& s = state();
  s.seen_since_ns = now_ns();
  MPI_Comm_rank(world, &s.rank);
  MPI_Comm_size(world, &s.size);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  s.host.assign(name, static_cast<size_t>(len));
  if (s.size <= 1) return;
  // Every rank must take the same branch (MPI_Comm_dup is collective): agree on it.
  const char* peers = std::getenv("MPITRAIN_WATCHDOG_PEERS");
  const bool off = peers && std::strcmp(peers, "0") == 0;
  int mine = thread_multiple && !off ? 1 : 0, all = 0;
  if (MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, world) != MPI_SUCCESS || !all) {
    s.no_peers_why = off ? "peer queries are off: MPITRAIN_WATCHDOG_PEERS=0"
                     : !thread_multiple ? "MPI gives no MPI_THREAD_MULTIPLE: the other ranks cannot be asked"
                                        : "peer queries are off on some rank";
    return;
  }
  s.no_peers_why = "the watchdog communicator could not be set up";
  MPI_Comm dup = MPI_COMM_NULL;
  if (MPI_Comm_dup(world, &dup) != MPI_SUCCESS) return;
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  std::vector<char> names(static_cast<size_t>(s.size) * MPI_MAX_PROCESSOR_NAME);
  if (MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                    dup) != MPI_SUCCESS) {
    MPI_Comm_free(&dup);
    return;
  }
  for (int r = 0; r < s.size; ++r)
    s.hosts.emplace_back(&names[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME],
                         strnlen(&names[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME], MPI_MAX_PROCESSOR_NAME));
  s.comm = dup;
  ensure_thread();
}

void Watchdog::detach() {
  auto& s = state();
  std::thread* t = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stop = true;
    t = s.thread;
    s.thread = nullptr;
  }
  s.cv.notify_all();
  if (t) {
    t->join();
    delete t;
  }
  if (s.comm != MPI_COMM_NULL) MPI_Comm_free(&s.comm);
}

void Watchdog::start(double timeout_s, double first_timeout_s) {
  auto& s = state();
  s.timeout_s = timeout_s;
  s.first_timeout_s = first_timeout_s;
  s.armed = true;
  ensure_thread();
}

void Watchdog::set_step(int64_t step) { state().step = step; }

void Watchdog::on_abort(std::function<void()> hook) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.fire_mu);
  s.abort_hook = std::move(hook);
}

// The hot path: a few plain stores, no lock, no locked instruction, no clock read (the watchdog
// thread times what it sees). The main thread is the only writer: a seqlock.
namespace {
inline void begin_update(State& s) {
  s.version.store(s.version.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}
inline void end_update(State& s) {
  s.version.store(s.version.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}
}  // namespace

Watchdog::Scope::Scope(const char* op) : outer_(scope_depth++ == 0) {
  if (!outer_) return;
  auto& s = state();
  begin_update(s);
  s.seq.store(s.seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  s.last_op.store(op, std::memory_order_relaxed);
  s.op.store(op, std::memory_order_relaxed);
  end_update(s);
}

Watchdog::Scope::~Scope() {
  --scope_depth;
  if (!outer_) return;
  auto& s = state();
  begin_update(s);
  s.op.store(nullptr, std::memory_order_relaxed);
  end_update(s);
  if (!s.seen_first.load(std::memory_order_relaxed)) s.seen_first.store(true);
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
