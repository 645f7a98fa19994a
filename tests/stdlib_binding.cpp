// Which std::filesystem::remove_all does this executable call? Linked with the interposing library
// (tests/stdlib_interposer.cpp, standing for pip's libtorch) listed before libstdc++, it must still
// call libstdc++'s: test_stdlib_binding links mpitrain_stdlib_first and passes;
// test_stdlib_binding_control does not, and must reach the interposer (the check can fail). In a GPU build
// test_stdlib_binding links the real libtorch as well (through mpitrain_model), which is where
// remove_all jumped to address 0 on the H100 image; bench/gpu_check.sh runs it there.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

int main() {
  namespace fs = std::filesystem;
  const char* tmp = std::getenv("TMPDIR");
  const fs::path dir = fs::path(tmp && *tmp ? tmp : "/tmp") / ("mpitrain-stdlib-binding-" + std::to_string(getpid()));
  fs::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "file") << "x";
  const auto removed = fs::remove_all(dir);
  if (removed != 4 || fs::exists(dir)) {
    std::fprintf(stderr, "stdlib_binding: remove_all(%s) removed %ju entries, expected 4\n", dir.c_str(),
                 static_cast<uintmax_t>(removed));
    return 1;
  }
  std::printf("stdlib_binding: std::filesystem::remove_all is libstdc++'s (4 entries removed)\n");
  return 0;
}
