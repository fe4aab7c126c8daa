"""Native fast paths of nn.MultiheadAttention / nn.TransformerEncoder(Layer) (estimator/corrections/
fastpath.py): the capture takes them exactly where real tensors do, and prices them as their
kernels run.  Measured against the CPU allocator (validators.cpu.measure_cpu); tolerance: exact
(0 B) for the hand-checked call, 0.5 % for the zoo rows (tests/test_validation.py's)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from session_cache import compare
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import estimator
from estimator.corrections import fastpath, registry
from estimator.vocab.categories import Target
from estimator.vocab.errors import CaptureError
from validators.cpu import measure_cpu

aten = torch.ops.aten
D, H, T = 16, 4, 8
FAST = {
    aten._native_multi_head_attention.default: "mha",
    aten._transformer_encoder_layer_fwd.default: "layer",
    aten._nested_tensor_from_mask.default: "nested",
}
SUBSTITUTED = {torch._native_multi_head_attention: "mha", torch._transformer_encoder_layer_fwd: "layer",
               torch._nested_tensor_from_mask: "nested"}


class _Seen(TorchDispatchMode):
    """The fast-path ops a real forward dispatches (a dispatch mode leaves the checks alone)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in FAST:
            self.ops.add(FAST[func])
        return func(*args, **(kwargs or {}))


def _real(model, sample, train: bool) -> set[str]:
    model.train(train)
    seen = _Seen()
    with warnings.catch_warnings(), torch.set_grad_enabled(train), seen:
        warnings.simplefilter("ignore")
        model(*sample)
    return seen.ops


def _captured(model, sample, train: bool, monkeypatch) -> set[str]:
    seen = set()
    for fn, name in SUBSTITUTED.items():
        original = registry._SUBSTITUTES[(Target.CPU, fn)]

        def spy(spec, func, args, kwargs, original=original, name=name):
            seen.add(name)
            return original(spec, func, args, kwargs)

        monkeypatch.setitem(registry._SUBSTITUTES, (Target.CPU, fn), spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator.report(model, sample, batch=sample[0].shape[0], mode="train" if train else "inference",
                         data_dependent="sample", loss_fn=lambda out, s: out.float().mean(), device="cpu")
    return seen


def _kpm(b=2, left_aligned=True):
    mask = torch.zeros(b, T, dtype=torch.bool)
    if left_aligned:
        mask[:, T - 3:] = True
    else:
        mask[:, :2] = True
    return mask


def _x(b=2):
    return torch.randn(b, T, D, generator=torch.Generator().manual_seed(0))


class Attn(nn.Module):
    def __init__(self, heads=H, batch_first=True, cross=False, float_mask=False, frozen=False, **kw):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, heads, batch_first=batch_first, **kw)
        self.cross, self.float_mask, self.frozen = cross, float_mask, frozen
        self.head = nn.Linear(D, D)
        if frozen:
            self.mha.requires_grad_(False)

    def train(self, mode=True):
        super().train(mode)
        if self.frozen:  # a frozen, eval-mode block inside a trained model
            self.mha.eval()
        return self

    def forward(self, x, mask=None):
        if mask is not None and self.float_mask:
            mask = torch.zeros(mask.shape).masked_fill(mask, -1e9)
        kv = x.flip(1) if self.cross else x
        out, _ = self.mha(x, kv, kv, key_padding_mask=mask, need_weights=False)
        return self.head(out)


class Unbatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x):
        return self.mha(x[0], x[0], x[0], need_weights=False)[0]


class Layer(nn.Module):
    def __init__(self, hook=False, eps2=None, **kw):
        super().__init__()
        kw.setdefault("batch_first", True)
        self.layer = nn.TransformerEncoderLayer(D, H, 32, **kw)
        if hook:
            self.layer.linear1.register_forward_hook(lambda m, i, o: None)
        if eps2 is not None:
            self.layer.norm2.eps = eps2

    def forward(self, x, mask=None):
        return self.layer(x, src_key_padding_mask=mask)


class Encoder(nn.Module):
    def __init__(self, nested=True, src_mask=False, norm_first=False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, 32, batch_first=True, norm_first=norm_first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.src_mask = src_mask

    def forward(self, x, mask=None):
        causal = nn.Transformer.generate_square_subsequent_mask(T) if self.src_mask else None
        return self.encoder(x, mask=causal, src_key_padding_mask=mask)


CASES = {
    "mha": (lambda: Attn(), lambda: (_x(), _kpm()), False),
    "mha without mask": (lambda: Attn(), lambda: (_x(),), False),
    "mha float mask": (lambda: Attn(float_mask=True), lambda: (_x(), _kpm()), False),
    "mha not batch_first": (lambda: Attn(batch_first=False), lambda: (_x(),), False),
    "mha odd heads": (lambda: Attn(heads=1), lambda: (_x(), _kpm()), False),
    "mha cross attention": (lambda: Attn(cross=True), lambda: (_x(), _kpm()), False),
    "mha bias_kv": (lambda: Attn(add_bias_kv=True), lambda: (_x(), _kpm()), False),
    "mha zero_attn": (lambda: Attn(add_zero_attn=True), lambda: (_x(), _kpm()), False),
    "mha unbatched": (lambda: Unbatched(), lambda: (_x(1),), False),
    "mha training": (lambda: Attn(), lambda: (_x(), _kpm()), True),
    "mha frozen in training": (lambda: Attn(frozen=True), lambda: (_x(), _kpm()), True),
    "layer": (lambda: Layer(), lambda: (_x(), _kpm()), False),
    "layer gelu norm_first": (lambda: Layer(activation="gelu", norm_first=True), lambda: (_x(), _kpm()), False),
    "layer silu": (lambda: Layer(activation=F.silu), lambda: (_x(), _kpm()), False),
    "layer hook": (lambda: Layer(hook=True), lambda: (_x(), _kpm()), False),
    "layer eps": (lambda: Layer(eps2=1e-6), lambda: (_x(), _kpm()), False),
    "layer not batch_first": (lambda: Layer(batch_first=False), lambda: (_x(),), False),
    "encoder nested": (lambda: Encoder(), lambda: (_x(), _kpm()), False),
    "encoder not left-aligned": (lambda: Encoder(), lambda: (_x(), _kpm(left_aligned=False)), False),
    "encoder without nested": (lambda: Encoder(nested=False), lambda: (_x(), _kpm()), False),
    "encoder src_mask": (lambda: Encoder(src_mask=True), lambda: (_x(), _kpm()), False),
    "encoder norm_first": (lambda: Encoder(norm_first=True), lambda: (_x(), _kpm()), False),
    "encoder without mask": (lambda: Encoder(), lambda: (_x(),), False),
    "encoder training": (lambda: Encoder(), lambda: (_x(), _kpm()), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_decision_mirrors_real_tensors(case, monkeypatch):
    build, sample, train = CASES[case]
    torch.manual_seed(0)
    expected = _real(build(), sample(), train)
    assert _captured(build(), sample(), train, monkeypatch) == expected


def test_fast_path_disabled_by_the_user(monkeypatch):
    monkeypatch.setattr(torch.backends.mha, "get_fastpath_enabled", lambda: False)
    assert _real(Attn(), (_x(), _kpm()), False) == set()
    assert _captured(Attn(), (_x(), _kpm()), False, monkeypatch) == set()


def test_has_torch_function_is_torchs_own_outside_captures():
    original = torch.overrides.has_torch_function
    estimator.report(Attn(), (_x(), _kpm()), batch=2, mode="inference", device="cpu")
    assert torch.overrides.has_torch_function is original is registry._HAS_TORCH_FUNCTION


class OneMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, mask):
        return self.mha(x, x, x, key_padding_mask=mask, need_weights=False)[0]


def test_one_mha_fast_path_call_is_exact():
    # B = 2, T = 4, D = 8, H = 2 (dh = 4), fp32, a bool key_padding_mask.
    # Baseline: in_proj 24*8*4 = 768 + 24*4 = 96, out_proj 8*8*4 = 256 + 8*4 = 32 -> 1,152 B of
    # parameters; x 2*4*8*4 = 256 + mask 8 -> 1,416 B.
    # Forward: the canonical float mask (zeros_like + masked_fill_) 2*4*4 = 32 B, alive to the end;
    # then native_multi_head_attention_cpu: qkv = mm [8, 24] 768 B; _transform_bias_rescale_qkv
    # [3, 2, 2, 4, 4] 768 B  <- peak: 32 + 768 + 768 = 1,568 B; qkv freed (800); scores bmm
    # [4, 4, 4] 256 (1,056); mask.to(bool) 8 and _masked_softmax 256 (1,320); both freed with the
    # scores (800 after the softmax is dropped); permute().contiguous() 256 and addmm 256 (1,312).
    # Peak = 1,416 + 1,568 = 2,984 B.
    torch.manual_seed(0)
    x, mask = torch.randn(2, 4, 8), torch.zeros(2, 4, dtype=torch.bool)
    mask[:, 3] = True
    rep = estimator.report(OneMHA(), (x, mask), batch=2, mode="inference", device="cpu")
    assert rep.peak_bytes == 2984
    assert measure_cpu(OneMHA(), (x, mask), "inference").peak_bytes == 2984
    ops = {str(n.target) for n in rep.graph.nodes if n.op == "call_function"}
    assert {"aten._transform_bias_rescale_qkv.default", "aten._masked_softmax.default"} <= ops


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_layer_fast_path_matches_cpu(amp):
    # Under CPU autocast the dispatcher casts _native_multi_head_attention's arguments (query,
    # key and value each: three projections and a cat) and the layer's add_ casts src.
    torch.manual_seed(0)
    sample = (_x(8), _kpm(8))
    measured = measure_cpu(Layer(), sample, "inference", amp=amp).peak_bytes
    torch.manual_seed(0)
    assert estimator.report(Layer(), sample, batch=8, mode="inference", amp=amp, device="cpu").peak_bytes == measured


def test_uneven_rows_are_an_upper_bound():
    # Rows of 8, 6 and 5 tokens: the per-row softmax of a row shorter than T' copies its block
    # first; fxmem prices a row of T' - 1 = 7 tokens (2 * 4 * 7 * 7 * 4 B), above the real 6.
    torch.manual_seed(0)
    mask = torch.zeros(3, T, dtype=torch.bool)
    mask[1, 6:], mask[2, 5:] = True, True
    sample = (_x(3), mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure_cpu(Encoder(), sample, "inference").peak_bytes
        predicted = estimator.report(Encoder(), sample, batch=3, mode="inference", data_dependent="sample",
                                     device="cpu").peak_bytes
    assert measured <= predicted <= measured + 2 * H * (7 * 7 - 6 * 6) * 4


def test_nested_sizes_are_data_dependent_sites():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = estimator.report(Encoder(), (_x(4), _kpm(4)), batch=4, mode="inference", data_dependent="sample",
                               device="cpu")
    notes = "\n".join(rep.notes)
    # 4 rows of 5 real tokens of 8: n = 20 of 32, the longest row 5 of 8, left-aligned.
    assert "encoder:_nested_tensor_from_mask#0" in notes and "on the sample 20 of 32" in notes
    assert "encoder:to_padded_tensor#0" in notes and "on the sample 5 of 8" in notes
    assert "encoder:_nested_tensor_from_mask_left_aligned#0" in notes


def test_nested_under_cpu_autocast_fails_as_torch_does():
    sample = (_x(), _kpm())
    with pytest.raises(RuntimeError, match="expected scalar type Float"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measure_cpu(Encoder(), sample, "inference", amp="bf16")
    with pytest.raises(CaptureError, match="nested-tensor fast path fails under CPU autocast"):
        estimator.report(Encoder(), sample, batch=2, mode="inference", amp="bf16", device="cpu")


def test_nested_stand_in_refuses_other_ops():
    nested = fastpath.Nested(None, torch.empty(3, 4), None, None, None, 1, 3, 4)
    assert nested.is_nested and nested.dim() == 3 and not nested.requires_grad
    with pytest.raises(CaptureError, match="nested tensor of the native TransformerEncoder fast path"):
        torch.add(nested, 1)


def _aten_ops(rep) -> set[str]:
    return {str(n.target).split(".")[1] for n in rep.graph.nodes if n.op == "call_function" and "aten" in str(n.target)}


@pytest.mark.parametrize("name", ["mha_padding", "encoder_padding"])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_cuda_target_runs_the_zoo_models(name, mode):
    import models_zoo

    model, make_sample, loss_fn = models_zoo.get(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = estimator.report(model, make_sample(4), batch=4, mode=mode, loss_fn=loss_fn, device="cuda", gpu="H100")
    assert rep.peak_bytes > 0
    ops = _aten_ops(rep)
    fast = "_transform_bias_rescale_qkv" in ops or "_addmm_activation" in ops
    assert fast == (mode == "inference")


def test_cuda_mha_without_mask_takes_the_fused_branch():
    # attention.cu: self-attention, no mask, need_weights=False, dh = 4 % 8 != 0 -> the bmm path;
    # D = 64, H = 4 (dh 16) -> _fused_sdp_choice: mem-efficient for fp32 on sm90 -> fused.
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(64, 4, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    x = torch.randn(2, T, 64)
    fused = _aten_ops(estimator.report(Wide(), (x,), batch=2, mode="inference", device="cuda", gpu="H100"))
    assert "_scaled_dot_product_efficient_attention" in fused and "_transform_bias_rescale_qkv" not in fused
    narrow = _aten_ops(estimator.report(Attn(), (_x(),), batch=2, mode="inference", device="cuda", gpu="H100"))
    assert "_transform_bias_rescale_qkv" in narrow
    # Under autocast a real GPU refuses the fast path ("autocast is enabled"): the Python path.
    amp = _aten_ops(estimator.report(Wide(), (x,), batch=2, mode="inference", device="cuda", gpu="H100",
                                     amp="bf16"))
    assert "_transform_bias_rescale_qkv" not in amp


@pytest.mark.parametrize("b", [2, 8, 32])
@pytest.mark.parametrize("name", ["mha_padding", "encoder_padding"])
def test_zoo_inference_rows(name, b):
    # The fast paths run in inference only (training rows: tests/test_validation.py); the
    # encoder's token count is the measured sample's (zoo.compare, DATA_DEPENDENT = "sample").
    # Once per session: tests/test_validation.py's rows at b = 2 and 32 are the same calls.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = compare(name, "debug", "inference", b)
    assert abs(row.error) <= 0.5, row
