"""Per-op corrections (estimator/corrections/conv.py, rnn.py): exact numbers on small ops, and
whole-step peaks against the profiler measurement (validators.cpu.measure_cpu).

The exact-number tests call the correction on real tensors (shapes are plain ints there) and
compare with sizes worked out by hand in the comments.  The conv numbers assume the oneDNN
path, which ``torch.get_num_threads() > 1`` or N > 1 selects; the tests pin N >= 2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
from estimator import step
from estimator.account import account
from estimator.capture.trace import StepSpec, capture
from estimator.categories import Mode
from estimator.corrections import lookup
from estimator.corrections.cpu import rnn as rnn_fix
from validators.cpu import measure_cpu

aten = torch.ops.aten


def _fix(func, *args):
    out = func(*args)
    return lookup(func, args, {}, out), out


# -- convolution ---------------------------------------------------------------------------
def test_conv_forward_3x3_cin16_exact():
    # x (2,16,8,8), w (32,16,3,3), pad 1 -> out (2,32,8,8) fp32 = 2*32*64*4 = 16384 B
    # in_r = 2*16*8*8*4 = 8192 (nChw16c reorder, Cin >= 16)
    # w_r  = 32*16*9*4 = 18432; y_b = 2*32*8*8*4 = 16384 (blocked dst)
    # peak before out = in_r + w_r + y_b = 43008 -> scratch = 43008 - 16384 = 26624
    # peak after out  = y_b + out -> scratch = y_b = 16384
    x, w = torch.randn(2, 16, 8, 8), torch.randn(32, 16, 3, 3)
    fix, _ = _fix(aten.convolution.default, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert fix.output_bytes == {}
    assert fix.scratch == (26624, 16384)


def test_conv_forward_1x1_strided_exact():
    # x (2,32,8,8), w (64,32,1,1), stride 2 -> out (2,64,4,4) = 8192 B
    # rtus scratchpad = threads*32*4*4*4 + 128; in_r = 16384; w_r = 64*32*4 = 8192; y_b = 8192
    x, w = torch.randn(2, 32, 8, 8), torch.randn(64, 32, 1, 1)
    threads = torch.get_num_threads()
    fix, _ = _fix(aten.convolution.default, x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    s = threads * 2048 + 128
    assert fix.scratch == (s + 16384 + 8192 + 8192 - 8192, 8192)


def test_conv_forward_first_conv_exact():
    # x (2,3,32,32), w (8,3,3,3): Cin < 16 and 3x3 -> no src reorder
    # w_r = rup(8,16)*3*9*4 = 1728; y_b = 2*16*32*32*4 = 131072; out = 2*8*32*32*4 = 65536
    x, w = torch.randn(2, 3, 32, 32), torch.randn(8, 3, 3, 3)
    fix, _ = _fix(aten.convolution.default, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert fix.scratch == (1728 + 131072 - 65536, 131072)


def test_conv_transpose_forward_exact():
    # x (2,32,8,8), w (32,16,2,2), stride 2 -> out (2,16,16,16) = 32768 B
    # in_r = 2*32*64*4 = 16384; w_r = 16*32*4*4 = 8192; y_b = 32768; s = 61616 (measured)
    x, w, b = torch.randn(2, 32, 8, 8), torch.randn(32, 16, 2, 2), torch.randn(16)
    fix, _ = _fix(aten.convolution.default, x, w, b, [2, 2], [0, 0], [1, 1], True, [0, 0], 1)
    assert fix.scratch == (61616 + 16384 + 8192 + 32768 - 32768, 32768 + 32768)


def test_conv_backward_stride1_exact():
    # grad_out (2,32,8,8), x (2,16,8,8), w (32,16,3,3); outputs gi 8192 + gw 18432 = 26624
    # backward_input: go_r 16384 + w_r 18432 + gi_b 8192 = 43008 -> 43008 - 26624 = 16384
    #                 then gi_b + gi alive -> 8192 - 18432 = -10240
    # backward_weights: go_r 16384 + in_r 8192 + gw_b 18432 (gi alive) -> 43008 - 18432 = 24576
    #                   then gw_b + gw -> 18432
    g, x, w = torch.randn(2, 32, 8, 8), torch.randn(2, 16, 8, 8), torch.randn(32, 16, 3, 3)
    fix, _ = _fix(aten.convolution_backward.default, g, x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                  [True, True, False])
    assert fix.scratch == (16384, -10240, 24576, 18432)


# -- LSTM ----------------------------------------------------------------------------------
def test_lstm_workspace_exact():
    # T=16, B=2, I=32, H=64, fp32; good_ld(256)=272 (256 is a multiple of 256), good_ld(64)=64
    # gates 16*2*272*4 = 34816; ht 16*2*64*4 = 8192; states 2*17*2*64*4 = 17408;
    # c states 17408; diff layer / iter 2*17*2*64*4 = 17408 each; diff c 17408
    # page offsets: 0 ->34816 ->36864+8192=45056 ->45056+17408=62464 ->65536+17408=82944
    #   ->86016+17408=103424 ->106496+17408=123904 ->126976+17408=144384 -> 147456+0
    assert rnn_fix.workspace_bytes(16, 2, 32, 64) == 147456
    assert rnn_fix.workspace_bytes(16, 2, 32, 64, grad_enabled=False) == 0


def test_lstm_layer_forward_fix():
    lstm = nn.LSTM(32, 64)
    x, h = torch.randn(16, 2, 32), torch.zeros(2, 64)
    ws = list(lstm.parameters())
    args = (x, *ws, h, h, False, [], 2, 64, 1, True, False, False, True)
    fix = lookup(aten.mkldnn_rnn_layer.default, args, {}, None)
    # workspace 147456 (above); scratch = bias 4*64*4 = 1024
    #   + W_ih' 32*272*4 = 34816 + W_hh' 64*272*4 = 69632 + scratchpad 49720 = 155192
    assert fix.output_bytes == {3: 147456}
    assert fix.scratch == (155192,)


# -- whole steps against the profiler --------------------------------------------------------
class _TinyConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.c2(torch.relu(self.c1(x))).mean((2, 3)))


class _TinyDeconv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 32, 3, padding=1)
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)

    def forward(self, x):
        return self.up(torch.relu(self.c(x))).mean((1, 2, 3))


class _TinyLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0].mean((1, 2))


def _mse(out, sample):
    return out.pow(2).mean()


# Tolerance 0.5 %: the measured peak includes a few small oneDNN scratchpad entries
# (per-thread reduction buffers of backward_weights, <= 45 KB) that the conv corrections do
# not model; everything else is exact.
TOL = 0.005


_DECONV_TRAIN_GAP = pytest.mark.xfail(
    strict=True,
    reason="backward_weights of the transposed conv books a 16768 B oneDNN reduction buffer at this "
    "N*H*W (not at the zoo's b=2/8 sizes); not modelled yet: -1.7 %",
)


@pytest.mark.parametrize(
    "make, mode",
    [
        (_TinyConv, "train"),
        (_TinyConv, "inference"),
        pytest.param(_TinyDeconv, "train", marks=_DECONV_TRAIN_GAP),
        (_TinyDeconv, "inference"),
    ],
    ids=["conv2d-train", "conv2d-inference", "convtranspose2d-train", "convtranspose2d-inference"],
)
def test_conv_models_against_measurement(make, mode):
    torch.manual_seed(0)
    model, x = make(), torch.randn(4, 3, 16, 16)
    rep = estimator.report(model, x, mode=mode, optimizer="adamw", loss_fn=_mse)
    meas = measure_cpu(model, x, mode, "adamw", _mse)
    assert abs(rep.peak_bytes - meas.peak_bytes) <= TOL * meas.peak_bytes, (rep.peak_bytes, meas.peak_bytes)


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_lstm_model_against_measurement(mode):
    # The LSTM workspace is page-rounded, so memory is not linear in b and the concrete
    # fallback's 3-point fit cannot hold it (see the engine note in rnn.py's report); this
    # checks the capture at the measured batch size itself: max over every candidate peak.
    torch.manual_seed(0)
    model, x = _TinyLSTM(), torch.randn(4, 8, 16)
    spec = StepSpec(Mode(mode), step.optimizer_factory("adamw") if mode == "train" else None, _mse)
    timeline = account(capture(model, x, spec, 4, symbolic=False))
    predicted = max(p(4) for op in timeline.ops for p in op.peaks())
    meas = measure_cpu(model, x, mode, "adamw", _mse)
    # 0.5 %: the backward's diff_b clone is modelled on the storage both fake outputs share,
    # which can die a little later than the real clone (1 KB here).
    assert abs(predicted - meas.peak_bytes) <= TOL * meas.peak_bytes, (predicted, meas.peak_bytes)


def test_batch_norm_scratch_inference():
    # BatchNorm2d(32) eval, x (4, 32, 8, 8) fp32: weight + bias 2*32*4 = 256, running stats
    # 2*32*4 + num_batches_tracked 8 = 264, input 4*32*8*8*4 = 32768, output 32768, and the
    # kernel's two per-channel temporaries 2*32*4 = 256: 256 + 264 + 32768 + 32768 + 256 = 66312.
    x = torch.randn(4, 32, 8, 8)
    rep = estimator.report(torch.nn.BatchNorm2d(32), x, mode="inference")
    assert rep.peak_bytes == 66312
    assert measure_cpu(torch.nn.BatchNorm2d(32), x, mode="inference").peak_bytes == 66312
