// A test's temporary directory, /tmp/mpitrain-<test binary>-XXXXXX, removed with the object.
// TempDir(true) is shared: rank 0 makes it and every rank of the world learns its name
// (collective); only rank 0 removes it, so a test whose other ranks still use it ends with a
// barrier before the directory goes out of scope.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "mpi_world.h"

class TempDir {
 public:
  explicit TempDir(bool shared = false) : owner_(!shared || world_rank() == 0) {
    if (owner_) {
      std::string tmpl = std::string("/tmp/mpitrain-") + program_invocation_short_name + "-XXXXXX";
      if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp " + tmpl + ": " + std::strerror(errno));
      path = tmpl;
    }
    if (shared) mpitrain::mpi::broadcast(path, 0, mpitrain::mpi::world());
  }
  ~TempDir() {
    std::error_code ec;
    if (owner_) std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string operator/(const std::string& name) const { return path + "/" + name; }

  std::string path;

 private:
  bool owner_;
};
