// `mpitrain inspect`: a listing of an HDF5 file's attributes and datasets.
#include <cstdio>
#include <sstream>

#include "mpitrain/h5.h"

namespace mpitrain::h5 {
namespace {

std::string type_name(hid_t type) {
  switch (H5Tget_class(type)) {
    case H5T_INTEGER:
      return concat(H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int", 8 * H5Tget_size(type));
    case H5T_FLOAT: return concat("float", 8 * H5Tget_size(type));
    case H5T_STRING: return "string";
    default: return "other";
  }
}

std::string attr_value(hid_t obj, const std::string& name) {
  if (auto s = get_attr_string(obj, name)) {
    std::string v = *s;
    for (auto& c : v)
      if (c == '\n') c = ' ';
    if (v.size() > 72) v = v.substr(0, 69) + "...";
    return "'" + v + "'";
  }
  if (auto i = get_attr_int(obj, name)) return std::to_string(*i);
  if (auto d = get_attr_double(obj, name)) return concat(*d);
  if (auto b = get_attr_bytes(obj, name)) return concat("<", b->size(), " bytes>");
  return "<?>";
}

// The object-info calls that take a fields mask: H5Oget_info2/H5Ovisit2 with H5O_info_t in HDF5
// 1.10 (Debian 12), H5Oget_info3/H5Ovisit3 with H5O_info2_t from 1.12 (Debian 13: 1.14).
#if H5_VERSION_GE(1, 12, 0)
using ObjectInfo = H5O_info2_t;
herr_t object_info(hid_t obj, ObjectInfo* info, unsigned fields) { return H5Oget_info3(obj, info, fields); }
herr_t visit_objects(hid_t obj, H5O_iterate2_t op, void* data, unsigned fields) {
  return H5Ovisit3(obj, H5_INDEX_NAME, H5_ITER_INC, op, data, fields);
}
#else
using ObjectInfo = H5O_info_t;
herr_t object_info(hid_t obj, ObjectInfo* info, unsigned fields) { return H5Oget_info2(obj, info, fields); }
herr_t visit_objects(hid_t obj, H5O_iterate_t op, void* data, unsigned fields) {
  return H5Ovisit2(obj, H5_INDEX_NAME, H5_ITER_INC, op, data, fields);
}
#endif

void list_attrs(hid_t obj, const std::string& indent, std::ostringstream& out) {
  ObjectInfo info;
  if (object_info(obj, &info, H5O_INFO_NUM_ATTRS) < 0) return;
  for (hsize_t i = 0; i < info.num_attrs; ++i) {
    char name[256] = {};
    H5Aget_name_by_idx(obj, ".", H5_INDEX_CRT_ORDER, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT) < 0 &&
        H5Aget_name_by_idx(obj, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
    out << indent << "@" << name << " = " << attr_value(obj, name) << "\n";
  }
}

struct Walk {
  hid_t file;
  std::ostringstream* out;
  int datasets = 0;
};

herr_t visit(hid_t root, const char* name, const ObjectInfo* info, void* op) {
  auto* w = static_cast<Walk*>(op);
  if (info->type != H5O_TYPE_DATASET) return 0;
  if (++w->datasets > 200) return w->datasets == 201 ? (*w->out << "  ...\n", 0) : 0;
  Dataset ds(H5Dopen2(root, name, H5P_DEFAULT), name);
  Datatype t(H5Dget_type(ds.get()));
  auto dims = shape(ds.get());
  *w->out << "  /" << name << "  " << type_name(t.get()) << " [";
  for (size_t i = 0; i < dims.size(); ++i) *w->out << (i ? ", " : "") << dims[i];
  *w->out << "]\n";
  list_attrs(ds.get(), "      ", *w->out);
  return 0;
}

}  // namespace

std::string describe(const std::string& path) {
  File f = open_read(path);
  std::ostringstream out;
  out << path << "\n";
  list_attrs(f.get(), "  ", out);
  Walk w{f.get(), &out};
  visit_objects(f.get(), visit, &w, H5O_INFO_BASIC);
  return out.str();
}

}  // namespace mpitrain::h5
