local gl = require 'gptlua'
local gpt2 = require 'gptlua.models.gpt2'
local nanochat = require 'gptlua.models.nanochat'
local ckpt = require 'gptlua.checkpoint'

local small = { vocab_size = 11, block_size = 8, n_layer = 2, n_head = 2, n_embd = 8 }

describe('gpt2', function()
  it('uses the GPT-2 checkpoint layout for names and shapes', function()
    local m = gpt2.GPT(small)
    local shapes = {}
    for _, np in ipairs(m:named_parameters()) do shapes[np[1]] = table.concat(np[2].shape, 'x') end
    assert.equal('11x8', shapes['transformer.wte.weight'])
    assert.equal('8x8', shapes['transformer.wpe.weight'])
    assert.equal('24x8', shapes['transformer.h.0.attn.c_attn.weight'])
    assert.equal('24', shapes['transformer.h.0.attn.c_attn.bias'])
    assert.equal('8x32', shapes['transformer.h.1.mlp.c_proj.weight'])
    assert.equal('8', shapes['transformer.ln_f.bias'])
    assert.is_nil(shapes['lm_head.weight'])  -- tied to wte
    -- GPT-2 124M: 124,439,808 parameters with the 50257 vocabulary (the published count)
    local C, L, V, T = 768, 12, 50257, 1024
    local per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    assert.equal(124439808, V * C + T * C + L * per_block + 2 * C)
  end)
  it('returns logits and a loss near log(V) at init, and FLOPs per token as documented', function()
    gl.manual_seed(3)
    local m = gpt2.GPT(small)
    local idx = gl.tensor({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 } }, { dtype = 'int64' })
    local logits = m:forward(idx)
    assert.same({ 2, 4, 11 }, logits.shape)
    local none, loss = m:forward(idx, idx)  -- with targets: the fused head's loss only
    assert.is_nil(none)
    assert.is_true(math.abs(loss:item() - math.log(11)) < 0.3)
    local N = m:num_params() - 8 * 8
    assert.equal(6 * N + 12 * 2 * 8 * 8, m:flops_per_token(8))
  end)
  it('rejects bad configurations with a clear error', function()
    assert.has_error(function() gpt2.GPT({ vocab_size = 5, n_embd = 10, n_head = 3 }) end,
      'gpt2: n_embd 10 is not divisible by n_head 3')
    assert.has_error(function() gpt2.GPT({ vocab_size = 5, n_lyer = 2 }) end)
    assert.has_error(function() gpt2.GPT({ vocab_size = 5, dropout = 1.5 }) end, 'gpt2: dropout must be in [0, 1), got 1.5')
    local m = gpt2.GPT(small)
    assert.has_error(function() m:forward(gl.zeros({ 1, 9 }, { dtype = 'int64' })) end,
      'gpt2: sequence of 9 tokens exceeds block_size 8')
    assert.has_error(function() m:forward(gl.full({ 1, 2 }, 11, { dtype = 'int64' })) end)
  end)
  it('generates the same tokens with the KV cache as without, deterministically for a seed', function()
    gl.manual_seed(4)
    local m = gpt2.GPT(small)
    local idx = gl.tensor({ { 1, 2 } }, { dtype = 'int64' })
    local a = m:generate(idx, 5, { seed = 7, temperature = 1.0 })
    local b = m:generate(idx, 5, { seed = 7, temperature = 1.0 })
    assert.same(a:totable(), b:totable())
    assert.same({ 1, 7 }, a.shape)
    -- no cache: generating past block_size re-runs the window; compare greedy decoding
    local greedy_cache = m:generate(idx, 6, { temperature = 0 }):totable()[1]
    local seq = { 1, 2 }
    for _ = 1, 6 do
      local logits = gl.no_grad(m.forward, m, gl.tensor({ seq }, { dtype = 'int64' }))
      local _, i = gl.max(logits:select(2, #seq), 2)
      seq[#seq + 1] = i:item()
    end
    assert.same(seq, greedy_cache)
    local long = m:generate(idx, 10, { seed = 1, top_k = 3 })
    assert.same({ 1, 12 }, long.shape)
  end)
  it('loads GPT-2 weights from a safetensors file in Hugging Face layout', function()
    local m = gpt2.GPT(small)
    local hf = {}
    for _, np in ipairs(m:named_parameters()) do
      local name = np[1]:gsub('^transformer%.', '')
      local t = gl.randn(np[2].shape, { seed = #name })
      if name:match('c_attn%.weight$') or name:match('c_proj%.weight$') or name:match('c_fc%.weight$') then
        t = t:t():contiguous()  -- HF stores Conv1D weights as (in, out)
      end
      hf[name] = t
    end
    hf['h.0.attn.bias'] = gl.ones({ 1, 1, 8, 8 })  -- HF's causal-mask buffer is skipped
    local p = os.tmpname()
    ckpt.save_safetensors(p, hf)
    m:load_gpt2_safetensors(p)
    assert.same(hf['h.1.mlp.c_fc.weight']:t():totable(), m.transformer.h[2].mlp.c_fc.weight:totable())
    assert.same(hf['wte.weight']:totable(), m.transformer.wte.weight:totable())
    os.remove(p)
  end)
  it('gives the same gradients with activation checkpointing', function()
    local function grads(ac)
      gl.manual_seed(9)
      local cfg = {}
      for k, v in pairs(small) do cfg[k] = v end
      cfg.activation_checkpointing = ac
      local m = gpt2.GPT(cfg)
      local idx = gl.tensor({ { 1, 2, 3, 4, 5 } }, { dtype = 'int64' })
      local _, loss = m:forward(idx, idx)
      loss:backward()
      return m.transformer.h[1].mlp.c_fc.weight.grad
    end
    assert.is_true(grads(false):max_abs_diff(grads(true)) < 1e-6)
  end)
end)

describe('nanochat', function()
  it('sizes the model from depth', function()
    local cfg = nanochat.resolve({ depth = 4, vocab_size = 100, block_size = 16 })
    assert.equal(4, cfg.n_layer); assert.equal(256, cfg.n_embd); assert.equal(2, cfg.n_head)
    local d20 = nanochat.resolve({ depth = 20, vocab_size = 65536 })
    assert.equal(1280, d20.n_embd); assert.equal(10, d20.n_head)
  end)
  it('has no biases, untied head, QK-normed rotary attention, and trains a step', function()
    gl.manual_seed(5)
    local m = nanochat.GPT({ depth = 2, n_embd = 16, n_head = 2, n_kv_head = 1, vocab_size = 13, block_size = 8 })
    for _, np in ipairs(m:named_parameters()) do assert.is_nil(np[1]:match('bias')) end
    assert.is_truthy(m.lm_head.weight ~= m.transformer.wte.weight)
    -- the token embedding is a lookup; the untied head counts
    assert.equal(6 * (m:num_params() - 13 * 16) + 12 * 2 * 16 * 8, m:flops_per_token())
    local idx = gl.tensor({ { 1, 2, 3, 4 } }, { dtype = 'int64' })
    local _, loss = m:forward(idx, idx)
    assert.is_true(math.abs(loss:item() - math.log(13)) < 0.5)
    loss:backward()
    assert.is_not_nil(m.transformer.h[1].attn.c_q.weight.grad)
    local logits = gl.no_grad(m.forward, m, idx)
    assert.is_true(gl.max(gl.abs(logits)):item() <= 15)
    local a = m:generate(idx, 3, { temperature = 0 })
    local seq = { 1, 2, 3, 4 }
    for _ = 1, 3 do
      local l = gl.no_grad(m.forward, m, gl.tensor({ seq }, { dtype = 'int64' }))
      local _, i = gl.max(l:select(2, #seq), 2)
      seq[#seq + 1] = i:item()
    end
    assert.same(seq, a:totable()[1])
  end)
end)

describe('both models', function()
  it('are causal: changing token p changes no logit before position p', function()
    for _, M in ipairs({ gpt2, nanochat }) do
      gl.manual_seed(3)
      local cfg = { vocab_size = 65, block_size = 70, n_layer = 2, n_head = 4, n_embd = 32 }
      if M == nanochat then cfg.depth = 2 end
      local m = M.GPT(cfg)
      -- random weights everywhere (nanochat starts its projections at zero,
      -- which would hide a leak through attention)
      gl.no_grad(function()
        for i, p in ipairs(m:parameters()) do p:add_(gl.randn(p.shape, { seed = 100 + i }), 0.3) end
      end)
      local ids = {}
      for i = 1, 70 do ids[i] = (i * 37) % 65 end
      local a = gl.tensor({ ids }, { dtype = 'int64' })
      ids[41] = (ids[41] + 7) % 65
      local b = gl.tensor({ ids }, { dtype = 'int64' })
      gl.no_grad(function()
        local d = (m:forward(a) - m:forward(b)):abs()
        assert.equal(0, d:narrow(2, 1, 40):max():item())
        assert.is_true(d:narrow(2, 41, 1):max():item() > 0)
        assert.is_true(d:narrow(2, 42, 29):max(3):min():item() > 0)  -- every later position sees it
      end)
    end
  end)
end)
