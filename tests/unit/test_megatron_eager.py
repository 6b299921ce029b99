"""Importing rlrun first keeps Megatron's import from compiling its fused activations: the jit fuser is Megatron's
own no-op, so TorchDynamo and Inductor never load in a trainer process (rlrun/runtime/megatron_eager.py)."""

import subprocess
import sys

PROBE = """
import sys
import rlrun.megatron.attention  # imports megatron.core through rlrun
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
compiled = hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")  # what torch.compile leaves on a function
print(jit.jit_fuser is jit.noop_decorator, compiled, "torch._dynamo" in sys.modules)
"""


def test_megatron_imported_through_rlrun_decorates_nothing_with_torch_compile():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False"], out


def test_plain_megatron_import_would_compile():
    """The reference: without rlrun's hook the same module's functions are torch.compile wrappers."""
    probe = "import megatron.core.jit as jit\nfrom megatron.core.fusions import fused_bias_swiglu as f\n"
    probe += "print(jit.jit_fuser is jit.noop_decorator, hasattr(f.swiglu, '_torchdynamo_orig_callable'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"], out
