// A hot segment served below the floor (Note [Below the floor]): while a segment is hot, the
// hot path's dispatch key hands each op to ``serve``, which checks it against the next step
// of the thread's plan (the trie nodes the hot path expects next, as tracer.hot_plan compiled
// them), records it and allocates its outputs, in C++ with the interpreter lock not taken:
// the same checks and records as the node's fast path (tracer.signature.make_fast), made on
// the dispatcher's values (IValues, TensorImpls) instead of Python objects. The first op the
// plan does not expect, or any of the engine's Python touching the segment, hands what was
// served to the tracer's Python segment (``hand_back``), exactly as if the fast paths had run
// one by one, and the engine goes on in Python.
#include "hot_segment.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/csrc/utils/torch_dispatch_mode.h>
#include <pybind11/stl.h>

#include <cstring>

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace ae_hot {
namespace {

using Impl = c10::TensorImpl;
using WeakTensor = c10::weak_intrusive_ptr<Impl, c10::UndefinedTensorImpl>;
using StrongTensor = c10::intrusive_ptr<Impl, c10::UndefinedTensorImpl>;

at::ScalarType dtype_of(py::handle obj) {
  TORCH_CHECK(THPDtype_Check(obj.ptr()), "hot plan: not a dtype");
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

enum class K { Val, Ext, New, SameNew, Rec, Value, Default, Tensors, Ints };

struct Check {
  K kind = K::Value;
  int64_t index = 0;             // Val: value; Ext: external; New/SameNew: new external; Rec: slot
  int rec = 0;                   // Rec: 0 a float, 1 an int, 2 a bool
  c10::IValue value;             // Value: equal, of the same kind; Default: equal (the default)
  at::ScalarType dtype = at::kFloat;  // New: the metadata a new external must have
  std::vector<int64_t> sizes, strides;
  c10::Device device = c10::Device(c10::kCPU);
  std::vector<Check> items;      // Tensors, Ints: a list, element by element
  bool twin = false;             // Val: a fresh value, whose twin (dtype, sizes, strides,
  int64_t offset = 0;            // offset on its memory) is the value too
};

enum class R { Fresh, Alias, None, Ext };

struct Result {
  R kind = R::None;
  int64_t arg = 0;               // Alias: the argument returned
  at::ScalarType dtype = at::kFloat;  // Fresh: what to allocate
  std::vector<int64_t> sizes, strides;  // Fresh: that too; Ext: what the view must produce
  c10::Device device = c10::Device(c10::kCPU);
  bool undefined = false;        // None: an undefined tensor (a Tensor return), not None
};

struct Step {
  std::optional<c10::OperatorHandle> op;
  std::vector<Check> args;       // one per schema argument
  std::vector<Result> outs;
  bool as_list = false;          // the op returns one Tensor[]
  bool view = false;             // a view op: run at once, below the key; its results are values
  bool ext_view = false;         // a view of an external: its results are new externals (outs)
  int64_t n_recs = 0, n_new = 0;
  std::optional<at::ScalarType> default_dtype;  // a factory: the default dtype it was learned at
  bool random = false;           // a random op: the segment keeps the generator's state at the
                                 // first one (Segment.rng), its launch draws from it
};

// Which ops the plan lets run at once when it does not expect them (Note [Host scalars] in
// tracer/mode.py): none, the cpu device's lone host scalars, or (cpu not managed) any op on
// cpu tensors only, which the mode passes through.
enum class Host { None, Scalars, Cpu };

struct Plan {
  std::vector<std::shared_ptr<Step>> steps;
  py::tuple nodes;               // the trie nodes, in order (S.node after each step)
  Host host = Host::None;
  py::object counter;            // the mode's counter of those ops' kind (a str)
  bool starts = false;           // its first step starts the segment (from the trie's root)
  // Note [Forks in a plan]: plans that share this one's steps before ``pos`` and take
  // another hot child of the trie there, tried in order when an op is not this plan's
  std::vector<std::pair<size_t, std::shared_ptr<Plan>>> forks;
};

// One served op, as the Python segment will record it: how many of each record it added to
// the state's flat lists (kept, with their capacity, across plans: no allocation per op).
struct Served {
  uint32_t rebound = 0, new_exts = 0, recs = 0, fresh = 0;
};

struct Matching {
  std::vector<c10::IValue> recs;
  std::vector<at::Tensor> fresh;  // the new externals, by position
  std::vector<std::pair<int64_t, at::Tensor>> twins;  // twins of values whose tensor died
};

// The thread's segment while a plan serves it: the Python segment's values and externals
// (imported at take-over) and what was served since.
struct State {
  std::shared_ptr<Plan> plan;
  py::object seg;
  int64_t serial = 0;                           // the segment's serial these tables are of
  size_t n_rebound = 0;                         // entries of the segment's ``rebound`` read
  size_t pos = 0;
  std::vector<WeakTensor> vals;                 // value i (a null one: dead at take-over)
  std::vector<Impl*> exts;                      // external k (held by the segment or below)
  std::unordered_map<Impl*, int64_t> known;     // impl -> value i, or ~k for external k
  std::vector<Served> served;
  // what the served ops recorded, in order: values rebound to a twin, new externals,
  // recorded numbers, values (a fresh output with its weak storage handle, or a view's
  // result with none)
  std::vector<std::pair<int64_t, at::Tensor>> r_rebound;
  std::vector<at::Tensor> r_new_exts;
  std::vector<c10::IValue> r_recs;
  std::vector<std::pair<WeakTensor, c10::StorageImpl*>> r_fresh;
  Matching m;                                   // scratch of serve_from
  std::vector<c10::IValue> results;             // scratch of serve_from
  int64_t host_ops = 0;                         // ops run at once since (Plan::host)
  int64_t ignored_ops = 0;                      // IGNORE ops (runs_at_once) run at once since
  at::Tensor rng;                               // the generator's state at the first random
  bool seg_rng = false;                         // op served (Segment.rng), if Python had none
  bool started = false;                         // a starting plan's first step was served,
  double t0 = 0.0;                              // at this time.perf_counter()
  std::unordered_set<c10::StorageImpl*> mem;    // the fresh values' storages (held weakly)
  std::vector<c10::StorageImpl*> val_mem;       // value i's storage: fresh ones (else null)
};

// The plan each mode's segment is served by, and the tables of its last plan, kept after the
// hand-back: a plan taken later in the same segment (after a host op, say) imports only what
// Python added since. Keyed by mode, not by thread: autograd runs a device's backward on a
// thread of its own, and ops of one segment may reach the key from either thread (one at a
// time: the program's thread waits in backward()). ``g_mu`` guards the maps; whoever takes
// the interpreter lock as well takes it first, and nothing waits for the interpreter lock
// while holding ``g_mu``: releasing a tensor may (its Python object), so ``serve`` holds it
// only to find the mode's state, which only that mode's ops touch, one at a time.
std::mutex g_mu;
std::unordered_map<PyObject*, State*> g_active, g_kept;

// ops served, plans taken, ops a segment's plan did not expect, launches at a read (Note
// [Launched below the floor]) (this process)
std::atomic<int64_t> g_served{0}, g_plans{0}, g_unexpected{0}, g_launched{0};
std::atomic<int64_t> g_forks{0};  // ops that took a fork of the plan (Note [Forks in a plan])
PyTypeObject* g_plain[2] = {nullptr, nullptr};  // torch.Tensor, torch.nn.Parameter
PyObject* g_dead = nullptr;                     // a weak reference to nothing
PyObject *s_outw, *s_exts, *s_extw, *s_ids, *s_floats, *s_stor, *s_node, *s_expect,
    *s_hot_next, *s_hot, *s_t0, *s_rng;

// What Python's time.perf_counter() reads (CLOCK_MONOTONIC, as steady_clock on Linux).
double perf_counter() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool same_ints(c10::IntArrayRef got, const std::vector<int64_t>& want) {
  return got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin());
}

bool is_known(const State& st, Impl* impl) {
  auto it = st.known.find(impl);
  if (it == st.known.end()) return false;
  if (it->second >= 0) return !st.vals[it->second].expired();
  return true;
}

// A plain tensor, as tracer.signature.is_plain and the fast path's check: of a type without a
// ``__torch_dispatch__`` of its own (nothing that dispatches to Python), not quantized and not
// a zero tensor (no memory: a gradient autograd knows to be zero).
bool plain(const at::Tensor& t) {
  if (t.key_set().has(c10::DispatchKey::Python) || t.is_quantized() || t._is_zerotensor())
    return false;
  PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  return obj == nullptr || Py_TYPE(obj) == g_plain[0] || Py_TYPE(obj) == g_plain[1];
}

bool same_kind(const c10::IValue& a, const c10::IValue& b) {
  return a.isDouble() == b.isDouble() && a.isInt() == b.isInt() && a.isBool() == b.isBool() &&
         a.isNone() == b.isNone();
}

// A Python number in a Tensor argument reaches the dispatcher as a wrapped-number tensor,
// which the mode receives converted back to the number, and an absent optional tensor may
// reach it as an undefined tensor (autograd's backward passes its saved ``attn_mask`` so),
// which the mode receives as None: the argument, as the mode saw it.
c10::IValue unwrapped(const c10::IValue& v) {
  if (!v.isTensor()) return v;
  if (!v.toTensor().defined()) return c10::IValue();  // an absent optional tensor: None to the mode
  Impl* impl = v.unsafeToTensorImpl();
  if (!impl->is_wrapped_number()) return v;
  const at::Tensor& t = v.toTensor();
  switch (t.scalar_type()) {
    case at::kDouble: return c10::IValue(*t.const_data_ptr<double>());
    case at::kLong: return c10::IValue(*t.const_data_ptr<int64_t>());
    case at::kBool: return c10::IValue(*t.const_data_ptr<bool>());
    default: return v;
  }
}

// Note [Memory of a value] (tracer/segment.py): ``t`` sits on fresh value i's memory exactly as
// the value does. The value's storage is held weakly (its address is not reused).
bool is_twin(const State& st, const Check& c, const at::Tensor& t) {
  size_t i = (size_t)c.index;
  return c.twin && i < st.val_mem.size() && st.val_mem[i] != nullptr && t.defined() &&
         t.has_storage() && t.storage().unsafeGetStorageImpl() == st.val_mem[i] &&
         t.scalar_type() == c.dtype && t.storage_offset() == c.offset &&
         same_ints(t.sizes(), c.sizes) && same_ints(t.strides(), c.strides) && plain(t);
}

bool check(const State& st, const Check& c, const c10::IValue& v, Matching& m) {
  switch (c.kind) {
    case K::Val: {
      if (!v.isTensor() || c.index >= (int64_t)st.vals.size()) return false;
      const WeakTensor& w = st.vals[c.index];
      if (w._unsafe_get_target() == v.unsafeToTensorImpl() && !w.expired()) return true;
      if (!is_twin(st, c, v.toTensor())) return false;
      if (w.expired()) m.twins.emplace_back(c.index, v.toTensor());  // it becomes the value's
      return true;
    }
    case K::Ext:
      return v.isTensor() && c.index < (int64_t)st.exts.size() &&
             st.exts[c.index] == v.unsafeToTensorImpl();
    case K::SameNew:
      return v.isTensor() && m.fresh[c.index].defined() &&
             m.fresh[c.index].unsafeGetTensorImpl() == v.unsafeToTensorImpl();
    case K::New: {
      if (!v.isTensor()) return false;
      const at::Tensor& t = v.toTensor();
      if (!t.defined() || t.layout() != at::kStrided || t.scalar_type() != c.dtype ||
          !same_ints(t.sizes(), c.sizes) || !same_ints(t.strides(), c.strides) ||
          t.device() != c.device || !plain(t))
        return false;
      Impl* impl = t.unsafeGetTensorImpl();
      if (is_known(st, impl)) return false;
      for (int64_t j = 0; j < c.index; j++)
        if (m.fresh[j].defined() && m.fresh[j].unsafeGetTensorImpl() == impl) return false;
      m.fresh[c.index] = t;
      return true;
    }
    case K::Rec: {
      c10::IValue x = unwrapped(v);
      if (!(c.rec == 0 ? x.isDouble() : c.rec == 1 ? x.isInt() : x.isBool())) return false;
      m.recs[c.index] = std::move(x);
      return true;
    }
    case K::Value: {
      c10::IValue x = unwrapped(v);
      return same_kind(c.value, x) && c.value == x;
    }
    case K::Default:
      return c.value == unwrapped(v);
    case K::Tensors: {
      if (!v.isTensorList()) return false;
      auto list = v.toTensorList();
      if (list.size() != c.items.size()) return false;
      for (size_t j = 0; j < c.items.size(); j++)
        if (!check(st, c.items[j], c10::IValue(static_cast<at::Tensor>(list[j])), m)) return false;
      return true;
    }
    case K::Ints: {
      c10::IValue x = unwrapped(v);
      if (!x.isIntList()) return false;
      auto list = x.toIntList();
      if (list.size() != c.items.size()) return false;
      for (size_t j = 0; j < c.items.size(); j++)
        if (!check(st, c.items[j], c10::IValue(static_cast<int64_t>(list[j])), m)) return false;
      return true;
    }
  }
  return false;
}

c10::StorageImpl* weak_storage(const at::Tensor& t) {
  return c10::raw::intrusive_ptr::make_weak(t.storage().unsafeGetStorageImpl());
}

// ---------------------------------------------------------------- handing back to Python

PyObject* attr(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr) throw python_error();
  return v;
}

void append(PyObject* list, PyObject* item) {  // steals ``item``
  if (item == nullptr) throw python_error();
  int rc = PyList_Append(list, item);
  Py_DECREF(item);
  if (rc != 0) throw python_error();
}

void set_id(PyObject* ids, PyObject* obj, Py_ssize_t index) {
  py::object key = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(obj));
  py::object val = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(index));
  if (!key || !val || PyDict_SetItem(ids, key.ptr(), val.ptr()) != 0) throw python_error();
}

PyObject* to_python(const c10::IValue& v) {
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  return PyLong_FromLongLong(v.toInt());
}

// The served ops into the Python segment, as their fast paths would have recorded them.
void record(State& st) {
  PyObject* S = st.seg.ptr();
  if (st.started) {  // as Segment.start: the segment is hot from its first op's time
    st.started = false;
    py::object t0 = py::reinterpret_steal<py::object>(PyFloat_FromDouble(st.t0));
    if (!t0 || PyObject_SetAttr(S, s_hot, Py_True) != 0 || PyObject_SetAttr(S, s_t0, t0.ptr()) != 0)
      throw python_error();
  }
  if (st.rng.defined()) {  // the first random op's generator state, as its fast path keeps it
    PyObject* obj = THPVariable_Wrap(std::move(st.rng));
    st.rng = at::Tensor();
    if (obj == nullptr) throw python_error();
    int rc = PyObject_SetAttr(S, s_rng, obj);
    Py_DECREF(obj);
    if (rc != 0) throw python_error();
  }
  py::object outw = py::reinterpret_steal<py::object>(attr(S, s_outw));
  py::object exts = py::reinterpret_steal<py::object>(attr(S, s_exts));
  py::object extw = py::reinterpret_steal<py::object>(attr(S, s_extw));
  py::object ids = py::reinterpret_steal<py::object>(attr(S, s_ids));
  py::object floats = py::reinterpret_steal<py::object>(attr(S, s_floats));
  py::object stor = py::reinterpret_steal<py::object>(attr(S, s_stor));
  size_t a = 0, b = 0, c = 0, d = 0;  // read positions in the flat lists
  for (const Served& op : st.served) {
    for (uint32_t k = 0; k < op.rebound; k++) {  // as Segment.adopt rebinds a value to its twin
      auto& [i, t] = st.r_rebound[a++];
      py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
      if (!obj) throw python_error();
      set_id(ids.ptr(), obj.ptr(), i);
      PyObject* ref = PyWeakref_NewRef(obj.ptr(), nullptr);
      if (ref == nullptr || PyList_SetItem(outw.ptr(), i, ref) != 0) throw python_error();
    }
    for (uint32_t k = 0; k < op.new_exts; k++) {
      PyObject* obj = THPVariable_Wrap(std::move(st.r_new_exts[b++]));
      if (obj == nullptr) throw python_error();
      set_id(ids.ptr(), obj, ~PyList_GET_SIZE(exts.ptr()));
      append(extw.ptr(), PyWeakref_NewRef(obj, nullptr));
      append(exts.ptr(), obj);
    }
    PyObject* rec = PyTuple_New((Py_ssize_t)op.recs);
    if (rec == nullptr) throw python_error();
    for (size_t j = 0; j < op.recs; j++) {
      PyObject* x = to_python(st.r_recs[c + j]);
      if (x == nullptr) {
        Py_DECREF(rec);
        throw python_error();
      }
      PyTuple_SET_ITEM(rec, j, x);
    }
    c += op.recs;
    append(floats.ptr(), rec);
    for (uint32_t k = 0; k < op.fresh; k++) {
      auto& [w, handle] = st.r_fresh[d++];
      StrongTensor alive = w.lock();
      if (alive) {
        py::object obj = py::reinterpret_steal<py::object>(
            THPVariable_Wrap(at::Tensor(std::move(alive))));
        if (!obj) throw python_error();
        set_id(ids.ptr(), obj.ptr(), PyList_GET_SIZE(outw.ptr()));
        append(outw.ptr(), PyWeakref_NewRef(obj.ptr(), nullptr));
      } else {
        Py_INCREF(g_dead);
        append(outw.ptr(), g_dead);
      }
      if (handle == nullptr) {  // a view's result: no storage reference
        Py_INCREF(Py_None);
        append(stor.ptr(), Py_None);
      } else {
        append(stor.ptr(), PyLong_FromVoidPtr(handle));
        handle = nullptr;  // the segment owns it now
      }
    }
  }
  if (st.host_ops != 0 || st.ignored_ops != 0) {
    py::object counters = st.seg.attr("owner").attr("counters");
    auto add = [&](py::str name, int64_t n) {
      if (n != 0) counters.attr(name) = counters.attr(name).cast<int64_t>() + n;
    };
    add(st.plan->counter, st.host_ops);
    add(py::str("ops_passthrough"), st.ignored_ops);
    st.host_ops = st.ignored_ops = 0;
  }
  if (!st.served.empty()) {
    PyObject* node = PyTuple_GET_ITEM(st.plan->nodes.ptr(), st.pos - 1);
    py::object next = py::reinterpret_steal<py::object>(attr(node, s_hot_next));
    if (PyObject_SetAttr(S, s_node, node) != 0 || PyObject_SetAttr(S, s_expect, next.ptr()) != 0)
      throw python_error();
  }
}

void drop_served(State* st) {
  st->started = false;
  st->rng = at::Tensor();
  for (auto& f : st->r_fresh)
    if (f.second != nullptr) c10::raw::weak_intrusive_ptr::decref(f.second);
  st->served.clear();
  st->r_rebound.clear();
  st->r_new_exts.clear();
  st->r_recs.clear();
  st->r_fresh.clear();
}

void release(State* st) {
  if (st == nullptr) return;
  drop_served(st);
  delete st;
}

int64_t serial_of(PyObject* seg) {
  py::object v = py::reinterpret_steal<py::object>(PyObject_GetAttrString(seg, "serial"));
  if (!v) throw python_error();
  return v.cast<int64_t>();
}

// Value i's tensor is ``t`` from now on (a twin: Note [Memory of a value]); the old tensor's
// entry goes, its address being free for reuse once ``vals`` lets go of it.
void rebind(State& st, int64_t i, const at::Tensor& t) {
  auto old = st.known.find(st.vals[i]._unsafe_get_target());
  if (old != st.known.end() && old->second == i) st.known.erase(old);
  st.known[t.unsafeGetTensorImpl()] = i;
  st.vals[i] = WeakTensor(t.getIntrusivePtr());
}

// Python's values and externals from ``st``'s sizes on into its tables.
void import_tail(State* st) {
  py::list outw = st->seg.attr("outw"), exts = st->seg.attr("exts"), stor = st->seg.attr("stor");
  st->seg_rng = !st->seg.attr("rng").is_none();
  for (size_t i = st->vals.size(); i < (size_t)stor.size(); i++) {
    PyObject* handle = PyList_GET_ITEM(stor.ptr(), i);  // a weak storage handle, or None
    auto* impl = handle == Py_None ? nullptr
                                   : static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(handle));
    if (impl != nullptr) st->mem.insert(impl);
    st->val_mem.push_back(impl);
  }
  // values Python rebound to a twin tensor since (Note [Memory of a value])
  py::list rebound = st->seg.attr("rebound");
  for (size_t r = st->n_rebound; r < (size_t)rebound.size(); r++) {
    size_t i = rebound[r].cast<size_t>();
    if (i >= st->vals.size()) continue;  // imported below
    PyObject* obj = PyWeakref_GetObject(outw[i].ptr());
    if (obj != Py_None && THPVariable_Check(obj)) {
      rebind(*st, (int64_t)i, THPVariable_Unpack(obj));
    }
  }
  st->n_rebound = rebound.size();
  for (size_t i = st->vals.size(); i < (size_t)outw.size(); i++) {
    PyObject* obj = PyWeakref_GetObject(outw[i].ptr());
    if (obj != Py_None && THPVariable_Check(obj)) {
      const at::Tensor& t = THPVariable_Unpack(obj);
      st->known[t.unsafeGetTensorImpl()] = (int64_t)st->vals.size();
      st->vals.emplace_back(t.getIntrusivePtr());
    } else {
      st->vals.emplace_back(StrongTensor());
    }
  }
  for (size_t k = st->exts.size(); k < (size_t)exts.size(); k++) {
    Impl* impl = THPVariable_Unpack(exts[k].ptr()).unsafeGetTensorImpl();
    st->known[impl] = ~(int64_t)st->exts.size();
    st->exts.push_back(impl);
  }
}

// ---------------------------------------------------------------- building steps

Check to_check(py::handle spec, const c10::Argument& arg) {
  auto t = spec.cast<py::tuple>();
  std::string kind = t[0].cast<std::string>();
  Check c;
  if (kind == "val" || kind == "ext" || kind == "same" || kind == "rec") {
    c.kind = kind == "val" ? K::Val : kind == "ext" ? K::Ext : kind == "same" ? K::SameNew : K::Rec;
    c.index = t[1].cast<int64_t>();
    if (c.kind == K::Rec) c.rec = t[2].cast<int>();
    if (c.kind == K::Val && t.size() == 6) {
      c.twin = true;
      c.dtype = dtype_of(t[2]);
      c.sizes = t[3].cast<std::vector<int64_t>>();
      c.strides = t[4].cast<std::vector<int64_t>>();
      c.offset = t[5].cast<int64_t>();
    }
  } else if (kind == "new") {
    c.kind = K::New;
    c.index = t[1].cast<int64_t>();
    c.dtype = dtype_of(t[2]);
    c.sizes = t[3].cast<std::vector<int64_t>>();
    c.strides = t[4].cast<std::vector<int64_t>>();
    c.device = t[5].cast<c10::Device>();
  } else if (kind == "value") {
    c.kind = K::Value;
    py::handle x = t[1];
    bool number = PyBool_Check(x.ptr()) || PyLong_Check(x.ptr()) || PyFloat_Check(x.ptr());
    if (number && arg.real_type()->kind() == c10::TypeKind::TensorType) {
      // a Python number for a Tensor: it arrives as a wrapped number (``unwrapped``)
      c.value = PyBool_Check(x.ptr())   ? c10::IValue(x.cast<bool>())
                : PyLong_Check(x.ptr()) ? c10::IValue(x.cast<int64_t>())
                                        : c10::IValue(x.cast<double>());
    } else {
      c.value = torch::jit::toIValue(x, arg.real_type());
    }
  } else if (kind == "default") {
    TORCH_CHECK(arg.default_value().has_value(), "hot plan: ", arg.name(), " has no default");
    c.kind = K::Default;
    c.value = *arg.default_value();
  } else if (kind == "tensors" || kind == "ints") {
    c.kind = kind == "ints" ? K::Ints : K::Tensors;
    for (py::handle item : t[1].cast<py::list>()) c.items.push_back(to_check(item, arg));
  } else {
    TORCH_CHECK(false, "hot plan: no check of kind ", kind);
  }
  return c;
}

std::shared_ptr<Step> make_step(const std::string& name, const std::string& overload,
                                py::list args, py::list outs, int64_t n_recs, int64_t n_new,
                                py::object default_dtype, bool view, bool random) {
  auto step = std::make_shared<Step>();
  step->random = random;
  step->op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  const auto& schema = step->op->schema();
  TORCH_CHECK(args.size() == schema.arguments().size(), "hot plan: ", name, " takes ",
              schema.arguments().size(), " arguments, given ", args.size(), " checks");
  for (size_t i = 0; i < args.size(); i++)
    step->args.push_back(to_check(args[i], schema.arguments()[i]));
  for (py::handle o : outs) {
    size_t j = step->outs.size();
    auto t = o.cast<py::tuple>();
    std::string kind = t[0].cast<std::string>();
    Result r;
    if (kind == "fresh") {
      r.kind = R::Fresh;
      r.dtype = dtype_of(t[1]);
      r.sizes = t[2].cast<std::vector<int64_t>>();
      r.strides = t[3].cast<std::vector<int64_t>>();
      r.device = t[4].cast<c10::Device>();
    } else if (kind == "ext") {
      r.kind = R::Ext;
      r.sizes = t[1].cast<std::vector<int64_t>>();
      r.strides = t[2].cast<std::vector<int64_t>>();
    } else if (kind == "alias") {
      r.kind = R::Alias;
      r.arg = t[1].cast<int64_t>();
    } else if (j < schema.returns().size()) {
      r.undefined = schema.returns()[j].real_type()->kind() == c10::TypeKind::TensorType;
    }
    step->outs.push_back(std::move(r));
  }
  step->as_list = schema.returns().size() == 1 &&
                  schema.returns()[0].real_type()->kind() == c10::TypeKind::ListType;
  step->view = view;
  step->ext_view = view && !step->outs.empty() && step->outs[0].kind == R::Ext;
  step->n_recs = n_recs;
  step->n_new = n_new;
  if (!default_dtype.is_none())
    step->default_dtype = dtype_of(default_dtype);
  return step;
}

std::shared_ptr<Plan> make_plan(py::list steps, py::tuple nodes, int host, py::object counter,
                                bool starts, py::list forks) {
  auto plan = std::make_shared<Plan>();
  plan->starts = starts;
  TORCH_CHECK(host >= 0 && host <= 2, "hot plan: host ", host, " is not 0, 1 or 2");
  plan->host = static_cast<Host>(host);
  plan->counter = counter;
  for (py::handle s : steps) plan->steps.push_back(s.cast<std::shared_ptr<Step>>());
  plan->nodes = nodes;
  TORCH_CHECK(plan->steps.size() == (size_t)nodes.size(), "hot plan: steps and nodes differ");
  for (py::handle f : forks) {
    auto pair = f.cast<std::pair<size_t, std::shared_ptr<Plan>>>();
    TORCH_CHECK(pair.first < plan->steps.size() && pair.first < pair.second->steps.size(),
                "hot plan: a fork at ", pair.first, " past a plan's steps");
    for (size_t k = 0; k < pair.first; k++)
      TORCH_CHECK(pair.second->steps[k] == plan->steps[k], "hot plan: a fork at ", pair.first,
                  " that does not share the steps before it");
    plan->forks.push_back(std::move(pair));
  }
  return plan;
}

// Does any segment hold a plan now; (ops served, plans taken, ops a plan did not expect,
// launches at a read) in this process.
bool serving() {
  std::lock_guard<std::mutex> lock(g_mu);
  return !g_active.empty();
}
std::vector<int64_t> served() {
  return {g_served.load(), g_plans.load(), g_unexpected.load(), g_launched.load(),
          g_forks.load()};
}

}  // namespace

at::Tensor allocate(const Result& r) {
  if (r.device.is_cpu()) return pooled_empty_strided(r.sizes, r.strides, r.dtype);
  KeyOff off;  // the device's own allocation, through the dispatcher
  return at::empty_strided(r.sizes, r.strides, at::TensorOptions().dtype(r.dtype).device(r.device));
}

void add_value(State& st, Served& rec, const at::Tensor& t, bool fresh) {
  st.known[t.unsafeGetTensorImpl()] = (int64_t)st.vals.size();
  st.vals.emplace_back(t.getIntrusivePtr());
  st.r_fresh.emplace_back(WeakTensor(t.getIntrusivePtr()), fresh ? weak_storage(t) : nullptr);
  rec.fresh++;
  if (fresh) st.mem.insert(st.r_fresh.back().second);
  st.val_mem.push_back(st.r_fresh.back().second);
}

// The dispatch mode on top of this thread's stack (the engine's, when a plan may serve).
PyObject* top_mode() {
  auto n = c10::impl::TorchDispatchModeTLS::stack_len();
  if (n == 0) return nullptr;
  return c10::impl::TorchDispatchModeTLS::get_stack_at(n - 1)->ptr(getPyInterpreter());
}

bool serve_from(State* st, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                torch::jit::Stack* stack, bool* borrowed);
bool serve_fork(State* st, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                torch::jit::Stack* stack, bool* borrowed);

// The op's arguments on ``stack`` made owning if they were borrowed (Note [Borrowed
// arguments]): before anything that consumes them.
void own_args(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool* borrowed) {
  if (borrowed == nullptr || !*borrowed) return;
  own(*stack, op.schema().arguments().size());
  *borrowed = false;
}

// Would the mode run ``op`` at once, outside the segment (Plan::host)? Every tensor argument
// on the cpu, plain; with Host::Scalars each a 0-dim tensor the segment does not know, alone
// on memory of its own (nothing the segment holds can alias it).
bool host_tensor(const State& st, const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !plain(t)) return false;
  if (st.plan->host == Host::Cpu) return true;
  if (t.dim() != 0 || st.known.count(t.unsafeGetTensorImpl())) return false;
  const c10::Storage& s = t.storage();  // not a value's memory (a twin of it), nor shared
  return s.resizable() && s.use_count() == 1 && !st.mem.count(s.unsafeGetStorageImpl());
}

bool host_op(const State& st, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (st.plan->host == Host::None) return false;
  bool any = false;
  for (const c10::IValue& v : torch::jit::last(stack, op.schema().arguments().size())) {
    if (v.isTensor()) {
      if (!host_tensor(st, v.toTensor())) return false;
      any = true;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (!host_tensor(st, t)) return false;
        any = true;
      }
    } else if (v.isList() || v.isGenericDict() || v.isObject() || v.isCapsule()) {
      return false;  // an optional tensor list, say: not worth reading here
    } else if (v.isDevice() && !v.toDevice().is_cpu()) {
      return false;
    }
  }
  return any;
}

// tracer/optable.py's IGNORE class: profiler ranges, and ops that compute nothing (Note [Ops
// that compute nothing]): the mode runs them as they come, outside any segment.
bool runs_at_once(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> nothing = {
      "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
      "aten::new_empty_strided", "aten::empty_permuted"};
  const std::string& name = op.schema().name();
  return name.rfind("profiler::", 0) == 0 || nothing.count(name) > 0;
}

bool serve(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
           bool* borrowed) {
  PyObject* mode = top_mode();
  if (mode == nullptr) return false;
  State* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto found = g_active.find(mode);
    if (found == g_active.end()) return false;
    st = found->second;
  }
  if (serve_from(st, op, ks, stack, borrowed)) return true;
  if (serve_fork(st, op, ks, stack, borrowed)) return true;
  bool ignored = runs_at_once(op);
  if (ignored || host_op(*st, op, *stack)) {  // runs now, as the mode would run it
    (ignored ? st->ignored_ops : st->host_ops)++;
    own_args(op, stack, borrowed);
    KeyOff off;
    op.redispatchBoxed(ks.remove(kKey), stack);
    return true;
  }
  g_unexpected.fetch_add(1, std::memory_order_relaxed);
  return false;
}

// Note [Forks in a plan]: a plan follows the trie's ``hot_next`` from its first node, the
// branch last taken at each node. A loop whose step takes one of several hot branches in
// turn (a batch size out of 8 buckets: the steps share their first op, the weight's
// transpose, and part ways at the first op that reads the batch) would leave the plan at the
// fork on every step but the one it was built for: the rest of the segment then ran through
// the mode and ended in Python, not below the floor (8 buckets: 1.3x eager where one size is
// 0.9x). So a plan carries plans for the other hot children at each node, sharing its steps
// up to there; an op the plan does not expect is tried against each fork at the current
// position (its checks only read the state: a miss changes nothing) and the first that takes
// it becomes the segment's plan, whose served prefix is the same ops.
bool serve_fork(State* st, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                torch::jit::Stack* stack, bool* borrowed) {
  std::shared_ptr<Plan> was = st->plan;
  for (const auto& [pos, fork] : was->forks) {
    if (pos != st->pos) continue;
    st->plan = fork;
    if (serve_from(st, op, ks, stack, borrowed)) {
      g_forks.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
  }
  st->plan = was;
  return false;
}

// ``op`` served from ``st``'s plan, if it is what the plan expects next.
bool serve_from(State* st, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                torch::jit::Stack* stack, bool* borrowed) {
  if (st->pos >= st->plan->steps.size()) return false;
  const Step& step = *st->plan->steps[st->pos];
  if (op != *step.op) return false;
  bool starting = st->pos == 0 && st->plan->starts;
  // Segment.start refuses under deterministic algorithms: the mode counts that fallback
  if (starting && at::globalContext().deterministicAlgorithms()) return false;
  size_t n = step.args.size();
  auto args = torch::jit::last(*stack, n);
  Matching& m = st->m;
  // emptied on the way out, matched or not: a tensor held here would count as a use of its
  // memory (Note [Storage objects], scheduler/storage.py)
  struct Emptied {
    Matching& m;
    ~Emptied() {
      m.recs.clear();
      m.fresh.clear();
      m.twins.clear();
    }
  } emptied{m};
  m.recs.resize(step.n_recs);
  m.fresh.resize(step.n_new);
  for (size_t i = 0; i < n; i++)
    if (!check(*st, step.args[i], args[i], m)) return false;
  if (step.default_dtype.has_value() &&
      c10::typeMetaToScalarType(at::get_default_dtype()) != *step.default_dtype)
    return false;
  std::vector<at::Tensor> ext_outs;
  if (step.ext_view) {  // run it now and check what it made: a miss leaves the stack as it was
    own_args(op, stack, borrowed);
    std::vector<c10::IValue> saved(args.begin(), args.end());
    {
      KeyOff off;
      op.redispatchBoxed(ks.remove(kKey), stack);
    }
    size_t n_out = op.schema().returns().size();
    for (const c10::IValue& v : torch::jit::last(*stack, n_out)) {
      if (v.isTensor()) {
        ext_outs.push_back(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList().vec()) ext_outs.push_back(t);
      }
    }
    bool same = ext_outs.size() == step.outs.size();
    for (size_t j = 0; same && j < ext_outs.size(); j++)
      same = same_ints(ext_outs[j].sizes(), step.outs[j].sizes) &&
             same_ints(ext_outs[j].strides(), step.outs[j].strides);
    if (!same) {
      torch::jit::drop(*stack, n_out);
      for (auto& v : saved) stack->push_back(std::move(v));
      return false;
    }
  }
  // It matches: record it and make its results, as its fast path does.
  if (starting) {
    st->started = true;
    st->t0 = perf_counter();
  }
  if (step.random && !st->rng.defined() && !st->seg_rng) {  // as torch.get_rng_state()
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    st->rng = gen.get_state();
  }
  Served rec;
  for (auto& [i, t] : m.twins) {  // a dead value's twin: the value's tensor from now on
    rebind(*st, i, t);
    st->r_rebound.emplace_back(i, std::move(t));
    rec.rebound++;
  }
  for (at::Tensor& t : m.fresh) {
    Impl* impl = t.unsafeGetTensorImpl();
    st->known[impl] = ~(int64_t)st->exts.size();
    st->exts.push_back(impl);
    st->r_new_exts.push_back(std::move(t));
    rec.new_exts++;
  }
  for (c10::IValue& v : m.recs) st->r_recs.push_back(std::move(v));
  rec.recs = (uint32_t)m.recs.size();
  if (step.ext_view) {  // its results are new externals, after those it read
    for (at::Tensor& t : ext_outs) {
      Impl* impl = t.unsafeGetTensorImpl();
      st->known[impl] = ~(int64_t)st->exts.size();
      st->exts.push_back(impl);
      st->r_new_exts.push_back(std::move(t));
      rec.new_exts++;
    }
    st->served.push_back(rec);
    st->pos++;
    g_served.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  if (step.view) {  // run it now (a view: no data is touched); each result a value
    own_args(op, stack, borrowed);
    {
      KeyOff off;
      op.redispatchBoxed(ks.remove(kKey), stack);
    }
    size_t n_out = op.schema().returns().size();
    for (const c10::IValue& v : torch::jit::last(*stack, n_out)) {
      if (v.isTensor()) {
        add_value(*st, rec, v.toTensor(), false);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList().vec()) add_value(*st, rec, t, false);
      }
    }
    st->served.push_back(rec);
    st->pos++;
    g_served.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  std::vector<c10::IValue>& results = st->results;
  results.clear();
  for (const Result& r : step.outs) {
    if (r.kind == R::Fresh) {
      at::Tensor t = allocate(r);
      add_value(*st, rec, t, true);
      results.emplace_back(std::move(t));
    } else if (r.kind == R::Alias) {  // borrowed as its argument is (the caller knows)
      const c10::IValue& arg = args[r.arg];
      bool lent = borrowed != nullptr && *borrowed && arg.isTensor();
      results.push_back(lent ? ae_hot::borrowed(arg.toTensor()) : arg);
    } else if (r.undefined) {
      results.emplace_back(at::Tensor());
    } else {
      results.emplace_back();
    }
  }
  st->served.push_back(rec);
  st->pos++;
  g_served.fetch_add(1, std::memory_order_relaxed);
  if (borrowed != nullptr && *borrowed) {
    unborrow(*stack, n);
  } else {
    torch::jit::drop(*stack, n);
  }
  if (step.as_list) {
    std::vector<at::Tensor> list;
    for (auto& v : results) list.push_back(v.toTensor());
    stack->emplace_back(std::move(list));
  } else {
    for (auto& v : results) stack->push_back(std::move(v));
  }
  results.clear();
  return true;
}

// ``mode``'s entry of ``map``, taken out of it (null if none).
State* take(std::unordered_map<PyObject*, State*>& map, PyObject* mode) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto found = map.find(mode);
  if (found == map.end()) return nullptr;
  State* st = found->second;
  map.erase(found);
  return st;
}

// ``st`` as ``mode``'s entry of ``map``; the entry it replaces, released (with the GIL).
void put(std::unordered_map<PyObject*, State*>& map, PyObject* mode, State* st) {
  State* old = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    State*& slot = map[mode];
    old = slot;
    slot = st;
  }
  release(old);
}

void hand_back(PyObject* mode) {
  if (mode == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_mu);  // no plan: nothing to do, without the GIL
    if (g_active.find(mode) == g_active.end()) return;
  }
  py::gil_scoped_acquire gil;
  State* st = take(g_active, mode);  // ours alone from here: serve no longer finds it
  if (st == nullptr) return;
  try {
    record(*st);
  } catch (...) {
    release(st);
    throw;
  }
  drop_served(st);
  st->plan.reset();
  st->pos = 0;
  put(g_kept, mode, st);
}

void hand_back_top() { hand_back(top_mode()); }

void forget(PyObject* mode) {
  hand_back(mode);
  release(take(g_kept, mode));
}

void take_over(PyObject* planner, PyObject* mode) {
  hand_back(mode);
  PyObject* got = PyObject_CallNoArgs(planner);
  if (got == nullptr) throw python_error();
  py::object res = py::reinterpret_steal<py::object>(got);
  if (res.is_none()) return;
  auto pair = res.cast<py::tuple>();
  py::object seg = pair[1];
  int64_t serial = serial_of(seg.ptr());
  State* st = take(g_kept, mode);
  if (st == nullptr) {
    st = new State();
  }
  if (!st->seg.is(seg) || st->serial != serial) {  // another segment: its tables, emptied
    drop_served(st);                               // (their memory kept for the next)
    st->seg = seg;
    st->serial = serial;
    st->n_rebound = 0;
    st->vals.clear();
    st->exts.clear();
    st->known.clear();
    st->mem.clear();
    st->val_mem.clear();
  }
  st->plan = pair[0].cast<std::shared_ptr<Plan>>();
  try {
    import_tail(st);
  } catch (...) {
    release(st);
    throw;
  }
  put(g_active, mode, st);
  g_plans.fetch_add(1, std::memory_order_relaxed);
}

// ---------------------------------------------------------------- a read at the plan's end

// Note [Launched below the floor] (hot_segment.h): what the launch of one path's fused graph
// needs, made by tracer.lifecycle.fast_end from a launch Python made (its variant) and kept on
// the path's last trie node (``Node.fast_end``) until the path retires or the engine is
// configured anew.
struct FastEnd {
  std::vector<int64_t> fresh;       // the path's fresh values (Path.fresh), in order
  std::vector<int64_t> live;        // those alive at the launch: the variant's
  std::vector<std::pair<int64_t, int64_t>> specialized;  // (op, slot) of floats compiled in
  std::vector<c10::IValue> spec_values;                  // and their values
  std::vector<std::pair<int64_t, int64_t>> lifted;       // (op, slot) of the packed floats
  std::vector<int64_t> ext_inputs;  // the graph's inputs: externals
  std::vector<int64_t> mutated;     // positions in them the graph writes
  std::vector<int64_t> targets;     // the values it writes (Graph.live), after the packed floats
  struct Meta {                     // and what each is (Meta.on_storage, scheduler/program.py)
    at::ScalarType dtype;
    std::vector<int64_t> sizes, strides;
    int64_t offset;
  };
  std::vector<Meta> target_metas;
  std::vector<std::pair<int64_t, int64_t>> zeros;  // (op, slot) of random ops' probabilities:
                                                   // zero, the launch draws nothing
  size_t n_ops = 0;
  py::object run;                   // Graph.run
  py::object done;                  // the Python bookkeeping: done(seconds, read, host, passed)
};

c10::IValue number_of(py::handle x) {
  if (PyBool_Check(x.ptr())) return c10::IValue(x.cast<bool>());
  if (PyLong_Check(x.ptr())) return c10::IValue(x.cast<int64_t>());
  return c10::IValue(x.cast<double>());
}

std::shared_ptr<FastEnd> make_fast_end(std::vector<int64_t> fresh, std::vector<int64_t> live,
                                       std::vector<std::pair<int64_t, int64_t>> specialized,
                                       py::tuple spec_values,
                                       std::vector<std::pair<int64_t, int64_t>> lifted,
                                       std::vector<int64_t> ext_inputs,
                                       std::vector<int64_t> mutated, std::vector<int64_t> targets,
                                       std::vector<std::pair<int64_t, int64_t>> zeros,
                                       py::list target_metas, size_t n_ops, py::object run,
                                       py::object done) {
  auto fe = std::make_shared<FastEnd>();
  for (py::handle m : target_metas) {
    auto t = m.cast<py::tuple>();
    fe->target_metas.push_back({dtype_of(t[0]), t[1].cast<std::vector<int64_t>>(),
                                t[2].cast<std::vector<int64_t>>(), t[3].cast<int64_t>()});
  }
  TORCH_CHECK(specialized.size() == spec_values.size(), "fast end: specialized floats differ");
  fe->fresh = std::move(fresh);
  fe->live = std::move(live);
  fe->specialized = std::move(specialized);
  for (py::handle x : spec_values) fe->spec_values.push_back(number_of(x));
  fe->lifted = std::move(lifted);
  fe->ext_inputs = std::move(ext_inputs);
  fe->mutated = std::move(mutated);
  fe->targets = std::move(targets);
  TORCH_CHECK(fe->targets.size() == fe->target_metas.size(), "fast end: targets differ");
  fe->zeros = std::move(zeros);
  fe->n_ops = n_ops;
  fe->run = std::move(run);
  fe->done = std::move(done);
  return fe;
}

bool same_number(const c10::IValue& a, const c10::IValue& b) {
  if (a.isDouble() && b.isDouble()) {
    double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof x) == 0;  // bitwise: a sign of zero is a variant too
  }
  return same_kind(a, b) && a == b;
}

// Does a written input share memory with another input (tracer.lifecycle.written_input_aliased)?
bool written_aliased(const FastEnd& fe, const std::vector<at::Tensor>& exts) {
  if (fe.mutated.empty()) return false;
  std::unordered_map<const void*, int> uses;
  std::vector<const void*> keys(fe.ext_inputs.size(), nullptr);
  for (size_t i = 0; i < fe.ext_inputs.size(); i++) {
    const at::Tensor& t = exts[fe.ext_inputs[i]];
    if (!t.has_storage() || t.storage().nbytes() == 0) continue;
    keys[i] = t.storage().data();
    uses[keys[i]]++;
  }
  for (int64_t i : fe.mutated)
    if (keys[i] != nullptr && uses[keys[i]] > 1) return true;
  return false;
}

// Empty ``st``'s tables for the next segment (the one served was launched).
void segment_over(State* st) {
  drop_served(st);
  st->pos = 0;
  st->n_rebound = 0;
  st->vals.clear();
  st->exts.clear();
  st->known.clear();
  st->mem.clear();
  st->val_mem.clear();
  st->host_ops = st->ignored_ops = 0;
  st->seg_rng = false;
}

// The segment ``st`` of ``mode`` served whole, launched with its path's fused graph, if it is
// that graph's variant (Note [Launched below the floor]); ``why``: the boundary's reason (a
// read's number in tracer.hot_plan._READ_OPS). ``in_op``: called inside an op's dispatch (a read), where the
// keys above Python are done, as in the mode's own handling. The interpreter lock held.
// Why the last launch below the floor was refused (a test's and a profile's question).
const char* g_refused = "";
bool refuse(const char* why) {
  g_refused = why;
  return false;
}

bool launch_whole(PyObject* mode, State* st, py::object why, bool in_op) {
  // a segment the plan served whole, from its first op: the tables hold nothing else
  size_t n_ops = st->served.size();
  if (!st->plan->starts || !st->started || n_ops == 0)
    return refuse("not a segment the plan started");
  if (st->pos != st->plan->steps.size()) return refuse("not at the plan's end");
  if (st->vals.size() != st->r_fresh.size() || st->exts.size() != st->r_new_exts.size())
    return refuse("values or externals from Python");
  if (torch::profiler::impl::profilerEnabled()) return refuse("profiling");  // Python's ranges
  PyObject* node = PyTuple_GET_ITEM(st->plan->nodes.ptr(), (Py_ssize_t)st->pos - 1);
  py::object got = py::reinterpret_steal<py::object>(PyObject_GetAttrString(node, "fast_end"));
  if (!got) throw python_error();
  if (got.is_none()) return refuse("no launch at its end");
  std::shared_ptr<FastEnd> fe = got.cast<std::shared_ptr<FastEnd>>();
  if (fe->n_ops != n_ops) return refuse("another path");
  // the variant: the same fresh values alive (Note [Liveness], scheduler/launch.py). The
  // twins the plan took for values (Note [Memory of a value]) it holds itself until the
  // hand-back, where only a weak reference keeps them: a twin nothing else holds is no use.
  std::unordered_map<c10::StorageImpl*, size_t> ours;
  for (const auto& r : st->r_rebound)
    if (r.second.defined() && r.second.use_count() == 1 && r.second.has_storage())
      ours[r.second.storage().unsafeGetStorageImpl()]++;
  size_t j = 0;
  for (int64_t i : fe->fresh) {
    c10::StorageImpl* handle = (size_t)i < st->r_fresh.size() ? st->r_fresh[i].second : nullptr;
    if (handle == nullptr) continue;
    size_t uses = c10::raw::weak_intrusive_ptr::use_count(handle);
    auto held = ours.find(handle);
    if (uses == 0 || (held != ours.end() && uses <= held->second)) continue;
    if (j >= fe->live.size() || fe->live[j] != i) return refuse("other values alive");
    j++;
  }
  if (j != fe->live.size()) return refuse("other values alive");
  std::vector<at::Tensor> targets;
  for (size_t k = 0; k < fe->targets.size(); k++) {
    int64_t i = fe->targets[k];
    StrongTensor t = st->vals[i].lock();  // the value's tensor, or its twin
    if (t) {
      targets.emplace_back(std::move(t));
      continue;
    }
    // alive through a view only: a tensor as the value on its memory (scheduler.launch._target)
    auto memory = c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim_copy(st->r_fresh[i].second).lock();
    if (!memory) return refuse("a value that died");
    const FastEnd::Meta& m = fe->target_metas[k];
    at::Tensor made = at::detail::empty_cpu({0}, m.dtype, false, std::nullopt);
    made.unsafeGetTensorImpl()->set_storage_keep_dtype(c10::Storage(std::move(memory)));
    made.unsafeGetTensorImpl()->set_sizes_and_strides(m.sizes, m.strides, m.offset);
    targets.push_back(std::move(made));
  }
  // and the same floats compiled in
  std::vector<size_t> first_rec(n_ops + 1, 0);
  for (size_t k = 0; k < n_ops; k++) first_rec[k + 1] = first_rec[k] + st->served[k].recs;
  auto rec_at = [&](const std::pair<int64_t, int64_t>& at) -> const c10::IValue* {
    if (at.first < 0 || (size_t)at.first >= n_ops || at.second < 0 ||
        (size_t)at.second >= st->served[at.first].recs)
      return nullptr;
    return &st->r_recs[first_rec[at.first] + at.second];
  };
  for (size_t k = 0; k < fe->specialized.size(); k++) {
    const c10::IValue* v = rec_at(fe->specialized[k]);
    if (v == nullptr || !same_number(*v, fe->spec_values[k])) return refuse("another float");
  }
  for (const auto& at : fe->zeros) {  // random ops that draw nothing (else Python's launch)
    const c10::IValue* v = rec_at(at);
    if (v == nullptr || !(v->isDouble() ? v->toDouble() == 0.0
                                        : v->isInt() ? v->toInt() == 0 : !v->toBool()))
      return refuse("random numbers drawn");
  }
  const std::vector<at::Tensor>& exts = st->r_new_exts;
  for (int64_t k : fe->ext_inputs)
    if (k < 0 || (size_t)k >= exts.size()) return refuse("another path");
  if (written_aliased(*fe, exts)) return refuse("a written input aliased");
  // It is the variant: launch it, as scheduler.launch.run would on a synchronous queue.
  size_t n_in = fe->ext_inputs.size() + (fe->lifted.empty() ? 0 : 1) + targets.size();
  py::list inputs(n_in);
  size_t at_in = 0;
  auto put_in = [&](at::Tensor t) {
    PyObject* obj = THPVariable_Wrap(std::move(t));
    if (obj == nullptr) throw python_error();
    PyList_SET_ITEM(inputs.ptr(), (Py_ssize_t)at_in++, obj);
  };
  for (int64_t k : fe->ext_inputs) put_in(exts[k]);
  if (!fe->lifted.empty()) {
    at::Tensor packed = at::detail::empty_cpu({(int64_t)fe->lifted.size()}, at::kDouble,
                                              false, std::nullopt);
    double* out = packed.mutable_data_ptr<double>();
    for (size_t k = 0; k < fe->lifted.size(); k++) {
      const c10::IValue* v = rec_at(fe->lifted[k]);
      TORCH_CHECK(v != nullptr, "adaptive_eager: a lifted float the segment did not record");
      out[k] = v->isDouble() ? v->toDouble() : v->isInt() ? (double)v->toInt() : (double)v->toBool();
    }
    put_in(std::move(packed));
  }
  for (at::Tensor& t : targets) put_in(std::move(t));
  double seconds = 0.0;
  {
    // as the mode handles an op: off the stack, the keys above Python done; the graph's own
    // reads (Inductor checks alignment through data_ptr) see the mode paused, as in _launch
    torch::torch_dispatch_mode::StashTorchDispatchModeGuard stash;
    c10::impl::ExcludeDispatchKeyGuard above(in_op ? kAbovePython : c10::DispatchKeySet());
    KeyOff off;
    at::AutoDispatchBelowADInplaceOrView below;
    py::object paused = py::reinterpret_steal<py::object>(PyObject_GetAttrString(mode, "paused"));
    if (!paused) throw python_error();
    int64_t was = paused.cast<int64_t>();
    if (PyObject_SetAttrString(mode, "paused", py::int_(was + 1).ptr()) != 0) throw python_error();
    PyObject* out = PyObject_CallOneArg(fe->run.ptr(), inputs.ptr());
    if (PyObject_SetAttrString(mode, "paused", py::int_(was).ptr()) != 0) {
      Py_XDECREF(out);
      throw python_error();
    }
    if (out == nullptr) {
      // the graph raised: Python's segment takes what was served and finds the op eager
      // would have failed at (scheduler.launch.attribute_fused)
      py::error_already_set error;
      hand_back(mode);
      py::object raised = fe->done(py::none(), why, error.value());
      PyErr_SetObject((PyObject*)Py_TYPE(raised.ptr()), raised.ptr());
      throw python_error();
    }
    Py_DECREF(out);
    g_launched.fetch_add(1, std::memory_order_relaxed);
    seconds = perf_counter() - st->t0;
    int64_t host = st->host_ops, passed = st->ignored_ops;
    segment_over(st);
    fe->done(seconds, why, py::make_tuple(host, passed, st->plan->counter));
  }
  return true;
}

bool launch_at_read(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  static const c10::OperatorName item("aten::_local_scalar_dense", ""),
      nonzero("aten::is_nonzero", "");
  const c10::OperatorName& name = op.operator_name();
  int read = name == item ? 0 : name == nonzero ? 1 : -1;
  if (read < 0 || stack->empty()) return false;
  PyObject* mode = top_mode();
  if (mode == nullptr) return false;
  State* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto found = g_active.find(mode);
    if (found == g_active.end()) return false;
    st = found->second;
  }
  const c10::IValue& arg = stack->back();
  if (!arg.isTensor() || !st->started) return false;
  auto known = st->known.find(arg.unsafeToTensorImpl());
  if (known == st->known.end() || known->second < 0) return false;  // it reads no value
  {
    py::gil_scoped_acquire gil;
    if (!launch_whole(mode, st, py::int_(read), true)) return false;
  }
  // the read itself, as the mode runs it (outside any segment)
  torch::torch_dispatch_mode::StashTorchDispatchModeGuard stash;
  KeyOff off;
  op.redispatchBoxed(ks.remove(kKey), stack);
  return true;
}

bool launch_served(py::handle mode_obj, py::str why) {
  PyObject* mode = mode_obj.ptr();
  if (top_mode() != mode) return false;
  State* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto found = g_active.find(mode);
    if (found == g_active.end()) return false;
    st = found->second;
  }
  return launch_whole(mode, st, why, false);
}

void bind(py::module_& m) {
  py::class_<Step, std::shared_ptr<Step>>(m, "Step");
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan");
  m.def("make_step", &make_step);
  m.def("make_plan", &make_plan);
  py::class_<FastEnd, std::shared_ptr<FastEnd>>(m, "FastEnd");
  m.def("make_fast_end", &make_fast_end);
  m.def("launch_served", &launch_served);
  m.def("refused", []() { return std::string(g_refused); });
  m.def("hand_back", [](py::handle mode) { hand_back(mode.ptr()); });
  m.def("forget", [](py::handle mode) { forget(mode.ptr()); });
  m.def("serving", &serving);
  m.def("served", &served);
  m.def("pool_held_bytes", &pool_held_bytes);
  py::module_ torch_mod = py::module_::import("torch");
  g_plain[0] = (PyTypeObject*)torch_mod.attr("Tensor").ptr();
  g_plain[1] = (PyTypeObject*)torch_mod.attr("nn").attr("Parameter").ptr();
  py::object gone = py::module_::import("builtins").attr("type")("Gone", py::tuple(), py::dict());
  py::object dummy = gone();
  g_dead = PyWeakref_NewRef(dummy.ptr(), nullptr);  // dead once ``dummy`` goes, below
  if (g_dead == nullptr) throw python_error();
  const char* names[] = {"outw", "exts", "extw", "ids", "floats", "stor", "node", "expect",
                         "hot_next", "hot", "t0", "rng"};
  PyObject** slots[] = {&s_outw, &s_exts, &s_extw, &s_ids, &s_floats, &s_stor, &s_node,
                        &s_expect, &s_hot_next, &s_hot, &s_t0, &s_rng};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    *slots[i] = PyUnicode_InternFromString(names[i]);
}

}  // namespace ae_hot
