-- gptlua.fp8 — the FP8 precision policy: which linear layers run their
-- three products in FP8 (gl.fp8_linear), and where FP8 may run at all.
--
-- The default choice, torchtitan's and modded-nanogpt's habit: every
-- nn.Linear inside the transformer's blocks except the first and the last
-- block's; the embeddings, the head, the norms and everything outside the
-- blocks stay in the model's dtype (the first and last blocks and the head
-- are where FP8 rounding costs the most loss).  A chosen layer keeps its
-- parameters as they are (float32 or bfloat16 masters and weights); only its
-- products' operands are quantized, afresh at every call (current scaling),
-- so checkpoints hold no FP8 tensors and load with FP8 on or off.  The
-- blocks are the whole model's: under pipeline parallelism every rank
-- marks the same layers of the whole structure (gptlua.dist.pp_build keeps
-- it), so "first and last" are the model's, whichever stage holds them;
-- tensor and context parallelism pass their groups to gl.fp8_linear, which
-- makes a split layer's scales one process's (gptlua.ops_fp8).
--
-- FP8 products need the tensor cores of sm_89 (Ada) or sm_90 (Hopper) and
-- newer; on the CPU they are emulated exactly (engine/cpu/fp8.c), which is
-- slower than float32 and only for checks: --fp8_emulate asks for it.
local M = {}

M.RECIPES = { 'off', 'tensorwise', 'rowwise' }
local KNOWN = { off = true, tensorwise = true, rowwise = true }

-- the refusal for this config on this device, or nil (device resolved:
-- 'cpu' or 'cuda:N'); major/minor: the GPU's compute capability
function M.refusal(cfg, major, minor)
  if not KNOWN[cfg.fp8] then
    return ("fp8 must be 'off', 'tensorwise' or 'rowwise', got '%s'"):format(tostring(cfg.fp8))
  end
  if cfg.fp8 == 'off' then return nil end
  if cfg.device == 'cpu' then
    if not cfg.fp8_emulate then
      return ("fp8 '%s' needs a GPU of sm_89 or newer; on the CPU it is emulated only with --fp8_emulate (slow, for checks)")
        :format(cfg.fp8)
    end
    return nil
  end
  if major and major * 10 + minor < 89 then
    return ("fp8 '%s' needs a GPU of sm_89 or newer (FP8 tensor cores), %s is sm_%d%d"):format(cfg.fp8, cfg.device,
      major, minor)
  end
  return nil
end

local function linears(m, out)
  local nn = require 'gptlua.nn'
  for _, x in ipairs(m:modules()) do
    if getmetatable(x) == nn.Linear then out[#out + 1] = x end
  end
  return out
end

-- the layers the default policy chooses: each block's nn.Linear modules
-- for blocks 2 .. n-1 of model.transformer.h; returns the list and the
-- block numbers (first, last) it covers, or nil and why
function M.choose(model)
  local h = model.transformer and model.transformer.h
  if not (h and h.n) then return nil, 'the model has no transformer.h blocks to choose FP8 layers from' end
  if h.n < 3 then
    return nil, ('the model has %d blocks; FP8 leaves the first and the last in high precision, so it needs at least 3')
      :format(h.n)
  end
  local out = {}
  for i = 2, h.n - 1 do linears(h[i], out) end
  return out, 2, h.n - 1
end

-- marks the chosen layers (Linear.fp8 = recipe: nn.Linear's forward runs
-- gl.fp8_linear) and returns the banner's line; recipe 'off' marks none
function M.apply(model, recipe)
  if recipe == 'off' then return nil end
  local layers, first, last = M.choose(model)
  if not layers then error('config: fp8: ' .. first, 0) end
  local params = 0
  for _, l in ipairs(layers) do
    l.fp8 = recipe
    params = params + l.weight:numel()
  end
  return ('fp8 %s: %d linear layers of blocks %d-%d (%.2fM weights) run their products in FP8 (e4m3 weights and '
    .. 'activations, e5m2 gradients); embeddings, head, norms and blocks 1 and %d stay %s'):format(recipe, #layers,
    first, last, params / 1e6, last + 1, model.transformer.wte.weight.dtype)
end

return M
