"""Published GPU peak-memory measurements, for ``python -m validators.published``.

Each ``Row`` is one figure a third party measured and published: where (``Source``: address,
title, date, the place in the page and the page's own words for the value), under which
configuration (``Setup``: model, GPU, batch, sequence length, precision, optimizer, software
stack), what was measured (``Quantity``), the value (``Published``), and how fxmem is asked to
predict the same run (``predict``: a function returning the model, the sample and the
``estimator.report`` keywords, the CUDA target and GPU being added by the validator) -- or why
it cannot (``not_estimable``), or why the published value is absent (``missing``).

The setups follow the sources' own code, not the numbers: a step is written as the source's
training loop ran it (the 2022 ``Trainer``'s in-place ``zero_grad``, LitGPT's chunked LM head),
and what still differs from the source's stack is listed in ``differences``.  Nothing here is
adjusted to bring a prediction closer to a published value.

Every model is built from a config object with the published sizes, on the meta device (no
weights are downloaded or allocated).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from estimator.integrations._common import import_optional

MiB = 2**20
GiB = 2**30
GB = 10**9


class Quantity(str, enum.Enum):
    """What a source measured."""

    ALLOCATED = "max_memory_allocated"  # torch.cuda.max_memory_allocated()
    RESERVED = "max_memory_reserved"  # torch.cuda.max_memory_reserved() / memory_stats reserved_bytes.all.peak
    NVIDIA_SMI = "nvidia-smi used"  # NVML memory used: the process's reserved memory + CUDA context
    SNAPSHOT_PEAK = "memory snapshot peak"  # the highest point of torch.cuda.memory._snapshot()'s timeline (allocated)


@dataclass(frozen=True)
class Difference:
    """One way the source's software stack differs from what fxmem predicts: a short ``label``
    for the table, the ``detail`` once below it."""

    label: str
    detail: str


@dataclass(frozen=True)
class Source:
    url: str
    title: str
    date: str
    location: str  # where in the source the value is (section, table, line)
    quote: str  # the source's own words for the value (and its unit)


@dataclass(frozen=True)
class Published:
    """A published value: ``text`` as printed, ``bytes`` its reading in bytes (the unit as the
    source defines it: ``info.used // 1024**2`` is MiB, ``/ 1e9`` is GB), ``approximate`` when
    the source gives it as "~"."""

    text: str
    bytes: int
    approximate: bool = False


@dataclass(frozen=True)
class Setup:
    model: str
    gpu: str  # as the source names it
    batch: str
    seq_len: str
    precision: str
    optimizer: str
    stack: str  # torch / transformers versions, attention implementation, other libraries
    fxmem_gpu: str | None = None  # estimator's GPU name for the prediction (None: not predicted)


@dataclass(frozen=True)
class Startup:
    """The source's own measurement of the process before training (nvidia-smi rows)."""

    text: str
    bytes: int  # the CUDA context part of it (see ``note``)
    note: str


@dataclass(frozen=True)
class Prediction:
    """What ``estimator.report`` is called with: ``report(model, sample, device="cuda",
    gpu=Setup.fxmem_gpu, **kwargs)``."""

    model: nn.Module
    sample: Any
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Row:
    key: str
    source: Source
    setup: Setup
    quantity: Quantity
    published: Published | None
    differences: tuple[Difference, ...]  # what differs between the source's stack and fxmem's prediction
    predict: Callable[[], Prediction] | None = None
    startup: Startup | None = None
    not_estimable: str | None = None  # what fxmem cannot express
    missing: str | None = None  # why there is no published value
    stand_in: str | None = None  # the model fxmem is given when it is not the source's own code
    notes: tuple[str, ...] = field(default=())

    @property
    def older_stack(self) -> bool:
        """Measured on a PyTorch older than 2.0 (``OLDER_STACKS``), whose kernels, autograd and
        allocator fxmem does not model: compared apart, each gap set against its cited stack
        difference."""
        return any(d in OLDER_STACKS for d in self.differences)


def _transformers():
    return import_optional("transformers", "transformers")


# -- Hugging Face: "Efficient Training on a Single GPU" / "Model training anatomy" (2022) -------------
# BERT-large (bert-large-uncased: 24 layers, width 1024, 16 heads, FFN 4096, vocabulary 30,522),
# sequence classification, 512 tokens, the Trainer of early 2022 on a 16 GB V100.


def bert_large() -> nn.Module:
    """``AutoModelForSequenceClassification.from_pretrained("bert-large-uncased")`` built from
    its config (2 labels, dropout 0.1); eager attention, the only BERT attention of 2022."""
    transformers = _transformers()
    config = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096, vocab_size=30522, attn_implementation="eager")
    with torch.device("meta"):
        return transformers.BertForSequenceClassification(config)


def bert_batch(b: int) -> dict[str, torch.Tensor]:
    """The pages' dummy data: token ids in [100, 30000), 512 per row, and class labels (the
    collated batch holds ``input_ids`` and ``labels`` only: no attention mask)."""
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(100, 30000, (b, 512), generator=g), "labels": torch.zeros(b, dtype=torch.long)}


def _decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Trainer.create_optimizer's two groups (``get_parameter_names(model, [nn.LayerNorm])``
    without biases decay; ``weight_decay`` 0.0, its default)."""
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "LayerNorm" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    return [{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0}]


@dataclass
class Trainer2022:
    """What the early-2022 ``Trainer`` keeps between steps: the optimizer and, with
    ``fp16=True``, the native-AMP ``GradScaler``."""

    optimizer: torch.optim.Optimizer
    scaler: Any = None


def trainer_2022_state(optim: str = "adamw", fp16: bool = False) -> Callable[[nn.Module], Trainer2022]:
    """``Trainer.create_optimizer`` of transformers 4.16: ``optim="adamw"`` is transformers'
    own ``AdamW`` (a per-parameter loop; the stand-in is ``torch.optim.AdamW(foreach=False)``,
    the same loop), ``"adafactor"`` transformers' ``Adafactor(scale_parameter=False,
    relative_step=False, lr=5e-5)``, ``"adam8bit"`` the page's ``bnb.optim.Adam8bit`` over the same
    two groups with the arguments' betas, eps and learning rate, handed to ``Trainer(optimizers=)``."""

    def build(model: nn.Module) -> Trainer2022:
        groups = _decay_groups(model)
        if optim == "adamw":
            opt = torch.optim.AdamW(groups, lr=5e-5, betas=(0.9, 0.999), eps=1e-8, foreach=False)
        elif optim == "adafactor":
            from transformers.optimization import Adafactor

            opt = Adafactor(groups, lr=5e-5, scale_parameter=False, relative_step=False)
        elif optim == "adam8bit":
            import bitsandbytes as bnb

            opt = bnb.optim.Adam8bit(groups, lr=5e-5, betas=(0.9, 0.999), eps=1e-8)
        else:
            raise ValueError(optim)
        device = next(model.parameters()).device.type
        return Trainer2022(opt, torch.amp.GradScaler(device) if fp16 else None)

    return build


def trainer_2022_step(accumulate: int = 1, fp16: bool = False, max_grad_norm: float = 1.0,
                      micro_steps: int | None = None):
    """One optimizer step of transformers 4.16's ``Trainer.train`` (``training_step`` per
    micro-batch, then clipping, the optimizer and ``model.zero_grad()``: the ``use_amp`` branch of
    the 4.1x trainer loop, ``scaler.unscale_`` before ``clip_grad_norm_``, ``scaler.step`` /
    ``update``, then ``model.zero_grad()``), as it ran then:

    - ``compute_loss`` returns the loss only: the outputs die before backward;
    - with ``fp16``: the forward under ``torch.cuda.amp.autocast()``, ``scaler.scale(loss)
      .backward()``, ``scaler.unscale_``, ``scaler.step``, ``scaler.update``;
    - ``gradient_accumulation_steps`` (``accumulate``): each micro-batch's loss divided by it,
      gradients summed in place; ``micro_steps`` of them run (default ``accumulate``; the same
      sample stands for each micro-batch: the dataloader gives one of the same shape each time).
      Since ``zero_grad`` keeps the gradients allocated, every micro-step allocates and frees the
      same tensors in the same order, so one micro-step and the optimizer step have the peak of
      ``accumulate`` of them (``tests/test_published.py`` checks it on a small BERT); the rows use
      ``micro_steps=1`` to keep a BERT-large capture under a minute;
    - ``nn.utils.clip_grad_norm_(model.parameters(), 1.0)``: torch 1.10's per-parameter norms
      and in-place scaling (``foreach=False``);
    - ``model.zero_grad()``: torch 1.10's default ``set_to_none=False``: the gradients are
      zeroed in place and stay allocated through the next step's forward.
    """

    def step(model: nn.Module, batch: dict[str, torch.Tensor], state: Trainer2022) -> None:
        for _ in range(accumulate if micro_steps is None else micro_steps):
            with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
                loss = model(**batch).loss
            if accumulate > 1:
                loss = loss / accumulate
            (state.scaler.scale(loss) if fp16 else loss).backward()
            del loss
        if fp16:
            state.scaler.unscale_(state.optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=False)
        if fp16:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        model.zero_grad(set_to_none=False)

    return step


def bert_trainer(b: int, accumulate: int = 1, checkpointing: bool = False, fp16: bool = False,
                 optim: str = "adamw") -> Callable[[], Prediction]:
    def predict() -> Prediction:
        model = bert_large()
        if checkpointing:  # TrainingArguments(gradient_checkpointing=True) in 4.16: reentrant checkpoint per layer
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        return Prediction(model, bert_batch(b), {"step": trainer_2022_step(accumulate, fp16, micro_steps=1),
                                                 "optimizer": trainer_2022_state(optim, fp16)})

    return predict


_HF_URL = ("https://github.com/huggingface/transformers/blob/0016acf7ef421c7fe8eff7945de52c71896c3b01/docs/source/en/"
           "perf_train_gpu_one.mdx")
_HF_TITLE = ("Efficient Training on a Single GPU (transformers docs, "
             "huggingface.co/docs/transformers/perf_train_gpu_one)")
_HF_FILE = ("github.com/huggingface/transformers docs/source/en/perf_train_gpu_one.mdx at commit "
            "0016acf7ef421c7fe8eff7945de52c71896c3b01")
_HF_DATE = ("early 2022 (the page's nvidia-smi log is dated Tue Jan 11 2022; the batch-4 figure and the start-up "
            "measurement are also in today's 'Model training anatomy')")
_HF_SETUP = dict(model="bert-large-uncased, sequence classification (335 M parameters)", gpu="Tesla V100-SXM2 16 GB",
                 seq_len="512", fxmem_gpu="V100 16GB",
                 stack="HF Trainer of early 2022 (transformers ~4.16, torch ~1.10, CUDA 11.2, driver 460.91.03: "
                       "versions not stated, inferred from the date and the nvidia-smi header); eager attention")
_HF_STARTUP = Startup(
    "1343 MB", 1341 * MiB,
    "the page's `torch.ones((1, 1)).to(\"cuda\")` then 'GPU memory occupied: 1343 MB.' (`info.used // 1024**2`: MiB); "
    "it holds the CUDA context and kernels plus the 2 MiB small-pool segment of that tensor, which the "
    "training's own small allocations reuse and fxmem's reserved figure already counts: context = 1341 MiB")
TORCH_110 = Difference(
    "torch 1.10",
    "torch ~1.10 kernels, autograd and caching allocator; fxmem models torch 2.13. One known difference explains "
    "the fp32 rows' per-sample gap: in 2021 releases the backward formula of softmax referenced its input "
    "(derivatives.yaml: `_softmax_backward_data(grad, result, dim, self)`), so autograd kept the input alive "
    "for backward (pytorch/pytorch#64000, Aug 2021; today `self.scalar_type()` only, PR #65242): in BERT's "
    "attention one more fp32 "
    "(b, 16, 512, 512) matrix per layer, 16 MiB per sample x 24 layers = 384 MiB per sample, against the "
    "per-sample gap below of 2,089 - 1,719 = 370 MiB. fxmem models today's autograd and does not add it")
BERT_416 = Difference("transformers 4.16 BERT", "transformers ~4.16 BertSelfAttention (eager, with an all-ones "
                      "attention mask the model builds) vs transformers 5.24 BERT with attn_implementation='eager' "
                      "and no mask")
CUBLAS_INIT = Difference("cuBLAS outside the allocator", "nvidia-smi also counts memory outside the caching "
                         "allocator that neither the page's 1343 MiB start-up figure (taken before the first matmul) "
                         "nor fxmem holds: cuBLAS's handles and the kernels it loads at the first GEMM; in torch 1.10 "
                         "the cuBLAS workspace was cuBLAS's own, not the allocator's 2 x 8.1 MiB")
EPOCH = Difference("whole epoch", "nvidia-smi after a whole epoch (128 optimizer steps at batch 4) vs fxmem's run "
                   "model: fragmentation that builds up over many steps")
OLDER_STACKS = (TORCH_110,)
_HF_COMMON_DIFFERENCES = (TORCH_110, BERT_416, CUBLAS_INIT, EPOCH)


def _hf_row(key: str, location: str, quote: str, mib: int, batch: str, optimizer: str, precision: str,
            predict: Callable[[], Prediction] | None, extra: tuple[Difference, ...] = (), *,
            not_estimable: str | None = None,
            url: str = _HF_URL, title: str = _HF_TITLE) -> Row:
    return Row(
        key=key,
        source=Source(url, title, _HF_DATE, f"{location}; {_HF_FILE}", quote),
        setup=Setup(batch=batch, precision=precision, optimizer=optimizer, **_HF_SETUP),
        quantity=Quantity.NVIDIA_SMI,
        published=Published(f"{mib} MB", mib * MiB),
        startup=_HF_STARTUP,
        predict=predict,
        not_estimable=not_estimable,
        differences=extra + _HF_COMMON_DIFFERENCES,
    )


_ADAMW_HF = Difference("adamw_hf", "transformers' own AdamW (the 2022 Trainer default, one param-sized `denom` "
                       "temporary per parameter) vs its stand-in torch.optim.AdamW(foreach=False) (two at once: "
                       "`exp_avg_sq.sqrt() / c`)")
_ADAFACTOR = Difference("Adafactor 5.24", "transformers 5.24's Adafactor vs 4.16's (same algorithm; temporaries may "
                        "differ)")
_BNB_2022 = Difference("bitsandbytes 2022", "bitsandbytes of early 2022 (~0.26, version not stated) vs 0.50: the same "
                       "states (two uint8 per element, fp32 under 4,096 elements, in place on CUDA), but its "
                       "block-wise update may have used the paper's blocks of 2,048 elements (fxmem: 0.50's 256): "
                       "then 335 M x 8 B x (1/256 - 1/2048) = 9 MiB fewer absmax bytes than fxmem counts")
_AMP = Difference("torch 1.10 autocast", "fp16: torch 1.10's autocast op lists and GradScaler vs torch 2.13's")
_GC = Difference("reentrant checkpoint", "gradient checkpointing as 4.16 did it (reentrant torch.utils.checkpoint per "
                 "layer, reproduced with use_reentrant=True) but through transformers 5.24's checkpointing code")

HF_ROWS = (
    _hf_row("hf-bert-large-b4", "section 'Memory utilization at vanilla training' of docs/source/en/"
            "model_memory_anatomy.md at commit 249ef8164cfbd8e288c2f6d8395539b9e90e8300; section 'Vanilla Training'",
            "TrainingArguments(per_device_train_batch_size=4, **default_args) ... GPU memory occupied: 14949 MB.",
            14949, "4", "AdamW (Trainer default)", "fp32", bert_trainer(4), (_ADAMW_HF,),
            url="https://huggingface.co/docs/transformers/model_memory_anatomy",
            title="Model training anatomy (transformers docs; the same run in 'Efficient Training on a Single GPU')"),
    _hf_row("hf-bert-large-b1-ga4", "section 'Gradient Accumulation'",
            "per_device_train_batch_size=1, gradient_accumulation_steps=4 ... GPU memory occupied: 8681 MB.",
            8681, "1 x 4 accumulation steps", "AdamW (Trainer default)", "fp32", bert_trainer(1, 4), (_ADAMW_HF,)),
    _hf_row("hf-bert-large-b1-ga4-gc", "section 'Gradient Checkpointing'",
            "per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True ... "
            "GPU memory occupied: 6775 MB.",
            6775, "1 x 4 accumulation steps", "AdamW (Trainer default)", "fp32",
            bert_trainer(1, 4, checkpointing=True), (_ADAMW_HF, _GC)),
    _hf_row("hf-bert-large-b4-fp16", "section 'FP16 Training'",
            "per_device_train_batch_size=4, fp16=True ... GPU memory occupied: 13939 MB.",
            13939, "4", "AdamW (Trainer default)", "fp16 AMP (autocast + GradScaler)", bert_trainer(4, fp16=True),
            (_ADAMW_HF, _AMP)),
    _hf_row("hf-bert-large-b1-ga4-gc-fp16", "section 'FP16 Training' (second run)",
            "per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True, fp16=True "
            "... GPU memory occupied: 7275 MB.",
            7275, "1 x 4 accumulation steps", "AdamW (Trainer default)", "fp16 AMP (autocast + GradScaler)",
            bert_trainer(1, 4, checkpointing=True, fp16=True), (_ADAMW_HF, _GC, _AMP)),
    _hf_row("hf-bert-large-b4-adafactor", "section 'Adafactor'",
            "per_device_train_batch_size=4, optim=\"adafactor\" ... GPU memory occupied: 12295 MB.",
            12295, "4", "Adafactor (scale_parameter=False, relative_step=False)", "fp32",
            bert_trainer(4, optim="adafactor"), (_ADAFACTOR,)),
    _hf_row("hf-bert-large-b1-ga4-gc-fp16-adafactor", "section 'Adafactor' (second run)",
            "per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True, fp16=True, "
            "optim=\"adafactor\" ... GPU memory occupied: 4847 MB.",
            4847, "1 x 4 accumulation steps", "Adafactor (scale_parameter=False, relative_step=False)",
            "fp16 AMP (autocast + GradScaler)", bert_trainer(1, 4, checkpointing=True, fp16=True, optim="adafactor"),
            (_ADAFACTOR, _GC, _AMP)),
    _hf_row("hf-bert-large-b4-adam8bit", "section '8-bit Adam'",
            "bnb.optim.Adam8bit(...) ... per_device_train_batch_size=4 ... GPU memory occupied: 13085 MB.",
            13085, "4", "bitsandbytes Adam8bit", "fp32", bert_trainer(4, optim="adam8bit"), (_BNB_2022,)),
)


# -- PyTorch tutorial: "How to save memory by fusing the optimizer step into the backward pass" -------


def vit_l16() -> nn.Module:
    """torchvision's ``vit_l_16()`` (the tutorial's model: 24 layers, width 1024, 16 heads, MLP
    4096, patch 16, 224x224, 1000 classes), random weights, on the meta device."""
    tv = import_optional("torchvision", "torchvision")
    with torch.device("meta"):
        return tv.models.vit_l_16()


def tutorial_image(b: int = 1) -> torch.Tensor:
    return torch.rand(b, 3, 224, 224, generator=torch.Generator().manual_seed(0))


def tutorial_step(model: nn.Module, image: torch.Tensor, optimizer) -> None:
    """The tutorial's ``train(model, optimizer)``: ``loss = model.forward(fake_image);
    loss.sum().backward(); optimizer.step(); optimizer.zero_grad()``."""
    loss = model.forward(image)
    loss.sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def tutorial_fused_state(model: nn.Module) -> dict:
    """The tutorial's ``optimizer_dict = {p: torch.optim.Adam([p], foreach=False) ...}`` and the
    ``register_post_accumulate_grad_hook`` that steps and zeroes each parameter's optimizer."""
    optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def hook(parameter) -> None:
        optimizers[parameter].step()
        optimizers[parameter].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return optimizers


def tutorial_fused_step(model: nn.Module, image: torch.Tensor, state) -> None:
    """The tutorial's second ``train(model)``: forward and backward only."""
    loss = model.forward(image)
    loss.sum().backward()


def _vit_adam() -> Prediction:
    return Prediction(vit_l16(), tutorial_image(), {"step": tutorial_step,
                                                    "optimizer": lambda m: torch.optim.Adam(m.parameters())})


def _vit_fused() -> Prediction:
    return Prediction(vit_l16(), tutorial_image(), {"step": tutorial_fused_step, "optimizer": tutorial_fused_state})


_TUTORIAL = Source(
    "https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html",
    "How to save memory by fusing the optimizer step into the backward pass (PyTorch tutorials)",
    "2023 (written for PyTorch 2.1: 'In our 2.1 release, we've added a new API')",
    "",
    "",
)
_TUTORIAL_FILE = "github.com/pytorch/tutorials intermediate_source/optimizer_step_in_backward_tutorial.py"
_TUTORIAL_SETUP = dict(model="torchvision vit_l_16 (304 M parameters)", gpu="1 CUDA GPU (not named)", batch="1",
                       seq_len="224x224 image (197 tokens)", precision="fp32",
                       stack="PyTorch >= 2.1 with torchvision (exact versions not stated); nn.MultiheadAttention "
                             "(need_weights=False: SDPA)",
                       fxmem_gpu="A100 40GB")
TORCH_21 = Difference("torch 2.1", "torch 2.1-era kernels, autograd and caching allocator; fxmem models torch 2.13")
_TUTORIAL_DIFFERENCES = (
    Difference("GPU unknown", "the tutorial does not name its GPU: predicted for an A100 40GB (the GPU decides the "
               "cuBLAS workspace and the SDPA backend, both small next to 1.2 GB of parameters)"),
    Difference("read off a plot", "the value is read off a memory-snapshot plot and given to one significant "
               "figure ('~')"),
    TORCH_21,
)

TUTORIAL_ROWS = (
    Row(
        key="pt-tutorial-vit-l16-adam",
        source=Source(_TUTORIAL.url, _TUTORIAL.title, _TUTORIAL.date,
                      f"first memory snapshot, paragraph 'Where is the memory bottleneck'; {_TUTORIAL_FILE}",
                      "The peak memory usage is during the optimizer step! ... ~1.2GB of parameters, ~1.2GB of "
                      "gradients, and ~2.4GB=2*1.2GB of the optimizer state ... The last ~1.2GB comes from Adam "
                      "optimizer requiring memory for intermediates, totaling to ~6GB of peak memory."),
        setup=Setup(optimizer="torch.optim.Adam(model.parameters()) (foreach: CUDA's default)", **_TUTORIAL_SETUP),
        quantity=Quantity.SNAPSHOT_PEAK,
        published=Published("~6 GB", 6 * GB, approximate=True),
        predict=_vit_adam,
        differences=_TUTORIAL_DIFFERENCES,
        notes=("3 steps from a model already on the GPU: step 1 creates Adam's state inside optimizer.step()",),
    ),
    Row(
        key="pt-tutorial-vit-l16-fused",
        source=Source(_TUTORIAL.url, _TUTORIAL.title, _TUTORIAL.date,
                      f"second memory snapshot, observation 3; {_TUTORIAL_FILE}",
                      "Most importantly! The peak memory is lower! It is now ~4GB"),
        setup=Setup(optimizer="one torch.optim.Adam([p], foreach=False) per parameter, stepped in "
                              "register_post_accumulate_grad_hook", **_TUTORIAL_SETUP),
        quantity=Quantity.SNAPSHOT_PEAK,
        published=Published("~4 GB", 4 * GB, approximate=True),
        predict=_vit_fused,
        differences=_TUTORIAL_DIFFERENCES,
        notes=("the first optimizer was deleted before this run (`del optimizer`); its state is gone",),
    ),
)


# -- torchao: low-bit optimizers on ViT-H (torchao/optim/README.md, "Benchmarks") -------------------------


def vit_h() -> nn.Module:
    """timm's ``vit_huge_patch14_224`` (the benchmark's ``timm/vit_huge_patch14_224.orig_in21k``,
    630 M parameters) with a 45-class head (resisc45), random weights, on the meta device, then
    ``model.compile(fullgraph=True)`` as the benchmark's ``--compile`` does."""
    timm = import_optional("timm", "timm")
    with torch.device("meta"):
        model = timm.create_model("vit_huge_patch14_224", pretrained=False, num_classes=45)
    model.compile(fullgraph=True)
    return model


def ao_benchmark_batch(b: int = 8) -> dict[str, torch.Tensor]:
    """One batch of the benchmark's loader: ``b`` 224x224 fp32 images and their labels."""
    generator = torch.Generator().manual_seed(0)
    return {"image": torch.rand(b, 3, 224, 224, generator=generator),
            "label": torch.randint(0, 45, (b,), generator=generator)}


def ao_benchmark_step(model: nn.Module, batch: dict[str, torch.Tensor], optimizer) -> None:
    """benchmarks/benchmark_low_bit_adam.py's loop with ``--amp bf16``: the forward and the loss
    under ``torch.autocast("cuda", dtype=torch.bfloat16)``, ``grad_scaler.scale(loss).backward()``
    with a disabled scaler (bf16: identity), ``grad_scaler.step(optim)`` (``optim.step()``),
    ``optim.zero_grad()`` (``set_to_none=True``)."""
    import torch.nn.functional as F

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(batch["image"]), batch["label"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# the benchmark's OPTIM_MAP, by the README table's row name: (module, class, extra keywords)
_AO_OPTIMIZERS = {
    "PyTorch (fused)": ("torch.optim", "AdamW", {"fused": True}),
    "bnb 8-bit": ("bitsandbytes.optim", "AdamW8bit", {}),
    "ao 8-bit": ("torchao.optim", "AdamW8bit", {}),
    "ao FP8 E4M3": ("torchao.optim", "AdamWFp8", {}),
    "ao 4-bit": ("torchao.optim", "AdamW4bit", {}),
}


def _ao_vit(name: str) -> Callable[[], Prediction]:
    def predict() -> Prediction:
        import importlib

        module, cls, extra = _AO_OPTIMIZERS[name]
        optimizer = getattr(importlib.import_module(module), cls)
        return Prediction(vit_h(), ao_benchmark_batch(), {
            "step": ao_benchmark_step,
            "optimizer": lambda m: optimizer(m.parameters(), lr=1e-4, weight_decay=0, **extra)})

    return predict


_AO_README = ("https://github.com/pytorch/ao/blob/072500abcfbdec15a429eb53160c63fb92534b85/torchao/optim/README.md")
_AO_STACK = ("PyTorch 2.4, timm, bitsandbytes and torchao's prototype low_bit_optim of mid-2024 (versions not stated "
             "beyond PyTorch); benchmarks/benchmark_low_bit_adam.py --amp bf16 --compile --batch_size 8")
_AO_DIFFERENCES = (
    Difference("torch 2.4", "torch 2.4's kernels, Inductor and caching allocator; fxmem models torch 2.13"),
    Difference("Inductor on CPU", "the compiled model (and torchao's compiled update) is estimated as Inductor's "
               "CPU program, sized by the CUDA allocator: on the GPU Inductor writes Triton kernels, whose fusion "
               "can keep other intermediates"),
    Difference("whole epoch + eval", "the maximum over a whole epoch and the validation pass that follows it "
               "(batch 8, no_grad: below a training step's peak) vs fxmem's run model of the training step"),
)
AO_ROWS = tuple(
    Row(
        key=f"ao-vit-h-{key}",
        source=Source(_AO_README, "Low-bit and specialized optimizers (torchao README)", "2024 (PyTorch 2.4)",
                      "section 'Benchmarks', first table (ViT-H on resisc45, 4070Ti SUPER)",
                      f"AdamW impl | Peak memory allocated (GB) ... {name} | {gb}"),
        setup=Setup(model="timm vit_huge_patch14_224 (630 M parameters), 45 classes", gpu="RTX 4070 Ti SUPER 16 GB",
                    batch="8", seq_len="224x224 image (257 tokens)", precision="bf16 AMP (autocast), compiled model",
                    optimizer=f"{name}: {module}.{cls}(lr=1e-4, weight_decay=0{', fused=True' if extra else ''})",
                    stack=_AO_STACK, fxmem_gpu="RTX 4070 Ti SUPER"),
        quantity=Quantity.ALLOCATED,
        published=Published(f"{gb} GB", round(float(gb) * GB)),
        predict=_ao_vit(name),
        differences=_AO_DIFFERENCES,
    )
    for key, name, gb in (("fused-adamw", "PyTorch (fused)", "12.23"), ("bnb-8bit", "bnb 8-bit", "8.32"),
                          ("ao-8bit", "ao 8-bit", "8.33"), ("ao-fp8", "ao FP8 E4M3", "8.33"),
                          ("ao-4bit", "ao 4-bit", "7.72"))
    for module, cls, extra in (_AO_OPTIMIZERS[name],)
)


# -- torchtitan: Llama 3.1 8B with FSDP2 (benchmarks/llama3_h100_202412_torchtitan.md) ---------------

_TITAN = Source(
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    "torchtitan performance benchmarks, Llama 3.1 (H100, end of 2024)",
    "2024-12 (torch 1963fc8 2024/12/23, torchtitan 9dec370 2024/12/26)",
    "",
    "",
)
TORCH_NIGHTLY = Difference("torch 2024-12 nightly", "torch nightly 1963fc8 (2024-12-23); fxmem models torch 2.13")


def titan_fsdp(ranks: int) -> Callable[[], Prediction]:
    """torchtitan's own job at 9dec370 (``validators.torchtitan``): its Llama 3.1 8B, its
    ``parallelize_llama`` (op-level SAC, FSDP2 with bf16 parameters and fp32 reduction) run on a
    fake process group of ``ranks`` ranks, its train step and AdamW, 2 sequences of 8,192 tokens
    per rank; the allocator as torchtitan's launcher at that commit sets it (``run_llama_train.sh``:
    ``PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"``)."""
    from estimator import Strategy
    from validators import torchtitan

    def predict() -> Prediction:
        return Prediction(torchtitan.build(), torchtitan.sample(2), {
            "batch": 2, "strategy": Strategy(mesh={"dp_shard": ranks}, parallelize=torchtitan.parallelize),
            "step": torchtitan.train_step, "optimizer": torchtitan.optimizer,
            "alloc_conf": "expandable_segments:True"})

    return predict


_TITAN_SETUP = dict(model="Llama 3.1 8B", batch="2 per GPU", seq_len="8192", precision="bf16 parameters, fp32 "
                    "reduce (FSDP2 mixed precision)", optimizer="torch.optim.AdamW (foreach)",
                    stack="torch nightly 1963fc8 (2024-12-23), torchtitan 9dec370; FSDP2, selective AC (op), "
                          "SDPA (flash); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by the launcher, "
                          "run_llama_train.sh)", fxmem_gpu="H100")
_TITAN_DIFFERENCES = (
    Difference("logging window", "the memory is the largest max_reserved over a 10-step logging window, read at "
               "the 90th step; fxmem's headline is the first steps from a cold start, its single-step figure one "
               "steady step"),
    Difference("stream timing", "FSDP2's side streams are replayed (each stream's freed blocks serve that stream "
               "only), but not when the GPU is done with a block: a block a collective still uses on NCCL's stream "
               "(recordStream's events) is not reused until then, and fxmem's replay, which has no timing, reuses it "
               "at once: reserved memory can be higher than predicted"),
    Difference("launcher", "the benchmark page does not name its launcher; fxmem assumes torchtitan's own "
               "(run_llama_train.sh, which sets expandable_segments:True); with the native allocator's segments "
               "the prediction moves by a few GiB (lower on 8 GPUs, higher on 128)"),
    Difference("NCCL", "the ranks run NCCL (fxmem's capture runs the same FSDP2 code on a fake process group); "
               "NCCL's own buffers are outside the caching allocator and not in max_reserved"),
    Difference("H100 96 GB", "Grand Teton's H100 has 96 GB of HBM2e; fxmem's H100 is the 80 GB HBM3 card (the "
               "capacity bounds max_batch, not this step's memory)"),
)
_TITAN_QUOTE = ("memory readings are stable across the whole training process ... | Techniques | TPS/GPU | "
                "Memory(GiB) | ... | FSDP | {tps} | {gib} |")
_TITAN_MEMORY = ("'Memory(GiB)' is torchtitan's logged max_reserved_gib: memory_stats()['reserved_bytes.all.peak'] "
                 "/ 2**30 since the previous log step (torchtitan/metrics.py and train.py at 9dec370)")

TITAN_ROWS = (
    Row(
        key="torchtitan-llama3.1-8b-fsdp8",
        source=Source(_TITAN.url, _TITAN.title, _TITAN.date,
                      "Table 1: 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch "
                      "size 16. Selective activation checkpointing. (seq_len 8192: train_configs/llama3_8b.toml at "
                      f"9dec370); {_TITAN_MEMORY}",
                      _TITAN_QUOTE.format(tps="5,762", gib="82.4")),
        setup=Setup(gpu="8 x H100 96 GB HBM2e (Grand Teton)", **_TITAN_SETUP),
        quantity=Quantity.RESERVED,
        published=Published("82.4 GiB", round(82.4 * GiB)),
        predict=titan_fsdp(8),
        differences=_TITAN_DIFFERENCES + (TORCH_NIGHTLY,),
    ),
    Row(
        key="torchtitan-llama3.1-8b-fsdp128",
        source=Source(_TITAN.url, _TITAN.title, _TITAN.date,
                      "Table 3: 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global "
                      f"batch size 256. Selective activation checkpointing; {_TITAN_MEMORY}",
                      _TITAN_QUOTE.format(tps="5,605", gib="67.0")),
        setup=Setup(gpu="128 x H100 96 GB HBM2e (Grand Teton)", **_TITAN_SETUP),
        quantity=Quantity.RESERVED,
        published=Published("67.0 GiB", round(67.0 * GiB)),
        predict=titan_fsdp(128),
        differences=_TITAN_DIFFERENCES + (TORCH_NIGHTLY,),
    ),
)


# -- torchtitan: Llama 3 8B, compiled, bf16 and float8 (pytorch/torchtitan#808, February 2025) -------

_TITAN_F8 = Source(
    "https://github.com/pytorch/torchtitan/pull/808",
    "torchtitan #808: add configuration for float8 with rowwise scaling, via recipe lookup",
    "2025-02-27 (merged as 069bae286)",
    "",
    "",
)


def titan_compiled(float8: str | None) -> Callable[[], Prediction]:
    """torchtitan's 8B job as #808 ran it (``validators.torchtitan.parallelize_compiled``):
    train_configs/llama3_8b.toml at 069bae286 (batch 1, 8,192 tokens, op-level SAC, FSDP over the
    8 GPUs, AdamW, clipping at 1.0) with ``--training.compile``, and with ``float8`` the float8
    converter's recipe; the allocator as run_train.sh sets it (``expandable_segments:True``)."""
    import functools

    from estimator import Strategy
    from validators import torchtitan

    def predict() -> Prediction:
        parallelize = functools.partial(torchtitan.parallelize_compiled, float8=float8)
        step = torchtitan.train_step_precomputing if float8 == "tensorwise-fsdp" else torchtitan.train_step
        return Prediction(torchtitan.build(), torchtitan.sample(1), {
            "batch": 1, "strategy": Strategy(mesh={"dp_shard": 8}, parallelize=parallelize),
            "step": step, "optimizer": torchtitan.optimizer, "alloc_conf": "expandable_segments:True"})

    return predict


_TITAN_F8_SETUP = dict(model="Llama 3 8B", gpu="8 x H100", batch="1 per GPU", seq_len="8192",
                       optimizer="torch.optim.AdamW (foreach)", fxmem_gpu="H100")
_TITAN_F8_STACK = ("torch and torchao nightlies of February 2025, torchtitan 069bae286; FSDP2 over 8 GPUs, selective "
                   "AC (op), each block torch.compile'd; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run_train.sh)")
_TITAN_F8_DIFFERENCES = (
    Difference("compiled blocks", "fxmem compiles each block with Inductor on the capture's CPU tensors: the program "
               "is Inductor's C++ one for the CPU (its fusions decide which intermediates exist), where the GPU runs "
               "Triton kernels; float8 matmuls are _scaled_mm as on the GPU"),
    Difference("torch and torchao", "the PR ran nightlies of February 2025 (torchao's float8 training as it was then); "
               "fxmem runs torch 2.13 and the torchao installed here, whose float8 code has changed since"),
    Difference("logging step", "the value is max_reserved at the logged step (20 or 30) since the previous log; "
               "fxmem's headline is the first steps from a cold start"),
) + _TITAN_DIFFERENCES[1:2] + _TITAN_DIFFERENCES[3:4]
_TITAN_F8_MEMORY = ("'memory' is torchtitan's logged max_reserved_gib: memory_stats()['reserved_bytes.all.peak'] / "
                    "2**30 (torchtitan/components/metrics.py at 069bae286)")


def _titan_f8_row(key: str, label: str, command: str, step: str, gib: str, float8: str | None,
                  precision: str, not_estimable: str | None = None) -> Row:
    return Row(
        key=key,
        source=Source(_TITAN_F8.url, _TITAN_F8.title, _TITAN_F8.date,
                      f"the PR's description, 'pretraining LLaMa 3 8B on 8 H100s', {label}: `{command}` "
                      f"(train_configs/llama3_8b.toml at 069bae286: batch_size 1, seq_len 8192); {_TITAN_F8_MEMORY}",
                      f"step: {step}  ...  memory: {gib}GiB"),
        setup=Setup(precision=precision, stack=_TITAN_F8_STACK, **_TITAN_F8_SETUP),
        quantity=Quantity.RESERVED,
        published=Published(f"{gib} GiB", round(float(gib) * GiB)),
        predict=None if not_estimable else titan_compiled(float8),
        not_estimable=not_estimable,
        differences=_TITAN_F8_DIFFERENCES,
    )


_TOML = "CONFIG_FILE=./torchtitan/models/llama/train_configs/llama3_8b.toml ./run_train.sh"
TITAN_F8_ROWS = (
    _titan_f8_row("torchtitan-llama3-8b-compile-bf16", "baseline (bf16 + compile)", f"{_TOML} --training.compile",
                  "20", "47.65", None, "bf16 parameters, fp32 reduce (FSDP2 mixed precision)"),
    _titan_f8_row("torchtitan-llama3-8b-compile-float8-rowwise", "experiment (rowwise float8 + compile)",
                  f"{_TOML} --model.converters float8 --training.compile --float8.recipe_name rowwise", "30", "47.77",
                  "rowwise", "float8 linears, rowwise scales (torchao), bf16 FSDP2 mixed precision"),
    _titan_f8_row("torchtitan-llama3-8b-compile-float8-tensorwise", "tensorwise float8 with float8 all-gather",
                  f"{_TOML} --model.converters float8 --training.compile --float8.enable_fsdp_float8_all_gather "
                  "--float8.precompute_float8_dynamic_scale_for_fsdp", "20", "47.32", "tensorwise-fsdp",
                  "float8 linears, tensorwise scales, float8 all-gather with precomputed scales (torchao)"),
)


# -- LitGPT resource tables (lit-gpt commit 8641822, October 2023): LoRA fine-tuning on 1 A100 ------


def lit_batch(b: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """The first iteration's batch: lit-gpt's ``get_batch`` forces the longest training sample
    first ("so potential OOMs happen right away"), the others padded to its length."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def litgpt_lora(name: str, b: int, seq: int, quantize: str | None = None) -> Callable[[], Prediction]:
    """lit-gpt's own LoRA GPT (``validators.litgpt``, written to follow 8641822) and one iteration
    of its ``finetune/lora.py`` through Fabric's ``bf16-true`` (mini-batch 128); with ``quantize``
    (``--quantize bnb.nf4``) the base linears in 4-bit and bitsandbytes' ``PagedAdamW``."""
    from validators import litgpt

    def predict() -> Prediction:
        model = litgpt.build(name, seq, quantize=quantize)
        return Prediction(model, lit_batch(b, seq, litgpt.CONFIGS[name].padded_vocab_size),
                          {"step": litgpt.lora_step(128 // b),
                           "optimizer": litgpt.paged_optimizer if quantize else litgpt.optimizer})

    return predict


_LIT_URL = "https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md"
_LIT_TITLE = "LitGPT Resource Tables ('Finetuning with LoRA on 1 GPU')"
_LIT_DATE = "2023-10-20 ('Last updated: 10/20/2023', LitGPT commit 8641822; added by PR #663, 0cc02afa)"
_LIT_STACK = ("lit-gpt at the table's PR #663 (0cc02afa: its own GPT, fused QKV LoRAQKVLinear, fp32 RMSNorm of PR "
              "#606), PyTorch 2.1.0+cu121, Lightning Fabric precision bf16-true, torch SDPA; driver 525.125.06")
_LIT_MEASURE = ("'Max GPU RAM' is finetune/lora.py's `Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} "
                "GB` at the end of the run")
_LIT_CODE = Difference(
    "lit-gpt 0cc02afa", "the table names 'Lit-GPT commit 8641822' (2023-10-16) and was merged by its PR #663 "
    "(0cc02afa, 2023-10-27); in between, PR #606 (2023-10-24) made RMSNorm compute in fp32. The stand-in follows "
    "0cc02afa: with 8641822's bf16 RMSNorm the Llama 2 rows (the only RMSNorm models here) come out -3.1 / -4.7 / "
    "-2.7 % (20.65, 27.69, 37.10 GB), with #606's within 0.2 %, so the runs had it (validators/litgpt.py; "
    "`RMSNorm.upcast = False` gives 8641822's)")
_LIT_DIFFERENCES = (
    _LIT_CODE,
    Difference("whole run", "max_memory_allocated over a whole run (the sanity-check validation with a KV cache "
               "for generation, 1k iterations) vs the first iteration's step; the LoRA gradients (a few MB) stay "
               "between the 128 / micro-batch accumulation iterations"),
    TORCH_21,
)


def _lit_row(key: str, model: str, line: str, gb: str, batch: int, seq: int, name: str, trainable: int) -> Row:
    return Row(
        key=key,
        source=Source(_LIT_URL, _LIT_TITLE, _LIT_DATE,
                      f"table 'Finetuning with LoRA on 1 GPU'; {_LIT_MEASURE}; longest Alpaca sample from the page's "
                      f"token counts; file tutorials/resource-tables.md",
                      line),
        setup=Setup(model=f"{model}, LoRA r=8 alpha=16 dropout 0.05 on query and value ({trainable:,} trainable)",
                    gpu="1 x A100-SXM4-40GB", batch=f"micro-batch {batch} (mini-batch 128)",
                    seq_len=f"{seq} (the longest Alpaca sample, forced into the first batch)",
                    precision="bf16-true (bf16 weights, no autocast; outputs cast to fp32)",
                    optimizer="torch.optim.AdamW on the LoRA parameters", stack=_LIT_STACK, fxmem_gpu="A100 40GB"),
        quantity=Quantity.ALLOCATED,
        published=Published(gb, round(float(gb.split()[0]) * GB)),
        predict=litgpt_lora(name, batch, seq),
        stand_in=f"validators/litgpt.py: lit-gpt's GPT and LoRAQKVLinear ({name}), Fabric bf16-true",
        differences=_LIT_DIFFERENCES,
        notes=(f"trainable parameters: {trainable:,} as the table says",),
    )


_PHI, _STABLELM, _LLAMA = "1.3 B | phi-1.5", "3 B   | StabeLM Alpha", "Llama 2"
LIT_ROWS = (
    _lit_row("litgpt-phi-1.5-lora-mb1", "phi-1.5", f"| {_PHI} | None | 1 | 1,572,864 | 4.82 GB | 1.62 min |",
             "4.82 GB", 1, 1044, "phi-1_5", 1_572_864),
    _lit_row("litgpt-phi-1.5-lora-mb2", "phi-1.5", f"| {_PHI} | None | 2 | 1,572,864 | 6.76 GB | 1.65 min |",
             "6.76 GB", 2, 1044, "phi-1_5", 1_572_864),
    _lit_row("litgpt-phi-1.5-lora-mb4", "phi-1.5", f"| {_PHI} | None | 4 | 1,572,864 | 10.68 GB | 1.70 min |",
             "10.68 GB", 4, 1044, "phi-1_5", 1_572_864),
    _lit_row("litgpt-stablelm-3b-lora-mb1", "StableLM Alpha 3B",
             f"| {_STABLELM} | None | 1 | 2,097,152 | 9.69 GB | 1.24 min |",
             "9.69 GB", 1, 1034, "stablelm-base-alpha-3b", 2_097_152),
    _lit_row("litgpt-stablelm-3b-lora-mb2", "StableLM Alpha 3B",
             f"| {_STABLELM} | None | 2 | 2,097,152 | 12.10 GB | 1.33 min |",
             "12.10 GB", 2, 1034, "stablelm-base-alpha-3b", 2_097_152),
    _lit_row("litgpt-stablelm-3b-lora-mb4", "StableLM Alpha 3B",
             f"| {_STABLELM} | None | 4 | 2,097,152 | 16.92 GB | 1.50 min |",
             "16.92 GB", 4, 1034, "stablelm-base-alpha-3b", 2_097_152),
    _lit_row("litgpt-llama-2-7b-lora-mb1", "Llama 2 7B",
             f"| 7 B | {_LLAMA} | None | 1 | 4,194,304 | 21.30 GB | 2.36 min |",
             "21.30 GB", 1, 1304, "Llama-2-7b-hf", 4_194_304),
    _lit_row("litgpt-llama-2-7b-lora-mb2", "Llama 2 7B",
             f"| 7 B | {_LLAMA} | None | 2 | 4,194,304 | 29.07 GB | 2.52 min |",
             "29.07 GB", 2, 1304, "Llama-2-7b-hf", 4_194_304),
    _lit_row("litgpt-llama-2-13b-lora-mb1", "Llama 2 13B",
             f"| 13 B | {_LLAMA} | None | 1 | 6,553,600 | 38.12 GB | 3.19 min |",
             "38.12 GB", 1, 1304, "Llama-2-13b-hf", 6_553_600),
    Row(
        key="litgpt-llama-2-7b-qlora-nf4-mb1",
        source=Source(_LIT_URL, _LIT_TITLE, _LIT_DATE,
                      f"table 'Finetuning with LoRA on 1 GPU'; {_LIT_MEASURE}; longest Alpaca sample from the page's "
                      "token counts; file tutorials/resource-tables.md",
                      "| 7 B | Llama 2 | bnb.nf4 | 1 | 4,194,304 | 14.14 GB | 3.68 min |"),
        setup=Setup(model="Llama 2 7B, LoRA r=8 alpha=16 dropout 0.05 on query and value (4,194,304 trainable), "
                          "every linear in bitsandbytes NF4 (finetune/lora.py --quantize bnb.nf4)",
                    gpu="1 x A100-SXM4-40GB", batch="micro-batch 1 (mini-batch 128)",
                    seq_len="1304 (the longest Alpaca sample, forced into the first batch)",
                    precision="NF4 base weights (quantized from fp16, blocks of 64), bf16 compute and LoRA",
                    optimizer="bitsandbytes.optim.PagedAdamW on the LoRA parameters",
                    stack=_LIT_STACK + ", bitsandbytes 0.41.1", fxmem_gpu="A100 40GB"),
        quantity=Quantity.ALLOCATED,
        published=Published("14.14 GB", round(14.14 * GB)),
        predict=litgpt_lora("Llama-2-7b-hf", 1, 1304, quantize="nf4"),
        stand_in="validators/litgpt.py: lit-gpt's GPT and LoRAQKVLinear (Llama-2-7b-hf), Lightning 2.1's "
                 "BitsandbytesPrecision('nf4') with bitsandbytes 0.41.1's Linear4bit forward, NF4 weights sized on "
                 "the meta device (estimator.integrations.bitsandbytes.quantize)",
        differences=(
            Difference("bitsandbytes 0.41.1", "the run had bitsandbytes 0.41.1, whose MatMul4Bit keeps each 4-bit "
                       "layer's input for backward (ctx.tensors = (A, B)); the installed 0.50.2 keeps (None, B). The "
                       "stand-in runs 0.41.1's Linear4bit forward and MatMul4Bit (validators/litgpt.py) on the "
                       "installed bitsandbytes' quantize / dequantize ops, whose outputs are 0.41.1's sizes; with "
                       "the installed Linear4bit the prediction is 12.29 GB (-13.1 %)"),
            Difference("Lightning 2.1", "the table names Lightning 2.1.0.rc0, which has no BitsandbytesPrecision; "
                       "lit-gpt pinned Lightning 2.1 (PR #669), whose plugin the stand-in follows"),
        ) + _LIT_DIFFERENCES,
        notes=("trainable parameters: 4,194,304 as the table says; the weights are quantized at init and again as "
               "the checkpoint loads, one linear at a time, before the first step; PagedAdamW's state is all under "
               "bitsandbytes' paging threshold of 100,000 elements (each LoRA matrix has 65,536): ordinary CUDA "
               "tensors",),
    ),
)


# -- optimum-benchmark: public results on AMD MI250 (ROCm) ------------------------------------------

ROCM = Difference("ROCm", "ROCm (the HIP build of the caching allocator, hipBLASLt workspaces, AMD's attention "
                  "kernels) vs fxmem's CUDA model")
_OB_MISSING = ("the value is not in the stored copies this session could read: the search corpus holds the Hub "
               "pages of huggingface.co/datasets/optimum-benchmark/rocm, but each excerpt stops in the 'config' "
               "part of benchmark.json, before the report's memory figures; left out rather than guessed")
_OB_STACK = ("optimum-benchmark TrainingScenario (HF Trainer, max_steps 5, warmup_steps 2), no_weights=True; torch "
             "2.2.2+rocm5.7 / 2.3.1+rocm5.7 (both in the stored pages); transformers 4.41-4.43")

OB_ROWS = (
    Row(
        key="optimum-benchmark-mi250-bert-base-mlm",
        source=Source("https://huggingface.co/datasets/optimum-benchmark/rocm/tree/main/"
                      "cuda_training_transformers_fill-mask_google-bert/bert-base-uncased",
                      "optimum-benchmark/rocm: cuda_training_transformers_fill-mask_google-bert/bert-base-uncased",
                      "2024 (stored page revisions 4-8 months before the crawl)", "benchmark_report.json, "
                      "report.train/overall memory (max_allocated, max_reserved)", ""),
        setup=Setup(model="google-bert/bert-base-uncased, fill-mask (MLM)", gpu="AMD Instinct MI250 (one GCD)",
                    batch="2", seq_len="16", precision="fp32", optimizer="AdamW (Trainer default)", stack=_OB_STACK),
        quantity=Quantity.ALLOCATED,
        published=None,
        missing=_OB_MISSING,
        differences=(ROCM,),
    ),
    Row(
        key="optimum-benchmark-mi250-gpt2",
        source=Source("https://huggingface.co/datasets/optimum-benchmark/rocm/tree/main/"
                      "cuda_training_transformers_text-generation_openai-community/gpt2",
                      "optimum-benchmark/rocm: cuda_training_transformers_text-generation_openai-community/gpt2",
                      "2024 (stored page revisions)", "benchmark.json, report.overall memory", ""),
        setup=Setup(model="openai-community/gpt2, text-generation (causal LM)", gpu="AMD Instinct MI250 (one GCD)",
                    batch="2", seq_len="16", precision="fp32", optimizer="AdamW (Trainer default)", stack=_OB_STACK),
        quantity=Quantity.ALLOCATED,
        published=None,
        missing=_OB_MISSING,
        differences=(ROCM,),
    ),
)

ROWS: tuple[Row, ...] = HF_ROWS + TUTORIAL_ROWS + LIT_ROWS + TITAN_ROWS + TITAN_F8_ROWS + OB_ROWS + AO_ROWS


@dataclass(frozen=True)
class Series:
    """Rows of one source that differ only in the (micro-)batch: a line through the published
    values and one through the predictions split each difference into a per-sample part
    (activations) and a fixed part (weights, optimizer state, context).  Derived from the rows,
    not fitted into anything."""

    name: str
    rows: tuple[tuple[str, int], ...]  # (row key, samples per forward)


SERIES: tuple[Series, ...] = (
    Series("HF docs, BERT-large fp32 AdamW, per sample of the micro-batch (512 tokens)",
           (("hf-bert-large-b1-ga4", 1), ("hf-bert-large-b4", 4))),
    Series("LitGPT phi-1.5 LoRA, per sample of the micro-batch (1044 tokens)",
           (("litgpt-phi-1.5-lora-mb1", 1), ("litgpt-phi-1.5-lora-mb2", 2), ("litgpt-phi-1.5-lora-mb4", 4))),
    Series("LitGPT StableLM Alpha 3B LoRA, per sample of the micro-batch (1034 tokens)",
           (("litgpt-stablelm-3b-lora-mb1", 1), ("litgpt-stablelm-3b-lora-mb2", 2), ("litgpt-stablelm-3b-lora-mb4", 4))),
    Series("LitGPT Llama 2 7B LoRA, per sample of the micro-batch (1304 tokens)",
           (("litgpt-llama-2-7b-lora-mb1", 1), ("litgpt-llama-2-7b-lora-mb2", 2))),
)
