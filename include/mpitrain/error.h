// Errors: one exception type for internal failures, one for bad user input, and the checks
// that turn a failed MPI/HDF5 call into a message naming rank, host, file and line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mpitrain {

// Something went wrong that is not the user's input: the job ends with exit code 1.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bad input (config, shard, checkpoint, command line): one line naming the file and key,
// exit code 2, printed once.
struct UsageError : Error {
  using Error::Error;
};

// Concatenates its arguments with operator<< (a tiny stand-in for std::format, which this
// toolchain lacks and which must not come from fmt: see log.h). Not called str(): c10::str would
// make unqualified calls with torch arguments ambiguous.
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// "a, b, c and 4 more": a list that stays on one line of an error message.
std::string first_few(const std::vector<std::string>& items);

// The items of a list as environment variables write them: split_list("eth0,,eth1", ',') is
// {"eth0", "", "eth1"}; "" gives {""}.
std::vector<std::string> split_list(const std::string& list, char sep);

// Text as one line of a table: newlines and tabs become spaces, runs of spaces one, no trailing space.
std::string one_line(std::string s);

// Throws Error("[rank 3 @ node07] MPI error at comm_mpi.cpp:41: ... (MPI_Allreduce)").
[[noreturn]] void fail(std::string_view lib, std::string_view what, const char* file, int line);

// MPI's own text for an error code.
std::string mpi_error_string(int rc);

}  // namespace mpitrain

#define MPITRAIN_CHECK(cond, msg)                                                          \
  do {                                                                                     \
    if (!(cond)) ::mpitrain::fail("check", ::mpitrain::concat(msg, " (" #cond ")"), __FILE__, \
                                  __LINE__);                                               \
  } while (0)

#define MPI_CHECK(call)                                                                   \
  do {                                                                                    \
    if (int rc_ = (call); rc_ != 0)                                                       \
      ::mpitrain::fail("MPI", ::mpitrain::mpi_error_string(rc_) + " in " #call, __FILE__, \
                       __LINE__);                                                         \
  } while (0)
