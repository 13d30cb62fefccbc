"""torch.compile for TrainLoop (``TrainLoop(..., torch_compile=True)``): the model's forward compiled in place
and the optimizers' steps compiled, with compile statistics and a clear error (or an eager fallback) when
something cannot be compiled. See the "Faster training" page of the docs."""
from aitoolbox.torchtrain.compiling.compiler import Compiler
from aitoolbox.torchtrain.compiling.options import CompileOptions
from aitoolbox.torchtrain.compiling.stats import CompileEvent, CompileStats

__all__ = ["CompileEvent", "CompileOptions", "CompileStats", "Compiler"]
