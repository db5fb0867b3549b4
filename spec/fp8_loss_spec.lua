-- recipes/tools/fp8_loss.lua, the FP8 loss criteria: the windowed gap of
-- two loss curves, the options, and the GPT-2 124M-shaped comparison run
-- end to end at a toy size (bf16, tensorwise, rowwise on the CPU, FP8
-- emulated), so the tool cannot rot; the full-size measurement is the
-- tool's own run (minutes), not a spec.
local gl = require 'gptlua'

local T = dofile(gl.root .. '/recipes/tools/fp8_loss.lua')

describe('fp8_loss: the criteria', function()
  it('averages consecutive windows (the last one shorter) and finds the largest gap between two curves', function()
    assert.same({ 2, 5, 7 }, T.window_means({ 1, 3, 4, 6, 7 }, 2))
    local a = { 4, 4, 3, 3, 2, 2 }
    local b = { 4, 4, 3.1, 2.9, 2.3, 2.1 }  -- window 2: means equal; window 3: 0.2 apart
    local gap, at = T.largest_gap(a, b, 2)
    assert.near(0.2, gap, 1e-12)
    assert.equal(3, at)
    gap = T.largest_gap(a, b, 1)  -- step by step: 0.3 at step 5
    assert.near(0.3, gap, 1e-12)
  end)

  it('refuses a bad option with one line', function()
    local function err(argv) local ok, e = pcall(T.options, argv); assert.is_false(ok); return e end
    assert.matches('^fp8_loss: unknown argument %-%-speed=1 %(expected %-%-batch_size', err({ '--speed=1' }))
    assert.equal("fp8_loss: --shape expected 'default' or 'gpt2_124m', got 'gpt3'", err({ '--shape=gpt3' }))
    assert.equal("fp8_loss: --recipe expected 'tensorwise' or 'rowwise', got 'off'", err({ '--recipe=off' }))
    assert.equal('fp8_loss: --steps expected a positive integer, got 0', err({ '--steps=0' }))
    assert.equal('fp8_loss: --tolerance expected a number >= 0, got x', err({ '--tolerance=x' }))
    local o = T.options({ '--shape=gpt2_124m' })
    assert.equal(96, o.n_embd)
    assert.equal(128, T.options({}).n_embd)
  end)

  it('runs the GPT-2 124M shape in bf16, tensorwise and rowwise from the same seed and batches (toy size)', function()
    local o = T.options({ '--shape=gpt2_124m', '--steps=4', '--window=2', '--n_embd=24', '--block_size=16',
                          '--batch_size=2' })
    local lines = {}
    local ok, res = T.gpt2(o, function(s) lines[#lines + 1] = s end)
    local text = table.concat(lines, '\n')
    assert.matches('GPT-2 124M shape (12 layers, 12 heads) at width 24, context 16, batch 2', text, 1, true)
    for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
      local r = res[recipe]
      assert.is_true(r.gap >= 0 and r.gap < 1, recipe)         -- finite, and the curves start together
      assert.is_true(r.val > 0 and r.val < 10, recipe)
      assert.near(math.abs(r.val - res.off.val), r.val_gap, 1e-12)
      assert.equal(r.gap <= o.train_tolerance and r.val_gap <= o.tolerance, r.tracks)
      assert.matches(recipe .. ' +largest gap of the 2%-step train%-loss means', text)
    end
    assert.equal(res.tensorwise.tracks and res.rowwise.tracks, ok)
    assert.matches('tracks: every 2-step train-loss mean within 0.05 of bf16\'s and the final val loss within 0.02', text,
                   1, true)
  end)
end)
