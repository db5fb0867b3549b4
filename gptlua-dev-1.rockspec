-- `luarocks --lua-version=5.1 make` in the checkout: builds the engine
-- (make all) and installs the Lua library (require 'gptlua') and the engine
-- libraries beside the tree's C modules, for LuaJIT (the library uses its
-- FFI; PUC Lua cannot load it).  lua-cjson and the engine's shared
-- libraries (OpenBLAS, ...) come from Debian: `make deps`.
rockspec_format = '3.0'
package = 'gptlua'
version = 'dev-1'
-- built from the checkout it sits in (luarocks make); nothing is fetched
source = { url = 'file://.' }
description = {
  summary = 'A GPT training engine: C/CUDA tensors and kernels, training logic in Lua (LuaJIT FFI)',
}
dependencies = { 'lua == 5.1' }
-- the Makefile's own flags (make's command line would replace them): a command, not type 'make'
build = {
  type = 'command',
  build_command = 'make all',
  install_command = 'make rock-install LUADIR=$(LUADIR) LIBDIR=$(LIBDIR)',
}
