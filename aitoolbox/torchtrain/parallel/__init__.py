"""apex.parallel's companions on native torch: change ``from apex.parallel import ...`` to
``from aitoolbox.torchtrain.parallel import ...``.

* :class:`DistributedDataParallel` takes apex's arguments and is torch's DistributedDataParallel
  underneath (``distributed.py`` maps each argument).
* :class:`SyncBatchNorm` and :func:`convert_syncbn_model` synchronise batch statistics across processes,
  on CPUs over gloo as well as on GPUs (``sync_batchnorm.py``).

aitoolbox 1.8's wrappers that keep a TTModel's ``get_loss`` / ``get_predictions`` usable through
DataParallel and DistributedDataParallel live here too (``data_parallel.py``): :class:`TTDataParallel`,
:class:`TTDistributedDataParallel` and their base :class:`TTParallelBase`.
"""
from aitoolbox.torchtrain.parallel.data_parallel import TTDataParallel, TTDistributedDataParallel, TTParallelBase
from aitoolbox.torchtrain.parallel.distributed import DistributedDataParallel, GradientReduction, apex_allreduce_hook
from aitoolbox.torchtrain.parallel.sync_batchnorm import SyncBatchNorm, SyncBatchNormFunction, convert_syncbn_model

__all__ = ["DistributedDataParallel", "GradientReduction", "apex_allreduce_hook", "SyncBatchNorm",
           "SyncBatchNormFunction", "convert_syncbn_model", "TTParallelBase", "TTDataParallel",
           "TTDistributedDataParallel"]
