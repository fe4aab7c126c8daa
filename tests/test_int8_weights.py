"""bitsandbytes' 8-bit weights (LLM.int8(): ``Linear8bitLt``) per target
(``estimator/corrections/libraries/bitsandbytes.py``).

Its ops' fake kernels ask a dynamic size for the outlier columns (inference failed on fake
tensors); the corrections allocate as each target's kernels do, the number of outlier columns
from the ``data_dependent`` policy.  The CPU side is checked against real CPU runs in
``test_low_bit.py::test_qlora_llama``; here, the CUDA side against its source's arithmetic, the
branch a CUDA run takes in training, and models built on the meta device.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import estimator
from estimator import integrations

bnb = pytest.importorskip("bitsandbytes")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16", per call

K, N, ROWS = 256, 128, 8  # in and out features, input rows: every size a multiple of 512 B


def _linear() -> nn.Module:
    """One ``Linear8bitLt`` (threshold 6.0, as ``load_in_8bit`` builds it), quantized on meta."""
    from estimator.integrations.bitsandbytes import quantize

    with torch.device("meta"):
        model = nn.Sequential(bnb.nn.Linear8bitLt(K, N, bias=False, has_fp16_weights=False, threshold=6.0))
    return quantize(model.to(torch.float16)).eval()


def _allocations(policy) -> list[tuple[str, int]]:
    rep = estimator.report(_linear(), torch.zeros(ROWS, K, dtype=torch.float16), mode="inference", device="cuda",
                           data_dependent=policy)
    return [(op.op.removeprefix("aten."), int(sum(v(ROWS) for v in op.allocated))) for op in rep.timeline.ops
            if any(v(ROWS) for v in op.allocated)]


@pytest.mark.parametrize("outliers", [K, 0])
def test_cuda_inference_allocates_as_the_kernels(outliers):
    """``MatMul8bitLt.forward`` on a CUDA fp16 input of 8 rows, every byte from bitsandbytes'
    sources (backends/cuda/ops.py, backends/default/ops.py) at ``outliers`` outlier columns: the
    bound (every column, the default policy) and none (given for the site)."""
    policy = "max" if outliers == K else {"0:int8_vectorwise_quant#0": 0}
    expected = [
        # int8_vectorwise_quant (CUDA): row stats fp32, int8 rows, |A| fp16, the mask, the 0-dim any()
        ("empty.memory_format", ROWS * 4), ("empty.memory_format", ROWS * K), ("abs.default", ROWS * K * 2),
        ("ge.Scalar", ROWS * K), ("any.default", 1),
    ] + ([
        ("any.dim", K), ("empty.memory_format", outliers * 8),  # the columns' any(), argwhere's int64 output
        ("lift_fresh.default", 1),  # out_row[:, outlier_cols] = 0: the 0 as a tensor
        # int8_mixed_scaled_mm (default): A[:, cols] fp16, CB[:, cols] int8, its dequantization in
        # fp32 (two multiplies), cast to fp16
        ("index.Tensor", ROWS * outliers * 2), ("index.Tensor", N * outliers), ("mul.Tensor", N * outliers * 4),
        ("mul.Tensor", N * outliers * 4), ("_to_copy.default", N * outliers * 2),
    ] if outliers else [("lift_fresh.default", 1)]) + [
        # int8_scaled_mm: int8_linear_matmul's int32 output, int8_mm_dequant's fp16 output
        ("empty.memory_format", ROWS * N * 4), ("empty_like.default", ROWS * N * 2),
    ] + ([("addmm.default", ROWS * N * 2)] if outliers else [])  # the outliers' product added: a new tensor
    assert _allocations(policy) == expected


def test_cuda_training_takes_the_cuda_branch():
    """``bitsandbytes.matmul`` trains with ``MatMul8bitFp`` on CPU tensors and ``MatMul8bitLt`` on
    CUDA ones: the CPU target's capture meets no LLM.int8() quantization, the CUDA target's one per
    linear, with the outlier columns kept for backward."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    model, sample, loss = _meta_llama()
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).train()
    cpu = estimator.report(model, sample, loss_fn=loss, device="cpu")
    cuda = estimator.report(model, sample, loss_fn=loss, device="cuda")
    assert not [s for s in cpu.data_dependent if "int8" in s.op]
    sites = [s for s in cuda.data_dependent if s.op == "int8_vectorwise_quant"]
    assert len(sites) == 2 * 7  # 2 layers of q, k, v, o, gate, up, down
    assert all(s.used == s.upper for s in sites)


def _meta_llama():
    """A tiny Llama built on the meta device with 8-bit weights (``load_in_8bit``)."""
    import transformers

    overrides = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     intermediate_size=512, vocab_size=512)
    return integrations.build("transformers", "LlamaForCausalLM", overrides=overrides, seq_len=16,
                              quantization=transformers.BitsAndBytesConfig(load_in_8bit=True))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_meta_model_infers_and_generates(device):
    """An 8-bit model built on the meta device (no values: the bound, every column an outlier) in
    inference and generate(); a fraction of the bound gives less, and the notes name the sites one
    line per op."""
    pytest.importorskip("transformers")
    model, sample, _ = _meta_llama()
    model.eval()
    # 12 new tokens: the decode steps' extension on CUDA (the CPU measures attention per step: 4)
    for mode, extra in (("inference", {}), ("generate", {"new_tokens": 12 if device == "cuda" else 4})):
        bound = estimator.report(model, sample, mode=mode, device=device, **extra)
        less = estimator.report(model, sample, mode=mode, device=device, data_dependent=0.01, **extra)
        assert less.peak_bytes < bound.peak_bytes, mode
        notes = [n for n in bound.notes if n.startswith("data-dependent size")]
        # the outlier columns; on the CPU also the outliers copied out of each input (A[outliers])
        ops = ["int8_vectorwise_quant"] + (["nonzero"] if device == "cpu" else [])
        assert [n.split(" in ")[0] for n in notes] == [f"data-dependent sizes of {op}" for op in ops], notes
        assert all("in 14 modules" in n for n in notes), notes
