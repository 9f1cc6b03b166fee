"""sparse_attention entry: validation, config and its resolution, the guard that refuses a tiling
before any launch, custom ops (log2 lse inside), torch.compile, precompile."""

import dataclasses

import pytest
import torch
from dsa_bench.dense import dense_attention
from dsa_sparse_attention import (
    AttentionShape,
    SparseAttentionConfig,
    _flash_mla,
    precompile,
    resolve_config,
    sparse_attention,
)
from dsa_sparse_attention._ops import _check_runnable, _table_lookup
from dsa_sparse_attention.config import CONFIG_TABLE, TORCH_CONFIG
from kernel_common import ARCH_ENV, Arch, device_arch
from kernel_common.constants import LN2
from kernel_common.testing import assert_close
from support import attention_indices, attention_inputs, fake_cuda, seeded_gen

HOPPER = Arch("cuda", 9, 0)


def make(b=1, s=6, h=4, g=1, d=40, topk=5, seed=0, sink=False):
    gen = seeded_gen("api", b, s, h, g, d, topk, seed)
    q, kv, attn_sink = attention_inputs(b, s, s, h, g, d, gen, sink=sink)
    return q, kv, attention_indices(b, s, g, topk, s, "mixed", gen).clamp(-1, s - 1), attn_sink


def _fields(config: SparseAttentionConfig) -> tuple:
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config))


def test_validation_messages():
    q, kv, idx, _ = make(h=4, g=2, d=40)
    cases = [
        (dict(q=q.float()), TypeError, "q must have dtype bfloat16, got float32"),
        (dict(q=q[0]), ValueError, r"q must have shape \[B, S, H, D\]"),
        (dict(kv=kv.half()), TypeError, "kv must have dtype bfloat16"),
        (dict(kv=kv[..., :32]), ValueError, r"kv must have shape \[B=1, S_kv, G, D=40\]"),
        (
            dict(kv=torch.randn(1, 6, 3, 40).bfloat16()),
            ValueError,
            "H=4 must be divisible by the kv groups G=3",
        ),
        (dict(indices=idx.long()), TypeError, "indices must have dtype int32"),
        (
            dict(indices=idx[:, :, :1]),
            ValueError,
            r"indices must have shape \[B=1, S=6, G=2, topk\]",
        ),
        (dict(indices=idx[..., :0]), ValueError, "topk >= 1"),
        (dict(indices=idx + 7), ValueError, r"indices must lie in \[-1, S_kv=6\)"),
        (dict(indices=idx - 8), ValueError, r"indices must lie in \[-1, S_kv=6\)"),
        (dict(d_v=41), ValueError, "d_v=41 must not exceed the q/kv width D=40"),
        (dict(d_v=0), ValueError, "d_v must be >= 1"),
        (dict(attn_sink=torch.zeros(3)), ValueError, r"attn_sink must have shape \[H=4\]"),
        (dict(attn_sink=torch.zeros(4).bfloat16()), TypeError, "attn_sink must have dtype float32"),
        (dict(config="fast"), TypeError, "config must be a SparseAttentionConfig"),
    ]
    for overrides, exc, msg in cases:
        args = dict(q=q, kv=kv, indices=idx, d_v=32)
        args.update(overrides)
        with pytest.raises(exc, match=msg):
            sparse_attention(args.pop("q"), args.pop("kv"), args.pop("indices"), **args)


@pytest.mark.gpu
def test_device_mismatch():
    q, kv, idx, _ = make()
    with pytest.raises(ValueError, match="kv is on cpu, expected cuda"):
        sparse_attention(q.cuda(), kv, idx.cuda())


# --------------------------------------------------------------------------- config


def test_config_validation():
    cases = [
        (dict(forward_backend="cudnn"), "SparseAttentionConfig.forward_backend must be one of"),
        (dict(backward_backend="flash_mla"), "SparseAttentionConfig.backward_backend"),
        (dict(dkv_reduce="bf16"), "SparseAttentionConfig.dkv_reduce"),
        (dict(forward_block_i=0), "SparseAttentionConfig.forward_block_i must be a positive int"),
        (dict(backward_stages=None), "SparseAttentionConfig.backward_stages"),
        (dict(split_store=True), "SparseAttentionConfig.split_store"),
        (dict(deterministic=1), "SparseAttentionConfig.deterministic must be a bool"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            SparseAttentionConfig(**kwargs)


def test_defaults_are_the_tilelang_kernels():
    """Every field explicit, the defaults the library's TileLang kernels: changing one field on
    a GPU keeps them (it does not fall back to the torch backend)."""
    assert dataclasses.asdict(SparseAttentionConfig()) == dict(
        forward_backend="tilelang",
        backward_backend="tilelang",
        forward_block_i=64,
        forward_stages=2,
        backward_block_i=32,
        backward_stages=1,
        split_store=2,
        dkv_reduce="tma",
        deterministic=False,
    )
    one = SparseAttentionConfig(backward_block_i=64)
    assert (one.forward_backend, one.backward_backend) == ("tilelang", "tilelang")
    assert dataclasses.replace(one, backward_block_i=32) == SparseAttentionConfig()


def test_resolve_config_on_cpu_is_the_torch_reference(monkeypatch):
    """CPU tensors run the torch reference whatever the caller passes or the arch claims."""
    q, kv, idx, _ = make()
    for arch in (None, "sm_90"):
        if arch is None:
            monkeypatch.delenv(ARCH_ENV, raising=False)
        else:
            monkeypatch.setenv(ARCH_ENV, arch)
        found = resolve_config(q, kv, idx, d_v=32)
        assert found.config == TORCH_CONFIG and found.source.startswith("cpu tensors")
        mine = resolve_config(q, kv, idx, d_v=32, config=SparseAttentionConfig(split_store=4))
        assert mine.config == TORCH_CONFIG and mine.source.startswith("cpu tensors")
        assert "CUDA tensors only" in mine.source
    assert (TORCH_CONFIG.forward_backend, TORCH_CONFIG.backward_backend) == ("torch", "torch")


def test_resolve_config_on_cuda(monkeypatch):
    """CUDA tensors: the caller's config or the (arch, RoPE tail, heads bucket, top-k bucket)
    row, with a FlashMLA forward replaced by the one that runs where FlashMLA cannot."""
    q, kv = fake_cuda(1, 1, 16, 576), fake_cuda(1, 1, 1, 576)
    idx = fake_cuda(1, 1, 1, 2048, dtype=torch.int32)
    monkeypatch.setattr(_flash_mla, "flash_mla_importable", lambda: False)
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    found = resolve_config(q, kv, idx)
    assert found.key == (
        ("arch_major", 9), ("rope_tail", True), ("heads", 16), ("topk", 2048),
        ("deterministic", False),
    )  # fmt: skip
    # The row's FlashMLA forward is not importable here: the TileLang forward, and it says so.
    assert found.source.startswith("row (FlashMLA forward measured fastest")
    assert found.source.endswith("flash_mla not importable or not for this shape: tilelang forward")
    assert found.config.forward_backend == "tilelang"
    assert resolve_config(q, kv, idx, d_v=576).key[1] == ("rope_tail", False)
    short = fake_cuda(1, 1, 1, 1024, dtype=torch.int32)
    assert resolve_config(q, kv, short).key[3] == ("topk", 1024)
    mine = SparseAttentionConfig(split_store=4)
    assert resolve_config(q, kv, idx, config=mine).config == mine
    assert resolve_config(q, kv, idx, config=mine).source == "caller"
    # FlashMLA not importable: a Hopper caller's FlashMLA forward runs as TileLang ...
    asked = SparseAttentionConfig(forward_backend="flash_mla")
    found = resolve_config(q, kv, idx, config=asked)
    assert found.config == dataclasses.replace(asked, forward_backend="tilelang")
    assert "flash_mla not importable" in found.source
    # A Triton forward runs where the width splits as d_v plus a power of two, else TileLang.
    asked = SparseAttentionConfig(forward_backend="triton")
    assert resolve_config(q, kv, idx, config=asked).config == asked
    odd = resolve_config(fake_cuda(1, 1, 16, 704), fake_cuda(1, 1, 1, 704), idx, config=asked)
    assert odd.config == dataclasses.replace(asked, forward_backend="tilelang")
    assert odd.source.endswith("the triton forward does not run this width: tilelang forward")
    # ... and Blackwell's FlashMLA row as the torch reference.
    monkeypatch.setenv(ARCH_ENV, "sm_100")
    found = resolve_config(q, kv, idx)
    assert found.config.forward_backend == "torch" and "flash_mla" in found.source
    # Importable: kept where it supports the shape (one kv group, d_v 512), replaced elsewhere.
    monkeypatch.setattr(_flash_mla, "flash_mla_importable", lambda: True)
    assert resolve_config(q, kv, idx).config.forward_backend == "flash_mla"
    grouped = resolve_config(q, fake_cuda(1, 1, 2, 576), fake_cuda(1, 1, 2, 64, dtype=torch.int32))
    assert grouped.config.forward_backend == "torch"
    # An arch without rows: the default, the torch reference.
    monkeypatch.setenv(ARCH_ENV, "sm_80")
    assert resolve_config(q, kv, idx).config == TORCH_CONFIG
    assert resolve_config(q, kv, idx).source == "default"


def test_deterministic_mode_resolution(monkeypatch):
    """deterministic=True (or torch.use_deterministic_algorithms(True) with the default None)
    picks the table's deterministic row, or sets the field of the caller's config;
    deterministic=False overrides torch's switch; a config that says True stays True."""
    q, kv = fake_cuda(1, 1, 16, 576), fake_cuda(1, 1, 1, 576)
    idx = fake_cuda(1, 1, 1, 2048, dtype=torch.int32)
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    default = resolve_config(q, kv, idx)
    assert not default.config.deterministic and dict(default.key)["deterministic"] is False
    row = resolve_config(q, kv, idx, deterministic=True)
    assert row.config.deterministic and dict(row.key)["deterministic"] is True
    assert row.source.startswith("row (") and "deterministic backward measured" in row.source
    mine = SparseAttentionConfig(split_store=4)
    found = resolve_config(q, kv, idx, config=mine, deterministic=True)
    assert found.config == dataclasses.replace(mine, deterministic=True)
    assert found.source == "caller; deterministic"
    kept = SparseAttentionConfig(deterministic=True)
    assert resolve_config(q, kv, idx, config=kept, deterministic=False).config == kept
    with pytest.raises(TypeError, match="deterministic must be a bool or None"):
        resolve_config(q, kv, idx, deterministic=1)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert resolve_config(q, kv, idx).config == row.config
        assert not resolve_config(q, kv, idx, deterministic=False).config.deterministic
    finally:
        torch.use_deterministic_algorithms(was)


def test_every_table_row_passes_the_kernel_checks():
    """No Hopper row holds a tiling its kernels refuse, at every head count its key covers."""
    rows = [r for r in CONFIG_TABLE.rows() if dict(r.key)["arch_major"] == 9]
    assert len(rows) == 32
    for row in rows:
        key = dict(row.key)
        dim = 576 if key["rope_tail"] else 512
        assert row.config.forward_backend in ("tilelang", "triton", "flash_mla")
        assert row.config.backward_backend == "tilelang"
        assert row.config.deterministic == key["deterministic"]
        # A FlashMLA row runs the TileLang forward where FlashMLA is not importable.
        fallback = dataclasses.replace(row.config, forward_backend="tilelang")
        for heads in {key["heads"], key["heads"] // 2 + 1, 2 * key["heads"]}:
            _check_runnable(row.config, HOPPER, heads, 1, dim, 512)
            _check_runnable(fallback, HOPPER, heads, 1, dim, 512)
            # A caller may also turn a default row deterministic: its staging fits too.
            deterministic = dataclasses.replace(row.config, deterministic=True)
            _check_runnable(deterministic, HOPPER, heads, 1, dim, 512)


def test_guard_refuses_what_the_kernels_cannot_run():
    """The op checks the config against the shapes before any compile or launch, and names the
    field to change."""
    with pytest.raises(ValueError, match=r"SparseAttentionConfig\.forward_block_i"):
        _check_runnable(SparseAttentionConfig(forward_block_i=48), HOPPER, 64, 1, 576, 512)
    with pytest.raises(ValueError, match=r"SparseAttentionConfig\.forward_stages"):
        _check_runnable(SparseAttentionConfig(forward_stages=1), HOPPER, 64, 1, 576, 512)
    with pytest.raises(ValueError, match=r"SparseAttentionConfig\.backward_block_i"):
        _check_runnable(SparseAttentionConfig(backward_block_i=24), HOPPER, 64, 1, 576, 512)
    with pytest.raises(ValueError, match=r"SparseAttentionConfig\.split_store"):
        _check_runnable(SparseAttentionConfig(split_store=3), HOPPER, 64, 1, 576, 512)
    with pytest.raises(ValueError, match="Hopper"):
        _check_runnable(SparseAttentionConfig(), Arch("cuda", 10, 0), 64, 1, 576, 512)
    triton = SparseAttentionConfig(forward_backend="triton", backward_backend="torch")
    with pytest.raises(ValueError, match=r"forward_backend='triton' needs q.shape\[-1\] = 704"):
        _check_runnable(triton, HOPPER, 8, 1, 704, 512)
    with pytest.raises(ValueError, match="no launch within 50000 bytes of shared memory"):
        _check_runnable(triton, HOPPER, 8, 1, 576, 512, smem_limit=50_000)
    _check_runnable(triton, Arch("cuda", 10, 0), 8, 1, 576, 512)  # Triton: any CUDA arch
    # The torch backends need no check, whatever the tiling fields hold.
    torch_only = dataclasses.replace(TORCH_CONFIG, forward_block_i=48, split_store=3)
    _check_runnable(torch_only, Arch("cuda", 10, 0), 64, 1, 576, 512)


def test_precompile_builds_nothing_without_tilelang_kernels():
    shape = AttentionShape(heads=16, d_qk=576, d_v=512, topk=2048)
    assert (shape.groups, shape.sink) == (1, False)
    # Blackwell rows run FlashMLA / torch; a torch config on Hopper runs no TileLang either.
    assert precompile([shape], arch="sm_100") == 0
    assert precompile([shape], arch="sm_90", config=TORCH_CONFIG) == 0
    with pytest.raises(ValueError, match=r"SparseAttentionConfig\.forward_block_i"):
        precompile([shape], arch="sm_90", config=SparseAttentionConfig(forward_block_i=48))


# --------------------------------------------------------------------------- custom ops


def test_ops_take_the_config_fields_in_declaration_order():
    """Both ops rebuild the config from their trailing arguments by position."""
    ops = torch.ops.dsa_sparse_attention
    fields = [f.name for f in dataclasses.fields(SparseAttentionConfig)]
    forward = [a.name for a in ops.forward.default._schema.arguments]
    assert forward == ["q", "kv", "indices", "attn_sink", "sm_scale", "d_v", *fields]
    backward = [a.name for a in ops.backward.default._schema.arguments]
    assert backward == [
        "dout", "dlse2", "q", "kv", "indices", "out", "lse2", "attn_sink", "sm_scale", "d_v",
        *fields,
    ]  # fmt: skip


def test_rocm_gets_the_torch_reference(monkeypatch):
    """No kernel here is built for ROCm: its devices resolve to the torch reference."""
    monkeypatch.setenv(ARCH_ENV, "gfx942")
    found = resolve_config(
        fake_cuda(1, 1, 16, 576), fake_cuda(1, 1, 1, 576), fake_cuda(1, 1, 1, 64, dtype=torch.int32)
    )
    assert found.config == TORCH_CONFIG and found.source.startswith("gfx942")


def test_forward_op_returns_the_lse_in_log2_units():
    q, kv, idx, sink = make(h=4, g=2, d=40, sink=True)
    fields = _fields(resolve_config(q, kv, idx, d_v=32).config)
    out, lse2 = torch.ops.dsa_sparse_attention.forward(q, kv, idx, sink, 0.2, 32, *fields)
    o64, l64 = dense_attention(q.double(), kv.double(), idx, 0.2, 32, sink.double())
    assert_close(out, o64, max_rel_diff=2e-5, name="out")
    assert_close(lse2 * LN2, l64, max_rel_diff=1e-6, name="lse2 * ln 2")
    public_out, lse = sparse_attention(q, kv, idx, sm_scale=0.2, d_v=32, attn_sink=sink,
                                       return_lse=True)  # fmt: skip
    assert torch.equal(public_out, out) and torch.equal(lse, lse2 * LN2)


def test_opcheck():
    q, kv, idx, _ = make(h=4, g=2)
    fields = _fields(resolve_config(q, kv, idx, d_v=32).config)
    sink = torch.randn(4, generator=seeded_gen("opcheck sink"))
    for s in (sink, None):
        leaves = (q.clone().requires_grad_(), kv.clone().requires_grad_())
        sk = s.clone().requires_grad_() if s is not None else None
        torch.library.opcheck(
            torch.ops.dsa_sparse_attention.forward.default, (*leaves, idx, sk, 0.2, 32, *fields)
        )
        out, lse2 = torch.ops.dsa_sparse_attention.forward(q, kv, idx, s, 0.2, 32, *fields)
        gen = seeded_gen("opcheck grads", s is None)
        dout = torch.randn(out.shape, generator=gen).bfloat16()
        dlse2 = torch.randn(lse2.shape, generator=gen)
        torch.library.opcheck(
            torch.ops.dsa_sparse_attention.backward.default,
            (dout, dlse2, q, kv, idx, out, lse2, s, 0.2, 32, *fields),
        )


def test_config_choice_traces(monkeypatch):
    """torch.compile traces the entry's config choice on Hopper (fullgraph: no graph break),
    the FlashMLA row falling back to TileLang where flash_mla is not importable."""
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    monkeypatch.setattr(_flash_mla, "flash_mla_importable", lambda: False)

    def pick(x):
        arch = device_arch(torch.device("cuda"))
        cfg = _table_lookup(arch, 64, 1, 576, 512, 2048, None, False).config
        return x + (1 if cfg.forward_backend == "tilelang" else 2)

    assert torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2)).tolist() == [1, 1]


def test_compile_forward_backward_dynamic():
    def loss_fn(q, kv, idx, sink):
        out, lse = sparse_attention(q, kv, idx, d_v=32, attn_sink=sink, return_lse=True)
        return out.float().square().sum() + lse.sum()

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True)
    for s in (6, 9):
        q, kv, idx, sink = make(s=s, seed=s, sink=True)
        eager = [x.clone().requires_grad_() for x in (q, kv, sink)]
        comp = [x.clone().requires_grad_() for x in (q, kv, sink)]
        l1 = loss_fn(eager[0], eager[1], idx, eager[2])
        l2 = compiled(comp[0], comp[1], idx, comp[2])
        l1.backward()
        l2.backward()
        torch.testing.assert_close(l1, l2)
        for a, b in zip(eager, comp, strict=True):
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["table", "triton", "tilelang"])
@pytest.mark.parametrize(
    "heads,dim,topk,sink", [(64, 576, 2048, False), (8, 512, 640, True), (8, 576, 2048, False)]
)
def test_gpu_public_op_against_the_reference(heads, dim, topk, sink, forward):
    """The public entry on CUDA with the table's config, or its row with the Triton or the
    TileLang forward swapped in (custom ops, the TileLang backward from that forward's lse, the
    lse through autograd), against the fp32 torch reference."""
    from dsa_sparse_attention import reference

    gen = seeded_gen("public op gpu", heads, dim, topk, sink)
    s, s_kv = 96, 2500
    q, kv, attn_sink = attention_inputs(1, s, s_kv, heads, 1, dim, gen, sink=sink, device="cuda")
    idx = attention_indices(1, s, 1, topk, s_kv, "shuffled", gen, device="cuda")
    config = None
    if forward != "table":
        config = dataclasses.replace(resolve_config(q, kv, idx).config, forward_backend=forward)
        assert resolve_config(q, kv, idx, config=config).config.forward_backend == forward
    leaves = [x.clone().requires_grad_() for x in (q, kv) + ((attn_sink,) if sink else ())]
    out, lse = sparse_attention(
        leaves[0],
        leaves[1],
        idx,
        attn_sink=leaves[2] if sink else None,
        return_lse=True,
        config=config,
    )
    dout = torch.randn(out.shape, generator=gen).bfloat16().cuda()
    dlse = torch.randn(lse.shape, generator=gen).cuda()
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * dlse).sum(), leaves)
    scale = dim**-0.5
    ref_out, ref_lse = reference.sparse_attention_forward_reference(
        q, kv, idx, scale, 512, attn_sink
    )
    ref = reference.sparse_attention_backward_reference(
        dout, dlse, q, kv, idx, ref_lse, scale, 512, attn_sink
    )
    assert_close(out, ref_out, name="out")
    assert_close(lse, ref_lse, name="lse")
    for name, got, want in zip(("dq", "dkv", "dsink"), grads, ref, strict=False):
        assert_close(got, want, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["argument", "config", "torch_flag", "torch_backward"])
def test_gpu_deterministic_mode_end_to_end(how):
    """Through the public op, three forward+backward runs give the same bits for dq, dkv and
    dsink: deterministic=True as the argument (the table's deterministic row), in the caller's
    config (the default row's tiling), through torch's switch with no config, and with the
    torch backward in that mode."""
    gen = seeded_gen("deterministic public op", how)
    s, s_kv, heads, topk = 256, 96, 8, 160  # 2 x 256 queries per key row: contended adds
    q, kv, sink = attention_inputs(1, s, s_kv, heads, 1, 576, gen, sink=True, device="cuda")
    idx = attention_indices(1, s, 1, topk, s_kv, "duplicates", gen, device="cuda")
    dout = torch.randn(1, s, heads, 512, generator=gen).bfloat16().cuda()
    row = resolve_config(q, kv, idx).config
    kwargs = {
        "argument": dict(deterministic=True),
        "config": dict(config=dataclasses.replace(row, deterministic=True)),
        "torch_flag": {},
        "torch_backward": dict(
            config=dataclasses.replace(row, backward_backend="torch", deterministic=True)
        ),
    }[how]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how == "torch_flag" or was)
    try:
        assert resolve_config(q, kv, idx, **kwargs).config.deterministic
        runs = []
        for _ in range(3):
            leaves = [x.clone().requires_grad_() for x in (q, kv, sink)]
            out = sparse_attention(leaves[0], leaves[1], idx, attn_sink=leaves[2], **kwargs)
            runs.append(torch.autograd.grad(out, leaves, dout))
    finally:
        torch.use_deterministic_algorithms(was)
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dkv", "dsink"), runs[0], run, strict=True):
            assert torch.equal(a, b), f"{name} differs bitwise between runs"


@pytest.mark.gpu
def test_gpu_compiled_forward_backward():
    """torch.compile(fullgraph=True) of a forward+backward on CUDA with the table's config in
    deterministic mode gives the eager run's bits: out, lse, dq, dkv and dsink (the memcheck
    shape, whose kernels a TileLang cache may already hold)."""
    gen = seeded_gen("compiled public op gpu")
    s, s_kv, heads, topk = 33, 70, 64, 150
    q, kv, sink = attention_inputs(1, s, s_kv, heads, 1, 576, gen, sink=True, device="cuda")
    idx = attention_indices(1, s, 1, topk, s_kv, "duplicates", gen, device="cuda")

    def forward(q, kv, sink):
        out, lse = sparse_attention(q, kv, idx, attn_sink=sink, return_lse=True, deterministic=True)
        loss = out.float().square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
        return loss, out, lse

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, kv, sink)]
        loss, out, lse = fn(*leaves)
        return (out, lse, *torch.autograd.grad(loss, leaves))

    eager = run(forward)
    compiled = run(torch.compile(forward, fullgraph=True))
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), eager, compiled, strict=True):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"
