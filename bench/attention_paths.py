import torch, time
import torch.nn.functional as F
torch.manual_seed(0)
def bench(fn, n=50):
    fn(); t=time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter()-t)/n*1e3
for B, mkv, mq in [(32, 90, 1), (32, 300, 1), (1, 300, 1), (8, 200, 200)]:
    H, Hk, D = 9, 3, 64
    q = torch.randn(B, H, mq, D, dtype=torch.bfloat16); k = torch.randn(B, Hk, mkv, D, dtype=torch.bfloat16); v = torch.randn_like(k)
    mask = torch.ones(B, 1, mq, mkv, dtype=torch.bool).tril(diagonal=mkv-mq)
    r = {}
    r["sdpa_bf16"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    qf, kf, vf = q.float(), k.float(), v.float()
    r["sdpa_f32(+cast)"] = bench(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True))
    def manual():
        qq = q.view(B, Hk, H//Hk*mq, D)
        s = torch.matmul(qq, k.transpose(-1, -2)).float().view(B, Hk, H//Hk, mq, mkv) * 0.125
        s = s.masked_fill(~mask.view(B, 1, 1, mq, mkv), float("-inf"))
        p = torch.softmax(s, -1).to(v.dtype).view(B, Hk, H//Hk*mq, mkv)
        return torch.matmul(p, v)
    r["manual_bf16"] = bench(manual)
    fmask = torch.zeros(B,1,mq,mkv).masked_fill(~mask, float("-inf")).to(torch.bfloat16)
    r["sdpa_bf16_floatmask"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, enable_gqa=True))
    if mq > 1:
        r["sdpa_bf16_causal_nomask"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    print(B, mkv, mq, {a: round(b, 3) for a, b in r.items()})
