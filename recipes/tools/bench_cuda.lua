-- recipes/tools/bench_cuda.lua — throughput of the CUDA kernels at GPT training shapes.
--   build/gptlua recipes/tools/bench_cuda.lua [--B=32] [--T=1024] [--C=768] [--H=12] [--V=50304] [--iters=20]
--                                     [--square=4096] [--params=124e6]
--   build/gptlua recipes/tools/bench_cuda.lua --account [--model=gpt2_124m|nanochat_d20] [--check=1] [--quick=0] [--save=1]
--     the byte-and-FLOP account of one training step instead (recipes/tools/account.lua;
--     runs in build/sim-account/gptlua, `make sim-account`; --quick=0 computes the
--     GEMMs' values too, which changes no count and takes many times longer; --save=1 keeps the
--     predicted range in recipes/tools/account_predictions.json, which make gpu-check compares with;
--     --decode=1: the predicted decode speed of the KV-cache engine at batch 1 and 8 instead)
-- Defaults are GPT-2 124M (context 1024, device batch 32).  Times come from
-- CUDA events on the compute stream (warm-up calls first); matmul and
-- attention report TFLOP/s, memory-bound kernels GB/s of the bytes they must
-- move.  Prints a message and exits cleanly on a machine without a GPU.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local lib = gl.lib

local opts = { B = 32, T = 1024, C = 768, H = 12, V = 50304, iters = 20, square = 4096, params = 124e6 }
local account = { model = 'gpt2_124m', check = 0, quick = 1, save = 0, decode = 0 }  -- --account: recipes/tools/account.lua
for _, a in ipairs({ ... }) do
  if a == '--account' then account.on = true
  else
    local k, v = a:match('^%-%-(%w+)=(.*)$')
    if k and account[k] ~= nil then account[k] = tonumber(v) or v
    else
      if not k or opts[k] == nil or not tonumber(v) then error('cuda_bench: unknown argument ' .. a, 0) end
      opts[k] = tonumber(v)
    end
  end
end

-- --account: the byte-and-FLOP account of one training step, counted by the
-- simulator's account flavour (build/sim-account/gptlua, `make sim-account`);
-- any other engine hands the command over to it.
if account.on then
  local tool = dofile(gl.root .. '/recipes/tools/account.lua')
  local lib, why = tool.library()
  if lib and os.getenv('GL_SIM_SMS') == tostring(tool.SMS) then
    tool.main(account)
    return  -- (a recipe that returns a table is a training config)
  end
  if os.getenv('GL_ACCOUNT_HANDED') then error('cuda_bench: --account: ' .. (why or 'GL_SIM_SMS is not 2'), 0) end
  local exe = gl.root .. '/build/sim-account/gptlua'
  local f = io.open(exe, 'rb')
  if not f then
    error('cuda_bench: --account runs in the CUDA simulator\'s account flavour: build it with `make sim-account`', 0)
  end
  f:close()
  local args = { 'GL_SIM_SMS=' .. tool.SMS, 'GL_SIM_STREAMS=sync', 'GL_ACCOUNT_HANDED=1', exe,
                 gl.root .. '/recipes/tools/bench_cuda.lua' }
  for _, a in ipairs({ ... }) do args[#args + 1] = a end
  for i = 4, #args do args[i] = "'" .. args[i]:gsub("'", "'\\''") .. "'" end
  local ok = os.execute(table.concat(args, ' '))
  if ok ~= 0 and ok ~= true then os.exit(1) end
  return
end

if not cuda.is_available() then
  print('cuda_bench: no CUDA device available (' .. (cuda.built() and 'CUDA build' or 'CPU-only build') ..
        '), nothing to measure')
  return
end

local DEV = 'cuda:0'
local props = cuda.get_device_properties(0)
print(('cuda_bench: %s (sm_%d%d, %d SMs, %.0f GiB), B=%d T=%d C=%d H=%d V=%d'):format(
  props.name, props.major, props.minor, props.multiprocessor_count, props.total_memory / 2 ^ 30,
  opts.B, opts.T, opts.C, opts.H, opts.V))

local function K(rc) gl.check(rc, 2) end
local function randn(shape, dtype) return gl.randn(shape, { device = DEV, dtype = dtype or 'bfloat16', seed = 1 }) end
local function empty(shape, dtype) return gl.empty(shape, { device = DEV, dtype = dtype or 'bfloat16' }) end
local function ms(fn) return cuda.time(fn, { iters = opts.iters, warmup = 3 }) end

local rows = {}
local function report(name, t, flops, bytes)
  local s = ('%-44s %9.3f ms'):format(name, t)
  if flops then s = s .. ('  %8.1f TFLOP/s'):format(flops / t / 1e9) end
  if bytes then s = s .. ('  %8.1f GB/s'):format(bytes / t / 1e6) end
  print(s)
  rows[#rows + 1] = { name = name, ms = t }
end

local B, T, C, H, V = opts.B, opts.T, opts.C, opts.H, opts.V
local N, D = B * T, C / H

-- matrix products (cuBLASLt): the GPT-2 linear layers and a square reference
do
  local function bench_mm(name, M, Kd, Nn, dtype, transb)
    local a = randn({ M, Kd }, dtype)
    local b = transb and randn({ Nn, Kd }, dtype):t() or randn({ Kd, Nn }, dtype)
    local out = empty({ M, Nn }, dtype)
    report(name, ms(function() K(lib.gl_matmul(out.c, a.c, b.c, 1, 0)) end), 2 * M * Kd * Nn)
  end
  local S = opts.square
  bench_mm(('matmul bf16 %d^3'):format(S), S, S, S, 'bfloat16')
  bench_mm(('matmul f32 %d^3 (no TF32)'):format(S), S, S, S, 'float32')
  bench_mm(('qkv   bf16 %dx%dx%d (x W^T)'):format(N, C, 3 * C), N, C, 3 * C, 'bfloat16', true)
  bench_mm(('fc    bf16 %dx%dx%d'):format(N, C, 4 * C), N, C, 4 * C, 'bfloat16', true)
  bench_mm(('proj  bf16 %dx%dx%d'):format(N, 4 * C, C), N, 4 * C, C, 'bfloat16', true)
  bench_mm(('lm_head bf16 %dx%dx%d'):format(N, C, V), N, C, V, 'bfloat16', true)
end

-- nanochat's ReLU² MLP products (kernels/gemm_mma.cu, our mma.sync GEMM with
-- the epilogue) against what they replace: cuBLASLt's product and the
-- elementwise pass (GL_CUDA_MATMUL_FALLBACK is not needed: the plain product
-- and gl_unary / the relu2 backward are timed directly)
do
  local x, W1, g, W2 = randn({ N, C }), randn({ 4 * C, C }), randn({ N, C }), randn({ C, 4 * C })
  local h, pre, dpre = empty({ N, 4 * C }), empty({ N, 4 * C }), empty({ N, 4 * C })
  local f = 2 * N * C * 4 * C
  report(('relu2 fwd fused %dx%dx%d'):format(N, C, 4 * C),
         ms(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, h.c, x.c, W1:t().c, nil, nil)) end), f)
  report('relu2 fwd cuBLASLt + pass', ms(function()
    K(lib.gl_matmul(pre.c, x.c, W1:t().c, 1, 0)); K(lib.gl_unary(lib.GL_U_RELU2, h.c, pre.c, 0, 0)) end), f)
  report(('relu2 bwd dx fused %dx%dx%d'):format(N, C, 4 * C),
         ms(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, g.c, W2.c, nil, h.c)) end), f)
  report('relu2 bwd dx cuBLASLt + pass', ms(function()
    K(lib.gl_matmul(dpre.c, g.c, W2.c, 1, 0)); K(lib.gl_unary_backward(lib.GL_U_RELU2, dpre.c, dpre.c, pre.c, 0, 0)) end), f)
end

-- causal attention, (B, T, H, D) activations viewed as (B, H, T, D)
do
  local function view(t) return t:view(B, T, H, D):transpose(2, 3) end
  local q, k, v = view(randn({ B, T, C })), view(randn({ B, T, C })), view(randn({ B, T, C }))
  local o, lse = view(empty({ B, T, C })), empty({ B, H, T }, 'float32')
  local dout = view(randn({ B, T, C }))
  local dq, dk, dv = view(empty({ B, T, C })), view(empty({ B, T, C })), view(empty({ B, T, C }))
  local scale = 1 / math.sqrt(D)
  local causal = 4 * B * H * T * T * D / 2  -- QK^T and PV over the causal half
  report(('attention fwd bf16 D=%d'):format(D),
         ms(function() K(lib.gl_attention_forward(o.c, lse.c, q.c, k.c, v.c, scale, 0)) end), causal)
  report(('attention bwd bf16 D=%d'):format(D),
         ms(function() K(lib.gl_attention_backward(dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, o.c, lse.c, scale, 0)) end),
         2.5 * causal)
end

-- memory-bound kernels
do
  local x, dy = randn({ N, C }), randn({ N, C })
  local y, w, b = empty({ N, C }), randn({ C }), randn({ C })
  local mean, rstd = empty({ N }, 'float32'), empty({ N }, 'float32')
  local dx, dw, db = empty({ N, C }), empty({ C }), empty({ C })
  report('layernorm fwd bf16', ms(function()
    K(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, x.c, w.c, b.c, 1e-5)) end), nil, 2 * N * C * 2)
  report('layernorm bwd bf16', ms(function()
    K(lib.gl_layernorm_backward(dx.c, dw.c, db.c, dy.c, x.c, w.c, mean.c, rstd.c)) end), nil, 3 * N * C * 2)
  report('rmsnorm fwd bf16', ms(function() K(lib.gl_rmsnorm_forward(y.c, rstd.c, x.c, w.c, 1e-6)) end), nil, 2 * N * C * 2)
  local h, gh = randn({ N, 4 * C }), empty({ N, 4 * C })
  report('gelu fwd bf16', ms(function() K(lib.gl_unary(lib.GL_U_GELU_TANH, gh.c, h.c, 0, 0)) end), nil, 2 * N * 4 * C * 2)
  report('residual add bf16', ms(function() K(lib.gl_binary(lib.GL_B_ADD, y.c, x.c, dy.c)) end), nil, 3 * N * C * 2)
end

do
  local logits = randn({ N, V })
  local ids = {}
  for i = 1, N do ids[i] = (i * 7919) % V end
  local targets = gl.tensor(ids, { dtype = 'int64' }):to(DEV)
  local losses, lse = empty({ N }, 'float32'), empty({ N }, 'float32')
  report('cross-entropy fwd bf16', ms(function()
    K(lib.gl_cross_entropy_forward(losses.c, lse.c, logits.c, targets.c, -1, 0)) end), nil, N * V * 2)
  report('cross-entropy bwd bf16 (in place)', ms(function()
    K(lib.gl_cross_entropy_backward(logits.c, logits.c, targets.c, lse.c, -1, 0, 1 / N, nil)) end), nil, 2 * N * V * 2)
  local wte, emb, demb = randn({ V, C }), empty({ B, T, C }), randn({ B, T, C })
  local dwte = empty({ V, C })
  local tok = targets:view(B, T)
  report('embedding fwd bf16', ms(function() K(lib.gl_embedding_forward(emb.c, wte.c, tok.c)) end), nil, 2 * N * C * 2)
  report('embedding bwd bf16 (deterministic)', ms(function()
    K(lib.gl_embedding_backward(dwte.c, demb.c, tok.c)) end), nil, (N + V) * C * 2)
end

do
  local n = math.floor(opts.params)
  local p, g = randn({ n }, 'float32'), randn({ n }, 'bfloat16')
  local m, v = empty({ n }, 'float32'):zero_(), empty({ n }, 'float32'):zero_()
  report(('adamw %.0fM f32 params, bf16 grads'):format(n / 1e6), ms(function()
    K(lib.gl_adamw_update(p.c, g.c, m.c, v.c, 0, n, 1e-4, 0.9, 0.95, 1e-8, 0.1, 10)) end), nil, n * (4 * 6 + 2))
  local sq = require('ffi').new('double[1]')
  report(('global grad norm (sumsq) %.0fM bf16'):format(n / 1e6), ms(function() K(lib.gl_sumsq(g.c, sq)) end), nil, n * 2)
end

local st = cuda.memory_stats(0)
print(('peak device memory %.2f GiB, reserved %.2f GiB'):format(st.peak / 2 ^ 30, st.reserved / 2 ^ 30))
