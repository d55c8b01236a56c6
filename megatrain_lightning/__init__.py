"""megatrain-lightning: full-precision training of models larger than accelerator memory.

Importing this package registers ``strategy="megatrain"`` with Lightning's
``StrategyRegistry`` (Lightning has no entry-point discovery for strategies).
"""

from lightning.pytorch.strategies import StrategyRegistry

from .blocks import BlockDiscoveryError, discover_blocks
from .engine.streaming import StreamingEngine
from .optim.host_adamw import HostAdamW, UnsupportedOptimizerError
from .precision import MegaTrainPrecision, UnsupportedPrecisionError
from .strategy import MegaTrainStrategy

__version__ = "0.1.0"

if "megatrain" not in StrategyRegistry:
    MegaTrainStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "BlockDiscoveryError",
    "HostAdamW",
    "MegaTrainPrecision",
    "MegaTrainStrategy",
    "StreamingEngine",
    "UnsupportedOptimizerError",
    "UnsupportedPrecisionError",
    "discover_blocks",
]
