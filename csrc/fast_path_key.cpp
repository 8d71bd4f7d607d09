// fast_path_key: the per-call fast path's key of the public ops (vit_kernels/backend.py, ``_call_key``),
// read in C++. Reading a tensor's shape, dtype, device, requires_grad and contiguity from Python
// costs five attribute lookups and three new objects per tensor; an MLP call's six tensors cost the
// host more than the rest of its dispatch together. Here each tensor's facts, and the state a
// call's decision and casts depend on, are packed into one bytes object, so that a warm call is one
// C call, a tuple hash and a dictionary lookup.
//
// fast_path_key(args: tuple, parameter_type: type, op: str, choice: ContextVar, process_choice) returns
// * a tuple: op; the backend choice in force (``choice``'s value in this context, else
//   ``process_choice``); for each argument that is None, a bool, an int, a float or a str (exact
//   types), its type then its value; then one bytes object holding, as int64, grad mode, the
//   autocast dtype of the first tensor's device type (-1 where autocast is off there), and for each
//   tensor (exact torch.Tensor or ``parameter_type``) its position, dimensions, sizes, scalar type,
//   device type and index, requires_grad and contiguity;
// * NotImplemented when the first argument is not a plain tensor, or an argument is another tensor
//   type (a subclass, whose attributes Python may define) or its sizes cannot be read here
//   (symbolic): the Python key applies;
// * None when an argument is of any other type (the op's validation will say what was expected).

#include <Python.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

bool is_plain_value(PyObject* value) {
  return value == Py_None || PyBool_Check(value) || PyLong_CheckExact(value) || PyFloat_CheckExact(value) ||
         PyUnicode_CheckExact(value);
}

PyObject* fast_path_key(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 5 || !PyTuple_Check(argv[0]) || !PyType_Check(argv[1]) || !PyContextVar_CheckExact(argv[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "fast_path_key(args: tuple, parameter_type: type, op, choice: ContextVar, process_choice)");
    return nullptr;
  }
  PyObject* args = argv[0];
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  auto* parameter_type = reinterpret_cast<PyTypeObject*>(argv[1]);
  const Py_ssize_t count = PyTuple_GET_SIZE(args);
  Py_ssize_t plain = 0;
  // isinstance(value, torch.Tensor) goes through torch.Tensor's metaclass, several times the cost of
  // the rest: it is asked only of an argument that is neither a plain tensor nor a plain value.
  auto is_plain_tensor = [&](PyObject* value) {
    return Py_TYPE(value) == tensor_type || Py_TYPE(value) == parameter_type;
  };
  if (count == 0 || !is_plain_tensor(PyTuple_GET_ITEM(args, 0))) {  // the Python key decides
    Py_RETURN_NOTIMPLEMENTED;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* value = PyTuple_GET_ITEM(args, i);
    if (is_plain_tensor(value)) {
      continue;
    }
    if (is_plain_value(value)) {
      ++plain;
      continue;
    }
    const int is_tensor = PyObject_IsInstance(value, THPVariableClass);
    if (is_tensor < 0) {
      return nullptr;
    }
    if (is_tensor) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    Py_RETURN_NONE;
  }
  c10::SmallVector<int64_t, 64> facts;
  // The state: grad mode, and autocast for the first tensor's device type (whose casts the fast
  // path replays), as the Python key reads them.
  const auto device_type = THPVariable_Unpack(PyTuple_GET_ITEM(args, 0)).device().type();
  const bool autocast =
      at::autocast::is_autocast_available(device_type) && at::autocast::is_autocast_enabled(device_type);
  facts.push_back(c10::GradMode::is_enabled());
  facts.push_back(autocast ? static_cast<int64_t>(at::autocast::get_autocast_dtype(device_type)) : -1);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* value = PyTuple_GET_ITEM(args, i);
    if (!is_plain_tensor(value)) {
      continue;
    }
    const at::Tensor& tensor = THPVariable_Unpack(value);
    if (tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    try {
      const auto sizes = tensor.sizes();
      facts.push_back(i);
      facts.push_back(static_cast<int64_t>(sizes.size()));
      facts.append(sizes.begin(), sizes.end());
      facts.push_back(static_cast<int64_t>(tensor.scalar_type()));
      facts.push_back(static_cast<int64_t>(tensor.device().type()));
      facts.push_back(tensor.device().index());
      facts.push_back(tensor.requires_grad());
      facts.push_back(tensor.is_contiguous());
    } catch (const std::exception&) {  // a tensor whose facts only Python reads (e.g. no strides)
      Py_RETURN_NOTIMPLEMENTED;
    }
  }
  PyObject* choice = nullptr;
  if (PyContextVar_Get(argv[3], nullptr, &choice) < 0) {
    return nullptr;
  }
  if (choice == nullptr || choice == Py_None) {  // no use_backend block in force: the process's choice
    Py_XDECREF(choice);
    choice = argv[4];
    Py_INCREF(choice);
  }
  PyObject* key = PyTuple_New(2 * plain + 3);
  if (key == nullptr) {
    Py_DECREF(choice);
    return nullptr;
  }
  Py_INCREF(argv[2]);
  PyTuple_SET_ITEM(key, 0, argv[2]);
  PyTuple_SET_ITEM(key, 1, choice);
  Py_ssize_t at = 2;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* value = PyTuple_GET_ITEM(args, i);
    if (is_plain_tensor(value)) {
      continue;
    }
    auto* type = reinterpret_cast<PyObject*>(Py_TYPE(value));
    Py_INCREF(type);
    PyTuple_SET_ITEM(key, at++, type);
    Py_INCREF(value);
    PyTuple_SET_ITEM(key, at++, value);
  }
  PyObject* packed =
      PyBytes_FromStringAndSize(reinterpret_cast<const char*>(facts.data()), facts.size() * sizeof(int64_t));
  if (packed == nullptr) {
    Py_DECREF(key);
    return nullptr;
  }
  PyTuple_SET_ITEM(key, at, packed);
  return key;
}

}  // namespace

PyMethodDef vit_kernels_methods[] = {
    {"fast_path_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fast_path_key)),
     METH_FASTCALL, "The public ops' per-call fast-path key (see csrc/fast_path_key.cpp)."},
    {nullptr, nullptr, 0, nullptr}};
