// HDF5 helpers: attributes, whole-dataset I/O, and error reporting that names the file.
#include "mpitrain/h5.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cstring>

namespace mpitrain::h5 {

void silence_errors() {
  static bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

File open_read(const std::string& path) {
  silence_errors();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw UsageError(path + ": no such file");
  if (!S_ISREG(st.st_mode)) throw UsageError(path + ": not a regular file");
  if (H5Fis_hdf5(path.c_str()) <= 0) throw UsageError(path + ": not an HDF5 file");
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) throw UsageError(path + ": cannot open HDF5 file (truncated or corrupt?)");
  return File(id);
}

File create(const std::string& path, uint64_t alignment) {
  silence_errors();
  PropList fapl(H5Pcreate(H5P_FILE_ACCESS), "file access properties");
  if (alignment > 0 && H5Pset_alignment(fapl.get(), 64 << 10, alignment) < 0)
    throw Error("HDF5: cannot set the alignment of " + path);
  // ... and the metadata (object headers, attributes) together in 1 MiB blocks rather than in 2 KiB
  // pieces between the datasets: a cold load reads it in a few large reads, not hundreds of small
  // random ones (a load of a 1.5 GB checkpoint 0.83 -> 0.75 s, bench/checkpoint_io.sh).
  if (alignment > 0 && H5Pset_meta_block_size(fapl.get(), 1 << 20) < 0)
    throw Error("HDF5: cannot set the metadata block size of " + path);
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (id < 0) throw UsageError(path + ": cannot create file (directory missing or not writable?)");
  return File(id);
}

bool exists(hid_t loc, const std::string& path) {
  // H5Lexists needs each intermediate link to exist; walk the path.
  size_t pos = 0;
  while (true) {
    size_t next = path.find('/', pos);
    std::string prefix = path.substr(0, next);
    if (!prefix.empty() && H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (next == std::string::npos) return true;
    pos = next + 1;
  }
}

Group create_group(hid_t loc, const std::string& name) {
  return Group(H5Gcreate2(loc, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
               "group " + name);
}

Group open_group(hid_t loc, const std::string& name) {
  return Group(H5Gopen2(loc, name.c_str(), H5P_DEFAULT), "group " + name);
}

std::vector<std::string> list(hid_t group) {
  std::vector<std::string> names;
  H5Literate(
      group, H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* op) -> herr_t {
        static_cast<std::vector<std::string>*>(op)->emplace_back(name);
        return 0;
      },
      &names);
  return names;
}

// ---- attributes --------------------------------------------------------------------------------

static void write_attr(hid_t obj, const std::string& name, hid_t type, hid_t space,
                       const void* data) {
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  Attribute a(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT),
              "attribute " + name);
  if (H5Awrite(a.get(), type, data) < 0) throw Error("HDF5: cannot write attribute " + name);
}

void set_attr(hid_t obj, const std::string& name, const std::string& value) {
  Datatype t(H5Tcopy(H5T_C_S1));
  H5Tset_size(t.get(), value.empty() ? 1 : value.size());
  H5Tset_strpad(t.get(), H5T_STR_NULLPAD);
  Dataspace s(H5Screate(H5S_SCALAR));
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  write_attr(obj, name, t.get(), s.get(), padded.data());
}

void set_attr(hid_t obj, const std::string& name, int64_t value) {
  Dataspace s(H5Screate(H5S_SCALAR));
  write_attr(obj, name, H5T_NATIVE_INT64, s.get(), &value);
}

void set_attr(hid_t obj, const std::string& name, double value) {
  Dataspace s(H5Screate(H5S_SCALAR));
  write_attr(obj, name, H5T_NATIVE_DOUBLE, s.get(), &value);
}

void set_attr(hid_t obj, const std::string& name, const std::vector<uint8_t>& bytes) {
  hsize_t n = bytes.size();
  Dataspace s(H5Screate_simple(1, &n, nullptr));
  write_attr(obj, name, H5T_NATIVE_UINT8, s.get(), bytes.data());
}

bool has_attr(hid_t obj, const std::string& name) { return H5Aexists(obj, name.c_str()) > 0; }

std::optional<std::string> get_attr_string(hid_t obj, const std::string& name) {
  if (!has_attr(obj, name)) return std::nullopt;
  Attribute a(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "attribute " + name);
  Datatype t(H5Aget_type(a.get()));
  if (H5Tget_class(t.get()) != H5T_STRING) return std::nullopt;
  // Strings come variable-length (h5py's Python str) or fixed-length (numpy bytes, this
  // project's writer), ASCII or UTF-8: the memory type takes the file's character set, since
  // HDF5 refuses to convert between the two.
  const H5T_cset_t cset = H5Tget_cset(t.get());
  if (H5Tis_variable_str(t.get()) > 0) {
    Datatype mem(H5Tcopy(H5T_C_S1));
    H5Tset_size(mem.get(), H5T_VARIABLE);
    H5Tset_cset(mem.get(), cset);
    char* p = nullptr;
    if (H5Aread(a.get(), mem.get(), &p) < 0 || !p) return std::nullopt;
    std::string out(p);
    H5free_memory(p);
    return out;
  }
  size_t n = H5Tget_size(t.get());
  std::string out(n, '\0');
  Datatype mem(H5Tcopy(H5T_C_S1));
  H5Tset_size(mem.get(), n);
  H5Tset_strpad(mem.get(), H5T_STR_NULLPAD);
  H5Tset_cset(mem.get(), cset);
  if (H5Aread(a.get(), mem.get(), out.data()) < 0) return std::nullopt;
  out.resize(std::strlen(out.c_str()));
  return out;
}

template <class T>
static std::optional<T> get_attr_scalar(hid_t obj, const std::string& name, hid_t mem_type,
                                        H5T_class_t a_class, H5T_class_t b_class) {
  if (!has_attr(obj, name)) return std::nullopt;
  Attribute a(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "attribute " + name);
  Datatype t(H5Aget_type(a.get()));
  H5T_class_t c = H5Tget_class(t.get());
  if (c != a_class && c != b_class) return std::nullopt;
  Dataspace s(H5Aget_space(a.get()));
  if (H5Sget_simple_extent_npoints(s.get()) != 1) return std::nullopt;
  T v{};
  if (H5Aread(a.get(), mem_type, &v) < 0) return std::nullopt;
  return v;
}

std::optional<int64_t> get_attr_int(hid_t obj, const std::string& name) {
  return get_attr_scalar<int64_t>(obj, name, H5T_NATIVE_INT64, H5T_INTEGER, H5T_INTEGER);
}

std::optional<double> get_attr_double(hid_t obj, const std::string& name) {
  return get_attr_scalar<double>(obj, name, H5T_NATIVE_DOUBLE, H5T_FLOAT, H5T_INTEGER);
}

std::optional<std::vector<uint8_t>> get_attr_bytes(hid_t obj, const std::string& name) {
  if (!has_attr(obj, name)) return std::nullopt;
  Attribute a(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "attribute " + name);
  Dataspace s(H5Aget_space(a.get()));
  hssize_t n = H5Sget_simple_extent_npoints(s.get());
  if (n < 0) return std::nullopt;
  std::vector<uint8_t> out(static_cast<size_t>(n));
  if (n > 0 && H5Aread(a.get(), H5T_NATIVE_UINT8, out.data()) < 0) return std::nullopt;
  return out;
}

// ---- datasets ----------------------------------------------------------------------------------

// A dataspace of shape `dims` (scalar when empty).
static Dataspace dataspace(const std::vector<hsize_t>& dims) {
  return Dataspace(dims.empty() ? H5Screate(H5S_SCALAR)
                                : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                   "dataspace");
}

Dataset write(hid_t loc, const std::string& name, hid_t type, const std::vector<hsize_t>& dims,
              const void* data) {
  Dataspace s = dataspace(dims);
  Dataset d(H5Dcreate2(loc, name.c_str(), type, s.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
            "dataset " + name);
  if (H5Dwrite(d.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    throw Error("HDF5: cannot write dataset " + name + " (disk full?)");
  return d;
}

Dataset create_allocated(hid_t loc, const std::string& name, hid_t type, const std::vector<hsize_t>& dims) {
  Dataspace s = dataspace(dims);
  PropList dcpl(H5Pcreate(H5P_DATASET_CREATE), "dataset creation properties");
  if (H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS) < 0 || H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY) < 0 ||
      H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER) < 0)
    throw Error("HDF5: cannot set the layout of dataset " + name);
  return Dataset(H5Dcreate2(loc, name.c_str(), type, s.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                 "dataset " + name + " (disk full?)");
}

std::optional<uint64_t> raw_offset(hid_t dataset, hid_t mem_type, uint64_t bytes) {
  PropList dcpl(H5Dget_create_plist(dataset), "dataset creation properties");
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS || H5Pget_nfilters(dcpl.get()) != 0) return std::nullopt;
  if (H5Pget_external_count(dcpl.get()) != 0) return std::nullopt;
  Datatype t(H5Dget_type(dataset), "dataset type");
  if (H5Tequal(t.get(), mem_type) <= 0) return std::nullopt;
  if (H5Dget_storage_size(dataset) != bytes) return std::nullopt;
  const haddr_t at = H5Dget_offset(dataset);
  if (at == HADDR_UNDEF) return std::nullopt;
  return static_cast<uint64_t>(at);
}

std::vector<hsize_t> shape(hid_t dataset) {
  Dataspace s(H5Dget_space(dataset));
  int nd = H5Sget_simple_extent_ndims(s.get());
  std::vector<hsize_t> dims(static_cast<size_t>(nd < 0 ? 0 : nd));
  if (nd > 0) H5Sget_simple_extent_dims(s.get(), dims.data(), nullptr);
  return dims;
}

// "<file>: dataset '/name'" for messages about an open object.
static std::string describe(hid_t obj) {
  std::string file = "HDF5 file", name = "?";
  if (ssize_t n = H5Fget_name(obj, nullptr, 0); n > 0) {
    file.assign(static_cast<size_t>(n) + 1, '\0');
    H5Fget_name(obj, file.data(), file.size());
    file.resize(static_cast<size_t>(n));
  }
  if (ssize_t n = H5Iget_name(obj, nullptr, 0); n > 0) {
    name.assign(static_cast<size_t>(n) + 1, '\0');
    H5Iget_name(obj, name.data(), name.size());
    name.resize(static_cast<size_t>(n));
  }
  return file + ": dataset '" + name + "'";
}

void read(hid_t dataset, hid_t type, void* out) {
  if (H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
    throw UsageError(describe(dataset) + ": cannot read (truncated or corrupt file?)");
}

uint32_t crc32(const void* data, size_t bytes) { return crc32_update(static_cast<uint32_t>(::crc32(0L, Z_NULL, 0)), data, bytes); }

uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes) {
  uLong c = crc;
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes uInt lengths
    uInt chunk = bytes > (1u << 30) ? (1u << 30) : static_cast<uInt>(bytes);
    c = ::crc32(c, p, chunk);
    p += chunk;
    bytes -= chunk;
  }
  return static_cast<uint32_t>(c);
}

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t bytes_b) {
  return static_cast<uint32_t>(::crc32_combine(crc_a, crc_b, static_cast<z_off_t>(bytes_b)));
}

}  // namespace mpitrain::h5
