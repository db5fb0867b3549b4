-- The FFI's view of every shared struct equals the C compiler's.
local gl = require 'gptlua'
local ffi = gl.ffi
ffi.cdef 'const char *gl_abi_layout(void);'

describe('C/Lua boundary', function()
  it('agrees with the C compiler on sizeof and offsetof of every public struct', function()
    local text = ffi.string(gl.lib.gl_abi_layout())
    local structs, fields = 0, 0
    for key, value in text:gmatch('([%w_%.]+) (%d+)\n') do
      local s, f = key:match('^([%w_]+)%.([%w_]+)$')
      if s then
        fields = fields + 1
        assert.equal(tonumber(value), ffi.offsetof(s, f), key)
      else
        structs = structs + 1
        assert.equal(tonumber(value), ffi.sizeof(key), key)
      end
    end
    assert.is_true(structs >= 3 and fields >= 20, ('checked %d structs, %d fields'):format(structs, fields))
  end)
  it('declares the Lua side from the embedded header (no hand-copied declarations)', function()
    local cdef = ffi.string(gl.lib.gl_cdef())
    assert.truthy(cdef:find('typedef struct gl_tensor', 1, true))
    assert.equal(gl.lib.GL_MAX_DIMS, 8)
  end)
end)
