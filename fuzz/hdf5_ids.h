// Live HDF5 identifiers by type, for the fuzz targets' "no handle leaks" property: after each
// input every file, dataset, attribute, ... that our code (or the harness) opened must be closed
// again, on error paths too. A leaked handle keeps its memory reachable through HDF5's ID tables,
// so LeakSanitizer would never see it; a long training job would.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <iterator>
#include <string>

struct Hdf5Ids {
  static constexpr H5I_type_t kTypes[] = {H5I_FILE,      H5I_GROUP,   H5I_DATATYPE,   H5I_DATASPACE,
                                          H5I_DATASET,   H5I_ATTR,    H5I_GENPROP_LST};
  static constexpr const char* kNames[] = {"file",      "group",     "datatype", "dataspace",
                                           "dataset",   "attribute", "property list"};
  hsize_t count[std::size(kTypes)] = {};

  static Hdf5Ids now() {
    Hdf5Ids ids;
    for (size_t i = 0; i < std::size(kTypes); ++i) H5Inmembers(kTypes[i], &ids.count[i]);
    return ids;
  }

  // "" if no type has more live identifiers than in `base`, else e.g. "1 dataset, 2 attribute".
  std::string grown_since(const Hdf5Ids& base) const {
    std::string out;
    for (size_t i = 0; i < std::size(kTypes); ++i)
      if (count[i] > base.count[i])
        out += (out.empty() ? "" : ", ") + std::to_string(count[i] - base.count[i]) + " " + kNames[i];
    return out;
  }
};
