-- Attention on the GPU (kernels/attention.cu) against its CPU twin
-- (engine/cpu/attention.c), forward (out, lse) and backward (dq, dk, dv),
-- through spec/support/cuda_twin.lua's harness (its one rule for the
-- tolerances: against a float64 reference, within twice the CPU twin's error).
--
--  - the flash path (bfloat16, head dim 64 and 128): shapes that cross the
--    64-row query and key tiles (T, S not multiples of 64, and multiples),
--    a KV cache (T < S), grouped-query heads (2 and 4 per KV head), a
--    sliding window, a single query, rows given as (B, T, H, D) views, and
--    shapes with whole unmasked tile pairs and more work items than the two
--    shared stages (their reuse);
--  - the fallback (float32 / float64, other head dims, bfloat16 with D 40);
--  - no mask (window < 0), T > S and T < S, on both paths;
--  - segment ids (document masking) on both paths: documents crossing tile
--    edges, tile pairs that share no document (skipped), pairs within one
--    document (unmasked), GQA, a window; the simulator's trace shows which
--    path ran.
-- Under the simulator the kernels run with its bounds checks, and `make
-- test-race` runs this file again in race mode (two random thread orders).
-- Shapes stay small: the simulator runs every mma on the CPU.
local gl = require 'gptlua'
local lib = gl.lib
local twin = require 'support.cuda_twin'
local pair, compare, K = twin.pair, twin.compare, twin.K

local gpu_it = twin.gpu_it(it, pending)

-- the kernels a call launched, by name, when the engine is the simulator
-- (nil on a GPU: no trace there)
local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
local launched = trace.launched

-- q (B, H, T, D), k / v (B, Hkv, S, D); layout 'bthd' makes q, k, v, dout
-- transposed views of (B, T, H, D) tensors, as a model produces them
local function attention_case(dt, B, H, Hkv, T, S_, D, window, layout)
  local function qkv(heads, len)
    if layout == 'bthd' then
      local p = pair({ B, len, heads, D }, { dtype = dt })
      return { p[1]:transpose(2, 3), p[2]:transpose(2, 3) }
    end
    return pair({ B, heads, len, D }, { dtype = dt })
  end
  local ins = { q = qkv(H, T), k = qkv(Hkv, S_), v = qkv(Hkv, S_), g = qkv(H, T) }
  local sdt = dt == 'float64' and 'float64' or 'float32'
  local scale = 1 / math.sqrt(D)
  compare(ins, function(S)
    local o, lse = S.out({ B, H, T, D }, dt), S.out({ B, H, T }, sdt)
    K(lib.gl_attention_forward(o.c, lse.c, S.q.c, S.k.c, S.v.c, scale, window))
    local dq, dk, dv = S.out({ B, H, T, D }, dt), S.out({ B, Hkv, S_, D }, dt), S.out({ B, Hkv, S_, D }, dt)
    K(lib.gl_attention_backward(dq.c, dk.c, dv.c, S.g.c, S.q.c, S.k.c, S.v.c, o.c, lse.c, scale, window))
    return o, lse, dq, dk, dv
  end, dt, ('attention %s B=%d H=%d Hkv=%d T=%d S=%d D=%d window=%d %s'):format(
    dt, B, H, Hkv, T, S_, D, window, layout or 'bhtd'),
  -- the longest sums: a score over D, an output row or dQ over the keys, dK and dV over a group's queries
  { n = math.max(D, S_, T * H / Hkv) })
end

-- document masking: segment ids (of sdt, default int64) of packed documents
-- of the given lengths in each row, S positions in all; the T <= S queries
-- are the last T positions (T < S: a KV cache); path: the kernels expected
-- ('flash' or 'fallback'), checked in the simulator's trace
local function segmented_case(dt, B, H, Hkv, T, D, window, lengths, path, sdt_ids)
  local ids, S_ = {}, nil
  for b = 1, B do
    ids[b] = {}
    local id = 10 * b
    for _, n in ipairs(lengths[b]) do
      for _ = 1, n do ids[b][#ids[b] + 1] = id end
      id = id + 1
    end
    if b == 1 then S_ = #ids[1] end
    assert(#ids[b] == S_ and T <= S_, 'segmented_case: every row\'s lengths must add up to S >= T')
  end
  local seg = gl.tensor(ids, { dtype = sdt_ids or 'int64' })
  local ins = { q = pair({ B, H, T, D }, { dtype = dt }), k = pair({ B, Hkv, S_, D }, { dtype = dt }),
                v = pair({ B, Hkv, S_, D }, { dtype = dt }), g = pair({ B, H, T, D }, { dtype = dt }),
                seg = { seg, seg:to(twin.DEV) } }
  local sdt = dt == 'float64' and 'float64' or 'float32'
  local scale = 1 / math.sqrt(D)
  compare(ins, function(S)
    local o, lse = S.out({ B, H, T, D }, dt), S.out({ B, H, T }, sdt)
    local dq, dk, dv = S.out({ B, H, T, D }, dt), S.out({ B, Hkv, S_, D }, dt), S.out({ B, Hkv, S_, D }, dt)
    local names = launched(function()
      K(lib.gl_attention_forward_seg(o.c, lse.c, S.q.c, S.k.c, S.v.c, S.seg.c, scale, window))
      K(lib.gl_attention_backward_seg(dq.c, dk.c, dv.c, S.g.c, S.q.c, S.k.c, S.v.c, o.c, lse.c, S.seg.c, scale,
        window))
    end)
    if S.gpu and names then
      local all = table.concat(names, ' ')
      for _, kernel in ipairs(path == 'flash' and { 'flash_fwd_kernel', 'flash_bwd_kernel' }
                              or { 'attn_fwd_fallback_kernel', 'attn_dkdv_fallback_kernel' }) do
        assert(all:find(kernel, 1, true), ('%s path expected, %s not launched: %s'):format(path, kernel, all))
      end
    end
    return o, lse, dq, dk, dv
  end, dt, ('segmented attention %s B=%d H=%d Hkv=%d T=%d S=%d D=%d window=%d'):format(dt, B, H, Hkv, T, S_, D,
    window), { n = math.max(D, S_, T * H / Hkv) })
end

describe('CUDA attention vs CPU #cuda', function()
  gpu_it('segment ids (document masking): the fallback kernels, GQA, a window, bfloat16 to float64', function()
    segmented_case('float32', 2, 4, 2, 37, 24, 0, { { 5, 20, 1, 11 }, { 37 } }, 'fallback')
    segmented_case('float32', 1, 2, 1, 40, 64, 0, { { 17, 23 } }, 'fallback')  -- the flash path's D, in float32
    segmented_case('float64', 1, 2, 1, 19, 16, 4, { { 3, 9, 7 } }, 'fallback')
    segmented_case('bfloat16', 1, 2, 2, 40, 40, 0, { { 17, 23 } }, 'fallback')
    -- a KV cache (T < S): a batch of prompts' left padding (id 0), on the fallback in every dtype
    segmented_case('bfloat16', 2, 4, 2, 1, 64, 0, { { 30, 40 }, { 0, 70 } }, 'fallback')
    segmented_case('float32', 2, 2, 1, 3, 24, 5, { { 4, 9 }, { 13 } }, 'fallback')
  end)

  -- 64-position tiles: row {70, 10, 120} has tiles of ids {10}, {10..12},
  -- {12}, {12}: query tile 2 shares no document with key tile 0 (skipped),
  -- tiles 3 and 2 lie in one document (unmasked), tile 1 crosses three;
  -- row {5, 190, 5} crosses tiles 0 and 3 and is one document between
  for _, D in ipairs({ 64, 128 }) do
    gpu_it(('segment ids on the flash path, bfloat16, D=%d: skipped, unmasked and mixed tiles, GQA, a window'):format(D),
      function()
        segmented_case('bfloat16', 2, 4, 2, 200, D, 0, { { 70, 10, 120 }, { 5, 190, 5 } }, 'flash')
        segmented_case('bfloat16', 1, 2, 1, 77, D, 30, { { 1, 40, 36 } }, 'flash', 'int32')
      end)
  end

  for _, D in ipairs({ 64, 128 }) do
    gpu_it(('flash path, bfloat16, D=%d: tile edges, GQA 2 / 4, KV cache, window, one query'):format(D), function()
      attention_case('bfloat16', 2, 4, 2, 77, 77, D, 0)         -- GQA 2, a partial second tile
      attention_case('bfloat16', 1, 4, 1, 50, 130, D, 0, 'bthd') -- GQA 4, KV cache, three key tiles
      attention_case('bfloat16', 1, 2, 2, 100, 100, D, 20)       -- sliding window
      attention_case('bfloat16', 1, 3, 3, 1, 65, D, 0)           -- one query against a KV cache
    end)

    gpu_it(('flash path, bfloat16, D=%d: unmasked tiles, stage reuse, tile multiples'):format(D), function()
      attention_case('bfloat16', 1, 2, 1, 130, 130, D, 0)        -- whole tile pairs; 6 work items per key tile
      attention_case('bfloat16', 1, 2, 1, 64, 128, D, 70)        -- multiples of 64, window across tiles
      attention_case('bfloat16', 1, 2, 1, 3, 150, D, 10)         -- key tiles no query sees: dK = dV = 0
    end)
  end

  gpu_it('fallback: float32 / float64 and other head dims', function()
    attention_case('float32', 2, 4, 2, 37, 37, 64, 0)
    attention_case('float32', 1, 2, 1, 20, 45, 40, 7, 'bthd')
    attention_case('float64', 1, 2, 2, 19, 23, 24, 0)
    attention_case('bfloat16', 1, 2, 1, 33, 33, 40, 0)
  end)

  -- window < 0: no mask (ring attention's blocks of earlier chunks), T > S and T < S
  gpu_it('no mask: flash path and fallback', function()
    attention_case('bfloat16', 1, 2, 1, 70, 40, 64, -1)
    attention_case('float64', 1, 4, 2, 20, 9, 24, -1)
    attention_case('float32', 1, 2, 2, 9, 20, 40, -1, 'bthd')
  end)
end)
