"""Runtime validation of fxmem: run models for real, measure peak memory, compare.

Run from a checkout: ``python -m validators`` (not installed: PyPI already has a popular
package named ``validators``).
"""

import os as _os
import tempfile as _tempfile

# Inductor's on-disk caches (the validators' real compiled steps: torchao's optimizers, the
# compiled-step validator) do not tell a run held to an ISA (ATEN_CPU_CAPABILITY=avx2) from one
# at the host's: loading the kernels of torchao's 4-bit AdamW step that a run at the host's ISA
# (AVX-512) had compiled, a run held to AVX2 aborted ("index out of bounds: 0 <= tmp8 < 16"),
# while the same run on an empty cache passed.  A run held to an ISA keeps a cache of its own.
if _os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in _os.environ:
    _os.environ["TORCHINDUCTOR_CACHE_DIR"] = _os.path.join(_tempfile.gettempdir(),
                                                           f"torchinductor_{_os.environ['ATEN_CPU_CAPABILITY']}")
