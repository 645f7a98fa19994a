// What the structure-aware fuzz targets (fuzz_shard, fuzz_checkpoint) share: reporting a broken
// property, FUZZ_VERBOSE tracing, and the per-process scratch directory their HDF5 files go to.
// Each target defines kFuzzTarget ("fuzz_shard", ...), which names it in messages and paths.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

extern const char* const kFuzzTarget;

[[noreturn]] inline void bug(const std::string& what) {
  std::fprintf(stderr, "\n%s: PROPERTY VIOLATED: %s\n", kFuzzTarget, what.c_str());
  std::abort();
}

// FUZZ_VERBOSE=1: one line per step, for replaying a single input by hand.
inline bool verbose() {
  static const bool v = std::getenv("FUZZ_VERBOSE") != nullptr;
  return v;
}

inline void note(const std::string& s) {
  if (verbose()) std::fprintf(stderr, "  %s\n", s.c_str());
}

// A new directory <base>/mpitrain-<target>-XXXXXX: base is FUZZ_SCRATCH (set by
// tests/fuzz_test.sh, which removes it afterwards: a crash skips the targets' atexit clean-up),
// else /dev/shm, else $TMPDIR or /tmp. Aborts if it cannot be made.
inline std::string make_scratch_dir() {
  std::string base = "/dev/shm";
  if (const char* s = std::getenv("FUZZ_SCRATCH"); s && *s) {
    base = s;
  } else if (::access(base.c_str(), W_OK) != 0) {
    const char* t = std::getenv("TMPDIR");
    base = t && *t ? t : "/tmp";
  }
  std::string tmpl = base + "/mpitrain-" + kFuzzTarget + "-XXXXXX";
  if (!::mkdtemp(tmpl.data())) {
    std::perror((std::string(kFuzzTarget) + ": mkdtemp").c_str());
    std::abort();
  }
  return tmpl;
}
