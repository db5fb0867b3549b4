-- The engine embedded: recipes/embed/host.c (a C program linking
-- libgptlua and LuaJIT) trains in a Lua state and reads the weight back
-- through the C API; `luarocks make` installs the library from the checkout
-- into a tree, where a stock luajit outside the checkout requires it.
local H = require 'support.mpi'
-- make as a user runs it, not as a child of the make running the specs (its jobserver and flags)
local MAKE = 'env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

describe('embedding', function()
  it('a C host links libgptlua, runs training steps in Lua and reads a tensor back', function()
    local o, rc = H.sh(MAKE .. ' -s build/embed_host && build/embed_host . 30', 300)
    assert.equal(0, rc, o)   -- the host itself fails unless the loss fell and C and Lua read the same values
    local c = o:match('read by C:%s+([^\n]+)')
    local lua = o:match('as Lua reads it:%s+([^\n]+)')
    assert.truthy(c and #c > 0, o)
    assert.equal(lua, c)
    assert.equal(4, select(2, c:gsub('%S+', '')))
    has(o, 'engine ' .. require('gptlua').version .. ' (libgptlua, called from C)')
  end)

  it('luarocks make installs it for a stock luajit', function()
    local tree = os.tmpname()
    os.remove(tree)
    local o, rc = H.sh(('luarocks --lua-version=5.1 --tree=%s make'):format(quote(tree)), 600)
    assert.equal(0, rc, o)
    has(o, 'gptlua dev-1 is now installed in ' .. tree)
    o, rc = H.sh('bash -c ' .. quote(('cd / && eval "$(luarocks --lua-version=5.1 --tree=%s path)" && luajit -e %s')
      :format(quote(tree), quote("local gl = require 'gptlua'; print(require('gptlua.ffi').libdir, gl.ones({3}):sum():item())"))))
    assert.equal(0, rc, o)
    has(o, tree .. '/lib/lua/5.1\t3')
    os.execute('rm -rf ' .. quote(tree))
  end)
end)
