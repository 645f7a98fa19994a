// One job per checkpoint directory: an exclusive lock on <dir>/.mpitrain.lock, taken by rank 0 at
// start-up before anything is resumed or written, held until the process ends. The lock is the
// kernel's flock(2) on the open file: it vanishes with the process (kill -9, a crash), so a dead
// job never blocks the next one on a local filesystem. The file's text names the holder (host,
// pid, Slurm job, start time) for the refusal message. On NFS the lock is a network lock
// (NFSv4: released when the dead client's lease expires, about 90 s; NFSv3: through lockd/statd);
// Lustre needs the `flock` mount option. docs/operations.md says what is guaranteed where.
// Torch-free.
#pragma once

#include <optional>
#include <string>

namespace mpitrain {

// Who holds (or held) a lock, as its lock file says.
struct LockHolder {
  std::string host;
  long pid = 0;
  std::string slurm_job;  // empty outside Slurm
  std::string started;    // UTC, ISO 8601
  // "host node07, pid 4242, Slurm job 1234, started 2026-11-24T10:00:00Z"
  std::string describe() const;
};

class DirLock {
 public:
  static constexpr const char* kFileName = ".mpitrain.lock";

  // Locks `dir` (which must exist) for this process, writing `self` into the lock file.
  //  - Held by another process: UsageError "<key>: '<dir>' is in use by another job (host ...,
  //    pid ..., ...; lock file <dir>/.mpitrain.lock) ...".
  //  - force: a lock held by a process that is not alive on this host (a dead node's lock kept by
  //    a shared filesystem) is overridden: the lock file is replaced and `overridden` says whose
  //    lock that was. A live holder on this host is never overridden.
  //  - A filesystem that does not lock (ENOLCK, EOPNOTSUPP, ENOSYS): a warning, no lock.
  DirLock(const std::string& dir, const std::string& key, const LockHolder& self, bool force);
  ~DirLock();  // empties the holder text and releases the lock
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  bool held() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // The holder this lock replaced (force only); nullopt when there was none to override.
  const std::optional<LockHolder>& overridden() const { return overridden_; }

  // This process as a holder: host, getpid(), SLURM_JOB_ID, now.
  static LockHolder self(const std::string& host);
  // The holder named in a lock file (fields missing when the file is empty or foreign).
  static LockHolder read_holder(const std::string& lock_file);

 private:
  std::string path_;
  int fd_ = -1;
  std::optional<LockHolder> overridden_;
};

}  // namespace mpitrain
