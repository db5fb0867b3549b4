-- `gptlua` as a command after the set-up: `make install` into a PREFIX, and
-- `make link` (what `make run` and `make test` do) into a user's
-- ~/.local/bin with ~/.profile putting it on PATH at the next login, each
-- tried from a login shell in another directory.
local H = require 'support.mpi'
-- make as a user runs it, not as a child of the make running the specs (its jobserver and flags)
local MAKE = 'env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make'

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

-- a fresh login shell of a user whose home is home (PATH as the system's)
local function login(home, cmd)
  return H.sh(('env -i HOME=%s PATH=/usr/local/bin:/usr/bin:/bin bash -lc %s'):format(quote(home), quote(cmd)), 120)
end

describe('gptlua on PATH', function()
  it('make install PREFIX=DIR: a copy that runs from anywhere', function()
    local d = tmpdir()
    local o, rc = H.sh((MAKE .. ' -s install PREFIX=%s'):format(d), 600)
    assert.equal(0, rc, o)
    o, rc = H.sh('bash -c ' .. quote(('cd / && %s/bin/gptlua -e "local gl = require(\'gptlua\'); print(gl.root, gl.ones({3}):sum():item())"')
      :format(d)))
    assert.equal(0, rc, o)
    has(o, d .. '/share/gptlua\t3')
    os.execute('rm -rf ' .. quote(d))
  end)

  it("make link as a user: ~/.local/bin, on PATH at the next login through ~/.profile", function()
    local home = tmpdir()
    local o, rc = H.sh((MAKE .. ' -s link IS_ROOT= HOME=%s'):format(home), 600)
    assert.equal(0, rc, o)
    has(o, ('make link: %s/.local/bin/gptlua -> %s/build/gptlua'):format(home, H.ROOT))
    has(o, ('make link: added %s/.local/bin to PATH in %s/.profile (for new logins)'):format(home, home))
    o, rc = login(home, 'cd / && command -v gptlua && gptlua -e "print(6 * 7)"')
    assert.equal(0, rc, o)
    has(o, home .. '/.local/bin/gptlua\n42')
    -- again: the link replaced, the profile not touched twice
    o = H.sh((MAKE .. ' -s link IS_ROOT= HOME=%s && grep -c "local/bin" %s/.profile'):format(home, home))
    has(o, '\n1\n')
    os.execute('rm -rf ' .. quote(home))
  end)

  it('make link as root: /usr/local/bin (on every PATH); an installed copy is left alone', function()
    local o = H.sh(MAKE .. ' -n link IS_ROOT=1')
    has(o, ('ln -sfn %s/build/gptlua /usr/local/bin/gptlua'):format(H.ROOT))
    local d = tmpdir()
    os.execute(('mkdir -p %s/bin && echo copy > %s/bin/gptlua'):format(d, d))
    o = H.sh((MAKE .. ' -s link IS_ROOT=1 BINDIR=%s/bin'):format(d))
    has(o, ('make link: %s/bin/gptlua is an installed copy (make install), left as it is'):format(d))
    os.execute('rm -rf ' .. quote(d))
  end)
end)
