"""A small CPU model shaped like vLLM's Qwen2/Llama implementations, for the
weight-plan tests (no vLLM needed): its `load_weights` is a copy of
vLLM 0.24's `Qwen2Model.load_weights` logic (stacked q/k/v into qkv_proj and
gate/up into gate_up_proj through each parameter's `weight_loader`, shard ids,
TP narrowing of the incoming tensor, tied lm_head skipped, vocab padding rows
zero-filled), simulated at TP rank `tp_rank` of `tp_size`.

`odd=True` adds a layer whose loader computes on the incoming tensor (as a
quantizing or transposing loader would): the plan must leave it to load_weights.
"""

from __future__ import annotations

import torch
from torch import nn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape).to(dtype), requires_grad=False)


class Cfg:
    hidden = 32
    heads = 4
    kv_heads = 2
    head_dim = 8
    inter = 48
    vocab = 50
    vocab_padded = 64
    layers = 2


class StackedLinear(nn.Module):
    """QKVParallelLinear / MergedColumnParallelLinear: output shards stacked on dim 0."""

    def __init__(self, shards: dict, in_features: int, tp: tuple[int, int], dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp
        self.shards = {k: v // self.tp_size for k, v in shards.items()}  # shard id -> rows on this rank
        self.offsets, off = {}, 0
        for k, rows in self.shards.items():
            self.offsets[k] = off
            off += rows
        self.weight = _param(off, in_features, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(off, dtype=dtype)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        rows = self.shards[shard_id]
        dst = param.data.narrow(0, self.offsets[shard_id], rows)
        src = loaded.narrow(0, self.tp_rank * rows, rows)
        assert dst.shape == src.shape
        dst.copy_(src)


class RowLinear(nn.Module):
    """RowParallelLinear: the input dim is sharded (a strided view of the incoming tensor)."""

    def __init__(self, out_features: int, in_features: int, tp: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp
        self.weight = _param(out_features, in_features // self.tp_size, dtype=dtype)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))


class Embedding(nn.Module):
    """VocabParallelEmbedding (TP=1 semantics): rows past the vocab are padding, zero-filled."""

    def __init__(self, vocab: int, padded: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(padded, hidden, dtype=dtype)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0] :].data.fill_(0)


class OddLinear(nn.Module):
    """A loader that computes on the incoming tensor (transpose + contiguous)."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(n, n, dtype=dtype)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.t().contiguous())


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.size() == loaded.size()
    param.data.copy_(loaded)


class Layer(nn.Module):
    def __init__(self, c: Cfg, tp: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = StackedLinear({"q": q, "k": kv, "v": kv}, c.hidden, tp, dtype, bias=True)
        self.self_attn.o_proj = RowLinear(c.hidden, q, tp, dtype)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = StackedLinear({0: c.inter, 1: c.inter}, c.hidden, tp, dtype, bias=False)
        self.mlp.down_proj = RowLinear(c.hidden, c.inter, tp, dtype)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _param(c.hidden, dtype=dtype)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = _param(c.hidden, dtype=dtype)


class VllmLikeModel(nn.Module):
    def __init__(self, tp_rank: int = 0, tp_size: int = 1, dtype=torch.bfloat16, odd: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        c = self.cfg = Cfg()
        tp = (tp_rank, tp_size)
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(c.vocab, c.vocab_padded, c.hidden, dtype)
        self.model.layers = nn.ModuleList([Layer(c, tp, dtype) for _ in range(c.layers)])
        self.model.norm = nn.Module()
        self.model.norm.weight = _param(c.hidden, dtype=dtype)
        self.model.register_buffer("rotary_inv_freq", torch.ones(4))
        if odd:
            self.model.odd = OddLinear(c.hidden, dtype)
        self.lm_head = self.model.embed_tokens  # tied

    def load_weights(self, weights) -> set[str]:
        stacked = [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, w in weights:
            if name.startswith("lm_head."):  # tied: skipped
                continue
            if "rotary_emb.inv_freq" in name:
                continue
            for pname, wname, sid in stacked:
                if wname not in name:
                    continue
                name = name.replace(wname, pname)
                p = params[name]
                p.weight_loader(p, w, sid)
                break
            else:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(name)
        return loaded


def checkpoint(model: VllmLikeModel, seed: int, dtype=torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """Random full (unsharded) checkpoint tensors with HF names for `model`'s config."""
    g = torch.Generator().manual_seed(seed)
    c = model.cfg
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    out = [("model.embed_tokens.weight", r(c.vocab, c.hidden))]
    for i in range(c.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", r(q, c.hidden)),
            (p + "self_attn.k_proj.weight", r(kv, c.hidden)),
            (p + "self_attn.v_proj.weight", r(kv, c.hidden)),
            (p + "self_attn.q_proj.bias", r(q)),
            (p + "self_attn.k_proj.bias", r(kv)),
            (p + "self_attn.v_proj.bias", r(kv)),
            (p + "self_attn.o_proj.weight", r(c.hidden, q)),
            (p + "mlp.gate_proj.weight", r(c.inter, c.hidden)),
            (p + "mlp.up_proj.weight", r(c.inter, c.hidden)),
            (p + "mlp.down_proj.weight", r(c.hidden, c.inter)),
            (p + "input_layernorm.weight", r(c.hidden)),
            (p + "post_attention_layernorm.weight", r(c.hidden)),
        ]
    out += [("model.norm.weight", r(c.hidden)), ("lm_head.weight", r(c.vocab, c.hidden))]
    if hasattr(model.model, "odd"):
        out.append(("model.odd.weight", r(c.hidden, c.hidden)))
    return out


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit."""
    out = []
    for n in a:
        x, y = a[n], b[n]
        it = {2: torch.int16, 4: torch.int32}[x.element_size()]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(it), y.view(it)):
            out.append(n)
    return out
