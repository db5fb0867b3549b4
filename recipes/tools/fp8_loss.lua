-- The FP8 loss criteria: runs trained from the same seed and batches in
-- bfloat16 with and without --fp8, compared.  On the CPU the FP8 products are
-- emulated (--fp8_emulate); on a GPU (or the CUDA simulator:
-- build/sim/gptlua, slow) they are cuBLASLt's.
--
-- --shape=default: the default recipe trained N steps (300) in bf16 and with
-- --fp8=RECIPE; the final validation losses within --tolerance (0.02).
--
-- --shape=gpt2_124m: GPT-2 124M's shape (recipes/gpt2_124m.lua: its GPT-2
-- block, 12 layers, 12 heads, AdamW 6e-4 cosine to 6e-5) at a width a CPU
-- trains in minutes (--n_embd, 96), context 64, batch 8, on tiny
-- Shakespeare's characters (GPT-2's BPE vocabulary is not in this tree; the
-- char tokenizer is the data pipeline's tokenizer for a text without
-- shards), warmup a tenth of the steps and the cosine over the run; trained
-- in bf16, with --fp8=tensorwise and with --fp8=rowwise.  "Tracks" means:
-- the train loss averaged over consecutive windows of --window steps (20)
-- within --train_tolerance (0.05) of bf16's in every window, and the final
-- validation loss within --tolerance (0.02).  About 8 minutes of one core
-- at the defaults (FP8 emulation runs at about half bf16's speed).
--   gptlua recipes/tools/fp8_loss.lua [--shape=default|gpt2_124m] [--recipe=tensorwise|rowwise] [--steps=300]
--     [--device=cpu] [--tolerance=0.02] [--train_tolerance=0.05] [--window=20] [--n_embd=N]
--     [--block_size=64] [--batch_size=8]
-- Exits 1 when a criterion fails.
local train = require 'gptlua.train'
local gl = require 'gptlua'

local M = {}

M.DEFAULTS = { shape = 'default', recipe = 'tensorwise', steps = '300', device = 'cpu', tolerance = '0.02',
               train_tolerance = '0.05', window = '20', n_embd = '', block_size = '64', batch_size = '8' }
local WIDTH = { default = '128', gpt2_124m = '96' }

-- the options from the command line's --key=value arguments, checked
function M.options(argv)
  local o = {}
  for k, v in pairs(M.DEFAULTS) do o[k] = v end
  for _, a in ipairs(argv) do
    local k, v = a:match('^%-%-([%w_]+)=(.+)$')
    if not k or M.DEFAULTS[k] == nil then
      local names = {}
      for n in pairs(M.DEFAULTS) do names[#names + 1] = '--' .. n end
      table.sort(names)
      error(('fp8_loss: unknown argument %s (expected %s)'):format(a, table.concat(names, ', ')), 0)
    end
    o[k] = v
  end
  if not WIDTH[o.shape] then error(("fp8_loss: --shape expected 'default' or 'gpt2_124m', got '%s'"):format(o.shape), 0) end
  if o.recipe ~= 'tensorwise' and o.recipe ~= 'rowwise' then
    error(("fp8_loss: --recipe expected 'tensorwise' or 'rowwise', got '%s'"):format(o.recipe), 0)
  end
  if o.n_embd == '' then o.n_embd = WIDTH[o.shape] end
  for _, k in ipairs({ 'steps', 'window', 'n_embd', 'block_size', 'batch_size' }) do
    local n = tonumber(o[k])
    if not n or n < 1 or n % 1 ~= 0 then error(('fp8_loss: --%s expected a positive integer, got %s'):format(k, o[k]), 0) end
    o[k] = n
  end
  for _, k in ipairs({ 'tolerance', 'train_tolerance' }) do
    local n = tonumber(o[k])
    if not n or n < 0 then error(('fp8_loss: --%s expected a number >= 0, got %s'):format(k, o[k]), 0) end
    o[k] = n
  end
  return o
end

-- means of consecutive windows of w losses (a last, shorter window too)
function M.window_means(losses, w)
  local out = {}
  for i = 1, #losses, w do
    local s, n = 0, 0
    for j = i, math.min(i + w - 1, #losses) do s, n = s + losses[j], n + 1 end
    out[#out + 1] = s / n
  end
  return out
end

-- the largest |a - b| over the windows' means, and the window (1-based) where
function M.largest_gap(a, b, w)
  local ma, mb = M.window_means(a, w), M.window_means(b, w)
  assert(#ma == #mb, 'fp8_loss: curves of different lengths')
  local worst, at = 0, 1
  for i = 1, #ma do
    local d = math.abs(ma[i] - mb[i])
    if d > worst then worst, at = d, i end
  end
  return worst, at
end

-- one run: its train losses per step, final val loss and seconds
function M.run(o, fp8)
  local out = os.tmpname(); os.remove(out)
  local args = { '--device=' .. o.device, '--dtype=bfloat16', '--max_iters=' .. o.steps, '--eval_interval=' .. o.steps,
                 '--sample_length=0', '--tensorboard=false', '--quiet=true', '--out_dir=' .. out,
                 '--n_embd=' .. o.n_embd, '--fp8=' .. fp8, '--fp8_emulate' }
  local recipe
  if o.shape == 'gpt2_124m' then
    recipe = dofile(gl.root .. '/recipes/gpt2_124m.lua')
    for _, a in ipairs({ '--data=char', '--data_path=' .. gl.root .. '/data/tinyshakespeare.txt', '--tokenizer=',
                         '--vocab_size=0', '--block_size=' .. o.block_size, '--batch_size=' .. o.batch_size,
                         '--total_batch_size=0', '--warmup_iters=' .. math.max(1, math.floor(o.steps / 10)),
                         '--lr_decay_iters=' .. o.steps, '--checkpoint_interval=0' }) do
      args[#args + 1] = a
    end
  else
    recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
  end
  local t0 = os.time()
  local res = train.main(recipe, args)
  os.execute('rm -rf ' .. out)
  return { losses = res.losses, val = res.eval.val, seconds = os.time() - t0 }
end

-- the default recipe: final val losses; returns ok
function M.default(o, print)
  print(('the default recipe, %d steps, bfloat16, width %d, on %s:'):format(o.steps, o.n_embd, o.device))
  local ref = M.run(o, 'off')
  print(('  fp8 %-10s val loss %.4f  (%d s)'):format('off', ref.val, ref.seconds))
  local got = M.run(o, o.recipe)
  print(('  fp8 %-10s val loss %.4f  (%d s)'):format(o.recipe, got.val, got.seconds))
  local d = math.abs(got.val - ref.val)
  print(('|%.4f - %.4f| = %.4f: %s the tolerance %g'):format(got.val, ref.val, d, d <= o.tolerance and 'within' or
    'OUTSIDE', o.tolerance))
  return d <= o.tolerance
end

-- GPT-2 124M's shape: bf16, tensorwise and rowwise curves; returns ok and
-- { recipe -> { gap, window, val, val_gap, tracks } } (and 'off' -> { val })
function M.gpt2(o, print)
  print(('GPT-2 124M shape (12 layers, 12 heads) at width %d, context %d, batch %d, tiny Shakespeare characters, '
         .. '%d steps, bf16, on %s (FP8 %s):'):format(o.n_embd, o.block_size, o.batch_size, o.steps, o.device,
         o.device == 'cpu' and 'emulated' or 'cuBLASLt'))
  local ref = M.run(o, 'off')
  print(('  %-10s final train loss (last window) %.4f, val loss %.4f  (%d s)'):format('bf16',
    M.window_means(ref.losses, o.window)[math.ceil(#ref.losses / o.window)], ref.val, ref.seconds))
  local ok, res = true, { off = { val = ref.val } }
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    local got = M.run(o, recipe)
    local gap, at = M.largest_gap(got.losses, ref.losses, o.window)
    local vgap = math.abs(got.val - ref.val)
    local tracks = gap <= o.train_tolerance and vgap <= o.tolerance
    ok = ok and tracks
    res[recipe] = { gap = gap, window = at, val = got.val, val_gap = vgap, tracks = tracks }
    print(('  %-10s largest gap of the %d-step train-loss means %.4f (steps %d-%d), val loss %.4f (|diff| %.4f), '
           .. '%s  (%d s)'):format(recipe, o.window, gap, (at - 1) * o.window + 1, math.min(at * o.window, o.steps),
           got.val, vgap, tracks and 'tracks' or 'DOES NOT TRACK', got.seconds))
  end
  print(('tracks: every %d-step train-loss mean within %g of bf16\'s and the final val loss within %g: %s'):format(
    o.window, o.train_tolerance, o.tolerance, ok and 'yes' or 'NO'))
  return ok, res
end

function M.main(argv, print_)
  local o = M.options(argv)
  local p = print_ or print
  if o.shape == 'gpt2_124m' then return (M.gpt2(o, p)) end
  return M.default(o, p)
end

-- run as a script: the criterion; loaded (dofile) by a spec: the module
if arg and arg[0] and arg[0]:match('fp8_loss%.lua$') then
  local argv = {}
  for i = 1, #arg do argv[i] = arg[i] end
  if not M.main(argv) then os.exit(1) end
  return  -- (a script that returns a table would be a training config)
end
return M
