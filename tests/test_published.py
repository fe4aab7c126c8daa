"""The published-measurements table (``validators/published_data.py``) and its page.

No real-size capture runs here (``python -m validators.published`` does those, minutes on 2
cores): the table's integrity, one row computed with a stubbed prediction, the committed page
against the data file, and the gradient-accumulation shortcut the BERT rows use, on a small BERT.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import estimator
from estimator import InputError
from estimator.integrations import _common
from estimator.vocab.gpus import resolve_gpu
from validators import published
from validators.published_data import GB, ROWS, GiB, MiB, Quantity

UNITS = {"MB": MiB, "GB": GB, "GiB": GiB}  # "MB" is MiB in the HF pages: `info.used // 1024**2`


def _needs_transformers() -> None:
    try:
        _common.import_optional("transformers", "transformers")
    except InputError as exc:
        pytest.skip(f"transformers is not usable here: {exc}")


def test_rows_are_complete_and_cite_their_values():
    keys = [r.key for r in ROWS]
    assert len(keys) == len(set(keys)), "row keys must be unique"
    for row in ROWS:
        src = row.source
        assert src.url.startswith("https://") and src.title and src.date and src.location, row.key
        assert (row.published is None) != (row.missing is None), f"{row.key}: a value or the reason it is missing"
        if row.published is None:
            continue
        # the value as printed is in the source's own words, and its bytes follow the source's unit
        number, unit = re.fullmatch(r"~?([0-9.]+) ?(MB|GB|GiB)", row.published.text).groups()
        assert number in src.quote.replace(",", ""), f"{row.key}: {number} is not in the quote"
        assert row.published.bytes == round(float(number) * UNITS[unit]), row.key
        assert row.published.approximate == row.published.text.startswith("~"), row.key
        assert (row.predict is None) != (row.not_estimable is None), f"{row.key}: a prediction or why there is none"
        if row.predict is not None:
            resolve_gpu(row.setup.fxmem_gpu)  # a GPU fxmem knows
            assert row.differences, f"{row.key}: say what differs from the source's stack"
        if row.quantity is Quantity.NVIDIA_SMI:
            assert row.startup is not None and row.startup.text in src.quote + row.startup.note, row.key


def test_hf_startup_is_the_pages_context():
    """1343 MiB measured after ``torch.ones((1, 1)).to("cuda")``, less that tensor's 2 MiB
    small-pool segment (counted in the prediction's reserved memory)."""
    smi = [r for r in ROWS if r.quantity is Quantity.NVIDIA_SMI]
    assert smi and all(r.startup.bytes == (1343 - 2) * MiB for r in smi)


def test_row_with_a_stubbed_prediction():
    row = next(r for r in ROWS if r.key == "hf-bert-large-b4")
    cuda = SimpleNamespace(allocated=11_000 * MiB, reserved=13_000 * MiB, context=512 * MiB,
                           step_allocated=10_900 * MiB, step_reserved=12_500 * MiB, steps=3)
    res = published.compute(row, report=lambda r: SimpleNamespace(cuda=cuda))
    assert res.status == published.Status.COMPARED
    # nvidia-smi = reserved + the page's start-up (1341 MiB), not fxmem's 512 MiB estimate
    assert res.predicted == (13_000 + 1341) * MiB and res.predicted_step == (12_500 + 1341) * MiB
    assert res.published == 14_949 * MiB
    assert res.difference == pytest.approx(100 * (14_341 - 14_949) / 14_949)
    assert res.step_difference == pytest.approx(100 * (13_841 - 14_949) / 14_949)
    assert (res.allocated, res.step_reserved, res.steps) == (cuda.allocated, cuda.step_reserved, 3)

    # a report without the run model's fields: no single-step column
    old = SimpleNamespace(allocated=1, reserved=13_000 * MiB, context=512 * MiB)
    res = published.compute(row, report=lambda r: SimpleNamespace(cuda=old))
    assert res.predicted == (13_000 + 1341) * MiB and res.predicted_step is None and res.step_difference is None

    # allocated rows compare allocated; a failing prediction is reported, not raised
    lit = next(r for r in ROWS if r.quantity is Quantity.ALLOCATED and r.predict is not None)
    assert published.compute(lit, report=lambda r: SimpleNamespace(cuda=cuda)).predicted == cuda.allocated
    failed = published.compute(lit, report=lambda r: 1 / 0)
    assert failed.status == published.Status.FAILED and "ZeroDivisionError" in failed.detail


def test_rows_without_a_prediction():
    for row in ROWS:
        if row.not_estimable is not None:
            res = published.compute(row, report=None)
            assert res.status == published.Status.NOT_ESTIMABLE and res.detail == row.not_estimable
            assert res.predicted is None
        elif row.published is None:
            assert published.compute(row, report=None).status == published.Status.NO_VALUE


def test_committed_page_matches_the_data_file():
    """The committed JSON has every row of the data file with its published value, and the page is
    that JSON rendered (``python -m validators.published --render`` rewrites it)."""
    results, meta = published.load(published.JSON)
    assert list(results) == [r.key for r in ROWS], "regenerate: python -m validators.published"
    for row in ROWS:
        res = results[row.key]
        assert res.published == (row.published.bytes if row.published else None), row.key
        expected = (published.Status.NOT_ESTIMABLE if row.not_estimable else
                    published.Status.NO_VALUE if row.published is None else None)
        if expected:
            assert res.status == expected, row.key
        else:
            assert res.status in (published.Status.COMPARED, published.Status.FAILED), row.key
    assert published.MARKDOWN.read_text() == published.to_markdown(results, meta)


@pytest.mark.parametrize("name, trainable", [("phi-1_5", 1_572_864), ("stablelm-base-alpha-3b", 2_097_152),
                                             ("Llama-2-7b-hf", 4_194_304), ("Llama-2-13b-hf", 6_553_600)])
def test_litgpt_stand_in_trains_the_published_parameter_count(name, trainable):
    """lit-gpt's LoRA GPT (validators/litgpt.py) trains exactly the parameters the resource table
    lists (q and v, r = 8: 2·8·C + 2·C·8 per layer), bf16 but for the fp32 rope cache."""
    from validators import litgpt

    model = litgpt.build(name, 16)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.cos.dtype == torch.float32


def test_litgpt_qlora_stand_in():
    """``--quantize bnb.nf4`` (validators/litgpt.py): every linear a 4-bit layer quantized as Lightning
    2.1's plugin does (from fp16, NF4 in blocks of 64, no double quantization, bf16 compute), the
    LoRA matrices the only trainable parameters; and bitsandbytes 0.41.1's ``MatMul4Bit`` keeps each
    4-bit layer's input for backward, which the installed one does not: on a one-layer GPT the step
    with 0.41.1's forward holds more at its peak, by no more than those inputs."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from estimator import Category
    from validators import litgpt

    config = litgpt.Config(n_embd=256, n_head=4, n_layer=1, padded_vocab_size=512, intermediate_size=512,
                           rotary_percentage=1.0, parallel_residual=False, bias=False, norm="RMSNorm", mlp="LLaMAMLP")
    model = litgpt.build(config, 64, quantize="nf4")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 6 and all(type(m).__name__ == "Linear4bit041" for m in layers)  # qkv, proj, 3 MLP, head
    states = {(m.weight.quant_state.dtype, m.weight.quant_state.blocksize, m.weight.quant_state.nested,
               m.weight.quant_type, m.compute_dtype) for m in layers}
    assert states == {(torch.float16, 64, False, "nf4", torch.bfloat16)}
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    batch = {"input_ids": torch.zeros(1, 64, dtype=torch.long), "labels": torch.zeros(1, 64, dtype=torch.long)}
    kwargs = {"step": litgpt.lora_step(1), "optimizer": litgpt.paged_optimizer, "device": "cuda", "gpu": "A100 40GB"}
    old = estimator.report(model, batch, **kwargs)
    for m in model.modules():  # the installed bitsandbytes' forward
        if isinstance(m, bnb.nn.Linear4bit):
            m.__class__ = bnb.nn.Linear4bit
    new = estimator.report(model, batch, **kwargs)
    inputs = 2 * 64 * (256 + 256 + 256 + 512 + 256)  # bf16 inputs of qkv, proj, fc_1/fc_2 (one), proj, head
    assert 0 < old.peak_bytes - new.peak_bytes <= inputs
    assert old.breakdown[Category.PARAMETER] == new.breakdown[Category.PARAMETER]


def test_litgpt_v_is_a_view_of_the_fused_qkv():
    """model.py 196-215: ``v`` keeps the fused projection's storage (what attention saves), ``q``
    and ``k`` are new tensors (rope, cat)."""
    from validators import litgpt

    torch.manual_seed(0)
    config = litgpt.Config(n_embd=64, n_head=4, n_layer=1, padded_vocab_size=128, intermediate_size=256,
                           rotary_percentage=0.5)
    attn = litgpt.CausalSelfAttention(config, r=8, alpha=16, dropout=0.0)
    seen = {}
    attn.attn.register_forward_hook(lambda m, args, out: seen.setdefault("qkv", out))
    original = torch.nn.functional.scaled_dot_product_attention
    try:
        torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, **kw: seen.update(q=q, v=v) or original(
            q, k, v, **kw)
        attn(torch.randn(2, 8, 64), torch.ones(8, 8), torch.zeros(8, 8))
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    qkv = seen["qkv"].untyped_storage().data_ptr()
    assert seen["v"].untyped_storage().data_ptr() == qkv != seen["q"].untyped_storage().data_ptr()


def test_one_micro_step_has_the_peak_of_the_accumulation_loop():
    """With ``zero_grad(set_to_none=False)`` every micro-step repeats the same allocations, so the
    BERT rows predict one micro-step (+ the optimizer step) for 4 accumulation steps: the same
    figures, here for 2 accumulation steps of a 2-layer BERT with fp16 autocast and reentrant
    checkpointing (the validator's rows were also checked with 4 steps, fp32/fp16, AdamW/Adafactor,
    with and without checkpointing: equal to the byte)."""
    _needs_transformers()
    from validators import published_data

    transformers = _common.import_optional("transformers", "transformers")

    def tiny():
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, vocab_size=512, max_position_embeddings=64,
                                         attn_implementation="eager")
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        return model

    figures = []
    for micro_steps in (2, 1):
        batch = {"input_ids": torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0)),
                 "labels": torch.zeros(1, dtype=torch.long)}
        rep = estimator.report(tiny(), batch, device="cuda", gpu="V100 16GB",
                               step=published_data.trainer_2022_step(2, fp16=True, micro_steps=micro_steps),
                               optimizer=published_data.trainer_2022_state("adamw", fp16=True))
        c = rep.cuda
        figures.append((c.allocated, c.reserved, getattr(c, "step_allocated", None), getattr(c, "step_reserved", None)))
    assert figures[0] == figures[1]


def test_torchtitan_rows_run_torchtitans_own_job():
    """The torchtitan rows are predicted from torchtitan's own job (``validators.torchtitan``: its
    Llama, ``parallelize_llama``'s op-level SAC and FSDP2 with bf16 parameters and fp32 reduction,
    its step and AdamW) on a fake process group of 8 and 128 ranks.  At a tiny size: every rank
    holds 1/ranks of the fp32 parameters and of AdamW's two states, the activations do not depend
    on the number of ranks."""
    from estimator import Category, Strategy
    from validators import torchtitan

    titan = {r.key: r for r in ROWS if r.key.startswith("torchtitan-")}
    assert set(titan) == {"torchtitan-llama3.1-8b-fsdp8", "torchtitan-llama3.1-8b-fsdp128",
                          "torchtitan-llama3-8b-compile-bf16", "torchtitan-llama3-8b-compile-float8-rowwise",
                          "torchtitan-llama3-8b-compile-float8-tensorwise"}
    assert all(r.predict is not None and r.not_estimable is None for r in titan.values())
    params = 2 * 256 * 64 + 64 + 3 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 224 + 2 * 64)  # = 199,104
    reps = {}
    for ranks in (8, 16):  # every dim divides: no padded shard
        reps[ranks] = estimator.report(
            torchtitan.build(torchtitan.TINY), torchtitan.sample(2, 32, 256), batch=2, device="cuda",
            strategy=Strategy(mesh={"dp_shard": ranks}, parallelize=torchtitan.parallelize),
            step=torchtitan.train_step, optimizer=torchtitan.optimizer)
        assert [r.role for r in reps[ranks].ranks] == ["every rank"]
        assert reps[ranks].breakdown[Category.PARAMETER] == params * 4 // ranks  # 99,552 / 49,776 B
        assert reps[ranks].breakdown[Category.OPTIMIZER_STATE] == 2 * params * 4 // ranks
    assert reps[8].breakdown[Category.ACTIVATION] == reps[16].breakdown[Category.ACTIVATION]
    # #808's job compiles each block (a compiled region each call): the same state per rank
    compiled = estimator.report(
        torchtitan.build(torchtitan.TINY), torchtitan.sample(1, 32, 256), batch=1, device="cuda",
        strategy=Strategy(mesh={"dp_shard": 8}, parallelize=torchtitan.parallelize_compiled),
        step=torchtitan.train_step, optimizer=torchtitan.optimizer)
    assert compiled.breakdown[Category.OPTIMIZER_STATE] == 2 * params * 4 // 8
    assert any("Dynamo compiled 1 graph(s)" in n for n in compiled.notes)


@pytest.mark.parametrize("norm, mlp, rotary, parallel", [("RMSNorm", "LLaMAMLP", 1.0, False),
                                                        ("LayerNorm", "GptNeoxMLP", 0.5, True)])
def test_litgpt_stand_in_is_captured_exactly(norm, mlp, rotary, parallel):
    """The stand-in's iteration (fused LoRA QKV, bf16 with an fp32 rope cache, Fabric's fp32
    outputs, three 128-token LM-head chunks) against the CPU allocator: exact (0 B)."""
    from validators import litgpt
    from validators.cpu import measure_user_step

    config = litgpt.Config(n_embd=64, n_head=4, n_layer=2, padded_vocab_size=128, intermediate_size=128,
                           rotary_percentage=rotary, parallel_residual=parallel, norm=norm, mlp=mlp)

    def make():
        torch.manual_seed(0)
        return litgpt.build(config, 260, device="cpu")

    ids = torch.randint(0, 128, (2, 260), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids.clone()}
    rep = estimator.report(make(), sample, step=litgpt.lora_step(4), optimizer=litgpt.optimizer, device="cpu")
    assert rep.peak_bytes == measure_user_step(make(), sample, litgpt.lora_step(4), litgpt.optimizer).peak_bytes
