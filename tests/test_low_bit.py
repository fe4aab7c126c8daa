"""Low-bit optimizers (bitsandbytes, torchao) on the CPU target: captured as they run, exact.

bitsandbytes' update ops run their own CPU kernels on the fake tensors
(``estimator/corrections/libraries/bitsandbytes.py``); torchao's compile their per-parameter
update, which the capture compiles too (``estimator/capture/compiled.py``, ``fake_runtime(None)``).
``python -m validators.low_bit`` runs the same check on a transformer and a conv net as well
(48/48 rows exact).  The libraries are in the test extra; each test skips where its library
does not import.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import estimator
from estimator import Category
from estimator.vocab.errors import InputError
from validators.cpu import measure_cpu, threads
from validators.low_bit import OPTIMIZERS, Fallbacks, optimizer_class


def _factory(name: str):
    cls = optimizer_class(name)
    if cls is None:
        pytest.skip(f"{OPTIMIZERS[name][0].split('.')[0]} does not import here")
    return lambda params: cls(params, lr=1e-3)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_real_cpu_steps(name):
    """One report's formula against real CPU train steps at b = 2 and 8, to the byte: the
    parameters of 4,095 and 4,097 elements take the fallbacks (fp32 states)."""
    factory = _factory(name)
    torch.manual_seed(0)
    with threads(2):
        rep = estimator.report(Fallbacks(), torch.randn(2, 64), optimizer=factory, device="cpu")
        for b in (2, 8):
            torch.manual_seed(0)
            measured = measure_cpu(Fallbacks(), torch.randn(b, 64), "train", factory)
            assert rep.at(b) == measured.peak_bytes, (name, b)


def _blocks(n: int, size: int) -> int:
    return -(-n // size)


def test_bitsandbytes_state_to_the_byte():
    """bitsandbytes' ``Adam8bit`` (bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``):
    a parameter of ``min_8bit_size`` = 4,096 elements or more keeps two uint8 states and two fp32
    absmax per block of 256; a smaller one two fp32 states; the two 256-entry fp32 quantization
    maps are shared by all."""
    factory = _factory("bnb Adam8bit")
    model = Fallbacks()
    rep = estimator.report(model, torch.randn(2, 64), optimizer=factory, device="cpu")
    sizes = [p.numel() for p in model.parameters()]
    assert sizes == [4095, 4097, 32768, 512, 5120, 10]
    state = sum(2 * n + 2 * 4 * _blocks(n, 256) if n >= 4096 else 2 * 4 * n for n in sizes) + 2 * 256 * 4
    assert rep.breakdown[Category.OPTIMIZER_STATE] == state == 124_274
    # the formula export gives it per trainable parameter: 124,274 B / 46,602 parameters
    assert rep.trainable_params == sum(sizes) == 46_602
    assert rep.optimizer_state_per_param == 124_274 / 46_602
    assert "124,274 B over Ψ = 46,602 trainable parameters, 2.667 B per parameter" in rep.to_markdown()
    assert json.loads(rep.to_json())["optimizer_state_per_parameter"] == 124_274 / 46_602


def test_torchao_state_to_the_byte():
    """torchao's ``AdamW8bit`` and ``AdamW4bit`` (torchao/optim/adam.py ``_new_buffer``): a
    parameter of 4,096 elements or more that its block size divides keeps two quantized states
    (8-bit: a uint8 code per element and an fp32 scale per block of 256; 4-bit: a uint8 per two
    elements and an fp32 scale per block of 128), each with its own fp32 code map (256 and 16
    entries); any other the two fp32 states; every parameter a 0-dim fp32 ``step``."""
    sizes = [4095, 4097, 32768, 512, 5120, 10]
    for name, block, codes, qmap in (("ao AdamW8bit", 256, lambda n: n, 256), ("ao AdamW4bit", 128,
                                                                              lambda n: n // 2, 16)):
        factory = _factory(name)
        rep = estimator.report(Fallbacks(), torch.randn(2, 64), optimizer=factory, device="cpu")
        quantized = lambda n: n >= 4096 and n % block == 0  # noqa: E731
        state = sum(2 * (codes(n) + 4 * (n // block) + 4 * qmap) if quantized(n) else 2 * 4 * n
                    for n in sizes) + 4 * len(sizes)
        assert rep.breakdown[Category.OPTIMIZER_STATE] == state, name


def test_by_name():
    """``optimizer="adamw8bit"`` is bitsandbytes' ``AdamW8bit``, ``"adamw_torch_4bit"`` torchao's
    ``AdamW4bit`` (transformers' ``optim`` names work too); a missing library is named."""
    for name, cls in (("adamw8bit", "bnb AdamW8bit"), ("adamw_torch_4bit", "ao AdamW4bit")):
        factory = _factory(cls)
        by_name = estimator.report(Fallbacks(), torch.randn(2, 64), optimizer=name, device="cpu")
        assert by_name.peak_bytes == estimator.report(Fallbacks(), torch.randn(2, 64), optimizer=factory,
                                                      device="cpu").peak_bytes


def test_missing_library_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(InputError, match=r"'ao-adamw4bit' is torchao's AdamW4bit.*pip install torchao"):
        estimator.report(Fallbacks(), torch.randn(2, 64), optimizer="ao-adamw4bit", device="cpu")
    with pytest.raises(InputError, match="unknown optimizer 'adamw9bit'.*adamw8bit"):
        estimator.report(Fallbacks(), torch.randn(2, 64), optimizer="adamw9bit", device="cpu")


def test_compiled_update_on_the_cuda_target():
    """On the CUDA target torchao's compiled update is Inductor's CPU program (said so in the notes)."""
    factory = _factory("ao AdamW8bit")
    rep = estimator.report(Fallbacks(), torch.randn(2, 64), optimizer=factory, device="cuda")
    note = next(n for n in rep.notes if "passed to torch.compile" in n)
    assert "Triton" in note and "graph(s)" in note
    assert math.isfinite(rep.peak_bytes)


@pytest.mark.parametrize("name, mode", [("qlora llama", "train"), ("qlora llama", "generate"),
                                        ("bnb qlora llama", "train"), ("bnb qlora llama", "generate"),
                                        ("bnb int8 lora llama", "train"), ("bnb int8 lora llama", "generate")])
def test_qlora_llama(name, mode):
    """QLoRA on a tiny Llama, as torchtune builds it (torchao's NF4 weights, bf16 LoRA adapters)
    and as Hugging Face users do (``from_pretrained`` with bitsandbytes' NF4 config, PEFT LoRA),
    trained with AdamW and generating 8 tokens, and with 8-bit weights (``load_in_8bit``; generate()
    multiplies with LLM.int8(), its outlier columns read on the sample): one report against real CPU
    runs at b = 2 and 8.  bitsandbytes' generate repacks the 4-bit
    weights for the CPU at the first call (this host's branch, taken in the capture as in the run)."""
    from validators.low_bit import _QLORA_LIBRARY, compare_qlora

    pytest.importorskip(_QLORA_LIBRARY[name])
    for row in compare_qlora(mode, name):
        assert row.predicted == row.measured, row


def test_nf4_weights_to_the_byte():
    """An NF4 weight of n elements (torchao ``NF4Tensor.from_tensor``, block 64, scalers
    double-quantized in blocks of 256) holds n / 2 B of 4-bit codes, an int8 scaler per block of
    64, a bf16 factor per 256 scalers, a bf16 scaler mean and the 16-entry bf16 NF4 table."""
    pytest.importorskip("torchao")
    from validators.low_bit import QLoRALinear, qlora_llama, qlora_sample

    model = qlora_llama()
    nf4 = lambda n: n // 2 + n // 64 + 2 * (n // 64 // 256) + 2 + 16 * 2  # noqa: E731
    quantized = [m.weight.numel() for m in model.modules() if isinstance(m, QLoRALinear)]
    assert len(quantized) == 2 * 7 and sum(quantized) == 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
    plain = sum(2 * p.numel() for name, p in model.named_parameters() if not name.endswith(("proj.weight",)))
    rep = estimator.report(model, qlora_sample(2, "train"), device="cpu")
    assert rep.breakdown[Category.PARAMETER] == plain + sum(nf4(n) for n in quantized)


def test_paged_state_outside_the_allocator_on_cuda():
    """On the CUDA target a paged optimizer's state buffers of 100,000 elements or more live in CUDA
    managed memory (bitsandbytes ``get_state_buffer`` -> ``F.get_paged``): not in the allocator's
    figures, their own row in the device's; a 512 x 512 weight (262,144 elements) qualifies, the
    rest stays in the allocator."""
    _factory("bnb PagedAdamW")
    import bitsandbytes as bnb
    from torch import nn

    from estimator.devices.cuda import Overhead

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    x = torch.randn(4, 512)
    reports = {cls.__name__: estimator.report(model(), x, optimizer=lambda p, cls=cls: cls(p, lr=1e-3), device="cuda",
                                              gpu="A100 80GB")
               for cls in (bnb.optim.PagedAdamW, bnb.optim.PagedAdamW8bit, bnb.optim.AdamW8bit)}
    fp32, paged8, plain8 = reports["PagedAdamW"], reports["PagedAdamW8bit"], reports["AdamW8bit"]
    assert fp32.cuda.managed == 2 * 4 * 512 * 512 and paged8.cuda.managed == 2 * 512 * 512 and plain8.cuda.managed == 0
    # the 8-bit states of the big weight leave the allocator's optimizer state; their absmax stay
    state = plain8.breakdown[Category.OPTIMIZER_STATE]
    assert paged8.breakdown[Category.OPTIMIZER_STATE] == state - 2 * 512 * 512
    assert paged8.overheads[Overhead.MANAGED] == 2 * 512 * 512 and Overhead.MANAGED not in plain8.overheads
    assert paged8.device_bytes == paged8.reserved_bytes + paged8.cuda.context + 2 * 512 * 512
    assert any(n.startswith("CUDA managed memory: 524,288 B") for n in paged8.notes)
    assert "CUDA managed memory" in str(paged8)


def test_torchao_cpu_offload_optimizer_on_the_cuda_target():
    """torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py) keeps a pinned host copy and
    host gradient of each parameter of 4,096 elements or more, steps it with fused AdamW on the CPU
    and copies it back in place; smaller ones stay with a device AdamW.  Here the 256 x 256 weight
    (65,536 elements) is offloaded; the two biases and the 10 x 256 weight (2,826 elements) are
    not.  Its constructor asserts a CUDA device: the CPU target says so."""
    pytest.importorskip("torchao")
    from torch import nn
    from torchao.optim import CPUOffloadOptimizer

    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(4, 256)

    def report(**options):
        return estimator.report(model, x, device="cuda",
                                optimizer=lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, **options))

    params, small = (65_536 + 2_826) * 4, 2_826 * 4
    kept, dropped, plain = report(), report(offload_gradients=True), estimator.report(model, x, device="cuda")
    assert plain.breakdown[Category.OPTIMIZER_STATE] == 2 * params  # foreach AdamW: its step counts on the host
    for rep in kept, dropped:
        assert rep.breakdown[Category.PARAMETER] == params
        # the small parameters' two states and fused AdamW's step counts, on the device
        assert rep.breakdown[Category.OPTIMIZER_STATE] == 2 * small + 3 * 4
        # on the host: the big weight's copy, its gradient and its two states
        assert any(n.startswith(f"the optimizer keeps {4 * 65_536 * 4:,} B in host memory") for n in rep.notes)
    # gradients stay on the device until zero_grad, or leave it once copied (offload_gradients=True)
    assert kept.breakdown[Category.GRADIENT] == params and dropped.breakdown[Category.GRADIENT] == small
    assert kept.peak_bytes < plain.peak_bytes
    with pytest.raises(InputError, match="CPU Offload currently only supports CUDA"):
        estimator.report(model, x, device="cpu", optimizer=lambda ps: CPUOffloadOptimizer(ps))


def test_bitsandbytes_4bit_on_the_cuda_target():
    """On the CUDA target a 4-bit model is not repacked for the CPU (its quantized storage stays as
    loaded: the weights' 4-bit codes, int8 absmax and their fp32 second-level scales and codes), and
    ``gemm_4bit`` follows the CUDA backend's own dispatch for the GPU: the fused kernel for few
    rows, the dequantize + ``F.linear`` fallback past 1,536 rows (bitsandbytes/backends/cuda/ops.py)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from estimator.capture import steps
    from estimator.corrections.libraries.bitsandbytes import uses_fused_kernel
    from estimator.vocab.target import target_spec
    from validators.low_bit import bnb_qlora_llama, qlora_sample

    model = bnb_qlora_llama("generate")
    loaded = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in steps.state_tensors(model, None, ())[Category.PARAMETER].values()}
    rep = estimator.report(model, qlora_sample(2, "generate"), mode="generate", new_tokens=2, device="cuda",
                           gpu="A100 80GB")
    assert rep.breakdown[Category.PARAMETER] == sum(loaded.values())
    spec, _ = target_spec("cuda", "A100 80GB", None)
    assert spec.gpu.arch == "sm_80"
    assert uses_fused_kernel(spec, torch.bfloat16, 4, 512, 256, 64)  # at most 4 rows: always fused
    assert not uses_fused_kernel(spec, torch.bfloat16, 2048, 512, 256, 64)  # past 1,536 rows: never
    assert not uses_fused_kernel(spec, torch.bfloat16, 8, 512, 100, 64)  # K not a multiple of the block


def test_float8_matmul_on_the_cpu_kernel():
    """A CPU ``_scaled_mm`` without AMX (``_scaled_mm_out_cpu_emulated``, Blas.cpp): the buffers the
    correction gives are what the kernel allocates, run alone under the profiler: for a (M, K)
    fp8 ``a``, a column-major (K, N) fp8 ``b`` and a bf16 output, the copy of ``b`` (K N B), the
    fp32 copies of both and the fp32 product, and the product cast to bf16."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this host has AMX: oneDNN's fp8 matmul runs, measured instead")
    from torch.profiler import ProfilerActivity, profile

    from estimator.corrections.registry import lookup
    from validators.cpu import _allocation_deltas

    for M, K, N in ((16, 256, 512), (256, 16, 512)):
        a = torch.randn(M, K).to(torch.float8_e4m3fn)
        b = torch.randn(N, K).to(torch.float8_e4m3fn).t()
        for scale in ((torch.ones(M, 1), torch.ones(1, N)), (torch.tensor(1.0), torch.tensor(1.0))):  # row, tensor
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = torch._scaled_mm(a, b, *scale, out_dtype=torch.bfloat16)
            running = peak = 0
            for _, delta in _allocation_deltas(prof):
                running += delta
                peak = max(peak, running)
            fix = lookup(torch.ops.aten._scaled_mm.default, (a, b, *scale), {"out_dtype": torch.bfloat16}, out)
            assert peak - out.untyped_storage().nbytes() == max(int(x) for x in fix.scratch), (M, K, N, scale[0].shape)


@pytest.mark.parametrize("recipe", [None, "rowwise"])
def test_float8_training_matches_real_cpu_steps(recipe):
    """torchao's float8 training on the CPU target, tensorwise (the default) and rowwise recipes,
    against real CPU train steps at b = 16 (fp8 matmuls need multiples of 16): exact.  The rowwise
    backward's ``grad.mul_(scale)`` (bf16 by fp32, in place) holds an fp32 copy and an fp32 result
    (``registry._promoted_input_bytes``)."""
    pytest.importorskip("torchao")
    from torch import nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(torch.bfloat16)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe) if recipe else None)
        return model

    x = torch.randn(16, 256, dtype=torch.bfloat16)
    with threads(2):
        assert estimator.report(build(), x, device="cpu").peak_bytes == measure_cpu(build(), x).peak_bytes


def test_float8_training_is_captured():
    """torchao's float8 training (``convert_to_float8_training``): its ``Float8TrainingTensor``
    operands are fake where their inner tensors are (``capture/fake.py``), and the ops its own
    dispatch runs (the ``_scaled_mm`` of each matmul) are recorded (``Tracker._subclass_dispatch``);
    on the CPU target the report says how far whole steps are validated."""
    pytest.importorskip("torchao")
    from torch import nn
    from torchao.float8 import convert_to_float8_training

    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(torch.bfloat16)
    convert_to_float8_training(model)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    rep = estimator.report(model, x, device="cpu")
    assert sum(op.op == "aten._scaled_mm.default" for op in rep.timeline.ops) == 6  # 3 matmuls x 2 layers
    assert any(n.startswith("float8 matmuls") for n in rep.notes)
    cuda = estimator.report(model, x, device="cuda", gpu="H100")
    assert not any(n.startswith("float8 matmuls") for n in cuda.notes) and cuda.peak_bytes > 0
