"""A deep model from a capture of a few of its blocks (``estimator/capture/repeated_blocks.py``): the
extended capture is the full capture, event for event (both paths compared on several model
families, periods, strategies and both targets), it matches a real CPU step, and every case where
the blocks are not proven to repeat captures every block and says why."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from torch import nn

import estimator
from estimator.capture import repeated_blocks
from estimator.capture.records import StepSpec
from estimator.capture.steps import Generation
from estimator.capture.repeated_blocks import UNITS, Plan
from estimator.vocab.categories import Mode
import models_zoo
from models_zoo import gpt, llama
from models_zoo import parallelize as par
from validators.cpu import measure_cpu

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)


def _model(family: str, layers: int) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256,
                                                                    bos_token_id=0, eos_token_id=0))
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mixtral": transformers.MixtralConfig, "gemma2": transformers.Gemma2Config,
              "qwen2_moe": transformers.Qwen2MoeConfig}[family]
    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "gemma2": dict(head_dim=16, sliding_window=8),
             # a dense first layer, then experts (a head of one block)
             "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, mlp_only_layers=[0])}.get(family, {})
    return transformers.AutoModelForCausalLM.from_config(config(num_hidden_layers=layers, **SMALL, **extra))


def _sample(b: int = 2, s: int = 16) -> dict:
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def every_block():
    """Reports in the block capture every block (the path before the extension)."""
    plan = repeated_blocks.plan
    repeated_blocks.plan = lambda model, spec: None
    estimator.forget_captures()  # the extended capture is kept for the same step: capture it again
    try:
        yield
    finally:
        repeated_blocks.plan = plan


def _both(model, sample, **kwargs):
    """The report as fxmem makes it, and with every block captured."""
    extended = estimator.report(model, sample, **kwargs)
    with every_block():
        return extended, estimator.report(model, sample, **kwargs)


def _events(rep) -> tuple:
    """Everything of a report's timeline but the fx node names (the built blocks name the nodes
    of the block they were built from)."""
    t = rep.timeline
    ops = tuple((op.op, op.phase, op.module, op.live, op.allocated, op.scratch, op.total, op.owner) for op in t.ops)
    return t.baseline, ops, t.storages, t.owners, t.births, t.grad_order, t.marks


def _extended(rep) -> bool:
    return any("blocks from a capture of" in note for note in rep.notes)


def _same(extended, full) -> None:
    assert _extended(extended) and not _extended(full)
    assert _events(extended) == _events(full)
    # the report itself: formula pieces, range, breakdown, module rows, CUDA memory, ranks (all but the note)
    assert _report(extended) == _report(full)


def _report(rep):
    """A report but the extension's note, the count of host-measured kernel calls (the captured
    blocks': the extension's note says so) and the fx node names (a built block's are the template's)."""
    pieces = tuple(dataclasses.replace(p, node=None) for p in rep.pieces)
    notes = tuple(n for n in rep.notes if "blocks from a capture of" not in n and "kernel calls" not in n)
    return dataclasses.replace(rep, notes=notes, pieces=pieces,
                               peak_piece=dataclasses.replace(rep.peak_piece, node=None),
                               ranks=tuple(dataclasses.replace(r, report=_report(r.report)) for r in rep.ranks))


@pytest.mark.parametrize("family, layers, device, mode", [
    ("llama", 8, "cuda", "train"),
    ("llama", 12, "cpu", "train"),
    ("llama", 9, "cuda", "inference"),
    ("qwen2", 8, "cpu", "inference"),
    ("gpt2", 8, "cuda", "train"),
    ("mixtral", 8, "cuda", "train"),
    ("gemma2", 12, "cuda", "train"),  # sliding and global attention alternate: units of 2 blocks
    ("qwen2_moe", 8, "cuda", "train"),
])
def test_extended_capture_is_the_full_capture(family, layers, device, mode):
    _same(*_both(_model(family, layers), _sample(), device=device, mode=mode))


@pytest.mark.parametrize("strategy", [
    estimator.Strategy(checkpoint="model.layers.*"),
    estimator.Strategy(accumulate=2, amp="bf16"),
    estimator.Strategy(data_parallel=4, sharding="zero3"),
    estimator.Strategy(pipeline=2),
], ids=["checkpoint", "accumulate-amp", "zero3", "pipeline"])
def test_strategies_see_every_block(strategy):
    _same(*_both(_model("llama", 8), _sample(), strategy=strategy))


def test_a_mesh_sees_every_block():
    """A job's own FSDP2 on the zoo's Llama over 3 ranks (uneven shards: two roles): FSDP2's root
    pre-forward views every block's parameters at the root (no block's module: ``OpEvent.takes``
    places each view in its block; before, the built blocks had none, 27 ops short at 8 blocks),
    and the shards are made at one place of the load order (the built blocks' too).  FSDP x TP on
    a 2 x 2 mesh is the same (checked once, 30 s: left out of the suite)."""
    model, make_sample, loss_fn = llama.make(llama.Config(n_layers=6))  # one block built
    _same(*_both(model, make_sample(4), batch=4, loss_fn=loss_fn, device="cuda",
                 strategy=estimator.Strategy(mesh={"dp_shard": 3}, parallelize=par.fsdp)))


def test_autocast_frees_its_cast_weights_in_block_order():
    """Leaving autocast frees its cache of bf16 weight copies all at once, in its hash map's order
    of tensor pointers; the tracker keeps them in the order they were made, so the blocks' copies
    sit in block order and the zoo's GPT-2 (where that order broke the proof) is extended."""
    model, make_sample, loss_fn = gpt.make(gpt.Config(n_layer=8))
    _same(*_both(model, make_sample(4), batch=4, loss_fn=loss_fn, device="cpu", amp="bf16"))


def test_symbolic_sequence_length():
    """The formula in b and s (the zoo's GPT, 8 blocks, CPU target: its attention keeps s a symbol)."""
    model, make_sample, loss_fn = gpt.make(gpt.Config(n_layer=8))
    extended, full = _both(model, make_sample(4), batch=4, loss_fn=loss_fn, device="cpu",
                           dynamic={"input_ids": {1: "s"}})
    _same(extended, full)
    assert extended.seq == 32 and {str(x) for x in extended.peak.free_symbols} == {"b", "s"}


def test_matches_a_real_cpu_step():
    """The 10-block model's predicted peak is the real step's, byte for byte (b = 2 and 5)."""
    model = _model("llama", 10)
    rep = estimator.report(model, _sample(), device="cpu")
    assert _extended(rep)
    for b in (2, 5):
        assert rep.at(b) == measure_cpu(model, _sample(b)).peak_bytes


@pytest.mark.parametrize("device, attention", [("cuda", "sdpa"), ("cpu", "eager")])
def test_generate_with_a_dynamic_cache(device, attention):
    """The decode steps' extension first, then the blocks': the same run as capturing every block
    (the cache's bytes per token, the calls, the timeline and the CUDA allocator's view)."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=8, **SMALL,
                                                                   attn_implementation=attention)).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    extended, full = _both(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, mode="generate",
                           new_tokens=12, device=device)
    _same(extended, full)
    assert extended.timeline.decoding == full.timeline.decoding and len(extended.timeline.decoding.layer_bytes) == 8


class Block(nn.Module):
    def __init__(self, layer_idx: int, odd_one: int | None = None):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.layer_idx, self.odd_one = layer_idx, odd_one

    def forward(self, x):
        y = torch.relu(self.fc(x))
        if self.layer_idx == self.odd_one:  # a program its settings do not show
            y = y + torch.ones(4096)[:16]
        return y


class Stack(nn.Module):
    def __init__(self, blocks: int = 8, odd_one: int | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, odd_one) for i in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_root_sequential_and_a_plain_stack():
    _same(*_both(Stack(), torch.randn(4, 16), device="cpu"))
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(7)))
    extended, full = _both(model, torch.randn(4, 16), loss_fn=lambda out, x: out.sum())
    _same(extended, full)
    assert "7 blocks from a capture of 5" in next(n for n in extended.notes if "blocks from" in n)


class Features(Stack):
    """After the loop, at the root: each block's output taken by an op of no block, and stacked."""

    def forward(self, x):
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return torch.stack([torch.tanh(h) for h in outs]).sum()


def test_root_code_that_takes_each_blocks_tensor_is_built_per_block():
    """The ``tanh`` calls run at the root, after the blocks: each takes one block's output
    (``OpEvent.takes``), so each is its block's and the built blocks get theirs.  Placed by module
    only, they were no block's: the stack then held 5 tanh outputs, not 8, and the peak was
    13,568 B, 1,536 B = 3 built blocks x 2 outputs (tanh's and the stack's share) x 4 rows x 16 x 4 B
    under the full capture's (measured before the change)."""
    model, x = Features().eval(), torch.randn(4, 16)
    extended, full = _both(model, x, device="cpu", mode="inference")
    _same(extended, full)
    # at the stack: 8 x 272 parameters x 4 B + the input + 8 block outputs (kept in the list), 8 tanh
    # outputs and the stack's 8 rows, each 4 x 16 x 4 B = 256 B
    assert extended.peak_bytes == full.peak_bytes == 8 * 272 * 4 + 256 + 3 * 8 * 256 == 15_104


def _headed() -> Stack:
    """Nine blocks, the first of its own (no bias: DeepSeek's dense layers before the MoE ones)."""
    model = Stack(9)
    model.blocks[0].fc = nn.Linear(16, 16, bias=False)
    return model


def test_a_head_of_blocks_of_their_own():
    assert repeated_blocks.plan(_headed(), _spec()) == Plan("blocks", 1, 8, head=1)
    extended, full = _both(_headed(), torch.randn(4, 16), device="cpu")
    _same(extended, full)
    assert "9 blocks from a capture of 6 (1 of their own, then the first 3 and last 2)" in \
        next(n for n in extended.notes if "blocks from" in n)


def test_a_block_that_differs_is_captured_in_full():
    """Block 2's program differs (its settings do not say so): the proof fails, every block is
    captured, and the note names the blocks."""
    rep = estimator.report(Stack(odd_one=2), torch.randn(4, 16), device="cpu")
    note = next(n for n in rep.notes if "every one of its" in n)
    assert "blocks: every one of its 8 blocks was captured, as a capture of 5 did not prove they repeat" in note
    assert "blocks.1 to blocks.6 do not hold the same tensors, or do not free them alike: first at tensor" in note
    with every_block():
        full = estimator.report(Stack(odd_one=2), torch.randn(4, 16), device="cpu")
    assert _events(rep) == _events(full)


class Indexed(Stack):
    def forward(self, x):
        for i in range(8):  # the blocks by their index: the shallow copy has no block 3
            x = self.blocks[i](x)
        return x.sum()


def test_a_model_the_shallow_copy_cannot_run_is_captured_in_full():
    rep = estimator.report(Indexed(), torch.randn(4, 16), device="cpu")
    note = next(n for n in rep.notes if "every one of its" in n)
    assert "as a capture of 5 did not prove they repeat: the shallow copy failed" in note
    assert rep.peak_bytes == estimator.report(Stack(), torch.randn(4, 16), device="cpu").peak_bytes


class FixedBatch(Stack):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.reshape(2, -1).sum() if x.shape[0] == 4 else x.sum()  # the code fixes b: no symbol


def test_a_symbolic_failure_keeps_the_shallow_copy(monkeypatch):
    """A batch size the model's code fixes fails the symbolic capture whatever the depth: the
    concrete captures that follow run on the shallow copy too, and no capture of every block runs
    first (on Mixtral-8x7B's expert-parallel job that full-depth retry was half the report's time)."""
    from estimator.capture import trace

    runs = []
    capture_probed = trace._capture_probed

    def recorded(model, sample, spec, batch, symbolic, seq_dims=None):
        runs.append((len(model.blocks), symbolic))
        return capture_probed(model, sample, spec, batch, symbolic, seq_dims)

    monkeypatch.setattr(trace, "_capture_probed", recorded)
    rep = estimator.report(FixedBatch(), torch.randn(4, 16), device="cpu")
    assert runs[:2] == [(5, True), (5, False)] and {depth for depth, _ in runs} == {5}
    assert any("8 blocks from a capture of 5" in n for n in rep.notes)
    with every_block():
        assert _events(rep) == _events(estimator.report(FixedBatch(), torch.randn(4, 16), device="cpu"))


USER = Stack()


def _user_step(model, x, state):
    """A user's step that names the user's model (``USER``, a global) instead of its argument,
    and keeps an EMA copy of it in its state."""
    optimizer, ema = state
    USER(x).backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.01)


def _user_state(model):
    return torch.optim.AdamW(model.parameters()), copy.deepcopy(model)


def test_a_users_step_that_names_the_users_model_and_keeps_an_ema_copy():
    """The global ``USER`` maps to the shallow copy's fake, never to the user's model; the EMA copy's
    weights are named with the blocks' path, so its built blocks have theirs."""
    extended, full = _both(USER, torch.randn(4, 16), step=_user_step, optimizer=_user_state, device="cpu")
    _same(extended, full)
    assert all(p.grad is None for p in USER.parameters())  # the user's model was not run


LOSSES = []


def _keeps_a_list(model, x, optimizer):
    out = model(x)
    out.backward()
    optimizer.step()
    optimizer.zero_grad()
    LOSSES.append(out.detach())  # in a global list, as a training loop logs them: no name places them


def test_a_step_that_keeps_unnamed_tensors_is_captured_in_full():
    """What a step keeps that no name places may follow the blocks: not extended (what its state
    holds is named, and is extended when the name places it in a block: the EMA copy above)."""
    rep = estimator.report(Stack(), torch.randn(4, 16), step=_keeps_a_list,
                           optimizer=lambda model: torch.optim.SGD(model.parameters(), 0.1), device="cpu")
    assert any("the step keeps tensors no name places" in n for n in rep.notes)
    assert LOSSES == []  # the user's list was not touched


def _flat_buffer_step(model, x, optimizer):
    """Gradients copied into one flat buffer sized in Python (no list op shows its length)."""
    model(x).backward()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    flat.add_(1.0)
    optimizer.step()
    optimizer.zero_grad()


def test_a_flat_buffer_of_every_parameter_is_captured_in_full():
    rep = estimator.report(Stack(), torch.randn(4, 16), step=_flat_buffer_step,
                           optimizer=lambda model: torch.optim.SGD(model.parameters(), 0.1), device="cpu")
    note = next(n for n in rep.notes if "every one of its" in n)
    # the shallow copy's 5 blocks x 272 parameters x 4 B
    assert "a tensor of 5,440 B (made by aten.zeros.default) belongs to no block" in note


def _spec(mode=Mode.TRAIN, **kw) -> StepSpec:
    return StepSpec(mode, None, lambda out, sample: out.sum(), **kw)


def test_plan():
    assert repeated_blocks.plan(Stack(8), _spec()) == Plan("blocks", 1, 8)
    assert repeated_blocks.plan(Stack(UNITS), _spec()) is None  # nothing to gain
    # generate(): a cache that makes a tensor per layer when made (static, sliding windows) is refused
    llama, gemma = _model("llama", 8), _model("gemma2", 12)
    assert repeated_blocks.plan(llama, _spec(Mode.GENERATE, step=Generation(12))) == Plan("model.layers", 1, 8)
    assert repeated_blocks.plan(llama, _spec(Mode.GENERATE, step=Generation(12, "static"))) is None
    assert repeated_blocks.plan(gemma, _spec(Mode.GENERATE, step=Generation(12))) is None
    assert repeated_blocks.plan(Stack(8), _spec(step=lambda m, s, state: None)) == Plan("blocks", 1, 8)
    assert repeated_blocks.plan(Stack(8), _spec(compiled=object())) is None  # its regions name no modules
    assert repeated_blocks.plan(gemma, _spec()) == Plan("model.layers", 2, 6)
    assert repeated_blocks.plan(_model("gemma2", 11), _spec()) is None  # the period does not divide the depth
    # a per-layer list in the config (read by index in code): a period of its own
    llama = _model("llama", 12)
    llama.config.mlp_only_layers = [1, 3, 5, 7, 9, 11]
    assert repeated_blocks.plan(llama, _spec()) == Plan("model.layers", 2, 6)
    llama.config.mlp_only_layers = [4]
    assert repeated_blocks.plan(llama, _spec()) is None


def test_shallow_keeps_the_real_blocks_and_leaves_the_model_alone():
    model = _model("llama", 12)
    shallow = repeated_blocks.shallow(model, Plan("model.layers", 1, 12))
    assert [n for n, _ in shallow.model.layers.named_children()] == ["0", "1", "2", "10", "11"]
    assert list(shallow.model.layers)[3] is model.model.layers[10] and shallow.lm_head is model.lm_head
    assert len(model.model.layers) == 12


ZOO = [("vit", "vit-b16"), ("gpt", "gpt2-small"), ("bert", "base"), ("lora", "small"), ("custom_op", "small"),
       ("moe", "small"), ("masked_lm", "base"), ("spec_augment", "base"), ("mha_padding", "base"),
       ("encoder_padding", "base")]  # every zoo size with repeated blocks but Llama-7B and Mixtral-8x7B (above)


@pytest.mark.parametrize("name, size", ZOO, ids=[f"{n}-{s}" for n, s in ZOO])
def test_zoo_models_with_repeated_blocks(name, size):
    model, make_sample, loss_fn = models_zoo.get(name, size, device="meta")
    extended, full = _both(model, make_sample(2), loss_fn=loss_fn)
    _same(extended, full)


def test_training_arguments_through_trainers_own_step():
    """``from_training_args``: Trainer's own step (a user's step fxmem writes) on the shallow copy."""
    pytest.importorskip("accelerate")
    from estimator.integrations.training_args import from_training_args

    args = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_grad_norm": 1.0}
    extended = from_training_args(_model("llama", 8), args, _sample(4), device="cpu")
    with every_block():
        full = from_training_args(_model("llama", 8), args, _sample(4), device="cpu")
    _same(extended, full)
