// A small logging facade over spdlog.
//
// Why a facade: a CUDA libtorch (pip torch 2.x) ships fmt headers that clash with the system fmt
// Debian/Ubuntu's spdlog is built against, so no translation unit that includes torch may include
// spdlog or fmt. Only src/base/log.cpp does; this header exposes plain strings.
#pragma once

#include <string>

namespace mpitrain::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3 };

// Called once after MPI start-up. Console output comes from rank 0 only unless `all_ranks`.
void init(int rank, int world_size, const std::string& host);
void set_level(Level level);
bool enabled(Level level);  // would a message at `level` be printed (rank 0's view)?
void set_all_ranks(bool all_ranks);
Level parse_level(const std::string& name);  // throws std::invalid_argument

// "[rank 3 @ node07]": the prefix every error message carries.
std::string identity();
int rank();

// From here on this rank's lines also go to `path` (appended; every line with time, rank and
// host, flushed at once). std::runtime_error when it cannot be opened.
void open_rank_file(const std::string& path);
// A line for this rank's file only (a header when a run starts).
void file_only(const std::string& msg);

// Console messages of rank 0 (every rank's when set_all_ranks(true)); warnings of any rank, with
// its rank and host. Every rank's file gets its own lines. A warning every rank issues alike is
// issued by rank 0 only.
void debug(const std::string& msg);
void info(const std::string& msg);
void warn(const std::string& msg);
// Printed by whichever rank calls it, always, with the rank/host prefix.
void error(const std::string& msg);
// Printed by the calling rank regardless of rank (for per-rank diagnostics).
void any_rank(Level level, const std::string& msg);

}  // namespace mpitrain::log
