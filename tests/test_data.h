// The tests' data folder (tests/data of the checkout), for the test sources. Its absolute path is
// compiled into tests/mpi_main.cpp alone, so the other test sources hold no checkout's path and
// ccache reuses their objects in another clone (CI's fresh one) and in the MPICH-ABI build.
#pragma once

extern const char* const kTestDataDir;
