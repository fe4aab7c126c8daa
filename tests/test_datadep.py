"""Data-dependent sizes and values (estimator/capture/datadep.py): boolean masks, nonzero, MoE
routing, CTC, ``.item()`` -- captured by the policy, never refused; measured against the CPU
allocator where the sizes are the sample's (tolerance: exact, 0 B)."""

import copy

import pytest
import sympy
import torch
from torch import nn

import estimator
from estimator.vocab.data_dependent import Policy, Source
from estimator.vocab.errors import InputError
from validators.cpu import measure_cpu

D = 64


class Select(nn.Module):
    """``h[mask]`` with a mask the weights decide (``h.sum(-1) > 0``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        return self.b(h[h.sum(-1) > 0])


class Gather(nn.Module):
    def forward(self, x, mask):
        return x[mask] * 2


def _sample(b):
    return torch.randn(b, 16, D, generator=torch.Generator().manual_seed(0))


def _loss(out, sample):
    return out.mean()


def test_boolean_mask_upper_bound_is_every_element():
    x = torch.randn(4, 16, D)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    rep = estimator.report(Gather(), (x, mask), mode="inference", device="cpu")
    # x: 16·64·4 = 4096 B per row, the mask 16 B per row (alive: 4112·b).  x[mask] with n = 16·b
    # (the bound): the nonzero indices (16·b, 2) int64 = 256·b B alive with the output 16·b·64·4 =
    # 4096·b (8464·b); then the product 4096·b while the output lives: peak 4112·b + 2·4096·b.
    assert rep.peak == 12304 * estimator.vocab.symbolic.B + 12  # + the wrapped 2 (8 B) and its fp32 copy (4 B)
    (note,) = [n for n in rep.notes if "data-dependent" in n]
    assert ":nonzero#0" in note and "0 ≤ n ≤ 16*b" in note and "used n = 16*b" in note


def test_fraction_rounds_each_coefficient_up():
    x, mask = torch.randn(4, 16, D), torch.zeros(4, 16, dtype=torch.bool)
    full = estimator.report(Gather(), (x, mask), mode="inference", device="cpu")
    half = estimator.report(Gather(), (x, mask), mode="inference", data_dependent=0.3, device="cpu")
    # n = ceil(0.3 · 16)·b = 5·b instead of 16·b: 11·b rows less of the output and the product (2 · 256 B)
    assert sympy.expand(full.peak - half.peak) == 11 * 2 * 256 * estimator.vocab.symbolic.B


def test_sample_policy_matches_the_measurement():
    """Inference: the mask the weights decide is the sample's.  (In training the measured step
    runs on weights one optimizer step later than the sample's probe: validators.zoo reads the
    measured step's own sizes.)"""
    torch.manual_seed(0)
    predicted = estimator.report(Select(), _sample(8), mode="inference", loss_fn=_loss, data_dependent="sample",
                                 device="cpu")
    torch.manual_seed(0)
    measured = measure_cpu(Select(), _sample(8), "inference", None, _loss)
    assert predicted.peak_bytes == measured.peak_bytes  # exact: the sizes are the sample's
    assert any("observed on the sample" in n for n in predicted.notes)


def test_training_through_a_sample_mask_is_exact():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x, mask):
            return self.lin(x)[mask]

    x, mask = _sample(8), torch.rand(8, 16, generator=torch.Generator().manual_seed(1)) < 0.3
    torch.manual_seed(0)
    predicted = estimator.report(Head(), (x, mask), loss_fn=_loss, data_dependent="sample", device="cpu")
    torch.manual_seed(0)
    assert predicted.peak_bytes == measure_cpu(Head(), (x, mask), "train", "adamw", _loss).peak_bytes


def test_max_policy_is_an_upper_bound():
    torch.manual_seed(0)
    worst = estimator.report(Select(), _sample(8), mode="inference", loss_fn=_loss, device="cpu")
    torch.manual_seed(0)
    assert worst.peak_bytes >= measure_cpu(Select(), _sample(8), "inference", None, _loss).peak_bytes


def test_one_hot_total_is_shared_by_its_nonzero_calls():
    class Route(nn.Module):
        def forward(self, scores):
            chosen = scores.topk(2, dim=-1).indices  # (N, 2)
            mask = nn.functional.one_hot(chosen, 4).permute(2, 1, 0)  # (4, 2, N), 2·N ones in all
            return torch.cat([torch.where(mask[e])[1] for e in range(4)]).float().sum()

    rep = estimator.report(Route(), torch.randn(8, 4), mode="inference", device="cpu")
    used = [n for n in rep.notes if "data-dependent" in n]
    assert "used n = 2*b" in used[0] and all("used n = 0" in n for n in used[1:])
    assert "within a known total" in used[0]


def test_per_site_numbers_and_unknown_sites():
    x, mask = torch.randn(4, 16, D), torch.zeros(4, 16, dtype=torch.bool)
    rep = estimator.report(Gather(), (x, mask), mode="inference", data_dependent={":nonzero#0": 10}, device="cpu")
    assert any("used n = 10, given for this site" in n for n in rep.notes)
    with pytest.raises(InputError, match="no data-dependent call.*':nonzero#9'|nonzero#9"):
        estimator.report(Gather(), (x, mask), mode="inference", data_dependent={":nonzero#9": 10}, device="cpu")


@pytest.mark.parametrize("bad", ["most", 1.5, 0.0, -3, True, {"x": -1}, {"x": "balanced"}])
def test_bad_policies_are_input_errors(bad):
    with pytest.raises(InputError, match="data_dependent"):
        Policy.of(bad)


def test_balanced_is_the_bound_for_sizes_and_even_routing():
    """``"balanced"`` (also as the ``"*"`` default, the command line's form) keeps the sizes at their
    bound and assumes a router's picks spread evenly (``capture/routing.py``)."""
    from estimator.cli.options import data_dependent
    from estimator.vocab.data_dependent import Routing

    for given in ("balanced", "Balanced", {"*": "balanced", ":nonzero#0": 3}, data_dependent(("balanced",))):
        policy = Policy.of(given)
        assert (policy.default, policy.routing, policy.needs_probe) == ("max", Routing.BALANCED, False)
    assert Policy.of({"*": "balanced", ":nonzero#0": 3}).sites == {":nonzero#0": 3}
    assert Policy.of("max").routing is None


def test_item_in_forward_uses_the_real_sample():
    class Crop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x, lengths):
            return self.lin(x[:, : int(lengths.max())])  # a data-dependent value (.item())

    x, lengths = torch.randn(4, 16, D), torch.tensor([3, 5, 7, 6])
    torch.manual_seed(0)
    rep = estimator.report(Crop(), (x, lengths), mode="inference", device="cpu")
    assert rep.peak_bytes == measure_cpu(Crop(), (x, lengths), "inference", None).peak_bytes
    with torch.device("meta"):
        meta = Crop()
    # lengths.max() follows the sample alone (capture/shadows.py): no real weights needed
    assert estimator.report(meta, (x, lengths), mode="inference", device="cpu").peak_bytes == rep.peak_bytes


def test_a_sample_mask_is_counted_under_the_sample_policy_without_a_probe():
    """``x[mask]`` with the sample's own mask: its count is the sample's under
    ``data_dependent='sample'``, on the meta device too; the default stays the bound."""
    x, mask = torch.randn(4, 16, D), torch.rand(4, 16, generator=torch.Generator().manual_seed(2)) < 0.3
    with torch.device("meta"):
        model = Gather()
    rep = estimator.report(model, (x, mask), mode="inference", data_dependent="sample", device="cpu")
    assert rep.peak_bytes == measure_cpu(Gather(), (x, mask), "inference", None).peak_bytes
    assert any("fixed by the sample's own values" in n for n in rep.notes)
    bound = estimator.report(model, (x, mask), mode="inference", device="cpu")
    assert any("used n = 16*b" in n for n in bound.notes) and bound.peak_bytes > rep.peak_bytes


def test_sample_policy_needs_real_weights():
    with torch.device("meta"):
        model = Select()
    with pytest.raises(InputError, match="meta device"):
        estimator.report(model, _sample(4), mode="inference", loss_fn=_loss, data_dependent="sample", device="cpu")


def test_ctc_loss_with_length_tensors():
    class CTC(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 8)

        def forward(self, x, targets, target_lengths):
            logp = self.lin(x).log_softmax(-1).transpose(0, 1)  # (T, B, C)
            lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
            return nn.functional.ctc_loss(logp, targets, lengths, target_lengths)

    x, targets = torch.randn(4, 16, D), torch.randint(1, 8, (4, 5))
    sample = (x, targets, torch.tensor([5, 3, 4, 2]))
    torch.manual_seed(0)
    rep = estimator.report(CTC(), sample, loss_fn=lambda out, s: out, data_dependent="sample", device="cpu")
    torch.manual_seed(0)
    measured = measure_cpu(CTC(), sample, "train", "adamw", lambda out, s: out).peak_bytes
    # log_alpha (4, 16, 2·5 + 1) fp32 and the backward's log_beta are priced; 32 B of small length
    # buffers are not (tolerance 0.2 %, above the measurement: never under)
    assert 0 <= rep.peak_bytes - measured <= 0.002 * measured


class MaskedSelect(nn.Module):
    """``masked_select`` of a mask the sample decides, and a bool ``sum`` (an int64 copy)."""

    def __init__(self, broadcast: bool):
        super().__init__()
        self.lin, self.broadcast = nn.Linear(D, D), broadcast

    def forward(self, x):
        h = self.lin(x)
        mask = x[0, :, :1] > 0 if self.broadcast else (x[..., :1] > 0).expand_as(h)
        return h.masked_select(mask).sum() + mask.sum()


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("b", [2, 32])  # 8,192 elements: the serial kernel; 131,072: the parallel one (> 1 thread)
def test_masked_select_and_bool_sum_match_the_measurement(broadcast, b):
    x = torch.randn(b, D, D, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    rep = estimator.report(MaskedSelect(broadcast), x, mode="inference", data_dependent="sample", device="cpu")
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(MaskedSelect(broadcast), x, "inference", None).peak_bytes


def test_probe_leaves_the_users_hooks_alone():
    seen = []
    model = Select()
    handle = model.a.register_forward_hook(lambda m, args, out: seen.append(out))
    estimator.report(model, _sample(4), mode="inference", loss_fn=_loss, data_dependent="sample", device="cpu")
    assert seen == [] and len(model.a._forward_hooks) == 1  # not run on real tensors, still registered
    handle.remove()


def test_numpy_integers_in_a_strategy():
    np = pytest.importorskip("numpy")
    assert estimator.Strategy(accumulate=np.int64(2)).accumulate == 2


def test_concrete_fallback_with_accumulation():
    """``masked_select``'s backward reads ``input.sizes()`` (the batch becomes a constant): the
    concrete captures then run at multiples of the accumulated micro-batches."""
    x = torch.randn(8, D, D, generator=torch.Generator().manual_seed(0))
    rep = estimator.report(MaskedSelect(False), x, loss_fn=lambda out, s: out,
                           strategy=estimator.Strategy(accumulate=2), device="cpu")
    assert rep.path.value == "concrete" and "b = 8, 10, 32" in rep.notes[0]
    measured = measure_cpu(MaskedSelect(False), x, "train", "adamw", lambda out, s: out,
                           strategy=estimator.Strategy(accumulate=2))
    assert rep.peak_bytes >= measured.peak_bytes  # the bound (every element selected): an upper estimate


def test_report_lists_the_sizes_it_used():
    x, mask = torch.randn(4, 16, D), torch.zeros(4, 16, dtype=torch.bool)
    (site,) = estimator.report(Gather(), (x, mask), mode="inference", device="cpu").data_dependent
    b = estimator.vocab.symbolic.B
    assert (site.site, site.upper, site.used, site.source) == (":nonzero#0", 16 * b, 16 * b, Source.BOUND)


def test_transformers_eager_experts_replay_their_item_calls():
    """transformers' eager MoE loop (``for expert_idx in expert_hit: if expert_idx == E: ...``,
    ``expert_mask[expert_idx]``) needs ``.item()`` values: replayed from the probe by the line
    that asks (real and fake tensors ask in different numbers), exact on the sample."""
    from estimator.integrations._common import import_optional

    transformers = import_optional("transformers", "transformers")
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        experts_implementation="eager")
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))

    def model():
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(config)

    rep = estimator.report(model(), {"input_ids": ids}, mode="inference", data_dependent="sample", device="cpu")
    assert rep.peak_bytes == measure_cpu(model(), {"input_ids": ids}, "inference", None).peak_bytes


def test_the_bound_and_the_sample_side_by_side():
    """Under the default bound a report also carries the step at the sample's sizes
    (``Report.at_sample``), in its first lines and its JSON: here the head on the masked tokens,
    15 % of them in the sample, against every token under the bound (ModernBERT's
    ``sparse_prediction`` does the like).  The sample's own labels fix the count: the meta device
    needs no probe."""
    import json

    class MaskedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(100, 32), nn.Linear(32, 100)

        def forward(self, ids, labels):
            return nn.functional.cross_entropy(self.head(self.emb(ids)[labels != -100]), labels[labels != -100])

    ids = torch.randint(0, 100, (8, 64), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.rand(8, 64, generator=torch.Generator().manual_seed(1)) < 0.15, ids, -100)
    sample, loss = (ids, labels), (lambda out, s: out)
    rep = estimator.report(MaskedHead(), sample, loss_fn=loss, device="cpu")
    measured = measure_cpu(MaskedHead(), sample, "train", "adamw", loss).peak_bytes
    assert rep.at_sample.peak_bytes == measured < rep.peak_bytes  # the bound is above the run
    assert rep.at_sample.max_batch("1MiB") > rep.max_batch("1MiB")
    assert "at the sample's sizes (data_dependent='sample')" in str(rep).splitlines()[3]
    assert json.loads(rep.to_json())["at_sample"]["peak_bytes"] == measured
    with torch.device("meta"):
        meta = MaskedHead()
    assert estimator.report(meta, sample, loss_fn=loss, device="cpu").at_sample.peak_bytes == measured
    assert estimator.report(MaskedHead(), sample, loss_fn=loss, device="cpu", data_dependent=0.5).at_sample is None


# -- packed sequences (estimator/corrections/packed.py) -------------------------------------------
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("cell, batch_first, pad", [("lstm", True, True), ("gru", False, True), ("lstm", True, False)])
def test_packed_sequences_with_the_samples_lengths_are_exact(cell, batch_first, pad, mode):
    # pack_padded_sequence -> a 2-layer bidirectional RNN -> pad_packed_sequence: RNN.cpp's loop runs
    # batch_sizes[t] rows at step t, as the sample's lengths give them (b = 3: lengths 1..12).
    from validators.outside import PackedRNN, sequences, sum_loss

    loss = sum_loss if mode == "train" else None
    torch.manual_seed(0)
    rep = estimator.report(PackedRNN(cell, batch_first, pad), sequences(3), mode=mode, loss_fn=loss, device="cpu",
                           data_dependent="sample")
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(PackedRNN(cell, batch_first, pad), sequences(3), mode=mode,
                                         loss_fn=loss).peak_bytes
    (site,) = rep.data_dependent
    assert site.op == "pack_padded_sequence" and site.source is Source.INPUTS
    assert site.used == int(sequences(3)["lengths"].sum())  # the packed rows


def test_packed_sequences_default_to_full_lengths():
    # data_dependent="max": every sequence as long as the padding (12): the packed data is the whole
    # (b * 12, 16) block, never under the run's.
    from validators.outside import PackedRNN, sequences, sum_loss

    torch.manual_seed(0)
    rep = estimator.report(PackedRNN(), sequences(4), mode="train", loss_fn=sum_loss, device="cpu")
    assert rep.data_dependent[0].used == 4 * 12 and rep.data_dependent[0].source is Source.BOUND
    full = {"ids": sequences(4)["ids"], "lengths": torch.full((4,), 12)}
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(PackedRNN(), full, loss_fn=sum_loss).peak_bytes


def test_packed_sequence_errors_name_the_lengths():
    from validators.outside import PackedRNN, sequences

    sample = sequences(3) | {"lengths": torch.tensor([13, 2, 2])}  # longer than the padding (12)
    with pytest.raises(InputError, match="at most the padded length 12"):
        estimator.report(PackedRNN(), sample, mode="inference", device="cpu")  # the bound: no probe


def test_packed_sequences_on_the_cuda_target_say_what_stands_for_cudnn():
    from validators.outside import PackedRNN, sequences, sum_loss

    rep = estimator.report(PackedRNN(), sequences(4), mode="train", loss_fn=sum_loss, device="cuda")
    assert rep.peak_bytes > 0
    assert any("stands for cuDNN's packed kernel" in n for n in rep.notes)


# -- host code reading values, row lists (DETR) ---------------------------------------------------
def test_detr_matches_on_the_host_with_the_probes_values():
    # transformers' DETR loss: scipy's linear_sum_assignment on a cost matrix (.numpy() of model
    # outputs: the probe's real run gives the values, by site); labels: a list of one dict per
    # image (a row list: its length is the batch, its tensors their own sizes).  Exact (0 B).
    pytest.importorskip("scipy")
    pytest.importorskip("transformers")
    from validators.outside import detr, detr_sample

    model, sample = detr(), detr_sample(3)
    state, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    rep = estimator.report(model, sample, mode="train", device="cpu")
    # the probe's real run left the user's model, sample and RNG as they were
    assert torch.equal(torch.get_rng_state(), rng) and len(sample["labels"]) == 3
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert rep.peak_bytes == measure_cpu(detr(), detr_sample(3)).peak_bytes
    assert (rep.valid_from, rep.valid_to) == (3, 3)  # the loss loops over the images: held at b = 3
    assert any("3 tensor value(s) read on the host with .numpy()" in n for n in rep.notes)  # one matching per image


def test_row_lists_cycle_to_another_batch():
    # report(batch=4) of a 2-image sample: the capture cycles the images and their targets to 4
    # rows (a real run at b = 4 of the same images twice).
    pytest.importorskip("scipy")
    pytest.importorskip("transformers")
    from validators.outside import detr, detr_sample

    sample = detr_sample(2)
    rep = estimator.report(detr(), sample, mode="train", device="cpu", batch=4)
    twice = {"pixel_values": sample["pixel_values"].repeat(2, 1, 1, 1), "pixel_mask": sample["pixel_mask"].repeat(2, 1, 1),
             "labels": sample["labels"] + copy.deepcopy(sample["labels"])}
    assert rep.peak_bytes == measure_cpu(detr(), twice).peak_bytes


def test_a_row_list_must_have_the_batchs_length():
    from validators.outside import detr_sample

    sample = detr_sample(3) | {"labels": detr_sample(2)["labels"]}
    with pytest.raises(InputError, match=r"\['labels'\] \(a list of 2 dicts: one per row\): 2"):
        estimator.report(nn.Linear(2, 2), sample, mode="inference", device="cpu")


def test_accumulation_does_not_split_a_row_list():
    from validators.outside import detr_sample

    with pytest.raises(InputError, match="row list"):
        estimator.report(nn.Linear(2, 2), detr_sample(4), mode="train", device="cpu",
                         strategy=estimator.Strategy(accumulate=2))
