"""CUDA target entries.  Each module lists what it cannot model without a device in
``NOT_MODELLED``."""


def not_modelled() -> tuple[str, ...]:
    from estimator.corrections.cuda import attention, autocast, kernels, optim, rnn

    return tuple(item for module in (attention, autocast, kernels, optim, rnn) for item in getattr(module, "NOT_MODELLED", ()))
