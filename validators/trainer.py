"""Measure one optimizer step of a real ``transformers.Trainer`` on CPU.

``estimator.integrations.trainer.trainer_step`` maps Trainer's step to a ``report(step=)``
function; this runs the real Trainer (``train()`` with its accelerate dataloader, optimizer and
scheduler) and measures the peak of its ``step``-th optimizer step with the CPU allocator's
profiler events, as ``validators.cpu`` does for fxmem's own steps:

- the step: a ``TrainerCallback`` starts a profiler in ``on_step_begin`` and stops it in
  ``on_step_end`` of that step (the window holds the forward, backward, clipping, optimizer
  and scheduler steps and ``zero_grad``; the batch was fetched before it);
- the bytes alive when it starts: the model's parameters and buffers (listed) plus the net
  allocator delta from just before the ``Trainer`` is built to that ``on_step_begin`` (measured:
  the optimizer state, the batch being trained on and the next one the dataloader already
  holds, the loss and gradient norm of the previous step, ``_tr_loss``).

With ``gradient_accumulation_steps=k`` the window is one optimizer step: ``on_step_begin`` comes
after ``get_batch_samples`` has fetched its ``k`` micro-batches (they are in the baseline) and
before the first one's forward.  ``python -m validators.trainer`` prints ``from_training_args``
against real runs (tests/test_training_args.py asserts the same rows).

Needs ``transformers`` and ``accelerate`` (Trainer's own requirement).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from estimator.integrations._common import import_optional
from validators.cpu import Measurement, _allocation_deltas, _measurement, baseline_bytes


@dataclass(frozen=True)
class TrainerMeasurement:
    measurement: Measurement  # the measured step: baseline (alive at its start) + peak delta
    batch_bytes: int  # one collated batch (the dataloader holds the next one during the step)
    steps: int  # optimizer steps Trainer ran before the measured one

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes


def _profiler() -> profile:
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def measure_trainer(
    model: torch.nn.Module,
    dataset: Any,
    *,
    output_dir: str,
    batch_size: int,
    step: int = 2,
    **training_args: Any,
) -> TrainerMeasurement:
    """Train ``model`` on ``dataset`` (a sequence of dicts of tensors, collated by Trainer's
    default collator) with ``transformers.Trainer`` on CPU and measure its ``step``-th optimizer
    step (1-based; 2 = the first steady-state step: the optimizer state exists).

    ``training_args`` go to ``TrainingArguments`` on top of a quiet single-process CPU run
    (``use_cpu=True``, ``report_to=[]``, no saving, no logging, no progress bar); the run stops
    after ``step`` steps.  ``dataset`` must hold more than ``step * batch_size`` items, so that the
    measured step is not the last of its epoch (the dataloader then holds the next batch, as in
    every step of a real epoch but the last).
    """
    import_optional("transformers", "transformers")  # torchvision made importable first, as estimator does
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if len(dataset) <= step * batch_size * training_args.get("gradient_accumulation_steps", 1):
        raise ValueError(f"dataset needs more than step * batch_size = {step * batch_size} items, has {len(dataset)}")

    class Window(TrainerCallback):
        def __init__(self):
            self.setup, self.step, self.running = _profiler(), _profiler(), []

        def start(self, prof: profile) -> None:
            prof.start()
            self.running.append(prof)

        def stop(self, prof: profile) -> None:
            self.running.remove(prof)
            prof.stop()

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1:
                gc.collect()
                self.stop(self.setup)
                self.start(self.step)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                self.stop(self.step)

    args = TrainingArguments(**{
        "output_dir": output_dir, "use_cpu": True, "report_to": [], "save_strategy": "no",
        "logging_strategy": "no", "disable_tqdm": True, "per_device_train_batch_size": batch_size,
        "max_steps": step, **training_args,
    })
    window = Window()
    before = baseline_bytes(model, None, ())
    gc.collect()
    window.start(window.setup)
    try:
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[window])
        trainer.train()
    finally:
        for prof in list(window.running):  # a run that failed midway leaves no profiler running
            window.stop(prof)
    if window.step.profiler is None:
        raise RuntimeError(f"Trainer stopped before optimizer step {step}")
    kept = sum(delta for _, delta in _allocation_deltas(window.setup))
    collated = trainer.data_collator([dataset[i] for i in range(batch_size)])
    batch_bytes = sum(t.untyped_storage().nbytes() for t in collated.values() if isinstance(t, torch.Tensor))
    return TrainerMeasurement(_measurement(before + kept, _allocation_deltas(window.step)), batch_bytes, step - 1)


# -- ``python -m validators.trainer``: from_training_args against real Trainer runs ----------------


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def _tiny_lora():
    import peft

    return peft.get_peft_model(_tiny_gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                             lora_dropout=0.1, task_type="CAUSAL_LM"))


def main() -> None:
    """Print, for the tiny GPT-2 of tests/test_training_args.py (2 layers, width 64, s = 32) trained
    by a real ``Trainer`` with micro-batches of 4 and 2 accumulation steps: fxmem's
    ``from_training_args`` prediction (the next micro-batch the dataloader has fetched counted),
    the measured peak of the second optimizer step, the error, and the bytes the real run holds
    beyond the prediction; then the nearest explicit report (b = 8, ``Strategy(accumulate=2)``,
    the built-in step) against the plain run."""
    import tempfile

    import estimator
    from estimator.integrations.training_args import from_training_args

    import_optional("transformers", "transformers")
    b, k, s = 4, 2, 32
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 512, (s,), generator=g) for _ in range(3 * b * k)]
    rows = [{"input_ids": t, "labels": t.clone()} for t in ids]
    batch = {key: torch.stack([r[key] for r in rows[:b]]) for key in rows[0]}
    cases = [("plain", _tiny_gpt2, {}), ("activation_checkpointing", _tiny_gpt2, {"activation_checkpointing": True}),
             ("bf16", _tiny_gpt2, {"bf16": True}), ("peft LoRA r=4", _tiny_lora, {})]
    print("| TrainingArguments (+ batch 4 x accumulation 2) | predicted B | measured B | error | beyond "
          "prediction |")
    print("|---|---:|---:|---:|---:|")
    plain = None
    for name, make, extra in cases:
        args = {"per_device_train_batch_size": b, "gradient_accumulation_steps": k, **extra}
        rep = from_training_args(make(), args, batch, device="cpu")
        with tempfile.TemporaryDirectory() as out:
            m = measure_trainer(make(), rows, output_dir=out, batch_size=b, step=2, gradient_accumulation_steps=k,
                                **extra)
        plain = plain or m
        gap = m.peak_bytes - rep.peak_bytes
        error = (rep.peak_bytes - m.peak_bytes) / m.peak_bytes
        print(f"| {name} | {rep.peak_bytes:,} | {m.peak_bytes:,} | {error:+.2%} | {gap:+,} B |")
    full = {key: torch.stack([r[key] for r in rows[:b * k]]) for key in rows[0]}
    explicit = estimator.report(_tiny_gpt2(), full, strategy=estimator.Strategy(accumulate=k), device="cpu")
    print(f"| explicit report(b=8, Strategy(accumulate=2)), built-in step | {explicit.peak_bytes:,} | "
          f"{plain.peak_bytes:,} | {(explicit.peak_bytes - plain.peak_bytes) / plain.peak_bytes:+.2%} | |")


if __name__ == "__main__":
    main()
