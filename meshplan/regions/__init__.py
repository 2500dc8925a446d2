"""meshplan's built-in region ops (ir/regions.py says what a region op is), one file each:

- `moe.py`: the mixture-of-experts op and the Hugging Face block traced as it (expert parallelism);
- `batch_norm.py`: training batch norm with the batch or the channels split (SyncBN);
- `log_softmax.py`: the vocabulary-parallel log-softmax;
- `masked_lookup.py`: embedding and gather with the table split (vocabulary-parallel lookups);
- `context_parallel.py`: attention with the sequence split over a `cp` mesh axis (context parallelism), with
  `attention_blocks.py` (the fused blocks its kernels run) and `torch_ring.py` (torch's ring templates as one of them).

`register_builtin_regions()` registers them; `meshplan/__init__.py` calls it once.
"""

from meshplan.ir.regions import RegionOp, register_region_op
from meshplan.regions.batch_norm import BATCH_NORM_REGION
from meshplan.regions.context_parallel import CONTEXT_PARALLEL_REGION
from meshplan.regions.log_softmax import LOG_SOFTMAX_REGION
from meshplan.regions.masked_lookup import MASKED_EMBEDDING_REGION, MASKED_GATHER_REGION
from meshplan.regions.moe import MOE_REGION

BUILTIN_REGIONS: tuple[RegionOp, ...] = (MOE_REGION, BATCH_NORM_REGION, LOG_SOFTMAX_REGION, MASKED_EMBEDDING_REGION, MASKED_GATHER_REGION,
                                           CONTEXT_PARALLEL_REGION)


def register_builtin_regions() -> None:
    for region in BUILTIN_REGIONS:
        register_region_op(region)


__all__ = ["BUILTIN_REGIONS", "register_builtin_regions"]
