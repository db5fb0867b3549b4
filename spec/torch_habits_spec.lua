-- Torch habits: sizes as arguments (gl.randn(3, 4)), row indexing
-- (x[i] a view, x[i][j], x[i] = v, negative rows), nn printed as a list of
-- its classes, and Tab offering a tensor its methods only.
local gl = require 'gptlua'
local repl = require 'gptlua.repl'

local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

describe('Torch habits', function()
  it('take sizes as arguments, options after them', function()
    assert.same({ 3, 4 }, gl.randn(3, 4).shape)
    assert.same({ 2 }, gl.ones(2).shape)
    assert.same({ 2, 3, 4 }, gl.empty(2, 3, 4).shape)
    local z = gl.zeros(2, 3, { dtype = 'float64' })
    assert.same({ { 2, 3 }, 'float64' }, { z.shape, z.dtype })
    assert.equal(gl.randn({ 2, 2 }, { seed = 4 }):tolist()[3], gl.randn(2, 2, { seed = 4 }):tolist()[3])
    assert.equal("randn: expected sizes, then a table of options, got the string 'a' after the sizes",
      err_of(gl.randn, 2, 'a'):gsub('^.-randn:', 'randn:'))
  end)

  it('index rows: x[i] is a view, x[i][j] an element, negative rows from the end', function()
    local x = gl.arange(0, 12):view({ 3, 4 })
    assert.same({ 0, 1, 2, 3 }, x[1]:tolist())
    assert.same({ 8, 9, 10, 11 }, x[-1]:tolist())
    assert.equal(6, x[2][3])
    assert.equal(11, x[-1][-1])
    x[1]:fill_(9)                                   -- a view: writes through
    assert.same({ 9, 9, 9, 9 }, x:narrow(1, 1, 1):view({ 4 }):tolist())
    x[2][3] = 100                                   -- an element
    assert.equal(100, x:get(2, 3))
    x[3] = 5                                        -- a row from a number
    assert.same({ 5, 5, 5, 5 }, x[3]:tolist())
    x[-1] = gl.tensor({ 1, 2, 3, 4 })               -- a row from a tensor
    assert.same({ 1, 2, 3, 4 }, x[3]:tolist())
    local v = gl.zeros(3)
    v[-1] = 2
    v[1] = gl.tensor({ 7 })
    assert.same({ 7, 0, 2 }, v:tolist())
    assert.equal('index: row 4 is out of range for dim 1 of size 3 (1..3, or -3..-1)', err_of(function() return x[4] end))
    assert.equal('index: row 0 is out of range for dim 1 of size 3 (1..3, or -3..-1)', err_of(function() return x[0] end))
    assert.equal('index: expected an integer row, got 1.5', err_of(function() return x[1.5] end))
    assert.equal('index assignment: row -4 is out of range for dim 1 of size 3 (1..3, or -3..-1)',
      err_of(function() x[-4] = 1 end))
    assert.equal('index: a 0-dim tensor has no rows (x:item() is its value)',
      err_of(function() return gl.tensor(3)[1] end))
    -- fields and methods as before
    x.note = 'kept'
    assert.equal('kept', rawget(x, 'note'))
    assert.equal(12, x:numel())
  end)

  it("show a tensor with th's footer at the prompt", function()
    local x = gl.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    assert.equal('tensor([[1.0000, 2.0000, 3.0000],\n        [4.0000, 5.0000, 6.0000]])\n[float32 tensor of size 2x3]',
      repl.render(x))
    assert.equal('tensor(3.0000)\n[float64 tensor with no dimension]', repl.render(gl.tensor(3, { dtype = 'float64' })))
    assert.equal('[float32 tensor of size 2, requires_grad]', repl.render(gl.ones({ 2 }):requires_grad_()):match('\n(.*)$'))
    -- print() and tostring() keep shape and dtype inline
    assert.equal('tensor([1.0000, 2.0000], shape={2}, dtype=float32)', tostring(gl.tensor({ 1, 2 })))
  end)

  it('print nn as its classes, and complete a tensor with its methods only', function()
    local text = repl.render(require('gptlua.nn'))
    assert.truthy(text:find('classes  Dropout, Embedding, LayerNorm, Linear', 1, true), text)
    assert.is_nil(text:find('function: 0x', 1, true), text)
    _G.spec_x = gl.ones(2)
    assert.same({}, repl.complete('spec_x:sco'))
    assert.same({}, repl.complete('spec_x:set_def'))
    assert.same({ 'spec_x:narrow(' }, repl.complete('spec_x:narr'))
    assert.same({ 'spec_x:matmul(' }, repl.complete('spec_x:matm'))
    assert.same({ 'spec_x:backward(' }, repl.complete('spec_x:backw'))
    _G.spec_x = nil
  end)
end)
