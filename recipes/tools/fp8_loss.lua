-- The FP8 loss criterion: the default recipe trained N steps (300) twice
-- from the same seed and batches, in bfloat16 and with --fp8=RECIPE, and
-- the two final validation losses compared with a tolerance (0.02).  On the
-- CPU the FP8 products are emulated (--fp8_emulate); on a GPU (or the CUDA
-- simulator: build/sim/gptlua, slow) they are cuBLASLt's.
--   gptlua recipes/tools/fp8_loss.lua [--recipe=tensorwise|rowwise] [--steps=300] [--device=cpu]
--     [--tolerance=0.02] [--n_embd=128]
local train = require 'gptlua.train'
local gl = require 'gptlua'

local opts = { recipe = 'tensorwise', steps = '300', device = 'cpu', tolerance = '0.02', n_embd = '128' }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.+)$')
  if not k or opts[k] == nil then
    error('fp8_loss: unknown argument ' .. a .. ' (--recipe, --steps, --device, --tolerance, --n_embd)', 0)
  end
  opts[k] = v
end
local steps, tol = tonumber(opts.steps), tonumber(opts.tolerance)
local function run(fp8)
  local out = os.tmpname(); os.remove(out)
  local args = { '--device=' .. opts.device, '--dtype=bfloat16', '--max_iters=' .. steps, '--eval_interval=' .. steps,
                 '--sample_length=0', '--tensorboard=false', '--quiet=true', '--out_dir=' .. out,
                 '--n_embd=' .. opts.n_embd, '--fp8=' .. fp8, '--fp8_emulate' }
  local t0 = os.time()
  local res = train.main(dofile(gl.root .. '/recipes/shakespeare.lua'), args)
  os.execute('rm -rf ' .. out)
  print(('  fp8 %-10s val loss %.4f  (%d s)'):format(fp8, res.eval.val, os.time() - t0))
  return res.eval.val
end
print(('the default recipe, %d steps, bfloat16, width %s, on %s:'):format(steps, opts.n_embd, opts.device))
local ref, got = run('off'), run(opts.recipe)
local d = math.abs(got - ref)
print(('|%.4f - %.4f| = %.4f: %s the tolerance %g'):format(got, ref, d, d <= tol and 'within' or 'OUTSIDE', tol))
if d > tol then os.exit(1) end
