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

void list_attrs(hid_t obj, const std::string& indent, std::ostringstream& out) {
  H5O_info_t info;
  if (H5Oget_info2(obj, &info, H5O_INFO_NUM_ATTRS) < 0) return;
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

herr_t visit(hid_t root, const char* name, const H5O_info_t* info, void* op) {
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
  H5Ovisit2(f.get(), H5_INDEX_NAME, H5_ITER_INC, visit, &w, H5O_INFO_BASIC);
  return out.str();
}

}  // namespace mpitrain::h5
