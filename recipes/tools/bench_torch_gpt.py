"""PyTorch reference for `make bench`: nanoGPT's model at the default recipe's
configuration (n_layer 4, n_head 4, n_embd 128, block 64, batch 12, dropout 0,
bias False, AdamW lr 1e-3 betas (0.9, 0.99), weight decay 0.1 on matrices,
grad clip 1.0), timed the way nanoGPT's train.py reports ms/iter.
Usage: python3 recipes/tools/bench_torch_gpt.py ITERS THREADS          time ITERS steps on a fixed batch; one JSON line
       python3 recipes/tools/bench_torch_gpt.py ITERS THREADS --train  nanoGPT's full recipe on data/tinyshakespeare.txt
         (90/10 split, random windows, cosine lr with warmup 100 to ITERS, eval every 250 over 50
         batches), printing nanoGPT's "step N: train loss X, val loss Y" lines."""
import json, math, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

iters, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(1337)
V, T, B, L, H, C = 65, 64, 12, 4, 4, 128

class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with bias=False (torch 1.13's nn.LayerNorm always has a bias)"""
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
    def forward(self, x):
        return F.layer_norm(x, (C,), self.weight, None, 1e-5)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(), LayerNorm()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = [z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, 'scaled_dot_product_attention') else None
        if y is None:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // H)
            att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float('-inf'))
            y = F.softmax(att, dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate='tanh'))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = LayerNorm()
    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

model = GPT()
# nanoGPT's init: N(0, 0.02) everywhere, residual projections 0.02/sqrt(2L), zero biases
for name, p in model.named_parameters():
    if p.dim() >= 2:
        std = 0.02 / math.sqrt(2 * L) if name.endswith('c_proj.weight') or name.endswith('mlp_proj.weight') else 0.02
        torch.nn.init.normal_(p, mean=0.0, std=std)
decay = [p for p in model.parameters() if p.dim() >= 2]
nodecay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': nodecay, 'weight_decay': 0.0}],
                        lr=1e-3, betas=(0.9, 0.99))
if '--replay' in sys.argv:
    # identical initial weights and batches from gptlua (recipes/tools/compare_torch.lua)
    import numpy as np, os
    d = sys.argv[sys.argv.index('--replay') + 1]
    names = {'transformer.wte.weight': 'wte.weight', 'transformer.wpe.weight': 'wpe.weight',
             'transformer.ln_f.weight': 'ln_f.weight'}
    for i in range(L):
        for ours, theirs in (('ln_1.weight', 'ln_1.weight'), ('ln_2.weight', 'ln_2.weight'),
                             ('attn.c_attn.weight', 'c_attn.weight'), ('attn.c_proj.weight', 'c_proj.weight'),
                             ('mlp.c_fc.weight', 'c_fc.weight'), ('mlp.c_proj.weight', 'mlp_proj.weight')):
            names[f'transformer.h.{i}.{ours}'] = f'h.{i}.{theirs}'
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, theirs in names.items():
            p = params[theirs]
            p.copy_(torch.from_numpy(np.fromfile(os.path.join(d, ours + '.f32'), dtype=np.float32)).view(p.shape))
    batches = torch.from_numpy(np.fromfile(os.path.join(d, 'batches.i64'), dtype=np.int64)).view(iters, B, T + 1)
    losses = []
    for it in range(iters):
        lr = 1e-3 * (it + 1) / 100 if it < 100 else 1e-4 + 0.5 * (1 + math.cos(math.pi * (it - 100) / 1900)) * 9e-4
        for g in opt.param_groups:
            g['lr'] = lr
        loss = model(batches[it, :, :T], batches[it, :, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    print(json.dumps({'losses': losses}))
    sys.exit(0)
if '--train' in sys.argv:
    import os
    text = open(os.path.join(os.path.dirname(__file__), '..', 'data', 'tinyshakespeare.txt'), 'rb').read()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n = int(0.9 * len(ids))
    splits = {'train': ids[:n], 'val': ids[n:]}
    def batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - T, (B,))
        return torch.stack([d[i:i + T] for i in ix]), torch.stack([d[i + 1:i + 1 + T] for i in ix])
    def lr_at(it, warmup=100, lr=1e-3, min_lr=1e-4):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
    @torch.no_grad()
    def estimate():
        model.eval()
        out = {k: sum(model(*batch(k)).item() for _ in range(50)) / 50 for k in ('train', 'val')}
        model.train()
        return out
    t0 = time.time()
    for it in range(iters + 1):
        if it % 250 == 0:
            e = estimate()
            print(f"step {it}: train loss {e['train']:.4f}, val loss {e['val']:.4f}", flush=True)
        if it == iters:
            break
        for g in opt.param_groups:
            g['lr'] = lr_at(it)
        loss = model(*batch('train'))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    print(f"done: {iters} steps in {time.time() - t0:.0f}s", flush=True)
    sys.exit(0)
data = torch.randint(0, V, (B, T + 1))
x, y = data[:, :T], data[:, 1:]
times = []
for it in range(iters + 3):
    t0 = time.time()
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    loss.item()
    if it >= 3:
        times.append(time.time() - t0)
times.sort()
print(json.dumps({'torch': torch.__version__, 'threads': threads, 'ms_per_iter': 1000 * times[len(times) // 2],
                  'mean_ms': 1000 * sum(times) / len(times)}))
