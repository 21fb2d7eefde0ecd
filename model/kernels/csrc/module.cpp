// A build's entry point: Python imports the module by its file's name and calls PyInit_<that name>; each build is
// named by its sources, flags and torch (model/kernels/__init__.py's module_name), given here as
// TORCH_EXTENSION_NAME. The module itself is bindings.cpp's (ls_init_module), compiled once for every build.
#define LS_CONCAT(a, b) a##b
#define LS_PYINIT(name) LS_CONCAT(PyInit_, name)

struct _object;  // Python's PyObject
extern "C" _object* ls_init_module();
extern "C" __attribute__((visibility("default"))) _object* LS_PYINIT(TORCH_EXTENSION_NAME)() { return ls_init_module(); }
