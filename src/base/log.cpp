// The logging facade's implementation: the one translation unit that includes spdlog.
#include "mpitrain/log.h"

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

void emit(Level level, const std::string& msg, bool prefix) {
  auto& s = state();
  if (prefix)
    s.out->log(to_spd(level), "{} {}", identity(), msg);
  else
    s.out->log(to_spd(level), "{}", msg);
}

}  // namespace

void init(int rank, int world_size, const std::string& host) {
  auto& s = state();
  s.rank = rank;
  s.world = world_size;
  s.host = host;
}

void set_level(Level level) { state().out->set_level(to_spd(level)); }
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

static void console(Level level, const std::string& msg) {
  auto& s = state();
  if (s.rank == 0 && !s.all_ranks) emit(level, msg, false);
  else if (s.all_ranks) emit(level, msg, true);
}

void debug(const std::string& msg) { console(Level::debug, msg); }
void info(const std::string& msg) { console(Level::info, msg); }
void warn(const std::string& msg) { console(Level::warn, msg); }
void error(const std::string& msg) { emit(Level::error, msg, true); }
void any_rank(Level level, const std::string& msg) { emit(level, msg, true); }

}  // namespace mpitrain::log
