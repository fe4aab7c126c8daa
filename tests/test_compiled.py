"""``report(..., compile=...)``: a ``torch.compile``d step (Inductor on CPU), run on fake tensors.

One case is measured end to end (a real compiled step with a graph break, the CPU allocator's
events: exact, as every case of docs/validation.md "Compiled steps", ``python -m
validators.compiled``); the others check how the compiled model is found, the CLI, and bad
input.  The first compile in the
process imports Inductor (a few seconds); each later one of these tiny models takes about one.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import estimator
from estimator import InputError, Strategy
from estimator.capture import compiled
from validators.compiled import NormMLP, _class_loss, _features
from validators.cpu import measure_cpu


def test_compiled_step_matches_the_measured_compiled_step():
    """A graph break (two compiled regions, eager code between them), train: the compiled step is
    measured (torch.compile, one warm-up step, then the measured one) and predicted to the byte.
    The numbers at the report's b come from the program compiled for that b alone; the formula
    from the program for every b, raised where the static one holds more, so ``at(b)`` is the
    report's peak."""
    def build():
        torch.manual_seed(0)
        return NormMLP(16, 32, 4, graph_break=True)

    sample = _features(16, 4, 8)
    rep = estimator.report(build(), sample, loss_fn=_class_loss, device="cpu", compile=True)
    torch._dynamo.reset()
    measured = measure_cpu(torch.compile(build()), sample, loss_fn=_class_loss).peak_bytes
    assert rep.peak_bytes == measured  # tolerance: none (0 B) on this case
    assert rep.at(8) == rep.peak_bytes
    assert any("estimated as compiled" in n for n in rep.notes)
    assert any("each batch size compiles its own program" in n for n in rep.notes)
    assert any(n.startswith("Dynamo compiled 2 graph(s), with graph breaks (Call to `torch._dynamo.graph_break()`)")
               for n in rep.notes)


def test_the_compiled_model_is_found_on_the_model():
    """``torch.compile(model)`` and ``model.compile()`` are estimated as compiled (same bytes as
    ``compile=True``); ``compile=False`` estimates the same object eager."""
    sample = _features(16, 4, 8)
    plain = estimator.report(NormMLP(16, 32, 4), sample, loss_fn=_class_loss, device="cpu", mode="inference",
                             compile=True).peak_bytes
    wrapped = torch.compile(NormMLP(16, 32, 4))
    assert estimator.report(wrapped, sample, loss_fn=_class_loss, device="cpu", mode="inference").peak_bytes == plain
    in_place = NormMLP(16, 32, 4)
    in_place.compile()
    rep = estimator.report(in_place, sample, loss_fn=_class_loss, device="cpu", mode="inference")
    assert rep.peak_bytes == plain
    eager = estimator.report(NormMLP(16, 32, 4), sample, loss_fn=_class_loss, device="cpu", mode="inference")
    assert estimator.report(wrapped, sample, loss_fn=_class_loss, device="cpu", mode="inference",
                            compile=False).peak_bytes == eager.peak_bytes
    module, how = compiled.of(torch.compile(nn.Linear(2, 2), mode="max-autotune-no-cudagraphs", dynamic=False))
    assert isinstance(module, nn.Linear) and how.autotuned and how.dynamic is False


def test_compile_as_a_strategy():
    assert Strategy(compile=True).describe() == "compiled"
    assert Strategy(compile="max-autotune").describe() == "compiled (max-autotune)"


def test_compile_bad_input():
    model, sample = NormMLP(16, 32, 4), _features(16, 4, 8)
    with pytest.raises(InputError, match="not a torch.compile mode"):
        estimator.report(model, sample, device="cpu", compile="fastest")
    with pytest.raises(InputError, match="'bogus' is not a torch.compile mode"):  # in a dict too
        estimator.report(model, sample, device="cpu", compile={"mode": "bogus"})
    with pytest.raises(InputError, match="mode or options, not both"):
        estimator.report(model, sample, device="cpu", compile={"mode": "max-autotune", "options": {"trace.enabled": 1}})
    with pytest.raises(InputError, match="compile= names fullgraf"):
        estimator.report(model, sample, device="cpu", compile={"fullgraf": True})
    with pytest.raises(InputError, match="compile must be True"):
        estimator.report(model, sample, device="cpu", compile=3)
    with pytest.raises(InputError, match="both say how the model is compiled"):
        estimator.report(model, sample, device="cpu", compile=True, strategy=Strategy(compile=True))
    with pytest.raises(InputError, match="Strategy\\(compile=\\) must be"):
        Strategy(compile="fast")


def test_cli_compile():
    from click.testing import CliRunner

    from estimator.cli import cli

    result = CliRunner().invoke(cli, ["report", "mlp", "--batch", "8", "--device", "cpu", "--compile", "--json", "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["strategy"] == "compiled" and any("estimated as compiled" in n for n in data["notes"])
    refused = CliRunner().invoke(cli, ["report", "transformers:gpt2", "--generate", "4", "--compile", "-q"])
    assert refused.exit_code != 0 and "drop --compile" in refused.output


def _sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 8))


def _mean_square(out, sample):
    return out.square().mean()


def test_a_compiled_torch_nn_stack_is_estimated_as_the_user_compiled_it():
    """``torch.compile(nn.Sequential(...))`` compiles the stack (OptimizedModule wraps a torch.nn
    module in a frame Dynamo captures); ``seq.compile()`` compiles ``_call_impl``, a frame Dynamo
    skips: it runs eager.  Each against the measured step (tolerance: 0 B)."""
    x = torch.randn(256, 64)
    torch._dynamo.reset()
    rep = estimator.report(torch.compile(_sequential()), x, loss_fn=_mean_square, device="cpu")
    torch._dynamo.reset()
    assert rep.peak_bytes == measure_cpu(torch.compile(_sequential()), x, loss_fn=_mean_square).peak_bytes
    assert not any(n.startswith("torch.compile compiled no graph") for n in rep.notes)
    in_place = _sequential()
    in_place.compile()
    rep = estimator.report(in_place, x, loss_fn=_mean_square, device="cpu")
    assert rep.peak_bytes == measure_cpu(_sequential(), x, loss_fn=_mean_square).peak_bytes  # eager
    assert compiled.NO_GRAPH in rep.notes and not any("estimated as compiled" in n for n in rep.notes)


def test_the_eager_backend_is_described_as_it_runs():
    rep = estimator.report(NormMLP(16, 32, 4), _features(16, 4, 8), loss_fn=_class_loss, device="cpu",
                           compile={"backend": "eager"})
    torch._dynamo.reset()
    real = torch.compile(NormMLP(16, 32, 4), backend="eager")
    assert rep.peak_bytes == measure_cpu(real, _features(16, 4, 8), loss_fn=_class_loss).peak_bytes
    assert any("Dynamo's graphs run eagerly" in n for n in rep.notes)


def test_a_users_autocast_step_with_a_compiled_model_on_the_cuda_target():
    """A user's step with ``torch.autocast("cuda", dtype=torch.bfloat16)`` around a compiled model
    (torchao's optimizer benchmark): the compiler traces the autocast region itself, with the
    CPU's op lists (said in the notes); CUDA's emulated lists stay off there, whose fallthrough
    kernels the compiler's tracing re-entered without end (a segmentation fault)."""
    import torch.nn.functional as F

    def step(model, batch, optimizer):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model = NormMLP(16, 32, 4)
    model.compile(fullgraph=True)
    batch = {"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))}
    rep = estimator.report(model, batch, step=step, optimizer=lambda m: torch.optim.AdamW(m.parameters()),
                           device="cuda", gpu="A100 80GB")
    assert rep.peak_bytes > 0 and any("estimated as compiled" in n for n in rep.notes)
    assert any("autocast inside the compiled region follows the CPU's autocast op lists" in n for n in rep.notes)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = NormMLP(64, 256, 4, graph_break=True)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_submodule_torch_compile_wrapped_is_a_compiled_region():
    """``model.inner = torch.compile(model.inner)``: the submodule runs compiled (a region of the
    eager step: Dynamo's 2 graphs around its break), as measured on the real step, to the byte."""
    def build():
        model = _Outer()
        model.inner = torch.compile(model.inner)
        return model

    sample = _features(64, 4, 32)
    rep = estimator.report(build(), sample, loss_fn=_class_loss, device="cpu")
    torch._dynamo.reset()
    assert rep.peak_bytes == measure_cpu(build(), sample, loss_fn=_class_loss).peak_bytes  # tolerance: none (0 B)
    assert any("passed to torch.compile" in n and "Dynamo compiled 2 graph(s)" in n for n in rep.notes)
    assert not any("estimated as eager" in n for n in rep.notes)


def test_blocks_compiled_by_a_parallelize_function():
    """torchtitan's ``--training.compile``: each block ``torch.compile(block, fullgraph=True)`` in
    the parallelize function, after op-level SAC, before FSDP2 wraps it (which changes its class):
    each call is a compiled region, fxmem's module hooks kept out of Dynamo's trace (inside the
    checkpoint's higher-order op they are side effects it refuses), Inductor's
    ``run_and_save_rng_state`` passed through the capture's modes.  (Before: "torch.compile with
    fullgraph=True found no compiled frames".)"""
    from validators import torchtitan

    def parallelize(model, mesh):
        torchtitan.apply_ac(model)
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
        torchtitan.apply_fsdp(model, mesh)

    def report(device, fn):
        model, sample_fn, _ = torchtitan.tiny()
        return estimator.report(model, sample_fn(2), batch=2, device=device, optimizer=torchtitan.optimizer,
                                step=torchtitan.train_step, strategy=Strategy(mesh={"dp_shard": 2}, parallelize=fn))

    for device in ("cpu", "cuda"):
        rep = report(device, parallelize)
        assert any("passed to torch.compile" in n and "Dynamo compiled 1 graph(s)" in n for n in rep.notes)
        assert rep.peak_bytes != report(device, torchtitan.parallelize).peak_bytes  # not the eager blocks'


def test_blocks_compiled_with_op_level_sac_match_the_real_step():
    """torchtitan's blocks, op-level SAC then ``torch.compile(block)`` each, one process: the
    compiled regions take the batch symbol, so the numbers at b come from the programs compiled
    for b alone (as the real loop compiles them), and Inductor's ``run_and_save_rng_state`` (SDPA
    replayed under SAC) keeps the CPU generator's state, 5,056 B per block, to the backward.
    Exact to the byte against the real compiled step (SGD: the peak is in the backward; before
    both fixes the prediction was 46,208 B low)."""
    from validators import torchtitan
    from validators.cpu import measure_user_step, threads

    def build():
        torch.manual_seed(0)
        model = torchtitan.build(torchtitan.TINY, device="cpu").to(torch.bfloat16)
        torchtitan.apply_ac(model, torchtitan.SAVE_2025)
        torchtitan.apply_compile(model)
        return model

    sample = torchtitan.sample(2, torchtitan.TINY.max_seq_len, torchtitan.TINY.vocab_size)
    with threads(1):
        rep = estimator.report(build(), sample, batch=2, device="cpu", step=torchtitan.train_step, optimizer="sgd")
        torch._dynamo.reset()
        measured = measure_user_step(build(), sample, torchtitan.train_step, optimizer="sgd").peak_bytes
    assert rep.peak_bytes == measured  # tolerance: none (0 B)
    assert any("compile a program of their own for each batch size" in n for n in rep.notes)


def test_float8_all_gather_in_compiled_blocks():
    """torchtitan#808's tensorwise float8 row: FSDP2's float8 all-gather with precomputed scales
    into compiled blocks.  Before: "PendingUnbackedSymbolNotFound" (AOTAutograd's structured log
    formats the float8 weights' scales, and fxmem's ``Tensor.__format__`` read a compiler's fake
    0-dim tensor as ``.item()``), then a data-dependent read (torchao's ``__tensor_flatten__``
    asks ``if self._precomputed_scale``, which fxmem called to find a subclass's tensors)."""
    import functools

    from validators import torchtitan

    model, sample_fn, _ = torchtitan.tiny()
    parallelize = functools.partial(torchtitan.parallelize_compiled, float8="tensorwise-fsdp")
    rep = estimator.report(model, sample_fn(2), batch=2, device="cuda", optimizer=torchtitan.optimizer,
                           step=torchtitan.train_step_precomputing,
                           strategy=Strategy(mesh={"dp_shard": 2}, parallelize=parallelize))
    assert any("passed to torch.compile" in n and "Dynamo compiled 1 graph(s)" in n for n in rep.notes)
    assert not any("were taken as 0.0" in n for n in rep.notes)  # no scale's value was asked

