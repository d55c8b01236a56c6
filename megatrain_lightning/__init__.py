"""megatrain-lightning: full-precision training of models larger than accelerator memory.

Importing this package registers ``strategy="megatrain"`` (and ``"megatrain_nvme"``) with Lightning's
``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY`` (Lightning has no entry-point discovery for strategies).
It sets the ``megatrain_lightning`` logger to INFO, printing to stderr when the root logger has no handler, as
``lightning.pytorch`` does; and in a rank started by the strategy's launcher it starts the watch that ends the rank
once its parent is gone (``parallel/lifetime.py``).
"""

import logging

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from .blocks import BlockDiscoveryError, discover_blocks
from .checkpoint.errors import CheckpointError
from .engine.streaming import StreamingEngine
from .optim.host_adamw import HostAdamW, UnsupportedOptimizerError
from .parallel.faults import PeerFailure
from .parallel.lifetime import follow_parent_from_env
from .parallel.preflight import ConfigMismatchError, RendezvousError
from .precision import MegaTrainPrecision, UnsupportedPrecisionError
from .store.nvme import NVMeIOError
from .store.pinned import HostPinningError
from .store.shared import SharedMemoryTooSmall
from .config import MegaTrainConfig
from .strategy import MegaTrainStrategy
from .fabric import MegaTrainFabricStrategy

__version__ = "0.1.0"

_logger = logging.getLogger(__name__)
if _logger.level == logging.NOTSET:
    _logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not _logger.handlers:  # as lightning.pytorch does
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

follow_parent_from_env()  # a rank started by MegaTrainLauncher: ends when its local rank 0 is gone

if "megatrain" not in StrategyRegistry:
    MegaTrainStrategy.register_strategies(StrategyRegistry)
if "megatrain" not in FABRIC_STRATEGY_REGISTRY:
    MegaTrainFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "BlockDiscoveryError",
    "CheckpointError",
    "ConfigMismatchError",
    "HostAdamW",
    "HostPinningError",
    "MegaTrainConfig",
    "MegaTrainFabricStrategy",
    "MegaTrainPrecision",
    "MegaTrainStrategy",
    "NVMeIOError",
    "PeerFailure",
    "RendezvousError",
    "SharedMemoryTooSmall",
    "StreamingEngine",
    "UnsupportedOptimizerError",
    "UnsupportedPrecisionError",
    "discover_blocks",
]
