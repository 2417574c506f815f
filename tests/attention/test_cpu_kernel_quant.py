"""The compiled CPU kernel on quantized and other-dtype caches, and with attention sinks.

The quantized attention op is checked against plain masked softmax attention (float64) over the
context the reference codec dequantizes (`KVQuantFormat.read_blocks`). Both dequantize exactly the
same way (each value one float32 product, int4's plus its min; the kernel's conversions are exact),
so a float32 query meets the reference within 1e-4 absolute: only the softmax's summation order and
exp differ. The write op must produce the reference codec's bytes exactly."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch

from kvtide.attention import cpu_backend, cpu_extension
from kvtide.attention.cpu_backend import CpuAttentionBackend
from kvtide.kv_compression.formats import FP8_DTYPES, KIND_IDS, KVQuantFormat, resolve_kv_cache_dtype

ISAS = cpu_extension.available_isas()
FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8", "k8v4"]
TOL = {torch.float32: dict(rtol=0, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
KV_SCALE = torch.tensor([0.03, 0.02])
"""fp8's per-tensor K and V scales: randn / scale spans e4m3's normals and subnormals."""
SHORT = [(1, 37), (1, 16), (1, 0), (4, 0), (5, 11), (1, 64), (8, 16), (3, 29), (2, 1)]
"""Decodes and short multi-token rows over cached context, partial blocks among them."""
LONG = [(1, 300), (1, 129), (3, 200), (1, 70), (6, 90)]
CASES = [  # (requests, block_size, num_heads, num_kv_heads, head_dim, window, sink_tokens, partition_tokens)
    (SHORT, 16, 8, 2, 64, None, 0, 0),
    (SHORT, 8, 6, 3, 32, 20, 0, 16),
    (LONG, 16, 9, 3, 64, 50, 4, 0),
    (LONG, 8, 4, 1, 32, 30, 11, 24),
    (LONG, 32, 4, 4, 64, 40, 40, 64),
]
CASE_IDS = ["gqa4", "gqa2-win-parts", "smollm-win-sinks", "mqa-sinks-2-blocks-parts",
            "mha-sinks-reach-window"]


def op(name: str, isa: str):
    fn = cpu_extension.load_attention_op(name, isa)
    if fn is None:
        pytest.fail(f"the {isa} build failed (see the warning logged)")
    return fn


def fmt_of(name: str) -> KVQuantFormat:
    fmt = resolve_kv_cache_dtype(name, torch.float32)
    assert isinstance(fmt, KVQuantFormat)
    return fmt


def quantized_cache(batch, fmt: KVQuantFormat, with_step: bool = True) -> torch.Tensor:
    """The batch's random cache in every slot, then (with_step) this step's K/V, through the
    reference codec."""
    _, num_blocks, block_size, num_kv_heads, head_dim = batch.kv_cache.shape
    cache = torch.zeros(fmt.cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.uint8)
    every = batch.kv_cache.reshape(2, -1, num_kv_heads, head_dim)
    fmt.write(every[0], every[1], cache, torch.arange(every.shape[1]), KV_SCALE)
    if with_step:
        fmt.write(batch.key, batch.value, cache, batch.metadata.slot_mapping, KV_SCALE)
    return cache


def head_major(batch) -> torch.Tensor:
    """The batch's float cache after this step's write, in the torch backend's layout."""
    cache = batch.kv_cache.clone()
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    cache[0].view(-1, num_kv_heads, head_dim)[batch.metadata.slot_mapping] = batch.key
    cache[1].view(-1, num_kv_heads, head_dim)[batch.metadata.slot_mapping] = batch.value
    return cache.permute(0, 3, 1, 2, 4).contiguous()


def dequantized_context(cache: torch.Tensor, fmt: KVQuantFormat, head_dim: int):
    def context(table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        block_size = cache.shape[2] // fmt.bytes_per_token(head_dim)
        blocks = cache[:, table[:-(-seq_len // block_size)].long()]
        key, value = fmt.read_blocks(blocks, head_dim, KV_SCALE, torch.float64)
        return key[:, :seq_len], value[:, :seq_len]
    return context


def float_context(cache: torch.Tensor):
    def context(table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_kv_heads, _, block_size, head_dim = cache.shape
        kv = cache[:, :, table[:-(-seq_len // block_size)].long()].double()
        kv = kv.reshape(2, num_kv_heads, -1, head_dim)[:, :, :seq_len]
        return kv[0], kv[1]
    return context


def reference(query: torch.Tensor, md, context, scale: float, window: int | None,
              sink_tokens: int = 0) -> torch.Tensor:
    """Plain masked softmax attention in float64, one row at a time: query position p sees key j iff
    j <= p and, with a window, j > p - window or j < sink_tokens."""
    out = torch.empty(query.shape, dtype=torch.float64)
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    for r in range(md.num_reqs):
        start, end, seq_len = qsl[r], qsl[r + 1], seq_lens[r]
        key, value = context(md.block_tables[r], seq_len)
        heads = query.shape[1] // key.shape[0]
        key, value = key.repeat_interleave(heads, 0), value.repeat_interleave(heads, 0)
        pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        visible = j <= pos
        if window:
            visible &= (j > pos - window) | (j < sink_tokens)
        scores = torch.einsum("lhd,hjd->hlj", query[start:end].double(), key) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hlj,hjd->lhd", probs, value)
    return out


def run_quant(isa, batch, cache, fmt, query, scale, window, sink_tokens, partition_tokens=0):
    md = batch.metadata
    out = torch.full_like(query, float("nan"))
    op("paged_attention_quant", isa)(
        out, query, cache, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs, scale, window or 0,
        sink_tokens, KIND_IDS[fmt.k_kind], KIND_IDS[fmt.v_kind], KV_SCALE, query.shape[-1], md.block_size,
        partition_tokens)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_quant_op_equals_attention_over_the_dequantized_cache(case, name, dtype, isa=ISAS[0]):
    requests, block_size, num_heads, num_kv_heads, head_dim, window, sinks, partition_tokens = case
    fmt = fmt_of(name)
    batch = make_paged_batch(requests, num_heads, num_kv_heads, head_dim, block_size, torch.float32,
                             seed=block_size + head_dim + sinks)
    cache = quantized_cache(batch, fmt)
    query = batch.query.to(dtype)
    scale = head_dim ** -0.5
    context = dequantized_context(cache, fmt, head_dim)
    expected = reference(query, batch.metadata, context, scale, window, sinks)
    actual = run_quant(isa, batch, cache, fmt, query, scale, window, sinks, partition_tokens)
    torch.testing.assert_close(actual, expected.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("isa", ISAS[1:])
@pytest.mark.parametrize("name", FORMATS)
def test_quant_op_on_the_other_isa_builds(isa, name):
    test_quant_op_equals_attention_over_the_dequantized_cache(CASES[3], name, torch.float32, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_one_key_contexts_return_the_dequantized_value_exactly(isa, name):
    """Over a single key the softmax weight is exactly 1, so the output is V as the kernel
    dequantized it: equal to the reference codec's, for every code (fp8: every byte, NaN and
    infinities included; int8 / int4: random codes under random float16 parameters)."""
    fmt = KVQuantFormat(name, "int8" if name == "int4" else name, name)
    num_kv_heads, head_dim, block_size = 2, 64, 16
    batch = make_paged_batch([(1, 0)] * 6, 4, num_kv_heads, head_dim, block_size, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(1)
    num_blocks = batch.kv_cache.shape[1]
    cache = torch.randint(0, 256, fmt.cache_shape(num_blocks, block_size, num_kv_heads, head_dim),
                          dtype=torch.uint8, generator=gen)
    lay = fmt.layout(block_size, head_dim)
    blocks = batch.metadata.block_tables[:, 0].long()  # each row's only block
    if name.startswith("fp8"):
        codes = torch.arange(256, dtype=torch.uint8)
        finite = codes[torch.isfinite(codes.view(FP8_DTYPES[name]).float())]
        k_codes = cache[:, :, lay.k_codes:lay.v_codes]
        k_codes.copy_(finite[torch.arange(k_codes.numel()) % len(finite)].view(k_codes.shape))
        # The rows' first (only) tokens' V codes: every byte, NaN and infinities included.
        count = num_kv_heads * len(blocks) * head_dim
        every_byte = (torch.arange(count) % 256).to(torch.uint8)
        v_first = cache[:, :, lay.v_codes:lay.v_codes + head_dim]  # token 0 of every block
        v_first[:, blocks] = every_byte.view(num_kv_heads, len(blocks), head_dim)
    else:  # sane float16 parameters: positive scales, mins of either sign
        params = (torch.rand(num_kv_heads, num_blocks, block_size, 2, generator=gen) + 0.01).to(torch.float16)
        params[..., 1] -= 0.5
        cache[:, :, lay.k_params:lay.v_params] = (params[..., 0] / 3).contiguous().view(torch.uint8).view(
            num_kv_heads, num_blocks, -1)
        v_params = params if name == "int4" else params[..., :1]
        cache[:, :, lay.v_params:] = v_params.contiguous().view(torch.uint8).view(
            num_kv_heads, num_blocks, -1)
    out = run_quant(isa, batch, cache, fmt, batch.query, 0.1, None, 0)
    _, value = fmt.read_blocks(cache, head_dim, KV_SCALE, torch.float32)
    value = value.view(num_kv_heads, num_blocks, block_size, head_dim)[:, blocks, 0]  # (H_kv, rows, D)
    torch.testing.assert_close(out, value.transpose(0, 1).repeat_interleave(2, dim=1), rtol=0, atol=0,
                               equal_nan=True)


def awkward_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Rows that hit the codecs' edges: rounding ties (int8 at scale 1.0, int4 at step 1.0, fp8
    halfway between neighbours), zero and constant rows (zero scale -> 1.0), values past fp8's
    range (clamped) and below its normals."""
    base = torch.arange(head_dim, dtype=torch.float32)
    rows = [
        torch.cat([torch.tensor([127.0, -127.0]), (base[2:] % 9) - 4.5]),  # int8 ties x.5
        torch.cat([torch.tensor([0.0, 15.0]), (base[2:] % 15) + 0.5]),  # int4 ties
        torch.zeros(head_dim),
        torch.full((head_dim,), 3.25),
        torch.cat([torch.tensor([1e6, -1e6]), torch.randn(head_dim - 2) * 1e-5]),
        (1 + (base % 8) / 16) * KV_SCALE[0] * torch.where(base % 2 == 0, 1.0, -1.0),  # e4m3 ties near 1
    ]
    rows = torch.stack(rows)
    return rows.repeat(1, num_heads).view(-1, num_heads, head_dim) if num_heads > 1 else rows[:, None]


@pytest.mark.parametrize("isa", ISAS[:1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", FORMATS + ["int4 K"])
def test_write_op_produces_the_reference_codecs_bytes(isa, dtype, name):
    fmt = KVQuantFormat("k4v4", "int4", "int4") if name == "int4 K" else fmt_of(name)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 64, 16, 7
    gen = torch.Generator().manual_seed(7)
    num_tokens = 40
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen) * 2
    qkv[:6, num_kv_heads:2 * num_kv_heads] = awkward_rows(num_kv_heads, head_dim)
    qkv[6:12, 2 * num_kv_heads:] = awkward_rows(num_kv_heads, head_dim)
    qkv = qkv.to(dtype)
    # Strided views of one tensor, as a model's.
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 17]] = -1  # padding: written nowhere
    initial = torch.randint(0, 256, fmt.cache_shape(num_blocks, block_size, num_kv_heads, head_dim),
                            dtype=torch.uint8, generator=gen)
    expected, actual = initial.clone(), initial.clone()
    kept = slots >= 0
    fmt.write(key[kept], value[kept], expected, slots[kept], KV_SCALE)
    op("write_kv_quant", isa)(key, value, actual, slots, KIND_IDS[fmt.k_kind], KIND_IDS[fmt.v_kind], KV_SCALE,
                              block_size)
    assert torch.equal(actual, expected), f"{(actual != expected).sum()} bytes differ"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES[1:], ids=CASE_IDS[1:])
def test_float_op_sinks_equal_the_masked_reference(isa, case):
    requests, block_size, num_heads, num_kv_heads, head_dim, window, sinks, partition_tokens = case
    batch = make_paged_batch(requests, num_heads, num_kv_heads, head_dim, block_size, torch.float32,
                             seed=sinks)
    cache, md = head_major(batch), batch.metadata
    scale = head_dim ** -0.5
    for sink_tokens in (sinks, 1, 100):  # 100: sinks reaching into the window
        expected = reference(batch.query, md, float_context(cache), scale, window, sink_tokens)
        out = torch.full_like(batch.query, float("nan"))
        op("paged_attention", isa)(out, batch.query, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                   md.num_reqs, scale, window, partition_tokens, sink_tokens)
        torch.testing.assert_close(out, expected.float(), **TOL[torch.float32])


@pytest.mark.parametrize("isa", ISAS[:1])
def test_sinks_without_a_window_are_ignored(isa):
    batch = make_paged_batch(SHORT, 4, 2, 32, 8, torch.float32, seed=8)
    cache, md = head_major(batch), batch.metadata
    outs = []
    for sink_tokens in (0, 5):
        out = torch.empty_like(batch.query)
        op("paged_attention", isa)(out, batch.query, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                   md.num_reqs, 0.2, 0, 0, sink_tokens)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=["q-f32", "q-bf16"])
def test_float_cache_in_another_dtype_than_the_query(isa, cache_dtype, query_dtype):
    batch = make_paged_batch(LONG + SHORT, 6, 2, 64, 16, torch.float32, seed=11)
    cache, md = head_major(batch).to(cache_dtype), batch.metadata
    query = batch.query.to(query_dtype)
    expected = reference(query, md, float_context(cache), 0.125, 40, 3)
    out = torch.empty_like(query)
    op("paged_attention", isa)(out, query, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                               md.num_reqs, 0.125, 40, 0, 3)
    torch.testing.assert_close(out, expected.to(query_dtype), **TOL[query_dtype])


def quant_backend(name: str, isa: str | None) -> CpuAttentionBackend:
    """The cpu backend over a quantized cache, on one ISA's build or (None) on pure torch."""
    backend = CpuAttentionBackend(fmt_of(name))
    for attr, fn in (("_op", "paged_attention"), ("_quant_op", "paged_attention_quant"),
                     ("_write_op", "write_kv_quant")):
        setattr(backend, attr, op(fn, isa) if isa else None)
    return backend


@pytest.mark.parametrize("isa", ISAS[:1] + [None], ids=ISAS[:1] + ["pure-torch"])
@pytest.mark.parametrize("name", FORMATS)
def test_backend_on_a_quantized_cache(isa, name):
    """write_kv then forward on a mixed batch: short rows through the kernel, the 19- and 12-token
    rows through SDPA over the dequantized cache; the cache holds the reference codec's bytes."""
    fmt = fmt_of(name)
    batch = make_paged_batch(SHORT + [(19, 16), (12, 0)], 8, 2, 64, 16, torch.float32, seed=12)
    md = batch.metadata
    expected_cache = quantized_cache(batch, fmt)
    cache = quantized_cache(batch, fmt, with_step=False)
    backend = quant_backend(name, isa)
    backend.write_kv(batch.key * 1.5, -batch.value, cache, md.slot_mapping, KV_SCALE)  # overwritten next
    backend.write_kv(batch.key, batch.value, cache, md.slot_mapping, KV_SCALE)
    assert torch.equal(cache, expected_cache)
    actual = backend.forward(batch.query, cache, md, 0.125, 30, batch.key, batch.value, sink_tokens=2,
                             kv_scale=KV_SCALE)
    expected = reference(batch.query, md, dequantized_context(cache, fmt, 64), 0.125, 30, 2)
    torch.testing.assert_close(actual, expected.float(), **TOL[torch.float32])


@pytest.mark.parametrize("isa", ISAS[:1])
def test_backend_with_a_bfloat16_cache_under_a_float32_query(isa, monkeypatch):
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_QUERY_LEN", 1 << 30)  # every row through the kernel
    batch = make_paged_batch(SHORT + LONG, 8, 2, 64, 16, torch.float32, seed=13)
    cache = head_major(batch).bfloat16()
    backend = CpuAttentionBackend()
    backend._op = op("paged_attention", isa)
    actual = backend.forward(batch.query, cache, batch.metadata, 0.125, None)
    expected = reference(batch.query, batch.metadata, float_context(cache), 0.125, None)
    torch.testing.assert_close(actual, expected.float(), **TOL[torch.float32])


def _bad_quant_inputs(batch, cache, fmt):
    md = batch.metadata
    bad_table = md.block_tables.clone()
    bad_table[0, 0] = cache.shape[1]
    args = dict(out=torch.empty_like(batch.query), query=batch.query, kv_cache=cache,
                block_tables=md.block_tables, k_kind=KIND_IDS[fmt.k_kind], v_kind=KIND_IDS[fmt.v_kind],
                kv_scale=KV_SCALE, head_dim=64, block_size=16)
    return {
        "block bytes": {**args, "kv_cache": cache[:, :, :-2].contiguous()},
        "block size": {**args, "block_size": 8},
        "kind": {**args, "v_kind": 4},
        "float cache": {**args, "kv_cache": cache.float()},
        "head_dim": {**args, "head_dim": 32},
        "kv_scale": {**args, "kv_scale": KV_SCALE[:1]},
        "block id": {**args, "block_tables": bad_table},
        "float64 query": {**args, "query": batch.query.double(), "out": args["out"].double()},
    }


@pytest.mark.parametrize("isa", ISAS[:1])
def test_bad_input_raises(isa):
    fmt = fmt_of("k8v4")
    batch = make_paged_batch(SHORT, 4, 2, 64, 16, torch.float32, seed=14)
    cache = quantized_cache(batch, fmt)
    md = batch.metadata
    attend = op("paged_attention_quant", isa)
    for name, a in _bad_quant_inputs(batch, cache, fmt).items():
        with pytest.raises(RuntimeError, match="paged_attention_quant"):
            attend(a["out"], a["query"], a["kv_cache"], a["block_tables"], md.seq_lens, md.query_start_loc,
                   md.num_reqs, 0.1, 0, 0, a["k_kind"], a["v_kind"], a["kv_scale"], a["head_dim"],
                   a["block_size"])
            pytest.fail(f"{name} was accepted")
    write = op("write_kv_quant", isa)
    far = md.slot_mapping.clone()
    far[0] = cache.shape[1] * 16
    bad_writes = {
        "slot": (batch.key, far, cache),
        "int32 slots": (batch.key, md.slot_mapping.int(), cache),
        "heads": (batch.key[:, :1], md.slot_mapping, cache),
        "cache": (batch.key, md.slot_mapping, cache.float()),
    }
    for name, (key, slots, c) in bad_writes.items():
        with pytest.raises(RuntimeError, match="write_kv_quant"):
            write(key, batch.value[:, :key.shape[1]], c, slots, 2, 3, KV_SCALE, 16)
            pytest.fail(f"{name} was accepted")
