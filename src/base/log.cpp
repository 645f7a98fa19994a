// The logging facade's implementation: the one translation unit that includes spdlog.
#include "mpitrain/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <stdexcept>

namespace mpitrain::log {
namespace {

struct State {
  int rank = 0;
  int world = 1;
  std::string host = "localhost";
  bool all_ranks = false;
  std::shared_ptr<spdlog::logger> out;
  std::shared_ptr<spdlog::logger> file;  // this rank's log file, every line with rank, host and time
  State() {
    out = spdlog::stderr_color_mt("mpitrain");
    out->set_pattern("%^[%H:%M:%S] %v%$");
    out->set_level(spdlog::level::info);
  }
};

State& state() {
  static State s;
  return s;
}

spdlog::level::level_enum to_spd(Level l) {
  switch (l) {
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
  }
  return spdlog::level::info;
}

void to_file(Level level, const std::string& msg) {
  auto& s = state();
  if (s.file) s.file->log(to_spd(level), "{}", msg);
}

void emit(Level level, const std::string& msg, bool prefix) {
  auto& s = state();
  if (prefix)
    s.out->log(to_spd(level), "{} {}", identity(), msg);
  else
    s.out->log(to_spd(level), "{}", msg);
}

// "[2026-11-24 21:05:33.118] [rank 3 @ node07] [warning] ...": each line of a rank file says
// whose and when, so the files of all ranks can be merged and sorted.
std::string concat_pattern(int rank, const std::string& host) {
  return "[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) + " @ " + host + "] [%l] %v";
}

}  // namespace

void init(int rank, int world_size, const std::string& host) {
  auto& s = state();
  s.rank = rank;
  s.world = world_size;
  s.host = host;
}

void set_level(Level level) {
  auto& s = state();
  s.out->set_level(to_spd(level));
  if (s.file) s.file->set_level(to_spd(level));
}

void open_rank_file(const std::string& path) {
  auto& s = state();
  // Appended to: a resumed run's lines follow the earlier runs'. Throws spdlog_ex when it cannot
  // be opened; the caller names the key.
  try {
    auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
    auto file = std::make_shared<spdlog::logger>("mpitrain-rank-file", sink);
    file->set_pattern(concat_pattern(s.rank, s.host));
    file->set_level(s.out->level());
    file->flush_on(spdlog::level::debug);  // every line reaches the disk: the log of a rank that dies
    s.file = std::move(file);
  } catch (const spdlog::spdlog_ex& e) {
    throw std::runtime_error(e.what());
  }
}
bool enabled(Level level) { return state().out->should_log(to_spd(level)); }
void set_all_ranks(bool all_ranks) { state().all_ranks = all_ranks; }

Level parse_level(const std::string& name) {
  if (name == "debug") return Level::debug;
  if (name == "info") return Level::info;
  if (name == "warn") return Level::warn;
  if (name == "error") return Level::error;
  throw std::invalid_argument("unknown log level '" + name + "'");
}

std::string identity() {
  auto& s = state();
  return "[rank " + std::to_string(s.rank) + " @ " + s.host + "]";
}
int rank() { return state().rank; }

// The terminal shows rank 0's lines, and the warnings of every other rank (with its rank and host);
// at log.level debug every rank's lines. The rank file gets all of this rank's lines.
static void console(Level level, const std::string& msg) {
  auto& s = state();
  to_file(level, msg);
  if (s.all_ranks || (s.rank != 0 && level >= Level::warn)) emit(level, msg, true);
  else if (s.rank == 0) emit(level, msg, false);
}

void file_only(const std::string& msg) { to_file(Level::info, msg); }
void debug(const std::string& msg) { console(Level::debug, msg); }
void info(const std::string& msg) { console(Level::info, msg); }
void warn(const std::string& msg) { console(Level::warn, msg); }
void error(const std::string& msg) {
  to_file(Level::error, msg);
  emit(Level::error, msg, true);
}
void any_rank(Level level, const std::string& msg) {
  to_file(level, msg);
  emit(level, msg, true);
}

}  // namespace mpitrain::log
