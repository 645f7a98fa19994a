// The checkpoint directory's lock (see dir_lock.h).
#include "mpitrain/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include "mpitrain/error.h"
#include "mpitrain/log.h"

namespace mpitrain {

std::string LockHolder::describe() const {
  if (host.empty() && pid == 0) return "holder unknown: the lock file names none";
  std::string s = concat("host ", host.empty() ? "?" : host, ", pid ", pid);
  if (!slurm_job.empty()) s += concat(", Slurm job ", slurm_job);
  if (!started.empty()) s += concat(", started ", started);
  return s;
}

LockHolder DirLock::self(const std::string& host) {
  LockHolder h;
  h.host = host;
  h.pid = static_cast<long>(::getpid());
  if (const char* job = std::getenv("SLURM_JOB_ID")) h.slurm_job = job;
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  h.started = buf;
  return h;
}

LockHolder DirLock::read_holder(const std::string& lock_file) {
  LockHolder h;
  std::ifstream in(lock_file);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "host") h.host = value;
    else if (key == "pid") h.pid = std::strtol(value.c_str(), nullptr, 10);
    else if (key == "slurm_job") h.slurm_job = value;
    else if (key == "started") h.started = value;
  }
  return h;
}

namespace {

bool alive_here(const LockHolder& h, const std::string& host) {
  return h.host == host && h.pid > 0 && (::kill(static_cast<pid_t>(h.pid), 0) == 0 || errno == EPERM);
}

bool same_file(int fd, const std::string& path) {
  struct stat a {}, b {};
  return ::fstat(fd, &a) == 0 && ::stat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& key, const LockHolder& self, bool force)
    : path_(dir + "/" + kFileName) {
  // A few rounds: another job's --force-unlock may replace the file between our open and flock.
  for (int round = 0; round < 5; ++round) {
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) throw UsageError(concat(key, ": cannot open the lock file ", path_, ": ", std::strerror(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) {
        log::warn(concat(key, ": the filesystem of '", dir, "' does not lock files (", std::strerror(err),
                         "): nothing stops a second job from using the same checkpoint directory"));
        return;
      }
      if (err != EWOULDBLOCK) throw Error(concat(path_, ": flock failed: ", std::strerror(err)));
      const LockHolder holder = read_holder(path_);
      if (!force)
        throw UsageError(concat(key, ": '", dir, "' is in use by another job (", holder.describe(), "; lock file ",
                                path_, "). Two jobs on one checkpoint directory overwrite each other's checkpoints: "
                                "stop that job or give this one another ", key,
                                "; if that job is gone and its lock stayed behind (a dead node on a shared "
                                "filesystem), --force-unlock overrides it"));
      if (alive_here(holder, self.host))
        throw UsageError(concat(key, ": '", dir, "' is locked by pid ", holder.pid, ", which is alive on this host (",
                                holder.describe(), "); --force-unlock overrides only the lock of a job that is gone"));
      // The holder is gone (or on another host, which the user vouches for): a new lock file
      // replaces the old one; the old holder, if it did live, keeps a lock on a file no one opens.
      overridden_ = holder;
      if (::unlink(path_.c_str()) != 0 && errno != ENOENT)
        throw UsageError(concat(key, ": --force-unlock cannot remove ", path_, ": ", std::strerror(errno)));
      continue;
    }
    if (!same_file(fd, path_)) {  // replaced after we opened it: lock the new one
      ::close(fd);
      continue;
    }
    std::ostringstream text;
    text << "host=" << self.host << "\npid=" << self.pid << "\nslurm_job=" << self.slurm_job
         << "\nstarted=" << self.started << "\n";
    const std::string s = text.str();
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, s.data(), s.size(), 0) != static_cast<ssize_t>(s.size())) {
      const int err = errno;
      ::close(fd);
      throw UsageError(concat(key, ": cannot write the lock file ", path_, ": ", std::strerror(err)));
    }
    ::fsync(fd);
    fd_ = fd;
    return;
  }
  throw UsageError(concat(key, ": the lock file ", path_, " keeps being replaced (several jobs forcing it?)"));
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  // Should the truncation fail, only the holder text stays behind: the lock goes with the close.
  [[maybe_unused]] const int emptied = ::ftruncate(fd_, 0);
  ::close(fd_);
}

}  // namespace mpitrain
