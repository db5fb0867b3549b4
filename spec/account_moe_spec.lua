-- The mixture-of-experts account (recipes/tools/account_moe.lua): the
-- parameter counts of OLMoE-1B-7B's shape against the model built on the
-- meta device, the FLOPs per token by active parameters, the work of a
-- micro-step and the prediction's arithmetic, the memory statement from the
-- planner, and an output that says what it assumes and what limits it.
local gl = require 'gptlua'
local A = dofile(gl.root .. '/recipes/tools/account_moe.lua')
local dense = dofile(gl.root .. '/recipes/tools/account.lua')

local function config(changes)
  local c = {}
  for k, v in pairs(A.OLMOE) do c[k] = v end
  for k, v in pairs(changes or {}) do c[k] = v end
  return c
end

describe('MoE account', function()
  it('counts every expert and the active ones as the model built on the meta device, and its FLOPs per token', function()
    local c = config()
    local f = A.model_facts(c)
    local L, C, E, K, H, V, T = c.n_layer, c.n_embd, c.experts, c.top_k, c.hidden, c.vocab, c.T
    assert.equal(V, f.padded_vocab)
    -- the embedding and the untied head, and per layer attention's four
    -- C x C matrices, the router (E x C) and E experts of two C x H matrices
    local expert = 2 * C * H
    local total = 2 * V * C + L * (4 * C * C + C * E + E * expert)
    assert.equal(total, f.total)
    assert.equal(total - L * (E - K) * expert, f.active)
    assert.equal(V * C, f.lookup)
    -- about 1B active of 7B: OLMoE-1B-7B's 6.9B and 1.3B
    assert.is_true(f.total > 6.9e9 and f.total < 6.95e9, tostring(f.total))
    assert.is_true(f.active > 1.25e9 and f.active < 1.3e9, tostring(f.active))
    -- 6 N_active (less the lookup) + 12 L C T, the model's own count too
    local fpt = 6 * (f.active - V * C) + 12 * L * C * T
    assert.equal(fpt, A.flops_per_token(f, c))
    assert.equal(fpt, f.flops_per_token)
  end)

  it('puts the grouped products, the dispatch rows and the prediction together by its stated arithmetic', function()
    local f = A.model_facts(config())
    for _, cf in ipairs({ 0, 0.5, 1.25 }) do
      for _, ac in ipairs({ 0, 1 }) do
        local c = config({ capacity_factor = cf, activation_checkpointing = ac, B = 2 })
        local N, K, E, C, H, L = c.B * c.T, c.top_k, c.experts, c.n_embd, c.hidden, c.n_layer
        -- (gptlua.moe's forward: at most N K rows, E x capacity with one)
        local R = cf == 0 and N * K or math.min(N * K, E * math.ceil(cf * N * K / E))
        assert.equal(R, A.dispatch_rows(c))
        local rows = A.rows(c, f)
        local function by(prefix)
          for _, r in ipairs(rows) do if r.name:sub(1, #prefix) == prefix then return r end end
        end
        -- two products of 2 R C H FLOPs, forward (twice with checkpointing) and
        -- backward's two (input and weight gradients)
        local g = by('grouped expert products')
        assert.equal(L * 2 * (1 + ac + 2) * 2 * R * C * H, g.flops)
        assert.equal('grouped', g.kind)
        assert.equal(6 * N * C * c.vocab, by('lm_head').flops)
        -- the prediction: each row max(FLOPs / (eff peak), bytes / (eff bw)) +
        -- launches x gap, tokens over their sum, MFU by active parameters
        local fpt = A.flops_per_token(f, c)
        for _, k in ipairs(dense.EFFICIENCY_ORDER) do
          local e, ge = dense.EFFICIENCY[k], A.GROUPED[k]
          local t = 0
          for _, r in ipairs(rows) do
            local eff = r.kind == 'cublaslt' and e.cublaslt or r.kind == 'own' and e.own or r.kind == 'grouped' and ge or 1
            t = t + math.max(r.flops / (989e12 * eff), r.bytes / (3.35e12 * e.mem)) + r.launches * e.gap_us * 1e-6
          end
          local p = A.predict(rows, c, fpt, e, ge)
          assert.is_true(math.abs(p.step_s - t) <= 1e-12 * t, k)
          assert.is_true(math.abs(p.mfu - N / t * fpt / 989e12) <= 1e-12, k)
          assert.is_true(math.abs(p.mfu_causal - N / t * (fpt - 6 * L * C * c.T) / 989e12) <= 1e-12, k)
        end
      end
    end
  end)

  it('prints a labelled prediction: its assumptions, the range, the memory it needs and what limits it', function()
    local lines = {}
    local res = A.report(config(), function(s) lines[#lines + 1] = s end)
    local text = table.concat(lines, '\n')
    for _, s in ipairs({ 'prediction (not a measurement)', 'balanced routing', 'no tail effects',
                         'grouped expert products 30% of peak', 'grouped expert products 45% of peak',
                         'grouped expert products 60% of peak', 'memory-bound 75% of bandwidth',
                         'predicted (central; range pessimistic..optimistic)', 'MFU by active parameters',
                         'limited by: grouped expert products', 'does NOT fit one 80 GB H100', 'ZeRO-1',
                         'not in the figure', 'OLMoE\'s SwiGLU 1024' }) do
      assert.truthy(text:find(s, 1, true), 'missing "' .. s .. '" in:\n' .. text)
    end
    local lo, mid, hi = res.range.pessimistic, res.range.central, res.range.optimistic
    assert.is_true(lo.tps < mid.tps and mid.tps < hi.tps)
    -- the memory: 16 bytes a parameter of states; per GPU with ZeRO-1, the
    -- one-GPU plan less the master weights' and optimizer state's 7/8
    local m, P = res.memory, res.facts.total
    assert.equal(16 * P, m.states)
    assert.is_true(m.one > m.states and m.one > 80e9)
    assert.is_true(m.sharded < m.one - 7 / 8 * 12 * P + 1e6 and m.sharded > m.one - 7 / 8 * 12 * P - 1e9)
    assert.is_true(m.fits)
    assert.equal('grouped expert products (2 per layer, all experts in one launch each)', res.limit)
  end)

  it('refuses a bad option with one line naming it', function()
    local function err(args) local ok, e = pcall(A.main, args); assert.is_false(ok); return tostring(e) end
    assert.truthy(err({ '--B=0' }):find('account_moe: --B must be a positive integer, got 0', 1, true))
    assert.truthy(err({ '--capacity_factor=-1' }):find('--capacity_factor must be a number >= 0', 1, true))
    assert.truthy(err({ '--activation_checkpointing=2' }):find('must be 0 or 1', 1, true))
    assert.truthy(err({ '--depth=3' }):find('expected --B=', 1, true))
  end)
end)
