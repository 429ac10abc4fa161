// The hot path of one trie node, compiled: what tracer.signature.make_fast generates in
// Python, for the nodes whose every argument is a tensor, a recorded float or int, or a
// constant (tracer.native decides which). Called by the dispatch mode for each op that a hot
// segment expects next: it checks the call against the node's template by identity, records
// the op (new externals, floats), allocates the fresh outputs with at::empty_strided from
// cached metadata, and moves the segment on, touching the tracer's Python segment state
// (tracer.segment.Segment) exactly as the generated function does. A call that does not
// match returns the MISS sentinel before changing anything.
#include <torch/csrc/utils/pybind.h>
#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <unordered_map>
#include <vector>

namespace {

enum class Kind { Val, Ext, New, SameNew, Rec, Const, Is, Seq };

struct Check {
  Kind kind;
  Py_ssize_t index = 0;           // Val: value index; Ext: external index; New/SameNew: new
                                  // external's position; Rec: recorded slot
  PyObject* type = nullptr;       // Rec, Const: the exact type required
  PyObject* value = nullptr;      // Const: equal to it; Is: identical to it
  // New: the metadata a new external must have
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  c10::Device device = c10::Device(c10::kCPU);
  std::vector<Check> items;       // Seq: a list or tuple (``type``) of these, in order
};

struct Arg {
  PyObject* name = nullptr;       // keyword name, or nullptr for a positional argument
  Check check;
};

enum class Res { Fresh, Alias, AliasKw, None };

struct Out {
  Res kind;
  std::vector<int64_t> sizes, strides;
  at::TensorOptions options;
  Py_ssize_t arg = 0;
  PyObject* name = nullptr;
};

struct Strings {
  PyObject *outw, *exts, *ids, *extw, *floats, *stor, *hot, *start, *node, *expect, *hot_next,
      *ends_here, *finish, *seg, *fast, *spec, *func, *paused, *counters, *ops_host, *device;
};
Strings s;

struct FastNode {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* node;     // the trie node (S.node = node)
  PyObject* plain;    // the set of plain tensor types
  PyObject* miss;     // the MISS sentinel
  PyObject* empty;    // the EMPTY tuple of floats
  PyObject* view;     // a view op: the op to call (its results are the node's), else nullptr
  PyObject* func;     // the OpOverload it serves (borrowed from the node's spec, which it holds)
  std::vector<Arg>* args;
  std::vector<Out>* outs;
  Py_ssize_t n_args, n_kwargs, n_recs, n_new;
  int tree;           // 0 none, 1 one, 2 tuple, 3 list
  bool first;         // depth 1: the segment starts here
  bool check_dtype;
  at::ScalarType default_dtype;
};

PyObject* fetch(PyObject* args, PyObject* kwargs, const Arg& a, Py_ssize_t pos) {
  if (a.name == nullptr) return PyTuple_GET_ITEM(args, pos);
  return PyDict_GetItem(kwargs, a.name);  // borrowed, or nullptr
}

bool same_ints(c10::IntArrayRef got, const std::vector<int64_t>& want) {
  return got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin());
}

// Is ``t`` already a source of the segment (tracer.segment.Segment.source)?
int known(PyObject* t, PyObject* ids, PyObject* outw, PyObject* extw) {
  PyObject* key = PyLong_FromVoidPtr(t);
  if (key == nullptr) return -1;
  PyObject* idx = PyDict_GetItemWithError(ids, key);
  Py_DECREF(key);
  if (idx == nullptr) return PyErr_Occurred() ? -1 : 0;
  Py_ssize_t i = PyLong_AsSsize_t(idx);
  if (i == -1 && PyErr_Occurred()) return -1;
  PyObject* list = i >= 0 ? outw : extw;
  Py_ssize_t at = i >= 0 ? i : ~i;
  if (at >= PyList_GET_SIZE(list)) return 0;
  return PyWeakref_GET_OBJECT(PyList_GET_ITEM(list, at)) == t;
}

struct Seen {
  PyObject *outw, *exts, *ids, *extw;
  PyObject** recs;
  PyObject** fresh_exts;
};

// One argument against its check: 1 it matches, 0 it does not, -1 an error is set.
int check_one(FastNode* f, const Check& c, PyObject* v, Seen& st) {
  switch (c.kind) {
    case Kind::Val:
      if (c.index >= PyList_GET_SIZE(st.outw)) return 0;
      return PyWeakref_GET_OBJECT(PyList_GET_ITEM(st.outw, c.index)) == v;
    case Kind::Ext:
      return c.index < PyList_GET_SIZE(st.exts) && PyList_GET_ITEM(st.exts, c.index) == v;
    case Kind::SameNew:
      return st.fresh_exts[c.index] == v;
    case Kind::New: {
      int in_plain = PySet_Contains(f->plain, (PyObject*)Py_TYPE(v));
      if (in_plain != 1) return in_plain;
      const at::Tensor& t = THPVariable_Unpack(v);
      if (t.layout() != at::kStrided || t.scalar_type() != c.dtype ||
          !same_ints(t.sizes(), c.sizes) || !same_ints(t.strides(), c.strides) ||
          t.device() != c.device)
        return 0;
      int seen = known(v, st.ids, st.outw, st.extw);
      if (seen != 0) return seen < 0 ? -1 : 0;
      for (Py_ssize_t j = 0; j < c.index; j++)
        if (st.fresh_exts[j] == v) return 0;
      st.fresh_exts[c.index] = v;
      return 1;
    }
    case Kind::Rec:
      if ((PyObject*)Py_TYPE(v) != c.type) return 0;
      st.recs[c.index] = v;
      return 1;
    case Kind::Const: {
      if ((PyObject*)Py_TYPE(v) != c.type) return 0;
      int ne = PyObject_RichCompareBool(v, c.value, Py_NE);
      return ne < 0 ? -1 : !ne;
    }
    case Kind::Is:
      return v == c.value;
    case Kind::Seq: {
      if ((PyObject*)Py_TYPE(v) != c.type) return 0;
      Py_ssize_t n = (Py_ssize_t)c.items.size();
      if (PySequence_Fast_GET_SIZE(v) != n) return 0;  // an exact list or tuple
      for (Py_ssize_t j = 0; j < n; j++) {
        int r = check_one(f, c.items[j], PySequence_Fast_GET_ITEM(v, j), st);
        if (r != 1) return r;
      }
      return 1;
    }
  }
  return 0;
}

// The checks: 1 the call matches, 0 it does not, -1 an error is set.
int matches(FastNode* f, PyObject* args, PyObject* kwargs, Seen& st) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != f->n_args) return 0;
  Py_ssize_t nk = kwargs == nullptr ? 0 : PyDict_GET_SIZE(kwargs);
  if (nk != f->n_kwargs) return 0;
  Py_ssize_t pos = 0;
  for (const Arg& a : *f->args) {
    PyObject* v = fetch(args, kwargs, a, pos);
    if (a.name == nullptr) pos++;
    if (v == nullptr) return 0;
    int r = check_one(f, a.check, v, st);
    if (r != 1) return r;
  }
  return 1;
}

// Register ``t`` under ``index`` in the segment's id map (``ids[id(t)] = index``).
bool set_id(PyObject* ids, PyObject* t, Py_ssize_t index) {
  PyObject* key = PyLong_FromVoidPtr(t);
  PyObject* val = PyLong_FromSsize_t(index);
  bool ok = key && val && PyDict_SetItem(ids, key, val) == 0;
  Py_XDECREF(key);
  Py_XDECREF(val);
  return ok;
}

bool append_new(PyObject* list, PyObject* item) {  // steals ``item``
  if (item == nullptr) return false;
  int rc = PyList_Append(list, item);
  Py_DECREF(item);
  return rc == 0;
}

// Attributes of the tracer's objects, most of them ``__slots__`` (tracer.segment.Segment,
// tracer.trie.Node): a slot is read and written at its offset in the object, which its
// member descriptor gives once per (type, name), without the generic lookup through the
// type's dictionaries (most of the per-op cost of the fast path went there). Anything else,
// or a slot not set (which raises AttributeError), takes the generic path.
struct SlotOf {
  PyTypeObject* type = nullptr;
  PyObject* name = nullptr;
  Py_ssize_t offset = -1;  // -1: not an object slot of ``type``
};
SlotOf slot_cache[256];  // direct-mapped by (type, name): a miss only costs a lookup

Py_ssize_t slot_offset(PyObject* o, PyObject* name) {
  PyTypeObject* tp = Py_TYPE(o);
  SlotOf& e = slot_cache[(((uintptr_t)tp >> 4) ^ ((uintptr_t)name >> 4)) & 255];
  if (e.type == tp && e.name == name) return e.offset;
  Py_ssize_t offset = -1;
  PyObject* d = _PyType_Lookup(tp, name);  // borrowed
  if (d != nullptr && Py_TYPE(d) == &PyMemberDescr_Type) {
    PyMemberDef* m = ((PyMemberDescrObject*)d)->d_member;
    if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) offset = m->offset;
  }
  // the entry keeps its type (and so the offset) and name alive
  Py_INCREF(tp);
  Py_INCREF(name);
  Py_XDECREF((PyObject*)e.type);
  Py_XDECREF(e.name);
  e = {tp, name, offset};
  return offset;
}

PyObject* attr(PyObject* o, PyObject* name) {
  Py_ssize_t offset = slot_offset(o, name);
  if (offset >= 0) {
    PyObject* v = *(PyObject**)((char*)o + offset);
    if (v != nullptr) {
      Py_INCREF(v);
      return v;
    }
  }
  return PyObject_GetAttr(o, name);
}

int set_attr(PyObject* o, PyObject* name, PyObject* v) {
  Py_ssize_t offset = slot_offset(o, name);
  if (offset < 0) return PyObject_SetAttr(o, name, v);
  PyObject** p = (PyObject**)((char*)o + offset);
  PyObject* old = *p;
  Py_INCREF(v);
  *p = v;
  Py_XDECREF(old);
  return 0;
}

PyObject* run(FastNode* f, PyObject* args, PyObject* kwargs, PyObject* S) {
  PyObject *outw = attr(S, s.outw), *exts = attr(S, s.exts), *ids = attr(S, s.ids),
           *extw = attr(S, s.extw);
  PyObject* result = nullptr;
  std::vector<PyObject*> recs(f->n_recs, nullptr), fresh(f->n_new, nullptr), made;
  int ok = -1;
  if (outw && exts && ids && extw) {
    if (!PyList_Check(outw) || !PyList_Check(exts) || !PyList_Check(extw) ||
        !PyDict_Check(ids)) {
      PyErr_SetString(PyExc_TypeError, "fast path: unexpected segment state");
    } else {
      Seen st{outw, exts, ids, extw, recs.data(), fresh.data()};
      ok = matches(f, args, kwargs, st);
      if (ok == 1 && f->check_dtype &&
          c10::typeMetaToScalarType(at::get_default_dtype()) != f->default_dtype)
        ok = 0;
    }
  }
  if (ok == 1 && f->first) {  // ``if not S.hot and not S.start(): return MISS``
    PyObject* hot = attr(S, s.hot);
    int is_hot = hot ? PyObject_IsTrue(hot) : -1;
    Py_XDECREF(hot);
    if (is_hot < 0) {
      ok = -1;
    } else if (!is_hot) {
      PyObject* started = PyObject_CallMethodNoArgs(S, s.start);
      int yes = started ? PyObject_IsTrue(started) : -1;
      Py_XDECREF(started);
      ok = yes < 0 ? -1 : yes;
    }
  }
  if (ok != 1) {
    Py_XDECREF(outw); Py_XDECREF(exts); Py_XDECREF(ids); Py_XDECREF(extw);
    if (ok == 0) { Py_INCREF(f->miss); return f->miss; }
    return nullptr;
  }
  // The call matches: record it, as the generated function does.
  bool good = true;
  for (Py_ssize_t j = 0; good && j < f->n_new; j++) {
    PyObject* t = fresh[j];
    good = set_id(ids, t, ~PyList_GET_SIZE(exts)) && PyList_Append(exts, t) == 0 &&
           append_new(extw, PyWeakref_NewRef(t, nullptr));
  }
  PyObject* floats = good ? attr(S, s.floats) : nullptr;
  good = floats != nullptr;
  if (good) {
    PyObject* rec;
    if (f->n_recs) {
      rec = PyTuple_New(f->n_recs);
      for (Py_ssize_t j = 0; rec && j < f->n_recs; j++) {
        Py_INCREF(recs[j]);
        PyTuple_SET_ITEM(rec, j, recs[j]);
      }
    } else {
      rec = f->empty;
      Py_INCREF(rec);
    }
    good = append_new(floats, rec);
    Py_DECREF(floats);
  }
  PyObject* stor = good ? attr(S, s.stor) : nullptr;
  good = good && stor != nullptr;
  if (good && f->view != nullptr) {  // ``r = op(*a, **k)``; each leaf a value, no storage ref
    result = PyObject_Call(f->view, args, kwargs);
    good = result != nullptr;
    PyObject* seq = nullptr;
    if (good && f->tree != 1) {
      seq = PySequence_Fast(result, "fast path: a view's results");
      good = seq != nullptr;
    }
    Py_ssize_t n = !good ? 0 : f->tree == 1 ? 1 : PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t j = 0; good && j < n; j++) {
      PyObject* leaf = f->tree == 1 ? result : PySequence_Fast_GET_ITEM(seq, j);
      good = set_id(ids, leaf, PyList_GET_SIZE(outw)) &&
             append_new(outw, PyWeakref_NewRef(leaf, nullptr)) &&
             PyList_Append(stor, Py_None) == 0;
    }
    Py_XDECREF(seq);
    if (!good) Py_CLEAR(result);
  }
  for (const Out& o : *f->outs) {
    if (f->view != nullptr) break;
    if (!good) break;
    PyObject* leaf = nullptr;
    if (o.kind == Res::Fresh) {
      try {
        at::Tensor t = at::empty_strided(o.sizes, o.strides, o.options);
        c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
        leaf = THPVariable_Wrap(std::move(t));
        good = leaf && set_id(ids, leaf, PyList_GET_SIZE(outw)) &&
               append_new(outw, PyWeakref_NewRef(leaf, nullptr)) &&
               append_new(stor, PyLong_FromVoidPtr(c10::raw::intrusive_ptr::make_weak(impl)));
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        good = false;
      }
    } else if (o.kind == Res::Alias) {
      leaf = PyTuple_GET_ITEM(args, o.arg);
      Py_INCREF(leaf);
    } else if (o.kind == Res::AliasKw) {
      leaf = PyDict_GetItem(kwargs, o.name);
      Py_XINCREF(leaf);
      good = leaf != nullptr;
    } else {
      leaf = Py_None;
      Py_INCREF(leaf);
    }
    if (leaf) made.push_back(leaf);
  }
  Py_XDECREF(stor);
  if (good && f->view == nullptr) {
    if (f->tree == 0) {
      result = Py_None;
      Py_INCREF(result);
    } else if (f->tree == 1) {
      result = made[0];
      Py_INCREF(result);
    } else {
      Py_ssize_t n = (Py_ssize_t)made.size();
      result = f->tree == 2 ? PyTuple_New(n) : PyList_New(n);
      for (Py_ssize_t j = 0; result && j < n; j++) {
        Py_INCREF(made[j]);
        if (f->tree == 2) PyTuple_SET_ITEM(result, j, made[j]);
        else PyList_SET_ITEM(result, j, made[j]);
      }
    }
  }
  for (PyObject* m : made) Py_DECREF(m);
  Py_DECREF(outw); Py_DECREF(exts); Py_DECREF(ids); Py_DECREF(extw);
  if (result == nullptr) return nullptr;
  // ``S.node = N; S.expect = N.hot_next; if N.ends_here: S.finish()``
  PyObject* next = attr(f->node, s.hot_next);
  bool moved = next && set_attr(S, s.node, f->node) == 0 &&
               set_attr(S, s.expect, next) == 0;
  Py_XDECREF(next);
  if (moved) {
    PyObject* ends = attr(f->node, s.ends_here);
    int end = ends ? PyObject_IsTrue(ends) : -1;
    Py_XDECREF(ends);
    if (end > 0) {
      PyObject* done = PyObject_CallMethodNoArgs(S, s.finish);
      moved = done != nullptr;
      Py_XDECREF(done);
    }
    moved = moved && end >= 0;
  }
  if (!moved) {
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

PyObject* fast_vectorcall(PyObject* self, PyObject* const* argv, size_t nargsf,
                          PyObject* kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (n != 3 || kwnames != nullptr) {
    PyErr_SetString(PyExc_TypeError, "fast path: called as fast(args, kwargs, segment)");
    return nullptr;
  }
  PyObject* kwargs = argv[1];
  if (kwargs != Py_None && !PyDict_Check(kwargs)) {
    PyErr_SetString(PyExc_TypeError, "fast path: kwargs must be a dict");
    return nullptr;
  }
  return run((FastNode*)self, argv[0], kwargs == Py_None ? nullptr : kwargs, argv[2]);
}

void release_check(Check& c) {
  Py_XDECREF(c.type);
  Py_XDECREF(c.value);
  for (Check& item : c.items) release_check(item);
}

void release_checks(std::vector<Arg>* args) {
  for (Arg& a : *args) {
    Py_XDECREF(a.name);
    release_check(a.check);
  }
}

void fast_dealloc(PyObject* self) {
  FastNode* f = (FastNode*)self;
  Py_XDECREF(f->node);
  Py_XDECREF(f->plain);
  Py_XDECREF(f->miss);
  Py_XDECREF(f->empty);
  Py_XDECREF(f->view);
  if (f->args) { release_checks(f->args); delete f->args; }
  if (f->outs) {
    for (Out& o : *f->outs) Py_XDECREF(o.name);
    delete f->outs;
  }
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject FastNodeType = {PyVarObject_HEAD_INIT(nullptr, 0)};

std::vector<int64_t> ints(py::handle seq) {
  std::vector<int64_t> out;
  for (py::handle x : seq) out.push_back(x.cast<int64_t>());
  return out;
}

// A check from its Python description: (kind, index, type, value, meta) where meta is
// (dtype, sizes, strides, device) for a new external.
Check make_check(py::tuple d) {
  Check c;
  std::string kind = d[0].cast<std::string>();
  c.index = d[1].cast<Py_ssize_t>();
  if (kind == "val") c.kind = Kind::Val;
  else if (kind == "ext") c.kind = Kind::Ext;
  else if (kind == "new") c.kind = Kind::New;
  else if (kind == "same_new") c.kind = Kind::SameNew;
  else if (kind == "rec") c.kind = Kind::Rec;
  else if (kind == "const") c.kind = Kind::Const;
  else if (kind == "is") c.kind = Kind::Is;
  else if (kind == "seq") c.kind = Kind::Seq;
  else throw std::invalid_argument("fast path: unknown check " + kind);
  if (!d[2].is_none()) c.type = py::object(d[2]).release().ptr();
  if (c.kind == Kind::Const || c.kind == Kind::Is)
    c.value = py::object(d[3]).release().ptr();
  if (c.kind == Kind::Seq)
    for (py::handle item : d[3].cast<py::list>())
      c.items.push_back(make_check(item.cast<py::tuple>()));
  if (c.kind == Kind::New) {
    py::tuple m = d[4].cast<py::tuple>();
    c.dtype = m[0].cast<at::ScalarType>();
    c.sizes = ints(m[1]);
    c.strides = ints(m[2]);
    c.device = m[3].cast<c10::Device>();
  }
  return c;
}

}  // namespace

// The mode's ``__torch_dispatch__`` (tracer.mode._dispatch, in C): the op the segment expects
// next goes to its node's fast path; a host-scalar op that cannot touch the segment runs at
// once (host_op); anything else, or a miss, goes to ``mode._slow``.
struct Dispatch {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* mode;
  PyObject* slow;       // mode._slow
  PyObject* miss;
  PyObject* empty;      // the shared empty kwargs the fast paths get
  PyObject* plain;      // the set of plain tensor types
  PyObject* host_funcs; // ops mode._slow ran as host scalars (tracer.mode.host_funcs)
};

PyTypeObject DispatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// A tensor argument of a host-scalar op that cannot concern the segment: a plain 0-dim cpu
// tensor alone on memory PyTorch allocated (tracer.segment._alone: no other tensor, so no
// external of the segment, aliases it) and not one of the segment's own tensors. 1 yes, 0 no
// (or not sure), -1 an error is set.
int lone_host_scalar(Dispatch* d, PyObject* v, PyObject* S) {
  int in_plain = PySet_Contains(d->plain, (PyObject*)Py_TYPE(v));
  if (in_plain != 1) return in_plain;
  const at::Tensor& t = THPVariable_Unpack(v);
  if (t.dim() != 0 || !t.device().is_cpu() || t.layout() != at::kStrided ||
      t.is_quantized() || t._is_zerotensor())
    return 0;
  const c10::Storage& storage = t.storage();
  if (!storage.resizable() || storage.use_count() != 1) return 0;
  PyObject* ids = attr(S, s.ids);
  PyObject* outw = ids ? attr(S, s.outw) : nullptr;
  PyObject* extw = outw ? attr(S, s.extw) : nullptr;
  int seen = extw ? known(v, ids, outw, extw) : -1;
  Py_XDECREF(ids);
  Py_XDECREF(outw);
  Py_XDECREF(extw);
  return seen < 0 ? -1 : !seen;
}

// Note [Host scalars] (tracer.mode), the common case in C: an op mode._slow has run on the
// host before, whose every tensor is a lone host scalar (an optimizer's step count), runs at
// once and is counted as mode._slow counts it. nullptr with no error set: not such a call
// (mode._slow decides).
PyObject* host_op(Dispatch* d, PyObject* func, PyObject* args, PyObject* kwargs, PyObject* S) {
  int known_op = PyDict_Contains(d->host_funcs, func);
  if (known_op != 1) return nullptr;
  if (kwargs != nullptr && PyDict_Contains(kwargs, s.device) != 0) return nullptr;
  PyObject* paused = PyObject_GetAttr(d->mode, s.paused);
  if (paused == nullptr) return nullptr;
  int busy = PyObject_IsTrue(paused);
  Py_DECREF(paused);
  if (busy != 0) return nullptr;
  int n_tensors = 0;
  auto visit = [&](PyObject* x) -> int {  // 1 fine, 0 not a lone host scalar, -1 error
    if (THPVariable_Check(x)) {
      n_tensors++;
      return lone_host_scalar(d, x, S);
    }
    if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {
      PyObject* seq = PySequence_Fast(x, "");
      if (seq == nullptr) return -1;
      int ok = 1;
      for (Py_ssize_t i = 0; ok == 1 && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject* y = PySequence_Fast_GET_ITEM(seq, i);
        if (THPVariable_Check(y)) {
          n_tensors++;
          ok = lone_host_scalar(d, y, S);
        }
      }
      Py_DECREF(seq);
      return ok;
    }
    return 1;
  };
  int ok = 1;
  for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(args); i++)
    ok = visit(PyTuple_GET_ITEM(args, i));
  if (ok == 1 && kwargs != nullptr) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (ok == 1 && PyDict_Next(kwargs, &pos, &key, &value)) ok = visit(value);
  }
  if (ok != 1 || n_tensors == 0) return nullptr;  // an error, if any, propagates
  PyObject* counters = PyObject_GetAttr(d->mode, s.counters);
  if (counters == nullptr) return nullptr;
  PyObject* n = PyObject_GetAttr(counters, s.ops_host);
  static PyObject* one = PyLong_FromLong(1);
  PyObject* n1 = n ? PyNumber_Add(n, one) : nullptr;
  int set = n1 ? PyObject_SetAttr(counters, s.ops_host, n1) : -1;
  Py_XDECREF(n);
  Py_XDECREF(n1);
  Py_DECREF(counters);
  if (set < 0) return nullptr;
  return PyObject_Call(func, args, kwargs);
}

PyObject* dispatch_vectorcall(PyObject* self, PyObject* const* argv, size_t nargsf,
                              PyObject* kwnames) {
  Dispatch* d = (Dispatch*)self;
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || n < 3 || n > 4) {
    PyErr_SetString(PyExc_TypeError, "__torch_dispatch__(func, types, args=(), kwargs=None)");
    return nullptr;
  }
  PyObject *func = argv[0], *args = argv[2];
  PyObject* kwargs = n == 4 ? argv[3] : Py_None;
  bool no_kwargs = kwargs == Py_None || (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0);
  PyObject* S = PyObject_GetAttr(d->mode, s.seg);
  if (S == nullptr) return nullptr;
  PyObject* e = attr(S, s.expect);
  PyObject* r = nullptr;
  if (e != nullptr && e != Py_None) {
    PyObject* fast = attr(e, s.fast);
    if (fast != nullptr && Py_TYPE(fast) == &FastNodeType) {
      FastNode* f = (FastNode*)fast;
      if (f->func == func) r = run(f, args, no_kwargs ? nullptr : kwargs, S);
    } else if (fast != nullptr) {
      PyObject* spec = PyObject_GetAttr(e, s.spec);
      PyObject* want = spec ? PyObject_GetAttr(spec, s.func) : nullptr;
      Py_XDECREF(spec);
      if (want == nullptr) {  // the error propagates
        Py_DECREF(fast);
        fast = nullptr;
      } else {
        if (want == func)
          r = PyObject_CallFunctionObjArgs(fast, args, no_kwargs ? d->empty : kwargs, S,
                                           nullptr);
        Py_DECREF(want);
      }
    }
    if (fast == nullptr) {
      Py_DECREF(S);
      Py_DECREF(e);
      return nullptr;
    }
    Py_DECREF(fast);
  }
  Py_XDECREF(e);
  if (e == nullptr || (r != nullptr && r != d->miss) || (r == nullptr && PyErr_Occurred())) {
    Py_DECREF(S);
    return r;
  }
  Py_XDECREF(r);
  PyObject* host = host_op(d, func, args, no_kwargs ? nullptr : kwargs, S);
  Py_DECREF(S);
  if (host != nullptr || PyErr_Occurred()) return host;
  PyObject* kw = no_kwargs ? PyDict_New() : kwargs;  // ``kwargs or {}``
  if (kw == nullptr) return nullptr;
  PyObject* out = PyObject_CallFunctionObjArgs(d->slow, func, args, kw, nullptr);
  if (no_kwargs) Py_DECREF(kw);
  return out;
}

void dispatch_dealloc(PyObject* self) {
  Dispatch* d = (Dispatch*)self;
  PyObject_GC_UnTrack(self);
  Py_XDECREF(d->mode);
  Py_XDECREF(d->slow);
  Py_XDECREF(d->miss);
  Py_XDECREF(d->empty);
  Py_XDECREF(d->plain);
  Py_XDECREF(d->host_funcs);
  Py_TYPE(self)->tp_free(self);
}

int dispatch_traverse(PyObject* self, visitproc visit, void* arg) {
  Dispatch* d = (Dispatch*)self;
  Py_VISIT(d->mode);
  Py_VISIT(d->slow);
  return 0;
}

int dispatch_clear(PyObject* self) {
  Dispatch* d = (Dispatch*)self;
  Py_CLEAR(d->mode);
  Py_CLEAR(d->slow);
  return 0;
}

// PyTorch calls a mode's ``__torch_dispatch__`` only if it is bound to the mode (its
// ``__self__`` is the mode): a plain method, not a classmethod.
PyObject* dispatch_get_self(PyObject* self, void*) {
  PyObject* mode = ((Dispatch*)self)->mode;
  if (mode == nullptr) Py_RETURN_NONE;
  Py_INCREF(mode);
  return mode;
}

PyGetSetDef dispatch_getset[] = {{"__self__", dispatch_get_self, nullptr, "the mode", nullptr},
                                 {nullptr}};

// dispatcher(mode, miss, empty, plain, host_funcs): the mode's ``__torch_dispatch__``, bound
// to it.
py::object dispatcher(py::object mode, py::object miss, py::object empty, py::object plain,
                      py::dict host_funcs) {
  Dispatch* d = PyObject_GC_New(Dispatch, &DispatchType);
  if (d == nullptr) throw py::error_already_set();
  d->vectorcall = dispatch_vectorcall;
  d->mode = mode.inc_ref().ptr();
  d->slow = PyObject_GetAttrString(mode.ptr(), "_slow");
  d->miss = miss.inc_ref().ptr();
  d->empty = empty.inc_ref().ptr();
  d->plain = plain.inc_ref().ptr();
  d->host_funcs = host_funcs.inc_ref().ptr();
  if (d->slow == nullptr) {
    Py_DECREF(d);
    throw py::error_already_set();
  }
  PyObject_GC_Track((PyObject*)d);
  return py::reinterpret_steal<py::object>((PyObject*)d);
}

// make(node, plain, miss, empty, args, outs, tree, first, n_recs, n_new,
//      default_dtype, view, func): a compiled fast path. ``args``: per argument (keyword
// name or None, check description); ``outs``: per result leaf ("fresh", dtype, sizes,
// strides, device) or ("alias", position or keyword) or ("none",); ``tree``: "none", "one",
// "tuple", "list"; ``view``: the op to call for a view op (its results are the node's
// values), else None; ``func``: the node's OpOverload.
py::object make(py::object node, py::object plain, py::object miss, py::object empty,
                py::list args, py::list outs, std::string tree, bool first,
                Py_ssize_t n_recs, Py_ssize_t n_new, py::object default_dtype,
                py::object view, py::object func) {
  auto* checks = new std::vector<Arg>();
  auto* results = new std::vector<Out>();
  Py_ssize_t n_pos = 0, n_kw = 0;
  try {
    for (py::handle h : args) {
      py::tuple a = h.cast<py::tuple>();
      Arg arg;
      if (!a[0].is_none()) {
        arg.name = py::object(a[0]).release().ptr();
        PyUnicode_InternInPlace(&arg.name);
        n_kw++;
      } else {
        n_pos++;
      }
      arg.check = make_check(a[1].cast<py::tuple>());
      checks->push_back(arg);
    }
    for (py::handle h : outs) {
      py::tuple o = h.cast<py::tuple>();
      std::string kind = o[0].cast<std::string>();
      Out out;
      if (kind == "fresh") {
        out.kind = Res::Fresh;
        out.options = at::TensorOptions()
                          .dtype(o[1].cast<at::ScalarType>())
                          .device(o[4].cast<c10::Device>());
        out.sizes = ints(o[2]);
        out.strides = ints(o[3]);
      } else if (kind == "alias") {
        if (py::isinstance<py::int_>(o[1])) {
          out.kind = Res::Alias;
          out.arg = o[1].cast<Py_ssize_t>();
        } else {
          out.kind = Res::AliasKw;
          out.name = py::object(o[1]).release().ptr();
        }
      } else {
        out.kind = Res::None;
      }
      results->push_back(out);
    }
  } catch (...) {
    release_checks(checks);
    delete checks;
    delete results;
    throw;
  }
  FastNode* f = PyObject_New(FastNode, &FastNodeType);
  if (f == nullptr) throw py::error_already_set();
  f->vectorcall = fast_vectorcall;
  f->node = node.inc_ref().ptr();
  f->plain = plain.inc_ref().ptr();
  f->miss = miss.inc_ref().ptr();
  f->empty = empty.inc_ref().ptr();
  f->view = view.is_none() ? nullptr : view.inc_ref().ptr();
  f->func = func.ptr();  // the node (held above) holds its spec, which holds the op
  f->args = checks;
  f->outs = results;
  f->n_args = n_pos;
  f->n_kwargs = n_kw;
  f->n_recs = n_recs;
  f->n_new = n_new;
  f->tree = tree == "none" ? 0 : tree == "one" ? 1 : tree == "tuple" ? 2 : 3;
  f->first = first;
  f->check_dtype = !default_dtype.is_none();
  f->default_dtype = f->check_dtype ? default_dtype.cast<at::ScalarType>() : at::kFloat;
  return py::reinterpret_steal<py::object>((PyObject*)f);
}

// scheduler.program.alias_groups, compiled (a launch asks it of every input of a graph that
// writes one: an optimizer step's hundreds of parameters and states).
py::tuple alias_groups(const std::vector<at::Tensor>& tensors) {
  std::unordered_map<const void*, std::vector<std::pair<c10::Device, Py_ssize_t>>> first;
  py::tuple out(tensors.size());
  for (size_t i = 0; i < tensors.size(); i++) {
    const at::Tensor& t = tensors[i];
    Py_ssize_t group = -1;
    if (t.storage().nbytes() != 0) {
      auto& seen = first[t.storage().data()];
      for (const auto& [device, at] : seen)
        if (device == t.device()) group = at;
      if (group < 0) seen.emplace_back(t.device(), (Py_ssize_t)i);
    }
    out[i] = py::int_(group);
  }
  return out;
}

// tracer.lifecycle.written_input_aliased, compiled: does an input a fused graph writes share
// memory with another of its inputs? ``inputs`` are ``exts[k]`` for ``k`` in ``ext_inputs``;
// ``mutated`` are positions in them. One pass and one table of the inputs' memory, without
// the list and the group per input of ``alias_groups`` (AdamW over 200 parameters: 800
// inputs a launch).
bool written_input_aliased(py::list exts, py::tuple ext_inputs, py::tuple mutated) {
  struct Key {
    const void* data;
    c10::Device device;
    bool operator==(const Key& o) const { return data == o.data && device == o.device; }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.data) ^ std::hash<c10::Device>()(k.device);
    }
  };
  size_t n = ext_inputs.size();
  std::vector<std::optional<Key>> keys(n);
  std::unordered_map<Key, int, Hash> uses;
  uses.reserve(n);
  PyObject* list = exts.ptr();
  for (size_t i = 0; i < n; i++) {
    Py_ssize_t k = PyLong_AsSsize_t(ext_inputs[i].ptr());
    if (k < 0 || k >= PyList_GET_SIZE(list)) throw py::index_error("written_input_aliased: no such external");
    PyObject* obj = PyList_GET_ITEM(list, k);
    if (!THPVariable_Check(obj)) throw py::type_error("written_input_aliased: not a tensor");
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.has_storage() || t.storage().nbytes() == 0) continue;
    keys[i] = Key{t.storage().data(), t.device()};
    uses[*keys[i]]++;
  }
  for (py::handle m : mutated) {
    Py_ssize_t i = PyLong_AsSsize_t(m.ptr());
    if (i < 0 || (size_t)i >= n) throw py::index_error("written_input_aliased: no such input");
    if (keys[i] && uses[*keys[i]] > 1) return true;
  }
  return false;
}

// The launch's bookkeeping over a segment's values (tracer.segment, scheduler.launch), one
// call each instead of a Python loop over hundreds of values. A storage weak reference is the
// integer handle ``UntypedStorage._weak_ref()`` gives (and the fast paths make).
c10::StorageImpl* weak_of(PyObject* handle) { return (c10::StorageImpl*)PyLong_AsVoidPtr(handle); }

// scheduler.launch.live_values: the indices in ``fresh`` whose storage is still alive.
py::tuple live_values(py::tuple fresh, py::list stor) {
  std::vector<Py_ssize_t> live;
  PyObject* list = stor.ptr();
  for (py::handle i : fresh) {
    Py_ssize_t at = PyLong_AsSsize_t(i.ptr());
    if (at < 0 || at >= PyList_GET_SIZE(list)) throw py::index_error("live_values: no such value");
    PyObject* ref = PyList_GET_ITEM(list, at);
    if (ref != Py_None && c10::raw::weak_intrusive_ptr::use_count(weak_of(ref)) > 0)
      live.push_back(at);
  }
  py::tuple out(live.size());
  for (size_t j = 0; j < live.size(); j++) out[j] = py::int_(live[j]);
  return out;
}

// tracer.segment._release: free every weak storage reference of ``stor`` (None: none).
void release_weak(py::iterable stor) {
  for (py::handle ref : stor)
    if (!ref.is_none()) c10::raw::weak_intrusive_ptr::decref(weak_of(ref.ptr()));
}

// A tensor's storage seen without its Python storage object (scheduler.storage): once made,
// that object lives as long as the memory and holds a reference to it, so autograd would no
// longer find a gradient buffer alone on its memory (Note [Storage objects]).
const c10::Storage& storage_of(const at::Tensor& t) {
  if (!t.has_storage()) throw py::value_error("adaptive_eager: a tensor without storage");
  return t.storage();
}

int64_t storage_nbytes(const at::Tensor& t) { return (int64_t)storage_of(t).nbytes(); }

py::object storage_ptr(const at::Tensor& t) {
  const c10::Storage& st = storage_of(t);
  if (st.nbytes() == 0) return py::none();
  return py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(const_cast<void*>(st.data())));
}

// The storage's identity: the address a weak handle of it holds, without taking one.
py::object storage_id(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(
      PyLong_FromVoidPtr(storage_of(t).unsafeGetStorageImpl()));
}

py::object storage_weak(const at::Tensor& t) {
  c10::StorageImpl* impl = storage_of(t).unsafeGetStorageImpl();
  return py::reinterpret_steal<py::object>(
      PyLong_FromVoidPtr(c10::raw::intrusive_ptr::make_weak(impl)));
}

// Nothing but ``t`` (and the storage's own Python object, if one was ever made) holds the
// memory, which PyTorch allocated for this storage alone.
bool storage_alone(const at::Tensor& t) {
  const c10::Storage& st = storage_of(t);
  if (!st.resizable()) return false;
  size_t held = st.use_count();
  if (st.unsafeGetStorageImpl()->pyobj_slot()->load_pyobj() != nullptr) held--;
  return held == 1;
}

// tracer.lifecycle.Path.variant's specialized values: ``floats[n][j]`` for each (n, j).
py::tuple pick_floats(py::list floats, py::tuple at) {
  py::tuple out(at.size());
  PyObject* list = floats.ptr();
  for (size_t k = 0; k < at.size(); k++) {
    PyObject* nj = PyTuple_GET_ITEM(at.ptr(), k);
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(nj, 0));
    Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(nj, 1));
    if (n < 0 || n >= PyList_GET_SIZE(list)) throw py::index_error("pick_floats: no such op");
    PyObject* rec = PyList_GET_ITEM(list, n);
    if (PyTuple_Check(rec) && j >= 0 && j < PyTuple_GET_SIZE(rec)) {
      out[k] = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(rec, j));
    } else {
      PyObject* v = PySequence_GetItem(rec, j);
      if (v == nullptr) throw py::error_already_set();
      out[k] = py::reinterpret_steal<py::object>(v);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  FastNodeType.tp_name = "adaptive_eager.FastPath";
  FastNodeType.tp_basicsize = sizeof(FastNode);
  FastNodeType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  FastNodeType.tp_vectorcall_offset = offsetof(FastNode, vectorcall);
  FastNodeType.tp_call = PyVectorcall_Call;
  FastNodeType.tp_dealloc = fast_dealloc;
  FastNodeType.tp_doc = "A trie node's hot path, compiled (tracer.native).";
  if (PyType_Ready(&FastNodeType) < 0) throw py::error_already_set();
  const char* names[] = {"outw", "exts", "ids", "extw", "floats", "stor", "hot",
                         "start", "node", "expect", "hot_next", "ends_here", "finish",
                         "seg", "fast", "spec", "func", "paused", "counters", "ops_host",
                         "device"};
  PyObject** slots[] = {&s.outw, &s.exts, &s.ids, &s.extw, &s.floats, &s.stor, &s.hot,
                        &s.start, &s.node, &s.expect, &s.hot_next, &s.ends_here, &s.finish,
                        &s.seg, &s.fast, &s.spec, &s.func, &s.paused, &s.counters,
                        &s.ops_host, &s.device};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    *slots[i] = PyUnicode_InternFromString(names[i]);
  DispatchType.tp_name = "adaptive_eager.Dispatch";
  DispatchType.tp_basicsize = sizeof(Dispatch);
  DispatchType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC;
  DispatchType.tp_vectorcall_offset = offsetof(Dispatch, vectorcall);
  DispatchType.tp_call = PyVectorcall_Call;
  DispatchType.tp_dealloc = dispatch_dealloc;
  DispatchType.tp_traverse = dispatch_traverse;
  DispatchType.tp_clear = dispatch_clear;
  DispatchType.tp_getset = dispatch_getset;
  DispatchType.tp_doc = "The engine's __torch_dispatch__ for one mode (tracer.native).";
  if (PyType_Ready(&DispatchType) < 0) throw py::error_already_set();
  m.def("make", &make);
  m.def("dispatcher", &dispatcher);
  m.def("alias_groups", &alias_groups);
  m.def("written_input_aliased", &written_input_aliased);
  m.def("live_values", &live_values);
  m.def("release_weak", &release_weak);
  m.def("pick_floats", &pick_floats);
  m.def("storage_nbytes", &storage_nbytes);
  m.def("storage_ptr", &storage_ptr);
  m.def("storage_weak", &storage_weak);
  m.def("storage_id", &storage_id);
  m.def("storage_alone", &storage_alone);
}
