// A stand-in for PyTorch's pip wheels, which export copies of libstdc++ functions from libtorch.so
// (std::filesystem among them, broken against a newer system libstdc++: see CMakeLists.txt,
// "libstdc++ before libtorch"). This library exports a std::filesystem::remove_all that exits 3,
// so an executable that binds to it instead of libstdc++'s fails (tests/stdlib_binding.cpp).
#include <ftw.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace std::filesystem {
uintmax_t remove_all(const path& p) {
  std::fprintf(stderr, "stdlib_interposer: remove_all(%s) bound to the interposing library, not libstdc++\n",
               p.c_str());
  // The test's directory is removed all the same (POSIX nftw, depth first), so no run leaves it behind.
  nftw(p.c_str(), [](const char* f, const struct stat*, int, struct FTW*) { return ::remove(f); }, 16,
       FTW_DEPTH | FTW_PHYS);
  std::_Exit(3);
}
}  // namespace std::filesystem
